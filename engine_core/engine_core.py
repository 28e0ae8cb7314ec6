"""EngineCore: the scheduler, the KV cache and the model runner behind one `step()`.

step() = schedule() -> execute_model() -> update_from_output(), as in vLLM v1.
Token ids in, token ids out: no tokenizer and no transport in here. Whoever owns
an EngineCore (the offline LLMEngine or the gRPC busy loop) calls it from one
thread only.

Only requests in and the step are here: start-up (the constructor, and every "auto" it resolves) is in
engine_core/startup.py, the check of a new request in engine_core/request_intake.py, the calls made
between steps (prefix-cache reset, stats, KV-cache state, sleep and wake-up, profiling) in
engine_core/utility_calls.py and the LoRA calls in engine_core/lora/engine_calls.py.
"""

from __future__ import annotations

import time

from engine_core.lora.engine_calls import EngineLoraCalls
from engine_core.protocol import EngineCoreOutputs, EngineCoreRequest
from engine_core.request import RequestStatus
from engine_core.request_intake import check_request, to_request
from engine_core.startup import EngineStartup
from engine_core.utility_calls import EngineUtilityCalls


class EngineCore(EngineStartup, EngineLoraCalls, EngineUtilityCalls):
    """EngineCore(config, *, log_stats=False, kv_events=False): built by EngineStartup (engine_core/startup.py),
    which loads the model and makes the scheduler, the runner and, when steps overlap, `overlapped`; the LoRA
    and utility calls are mixed in (engine_core/lora/engine_calls.py, engine_core/utility_calls.py)."""

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
