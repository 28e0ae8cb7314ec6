"""EngineCore: the scheduler, the KV cache and the model runner behind one `step()`.

step() = schedule() -> execute_model() -> update_from_output(), as in vLLM v1.
Token ids in, token ids out: no tokenizer and no transport in here. Whoever owns
an EngineCore (the offline LLMEngine or the gRPC busy loop) calls it from one
thread only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from engine_core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig, ModelArchConfig, SchedulerConfig
from engine_core.cuda_graphs import capture_sizes
from engine_core.loader.registry import default_model_path, load_model, prepare_for_cpu
from engine_core.lora.admission import LoraAdmission
from engine_core.lora.engine_calls import EngineLoraCalls
from engine_core.lora.runtime import LoraRuntime
from engine_core.model_runner import ModelRunner, kv_cache_bytes_per_block
from engine_core.overlap import InlineQueue, OverlappedSteps, ThreadQueue, resolve_overlap
from engine_core.profiler import Profiler
from engine_core.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    KVCacheEvents,
    SchedulerStats,
    validate_sampling_params,
)
from engine_core.request import Request, RequestStatus
from engine_core.scheduler import Scheduler
from engine_core.structured.masks import StructuredOutputs
from kernels import fastest_float_dtype, select_backend, select_fused_ops

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


class EngineCore(EngineLoraCalls):  # add_lora, remove_lora, pin_lora, list_loras: engine_core/lora/engine_calls.py
    def __init__(self, config: EngineConfig, *, log_stats: bool = False, kv_events: bool = False) -> None:
        """log_stats: outputs carry per-request events (queued, scheduled, preempted) as in vLLM v1.
        kv_events: each step's outputs carry the prefix-cache hashes indexed and evicted (for routers)."""
        self.config = config
        if config.device.num_threads is not None:
            torch.set_num_threads(config.device.num_threads)
        torch.manual_seed(config.model.seed)
        device = resolve_device(config.device.device)
        dtype = resolve_dtype(config.model.dtype, device)
        self.attention = select_backend(device.type, config.device.attention_backend)
        fused = None if config.device.enforce_eager else select_fused_ops(device.type, dtype)
        logger.info("attention backend %s, fused layer ops %s", self.attention.name, fused.name if fused else "off")

        started = time.perf_counter()
        quantization = resolve_quantization(config.model.quantization, config.model.dtype, device)
        self.model, self.arch = load_model(config.model.model, dtype, device, self.attention, fused)
        if device.type == "cpu":
            prepare_for_cpu(self.model, quantization)
        self.model_path = str(Path(config.model.model) if config.model.model else default_model_path())
        logger.info("loaded %s in %.1f s", self.model_path, time.perf_counter() - started)

        self.max_model_len = self._resolve_max_model_len(self.arch)
        # the config as run: the defaults that depend on the device and model filled in
        scheduler_config = resolve_scheduler(config.scheduler, device, self.max_model_len)
        self.config = config = replace(config, scheduler=scheduler_config)
        logger.info("step token budget %d", config.scheduler.max_num_batched_tokens)
        block_size = config.cache.block_size
        num_blocks = config.cache.num_blocks or self._num_blocks_for_memory(dtype)
        self.lora = None  # the adapters (engine_core/lora), when the engine serves LoRA
        if config.lora.enable:
            self.lora = LoraRuntime.attach(self.model, config.lora, device, dtype, self.attention.name)
        self.structured = StructuredOutputs(self._tokenizer_path(), vocab_size=self.arch.vocab_size,
                                            eos_token_ids=list(self.arch.eos_token_ids))
        self.last_mask_timing = None  # the last step's structured-output mask timing (metrics only)
        self.runner = ModelRunner(
            self.model, self.arch, self.attention,
            num_blocks=num_blocks, block_size=block_size, device=device, dtype=dtype,
            max_model_len=self.max_model_len, cuda_graph_sizes=self._cuda_graph_sizes(device),
            structured=self.structured, lora=self.lora,
        )
        every_layer_slides = all(self.arch.is_sliding(i) for i in range(self.arch.num_hidden_layers))
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks, self.max_model_len, log_stats=log_stats,
                                   sliding_window=self.arch.sliding_window if every_layer_slides else None,
                                   lora=LoraAdmission(config.lora.max_loras, config.lora.max_wait_steps)
                                   if self.lora is not None else None)
        self._block_pool = self.scheduler.kv_cache_manager.block_pool
        self.overlapped: OverlappedSteps | None = None  # None: each step() runs its step to the end
        if resolve_overlap(config.device.overlap, device):
            queue = InlineQueue() if device.type == "cuda" else ThreadQueue()
            self.overlapped = OverlappedSteps(self.scheduler, self.runner, queue)
        self.records_kv_events = kv_events
        if kv_events:
            self._block_pool.record_events()
        self.eos_token_ids = frozenset(self.arch.eos_token_ids)
        self.asleep = False  # the KV cache is freed (sleep / wake_up)
        self._profiler = Profiler(device)
        self.info = EngineInfo(
            model_name=Path(self.model_path).stem if self.model_path.endswith(".gguf") else Path(self.model_path).name,
            model_path=self.model_path,
            max_model_len=self.max_model_len,
            block_size=block_size,
            num_blocks=num_blocks,
            vocab_size=self.arch.vocab_size,
            eos_token_ids=tuple(self.arch.eos_token_ids),
            bos_token_id=self.arch.bos_token_id,
            dtype=str(dtype).removeprefix("torch."),
            device=str(device),
            attention_backend=self.attention.name,
        )

    def _resolve_max_model_len(self, arch: ModelArchConfig) -> int:
        wanted = self.config.model.max_model_len
        if wanted is None:
            return arch.max_position_embeddings
        if wanted > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len {wanted} is longer than the model's context "
                f"({arch.max_position_embeddings} tokens)"
            )
        return wanted

    def _tokenizer_path(self) -> str | None:
        """The vocabulary for structured output: --tokenizer, else the model's own if it has one."""
        if self.config.model.tokenizer is not None:
            return self.config.model.tokenizer
        path = Path(self.model_path)
        return str(path) if path.suffix == ".gguf" or (path / "tokenizer.json").is_file() else None

    def _cuda_graph_sizes(self, device: torch.device) -> list[int]:
        """Decode batch sizes to capture: none off CUDA, with enforce_eager, or for a backend
        that cannot be captured."""
        device_config = self.config.device
        if device.type != "cuda" or device_config.enforce_eager:
            return []
        if not self.attention.supports_cuda_graphs:
            logger.info("attention backend %r cannot run in CUDA graphs: decode runs eagerly", self.attention.name)
            return []
        return capture_sizes(min(self.config.scheduler.max_num_seqs, device_config.cuda_graph_max_batch_size))

    def _num_blocks_for_memory(self, dtype: torch.dtype) -> int:
        per_block = kv_cache_bytes_per_block(self.arch, self.config.cache.block_size, dtype)
        num_blocks = int(self.config.cache.kv_cache_memory_gib * 2**30) // per_block
        blocks_for_one_full_request = -(-self.max_model_len // self.config.cache.block_size) + 1
        if num_blocks < blocks_for_one_full_request:
            raise ValueError(
                f"kv_cache_memory_gib={self.config.cache.kv_cache_memory_gib} holds {num_blocks} blocks, "
                f"fewer than the {blocks_for_one_full_request} one max_model_len={self.max_model_len} "
                "request needs; raise kv_cache_memory_gib or lower max_model_len"
            )
        return num_blocks

    # ---- requests ---------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request. Raises ValueError (with an actionable message) for bad input."""
        if self.scheduler.get_request(request.request_id) is not None:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        self.validate_request(request)
        internal = Request.from_engine_core_request(
            request,
            block_size=self.config.cache.block_size,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
        )
        if request.sampling_params.structured is not None:  # compiled once per grammar text, then copied
            internal.grammar = self.structured.new_matcher(request.sampling_params.structured)
        self.scheduler.add_request(internal)

    def validate_request(self, request: EngineCoreRequest) -> None:
        """Raise ValueError (naming the problem) if `add_request` would refuse this request."""
        num_tokens = len(request.prompt_token_ids)
        if num_tokens == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if num_tokens >= self.max_model_len:
            what, why = ("input", "to be embedded") if request.pooling else ("prompt", "so one can be generated")
            raise ValueError(
                f"the {what} has {num_tokens} tokens but max_model_len is {self.max_model_len}: "
                f"shorten it to at most {self.max_model_len - 1} tokens {why}"
            )
        vocab_size = self.arch.vocab_size
        bad = next((t for t in request.prompt_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of range: the vocabulary has {vocab_size} tokens")
        params = validate_sampling_params(request.sampling_params, vocab_size=vocab_size)
        if params.n != 1:
            raise ValueError(f"n must be 1 at the engine core (fan n > 1 out first, as the frontend does), "
                             f"got {params.n}")
        if params.structured is not None:
            self.structured.new_matcher(params.structured)  # compiles (and caches) or raises
        self.validate_lora(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Idempotent: unknown or finished ids are ignored."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """Also True while an overlapped step is in flight: the next step() takes in its outputs."""
        return self.scheduler.has_unfinished_requests() or (self.overlapped is not None and self.overlapped.in_flight)

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    # ---- the step -----------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        if self.overlapped is not None:  # the previous step's outputs; this one's forward is running
            outputs = self.overlapped.step()
            self.last_mask_timing = self.overlapped.mask_timing
        else:
            scheduler_output = self.scheduler.schedule()
            runner_output = self.runner.execute_model(scheduler_output)
            outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
            self.last_mask_timing = runner_output.mask_timing  # for the step's metrics (never sent)
        outputs.timestamp = time.time()
        outputs.kv_events = self._block_pool.take_events()
        return outputs

    # ---- utilities ----------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def take_kv_events(self) -> KVCacheEvents | None:
        """Prefix-cache changes not yet in a step's outputs (a reset between steps); None when none."""
        return self._block_pool.take_events()

    def kv_cache_snapshot(self) -> KVCacheEvents:
        """Every prefix-cache hash held now (cleared=True: it replaces what a reader knew)."""
        return self._block_pool.snapshot()

    # ---- sleep and profiling --------------------------------------------------------
    def sleep(self) -> None:
        """Free the KV cache (on CUDA also move the weights to CPU) until `wake_up()`; idempotent.
        Raises ValueError while requests are in flight: their KV blocks would be lost."""
        if self.asleep:
            return
        if self.overlapped is not None and not self.scheduler.has_unfinished_requests():
            self.overlapped.drain()  # a step of finished requests may still be in flight
        if self.has_unfinished_requests():
            raise ValueError(f"{self.get_num_unfinished_requests()} requests are in flight; "
                             "abort them (or let them finish) before sleeping")
        self.runner.free_kv_cache()
        if self.runner.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self.asleep = True

    def wake_up(self) -> None:
        """Allocate the KV cache again (and move the weights back); the prefix cache starts empty."""
        if not self.asleep:
            return
        if self.runner.device.type == "cuda":
            self.model.to(self.runner.device)
        self.runner.allocate_kv_cache()
        self.reset_prefix_cache()  # the cached blocks' contents are gone
        self.asleep = False

    def start_profile(self, folder: str) -> None:
        """Profile the steps from now on (torch.profiler); ValueError when it cannot (engine_core/profiler.py)."""
        self._profiler.start(folder)

    def stop_profile(self) -> Path:
        """Write the running profile into its folder as a chrome trace; returns the file."""
        return self._profiler.stop()
