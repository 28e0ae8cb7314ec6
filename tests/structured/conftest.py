"""A tiny random Llama with SmolLM2's vocabulary, whose engine takes SmolLM2's tokenizer for its masks."""

from __future__ import annotations

import pytest

from engine_core.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_core.loader import default_model_path
from engine_core.text.tokenizer import load_tokenizer
from tests.engine_core.tiny_models import write_tiny_model

VOCAB = 49152  # SmolLM2's


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-structured"), vocab_size=VOCAB, max_position_embeddings=512)


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(default_model_path())


def tiny_config(folder, *, num_blocks: int = 400, tokenizer: str | None = "smollm2", max_num_seqs: int = 32):
    return EngineConfig(
        model=ModelConfig(model=str(folder), dtype="float32", max_model_len=512,
                          tokenizer=str(default_model_path()) if tokenizer == "smollm2" else tokenizer),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=max_num_seqs),
        device=DeviceConfig(device="cpu", attention_backend="torch"),
    )
