"""EngineCore: the scheduler, the KV cache and the model runner behind one `step()`.

step() = schedule() -> execute_model() -> update_from_output(), as in vLLM v1.
Token ids in, token ids out: no tokenizer and no transport in here. Whoever owns
an EngineCore (the offline LLMEngine or the gRPC busy loop) calls it from one
thread only.

Only its fields, requests in and the step are here: making its parts (and every "auto" that resolves) is in
engine_core/startup.py, the check of a new request in engine_core/request_intake.py, the calls made
between steps (prefix-cache reset, stats, KV-cache state, sleep and wake-up, profiling) in
engine_core/utility_calls.py and the LoRA calls in engine_core/lora/engine_calls.py.
"""

from __future__ import annotations

import time

from engine_core.config import EngineConfig
from engine_core.lora.engine_calls import EngineLoraCalls
from engine_core.profiler import Profiler
from engine_core.protocol import EngineCoreOutputs, EngineCoreRequest
from engine_core.readiness import CompileMonitor
from engine_core.request import RequestStatus
from engine_core.request_intake import check_request, to_request
from engine_core.startup import build_parts
from engine_core.utility_calls import EngineUtilityCalls


class EngineCore(EngineLoraCalls, EngineUtilityCalls):
    """Built from an EngineConfig here, of the parts engine_core/startup.py makes. The LoRA and between-steps
    calls are method groups with no state of their own (engine_core/lora/engine_calls.py,
    engine_core/utility_calls.py): they read the fields set here."""

    def __init__(self, config: EngineConfig, *, log_stats: bool = False, kv_events: bool = False) -> None:
        """log_stats: outputs carry per-request events (queued, scheduled, preempted) as in vLLM v1.
        kv_events: each step's outputs carry the prefix-cache hashes indexed and evicted (for routers)."""
        self.compile_monitor = CompileMonitor()  # counts the compiles after ready_to_serve() (engine_core/readiness)
        with CompileMonitor.starting():  # its kernels compile and its plans are timed now, before it is ready
            parts = build_parts(config, log_stats=log_stats, kv_events=kv_events)
        self.compile_monitor.name = parts.info.model_name
        self.config = parts.config  # as run: the defaults that depend on the device and model filled in
        self.info, self.model_path, self.max_model_len = parts.info, parts.model_path, parts.max_model_len
        self.model, self.arch, self.attention = parts.model, parts.arch, parts.attention
        self.eos_token_ids = frozenset(parts.arch.eos_token_ids)
        self.structured = parts.structured  # grammars and their masks
        self.lora = parts.lora  # None: the engine serves no LoRA adapters
        self.runner, self.scheduler = parts.runner, parts.scheduler
        self.overlapped = parts.overlapped  # None: each step() runs its step to the end
        self.records_kv_events = kv_events
        self.last_mask_timing = None  # the last step's structured-output mask timing (metrics only)
        self.asleep = False  # the KV cache is freed (sleep / wake_up)
        self._block_pool = parts.scheduler.kv_cache_manager.block_pool  # the step's KV events come from it
        self._profiler = Profiler(parts.runner.device)

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
