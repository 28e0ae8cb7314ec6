"""What EngineCore decides once, at start-up, before its first step: the device and dtype, the
quantization, the step's token budget, max_model_len, the KV cache's size, the decode batch sizes to
capture as CUDA graphs and the vocabulary for structured output. Each "auto" in EngineConfig is
resolved here; the step never reads this file.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from engine_core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig, ModelArchConfig, SchedulerConfig
from engine_core.cuda_graphs import capture_sizes
from engine_core.kv_cache_tensors import kv_cache_bytes_per_block
from engine_core.protocol import EngineInfo
from kernels import AttentionBackend, fastest_float_dtype

logger = logging.getLogger(__name__)

# hidden x intermediate of the MLP the dtype race multiplies: the default model's (SmolLM2-135M), since the race
# picks the dtype the weights load in, before any model is read
_DTYPE_RACE_SHAPE = (576, 1536)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA GPU; use device='cpu'")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on CUDA; on CPU whichever of bf16 / fp32 multiplies faster here, measured."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    return fastest_float_dtype(*_DTYPE_RACE_SHAPE)


def resolve_quantization(name: str, dtype_name: str, device: torch.device) -> str:
    """auto -> none on CUDA and when float32 was asked for explicitly (the exact path); int8 and
    int4 need CPU."""
    if device.type != "cpu":
        if name in ("int8", "int4"):
            raise ValueError(f"quantization {name!r} runs on CPU only; use quantization='none' on CUDA")
        return "none"
    return "none" if name == "auto" and dtype_name == "float32" else name


def resolve_scheduler(config: SchedulerConfig, device: torch.device, max_model_len: int) -> SchedulerConfig:
    """The step's token budget, when none was given: the device's default (DEFAULT_MAX_NUM_BATCHED_TOKENS),
    and without chunked prefill at least max_model_len (a prompt is prefilled in one step)."""
    if config.max_num_batched_tokens is not None:
        return config
    budget = DEFAULT_MAX_NUM_BATCHED_TOKENS.get(device.type, DEFAULT_MAX_NUM_BATCHED_TOKENS["cuda"])
    if not config.enable_chunked_prefill:
        budget = max(budget, max_model_len)
    return replace(config, max_num_batched_tokens=budget)


def resolve_overlap(name: str, device: torch.device) -> bool:
    """Whether steps overlap (engine_core/overlap.py). auto: on for CUDA; off on CPU, where the forward already
    keeps every core busy (docs/gpu.md)."""
    return device.type == "cuda" if name == "auto" else name == "on"


def resolve_max_model_len(wanted: int | None, arch: ModelArchConfig) -> int:
    """The model's context, or the shorter max_model_len asked for."""
    if wanted is None:
        return arch.max_position_embeddings
    if wanted > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len {wanted} is longer than the model's context "
            f"({arch.max_position_embeddings} tokens)"
        )
    return wanted


def tokenizer_path(config: EngineConfig, model_path: str) -> str | None:
    """The vocabulary for structured output: --tokenizer, else the model's own if it has one."""
    if config.model.tokenizer is not None:
        return config.model.tokenizer
    path = Path(model_path)
    return str(path) if path.suffix == ".gguf" or (path / "tokenizer.json").is_file() else None


def cuda_graph_sizes(config: EngineConfig, device: torch.device, attention: AttentionBackend) -> list[int]:
    """Decode batch sizes to capture: none off CUDA, with enforce_eager, or for a backend
    that cannot be captured."""
    device_config = config.device
    if device.type != "cuda" or device_config.enforce_eager:
        return []
    if not attention.supports_cuda_graphs:
        logger.info("attention backend %r cannot run in CUDA graphs: decode runs eagerly", attention.name)
        return []
    return capture_sizes(min(config.scheduler.max_num_seqs, device_config.cuda_graph_max_batch_size))


def num_blocks_for_memory(config: EngineConfig, arch: ModelArchConfig, max_model_len: int, dtype: torch.dtype) -> int:
    """The KV cache's blocks in kv_cache_memory_gib; ValueError when they cannot hold one max_model_len request."""
    per_block = kv_cache_bytes_per_block(arch, config.cache.block_size, dtype)
    num_blocks = int(config.cache.kv_cache_memory_gib * 2**30) // per_block
    blocks_for_one_full_request = -(-max_model_len // config.cache.block_size) + 1
    if num_blocks < blocks_for_one_full_request:
        raise ValueError(
            f"kv_cache_memory_gib={config.cache.kv_cache_memory_gib} holds {num_blocks} blocks, "
            f"fewer than the {blocks_for_one_full_request} one max_model_len={max_model_len} "
            "request needs; raise kv_cache_memory_gib or lower max_model_len"
        )
    return num_blocks


def engine_info(model_path: str, arch: ModelArchConfig, max_model_len: int, block_size: int, num_blocks: int,
                dtype: torch.dtype, device: torch.device, attention_backend: str) -> EngineInfo:
    """What the engine tells its callers about itself (GetEngineInfo), as resolved above."""
    return EngineInfo(
        model_name=Path(model_path).stem if model_path.endswith(".gguf") else Path(model_path).name,
        model_path=model_path,
        max_model_len=max_model_len,
        block_size=block_size,
        num_blocks=num_blocks,
        vocab_size=arch.vocab_size,
        eos_token_ids=tuple(arch.eos_token_ids),
        bos_token_id=arch.bos_token_id,
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        attention_backend=attention_backend,
    )
