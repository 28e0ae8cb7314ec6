"""EngineCore's start-up, done once before its first step: `build_parts` loads the model, then makes the
structured-output grammars, the model runner, the scheduler and, when steps overlap, the device queue, and
hands them to EngineCore's constructor as one `EngineParts`. On the way it decides the device and dtype, the
quantization, the step's token budget, max_model_len, the KV cache's element type and size, the decode batch
sizes to capture as CUDA graphs and the vocabulary for structured output: each "auto" in EngineConfig is resolved
here. The step never reads this file.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine_core.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_SPECULATIVE_MAX_BATCH,
    EngineConfig,
    LoraConfig,
    ModelArchConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_linear_kernels,
)
from engine_core.loader.registry import default_model_path, load_model, prepare_for_cpu
from engine_core.lora.admission import LoraAdmission
from engine_core.lora.runtime import LoraRuntime
from engine_core.overlap import InlineQueue, OverlappedSteps, ThreadQueue
from engine_core.protocol import EngineInfo
from engine_core.runner.cuda_graphs import capture_sizes
from engine_core.runner.kv_cache_tensors import kv_cache_bytes_per_block
from engine_core.runner.model_runner import ModelRunner
from engine_core.scheduling.scheduler import Scheduler
from engine_core.spec_decode import NgramProposer, Proposer
from engine_core.spec_decode.draft_model import DraftModelProposer
from engine_core.spec_decode.speculator import Speculator
from engine_core.structured.masks import StructuredOutputs
from kernels import (
    KV_CACHE_DTYPES,
    AttentionBackend,
    Pins,
    batch_invariant_kernel,
    fastest_float_dtype,
    lossy_linear_kernels,
    resolve_kv_cache_dtype,
    select_backend,
    select_fused_ops,
)

logger = logging.getLogger(__name__)

# hidden x intermediate of the MLP the dtype race multiplies: the default model's (SmolLM2-135M), since the race
# picks the dtype the weights load in, before any model is read
_DTYPE_RACE_SHAPE = (576, 1536)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineParts:
    """What `build_parts` made from an EngineConfig, for EngineCore's constructor to keep."""

    config: EngineConfig  # as run: the defaults that depend on the device and model filled in
    model: torch.nn.Module
    arch: ModelArchConfig
    attention: AttentionBackend
    model_path: str
    max_model_len: int
    structured: StructuredOutputs
    lora: LoraRuntime | None  # the adapters (engine_core/lora), when the engine serves LoRA
    runner: ModelRunner
    scheduler: Scheduler
    overlapped: OverlappedSteps | None  # None: each step() runs its step to the end
    info: EngineInfo


