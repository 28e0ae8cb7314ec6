"""End to end on the embedded SmolLM2: tokenizer and chat template from the GGUF, the engine, greedy chat."""

from __future__ import annotations

import pytest

from engine_core.config import EngineConfig, ModelConfig
from engine_core.llm_engine import LLMEngine
from engine_core.loader import default_model_path
from engine_core.sampling_params import SamplingParams
from services.frontend.chat_template import render_chat
from services.frontend.tokenizer import load_tokenizer
from tests.engine_core.test_loader import CHAT_PROMPT

pytestmark = pytest.mark.slow  # loads the real SmolLM2 (make test-slow)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    text = render_chat(tokenizer.chat_template, messages, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    return tokenizer.encode(text, add_special_tokens=False)


def test_chat_prompt_tokens_match_transformers(tokenizer):
    # CHAT_PROMPT is what transformers' own GGUF tokenizer + apply_chat_template produce
    assert chat_prompt_ids(tokenizer, QUESTION) == CHAT_PROMPT


@pytest.mark.parametrize("dtype", ["float32", "auto"])  # auto: bf16 where the CPU has it
def test_greedy_chat_answer_names_paris(tokenizer, dtype):
    engine = LLMEngine(EngineConfig(model=ModelConfig(dtype=dtype, max_model_len=512)))
    output = engine.generate([chat_prompt_ids(tokenizer, QUESTION)], SamplingParams(temperature=0.0, max_tokens=32))[0]
    completion = output.outputs[0]
    answer = tokenizer.decode(completion.token_ids)
    assert "Paris" in answer, answer
    assert str(completion.finish_reason) == "stop"  # ended by <|im_end|>, one of the model's eos ids
