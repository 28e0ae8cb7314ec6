"""EngineCore: the scheduler, the KV cache and the model runner behind one `step()`.

step() = schedule() -> execute_model() -> update_from_output(), as in vLLM v1.
Token ids in, token ids out: no tokenizer and no transport in here. Whoever owns
an EngineCore (the offline LLMEngine or the gRPC busy loop) calls it from one
thread only.

Only the step's own code is here: what start-up decides is in engine_core/startup.py, the calls
made between steps (prefix-cache reset, stats, KV-cache state, sleep and wake-up, profiling) in
engine_core/utility_calls.py and the LoRA calls in engine_core/lora/engine_calls.py, both mixed in.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from engine_core.config import EngineConfig
from engine_core.loader.registry import default_model_path, load_model, prepare_for_cpu
from engine_core.lora.admission import LoraAdmission
from engine_core.lora.engine_calls import EngineLoraCalls
from engine_core.lora.runtime import LoraRuntime
from engine_core.model_runner import ModelRunner
from engine_core.overlap import InlineQueue, OverlappedSteps, ThreadQueue
from engine_core.profiler import Profiler
from engine_core.protocol import EngineCoreOutputs, EngineCoreRequest
from engine_core.request import RequestStatus
from engine_core.request_intake import check_request, to_request
from engine_core.scheduler import Scheduler
from engine_core.startup import (
    cuda_graph_sizes,
    engine_info,
    num_blocks_for_memory,
    resolve_device,
    resolve_dtype,
    resolve_max_model_len,
    resolve_overlap,
    resolve_quantization,
    resolve_scheduler,
    tokenizer_path,
)
from engine_core.structured.masks import StructuredOutputs
from engine_core.utility_calls import EngineUtilityCalls
from kernels import select_backend, select_fused_ops

logger = logging.getLogger(__name__)


class EngineCore(EngineLoraCalls, EngineUtilityCalls):  # their calls: lora/engine_calls.py, utility_calls.py
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

        self.max_model_len = resolve_max_model_len(config.model.max_model_len, self.arch)
        # the config as run: the defaults that depend on the device and model filled in
        scheduler_config = resolve_scheduler(config.scheduler, device, self.max_model_len)
        self.config = config = replace(config, scheduler=scheduler_config)
        logger.info("step token budget %d", config.scheduler.max_num_batched_tokens)
        block_size = config.cache.block_size
        num_blocks = config.cache.num_blocks or num_blocks_for_memory(config, self.arch, self.max_model_len, dtype)
        self.lora = None  # the adapters (engine_core/lora), when the engine serves LoRA
        if config.lora.enable:
            self.lora = LoraRuntime.attach(self.model, config.lora, device, dtype, self.attention.name)
        self.structured = StructuredOutputs(tokenizer_path(config, self.model_path), vocab_size=self.arch.vocab_size,
                                            eos_token_ids=list(self.arch.eos_token_ids))
        self.last_mask_timing = None  # the last step's structured-output mask timing (metrics only)
        self.runner = ModelRunner(
            self.model, self.arch, self.attention,
            num_blocks=num_blocks, block_size=block_size, device=device, dtype=dtype,
            max_model_len=self.max_model_len, cuda_graph_sizes=cuda_graph_sizes(config, device, self.attention),
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
        self.info = engine_info(self.model_path, self.arch, self.max_model_len, block_size, num_blocks, dtype, device,
                                self.attention.name)

    # ---- requests ---------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request. Raises ValueError (with an actionable message) for bad input."""
        if self.scheduler.get_request(request.request_id) is not None:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        self.validate_request(request)
        internal = to_request(
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
        check_request(request, max_model_len=self.max_model_len, vocab_size=self.arch.vocab_size,
                      structured=self.structured)
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