def build_parts(config: EngineConfig, *, log_stats: bool, kv_events: bool) -> EngineParts:
    """Load the model and make every part an EngineCore steps with. log_stats: the scheduler records per-request
    events; kv_events: the block pool records the prefix-cache hashes indexed and evicted."""
    if config.device.num_threads is not None:
        torch.set_num_threads(config.device.num_threads)
    torch.manual_seed(config.model.seed)
    device = resolve_device(config.device.device)
    dtype = resolve_dtype(config.model.dtype, device)
    kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype, device)
    invariant = config.device.batch_invariant
    attention = select_backend(device.type, config.device.attention_backend, batch_invariant=invariant)
    fused = None if config.device.enforce_eager else select_fused_ops(device.type, dtype)
    logger.info("attention backend %s, fused layer ops %s", attention.name, fused.name if fused else "off")

    started = time.perf_counter()
    quantization = resolve_quantization(config.model.quantization, config.model.dtype, device)
    model, arch = load_model(config.model.model, dtype, device, attention, fused)
    pins = parse_linear_kernels(config.model.linear_kernels)
    if pins and device.type != "cpu":
        raise ValueError("linear_kernels pins CPU kernels; leave it unset on CUDA")
    if invariant:
        pins = batch_invariant_pins(pins, quantization, dtype, device)
    if device.type == "cpu":
        prepare_for_cpu(model, quantization, pins=pins, kv_cache_dtype=kv_cache_dtype)
    model_path = str(Path(config.model.model) if config.model.model else default_model_path())
    logger.info("loaded %s in %.1f s", model_path, time.perf_counter() - started)

    max_model_len = resolve_max_model_len(config.model.max_model_len, arch)
    config = replace(config, scheduler=resolve_scheduler(config.scheduler, device, max_model_len))
    logger.info("step token budget %d", config.scheduler.max_num_batched_tokens)
    block_size = config.cache.block_size
    num_blocks = config.cache.num_blocks or num_blocks_for_memory(config, arch, max_model_len, kv_cache_dtype)
    logger.info("KV cache: %d blocks of %d tokens in %s", num_blocks, block_size,
                str(kv_cache_dtype).removeprefix("torch."))
    lora_config = batch_invariant_lora(config.lora, attention.name) if invariant else config.lora
    lora = LoraRuntime.attach(model, lora_config, device, dtype, attention.name) if config.lora.enable else None
    structured = StructuredOutputs(tokenizer_path(config, model_path), vocab_size=arch.vocab_size,
                                   eos_token_ids=list(arch.eos_token_ids))
    overlap = resolve_overlap(config.device.overlap, device, config.speculative)
    draft = load_draft(config, arch, device, dtype, attention, fused, quantization, pins, num_blocks,
                       max_model_len, kv_cache_dtype) if config.speculative.method == "draft" else None
    spec = speculator(config.speculative, device, draft)
    runner = ModelRunner(
        model, arch, attention,
        num_blocks=num_blocks, block_size=block_size, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
        max_model_len=max_model_len, cuda_graph_sizes=cuda_graph_sizes(config, device, attention),
        structured=structured, lora=lora, spec=spec,
    )
    every_layer_slides = all(arch.is_sliding(i) for i in range(arch.num_hidden_layers))
    scheduler = Scheduler(config.scheduler, config.cache, num_blocks, max_model_len, log_stats=log_stats,
                          sliding_window=arch.sliding_window if every_layer_slides else None,
                          lora=LoraAdmission(config.lora.max_loras, config.lora.max_wait_steps)
                          if lora is not None else None, spec_max_batch=spec.max_batch if spec is not None else 0)
    overlapped = None
    if overlap:
        overlapped = OverlappedSteps(scheduler, runner, InlineQueue() if device.type == "cuda" else ThreadQueue())
    if kv_events:
        scheduler.kv_cache_manager.block_pool.record_events()
    info = engine_info(model_path, arch, max_model_len, block_size, num_blocks, dtype, device, attention.name,
                       lossy_linear_kernels(model), invariant, kv_cache_dtype)
    return EngineParts(config, model, arch, attention, model_path, max_model_len, structured, lora, runner,
                       scheduler, overlapped, info)


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


def batch_invariant_pins(pins: Pins, quantization: str, dtype: torch.dtype, device: torch.device) -> Pins:
    """The linear kernels batch-invariant mode runs: on the CPU one fixed-order float kernel for every layer and
    batch size (kernels.batch_invariant_kernel). ValueError where the user asked for kernels of their own."""
    if device.type != "cpu":
        raise ValueError("batch_invariant runs on the CPU only for now: on CUDA the linears are cuBLAS, whose tiling "
                         "follows the batch (docs/batch-invariance.md)")
    if pins:
        raise ValueError("batch_invariant chooses the linear kernels itself; leave linear_kernels unset")
    if quantization not in ("auto", "none"):
        raise ValueError(f"batch_invariant runs float linears; quantization {quantization!r} cannot be combined "
                         "with it (leave it auto)")
    return {"*": {None: batch_invariant_kernel(dtype)}}


def batch_invariant_lora(config: LoraConfig, attention_backend: str) -> LoraConfig:
    """Adapters in batch-invariant mode: on the C++ attention, the C++ BGMV kernel at every batch size (each
    row's products in one order, however many rows share a pass); the measured choice per bucket is not."""
    if attention_backend != "cpp":
        return config
    if config.kernel not in ("auto", "cpp"):
        raise ValueError(f"batch_invariant runs LoRA through the 'cpp' kernel at every batch size; lora kernel "
                         f"{config.kernel!r} cannot be combined with it (leave it auto)")
    return replace(config, kernel="cpp")


def resolve_scheduler(config: SchedulerConfig, device: torch.device, max_model_len: int) -> SchedulerConfig:
    """The step's token budget, when none was given: the device's default (DEFAULT_MAX_NUM_BATCHED_TOKENS),
    and without chunked prefill at least max_model_len (a prompt is prefilled in one step)."""
    if config.max_num_batched_tokens is not None:
        return config
    budget = DEFAULT_MAX_NUM_BATCHED_TOKENS.get(device.type, DEFAULT_MAX_NUM_BATCHED_TOKENS["cuda"])
    if not config.enable_chunked_prefill:
        budget = max(budget, max_model_len)
    return replace(config, max_num_batched_tokens=budget)


def resolve_overlap(name: str, device: torch.device, speculative: SpeculativeConfig | None = None) -> bool:
    """Whether steps overlap (engine_core/overlap.py). auto: on for CUDA; off on CPU, where the forward already
    keeps every core busy (docs/gpu.md), and off with speculative decoding, whose next step's inputs wait for the
    number of drafts this one accepts."""
    speculating = speculative is not None and speculative.enabled
    if name == "on" and speculating:
        raise ValueError("overlap 'on' cannot be combined with speculative decoding yet: leave overlap auto (off while "
                         "speculating) or turn speculation off")
    return device.type == "cuda" and not speculating if name == "auto" else name == "on"


def speculator(config: SpeculativeConfig, device: torch.device, proposer: Proposer | None = None) -> Speculator | None:
    """Speculative decoding's runner part (engine_core/spec_decode), or None when it is off. proposer: the draft
    model's (load_draft), for method 'draft'; else prompt lookup."""
    if not config.enabled:
        return None
    if config.method == "draft" and proposer is None:
        raise ValueError("speculative method 'draft' needs its draft model loaded (load_draft)")
    max_batch = config.max_batch
    if max_batch is None:
        max_batch = DEFAULT_SPECULATIVE_MAX_BATCH.get(device.type, DEFAULT_SPECULATIVE_MAX_BATCH["cuda"])
    logger.info("speculative decoding: %s, %d tokens, while at most %d requests run", config.method,
                config.num_speculative_tokens, max_batch)
    proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    return Speculator(proposer, config.num_speculative_tokens, max_batch)


def load_draft(config: EngineConfig, arch: ModelArchConfig, device: torch.device, dtype: torch.dtype,
               attention: AttentionBackend, fused, quantization: str, pins: Pins, num_blocks: int,  # noqa: ANN001
               max_model_len: int, kv_cache_dtype: torch.dtype | None = None) -> DraftModelProposer:
    """The draft model, loaded and planned as the target is (same dtype, attention, quantization and pins), with a
    runner and a KV cache of as many blocks as the target's, of the target's KV element type (so an int8 target's
    twice as many blocks do not double the draft's memory)."""
    path = config.speculative.draft_model
    started = time.perf_counter()
    model, draft_arch = load_model(path, dtype, device, attention, fused)
    if draft_arch.vocab_size > arch.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft_arch.vocab_size} tokens) is larger than the model's "
                         f"({arch.vocab_size}): a draft model must share the model's tokenizer")
    if device.type == "cpu":
        prepare_for_cpu(model, quantization, pins=pins, kv_cache_dtype=kv_cache_dtype)
    max_len = min(max_model_len, draft_arch.max_position_embeddings)
    runner = ModelRunner(model, draft_arch, attention, num_blocks=num_blocks, block_size=config.cache.block_size,
                         device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_model_len=max_len,
                         cuda_graph_sizes=cuda_graph_sizes(config, device, attention))
    logger.info("loaded the draft model %s in %.1f s", path, time.perf_counter() - started)
    return DraftModelProposer(runner, max_model_len=max_len)


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


def num_blocks_for_memory(config: EngineConfig, arch: ModelArchConfig, max_model_len: int,
                          kv_cache_dtype: torch.dtype) -> int:
    """The KV cache's blocks in kv_cache_memory_gib, at kv_cache_dtype's bytes (an int8 cache's scales included);
    ValueError when they cannot hold one max_model_len request."""
    per_block = kv_cache_bytes_per_block(arch, config.cache.block_size, kv_cache_dtype)
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
                dtype: torch.dtype, device: torch.device, attention_backend: str,
                lossy_kernels: tuple[str, ...] = (), batch_invariant: bool = False,
                kv_cache_dtype: torch.dtype | None = None) -> EngineInfo:
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
        lossy_linear_kernels=lossy_kernels,
        batch_invariant=batch_invariant,
        kv_cache_dtype=kv_cache_dtype_name(kv_cache_dtype or dtype),
    )


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """The KV cache's element type as --kv-cache-dtype names it (bf16, fp32, int8, fp8_e4m3), else torch's name."""
    names = {dtype: name for name, dtype in KV_CACHE_DTYPES.items()}
    return names.get(dtype, str(dtype).removeprefix("torch."))
