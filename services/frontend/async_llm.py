"""AsyncLLM: the frontend's core, with no gRPC in it (vLLM v1's AsyncLLM over an EngineClient).

InputProcessor -> EngineClient -> OutputProcessor, with `generate()` as an async generator
that takes and yields dataclasses. One output-handler task pulls engine outputs from the
engine client, runs the OutputProcessor and sends the aborts it asks for. The gRPC
servicers in server.py are thin shells around this class.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace

from engine_core.protocol import (
    EngineInfo,
    ListLorasCall,
    LoadLoraCall,
    OutputKind,
    PauseCall,
    PauseMode,
    PinLoraCall,
    PoolingParams,
    RequestOutput,
    ResetPrefixCacheCall,
    ResumeCall,
    SamplingParams,
    SleepCall,
    StartProfileCall,
    StopProfileCall,
    UnloadLoraCall,
    Usage,
    WakeUpCall,
)
from services.frontend.change_listeners import ChangeListeners
from services.frontend.chat.template_choice import ChatSetup
from services.frontend.engines.client import EngineCallResult, EngineClient, OutputBatch
from services.frontend.engines.lora_results import lora_results
from services.frontend.errors import DuplicateRequest, EngineUnavailable, InvalidRequest, NotFound, TooManyRequests
from services.frontend.input_processor import InputProcessor, Prompt, PromptLike, TextPrompt, as_prompt, new_request_id
from services.frontend.limits import RequestLimits
from services.frontend.output_processor import DEFAULT_MAX_UNSENT_TOKENS, OutputProcessor, RequestOutputCollector
from services.frontend.telemetry import FrontendTelemetry
from services.frontend.tokenizer import TokenizerBundle

log = logging.getLogger(__name__)

DEFAULT_MAX_WAITING_REQUESTS = 1024


@dataclass
class EmbedResult:
    """What `AsyncLLM.embed()` returns: one vector per input, in input order."""

    request_id: str
    embeddings: list[list[float]]
    num_prompt_tokens: list[int]
    usage: Usage


class AsyncLLM(ChangeListeners):
    """Generate text through one or more engine cores."""

    def __init__(self, engine_client: EngineClient, tokenizer: TokenizerBundle, *,
                 max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
                 limits: RequestLimits = RequestLimits(),
                 max_unsent_tokens: int = DEFAULT_MAX_UNSENT_TOKENS,
                 telemetry: FrontendTelemetry | None = None, chat_setup: ChatSetup | None = None) -> None:
        self.engine_client = engine_client
        self.tokenizer = tokenizer
        self.telemetry = telemetry or FrontendTelemetry()  # default: request log lines only
        self.input_processor = InputProcessor(tokenizer, limits=limits, chat_setup=chat_setup)
        self.output_processor = OutputProcessor(tokenizer.tokenizer, max_unsent_tokens, self.telemetry)
        if self.telemetry.metrics is not None:
            self.telemetry.metrics.track_streams(lambda: len(self.output_processor.parents))
        self.max_waiting_requests = max_waiting_requests
        self.model_info: EngineInfo | None = None  # the last model an engine reported
        self.draining = False  # set by drain(): no new requests are admitted
        # each admission's engine requests get ids of their own ("{request id}@{admission}"): a client may reuse a
        # request id as soon as its request ended, while the engine may still send a step or two of the old one
        # (a stop string ends a request here before the engine hears of the abort); with the client's id those
        # would reach the new request. vLLM makes its internal request ids unique the same way
        self._admissions = itertools.count(1)
        self._output_handler: asyncio.Task | None = None
        # called with each admitted request's prompt token ids and LoRA adapter (the gateway's KV event feed)
        self.prompt_listeners: list[Callable[[Sequence[int], str | None], None]] = []
        ChangeListeners.__init__(self)  # notified when `serving` may have changed: engines, their states, a drain
        engine_client.add_listener(self._on_engines_changed)
        self._on_engines_changed()

    def _on_engines_changed(self) -> None:
        info = self.engine_client.engine_info
        if info is not None:
            self.model_info = info
            if self.telemetry.metrics is not None:
                self.telemetry.metrics.set_model(info.model_name)
            self.input_processor.set_model_limits(info.max_model_len, info.vocab_size)
        self._notify()

    # ---- what new requests get --------------------------------------------------------
    @property
    def not_serving_reason(self) -> str | None:
        """Why new requests do not start now (draining, no engine, every engine asleep or paused); None
        when they do. Health reports SERVING exactly when this is None."""
        if self.draining:
            return "draining (AdminService/Drain or a shutdown): new requests get UNAVAILABLE until Resume"
        if not self.engine_client.is_connected:
            return "no engine is connected"
        if self.engine_client.admitting:
            return None
        engines = [e for e in self.engine_client.engines() if e.connected]
        if all(e.state.asleep for e in engines):
            return "every engine is asleep (AdminService/Sleep): new requests get UNAVAILABLE until WakeUp"
        return "every engine is paused or asleep (AdminService/Pause, Sleep): new requests wait for Resume"

    @property
    def serving(self) -> bool:
        return self.not_serving_reason is None

    @property
    def num_in_flight(self) -> int:
        """Engine requests in flight (an n > 1 request counts n); the OutputProcessor is the one record."""
        return self.output_processor.num_requests

    @property
    def chat_template(self) -> str | None:
        """The chat template text this frontend renders chats with (--chat-template, the model's own, or the
        tool-aware one shipped for it: services/frontend/chat/template_choice.py); what a gateway must render with."""
        return self.input_processor.chat_setup.template

    # ---- generation -----------------------------------------------------------------
    async def generate(self, prompt: PromptLike, sampling_params: SamplingParams | None = None, request_id: str = "", *,
                       priority: int = 0, trace_headers: dict[str, str] | None = None,
                       lora_name: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (sampling_params None: every default; the output kind defaults to DELTA).
        `prompt`: a str, token ids, vLLM's {"prompt": ...} / {"prompt_token_ids": [...]}, or a TextPrompt,
        TokensPrompt or ChatPrompt. Validation errors raise InvalidRequest; `lora_name` no engine has loaded,
        NotFound.

        Closing the generator early (client cancel, deadline) aborts the request in the engine.
        """
        request_id, collector = self.add_request(prompt, sampling_params, request_id, priority=priority,
                                                 trace_headers=trace_headers, lora_name=lora_name)
        finished = False
        try:
            while not finished:
                output = collector.get_nowait() or await collector.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    async def embed(self, prompts: list[Prompt], pooling: PoolingParams, request_id: str = "", *, priority: int = 0,
                    trace_headers: dict[str, str] | None = None, lora_name: str | None = None) -> EmbedResult:
        """One vector per prompt: each prompt is an engine request that is prefilled and pooled, in the
        same batches as generation. Validation errors raise InvalidRequest; cancelling aborts them all."""
        if not prompts:
            raise InvalidRequest("inputs is empty; send at least one text or token-id input")
        request_id = request_id or new_request_id()
        params = SamplingParams(max_tokens=1, output_kind=OutputKind.FINAL_ONLY)
        ids, collectors = [], []
        try:
            for i, prompt in enumerate(prompts):
                if prompt is None:
                    raise InvalidRequest(f"inputs[{i}] is empty: set text or token_ids")
                child_id, collector = self.add_request(prompt, params, f"{request_id}-{i}", priority=priority,
                                                       trace_headers=trace_headers, pooling=pooling,
                                                       lora_name=lora_name)
                ids.append(child_id)
                collectors.append(collector)
            outputs = [await collector.get() for collector in collectors]
        except BaseException:
            self.abort(ids)
            raise
        if any(o.completions[0].embedding is None for o in outputs):  # aborted (an Abort call, a pause)
            raise EngineUnavailable(f"embedding request {request_id!r} was aborted before it finished")
        return EmbedResult(
            request_id, [o.completions[0].embedding for o in outputs], [o.num_prompt_tokens for o in outputs],
            Usage(sum(o.usage.prompt_tokens for o in outputs), 0, sum(o.usage.cached_tokens for o in outputs)),
        )

    def add_request(self, prompt: PromptLike, sampling_params: SamplingParams | None = None, request_id: str = "",
                    *, priority: int = 0, trace_headers: dict[str, str] | None = None,
                    pooling: PoolingParams | None = None,
                    lora_name: str | None = None) -> tuple[str, RequestOutputCollector]:
        """Validate, admit and send a request (fanned out when n > 1); its id and collector."""
        prompt = as_prompt(prompt)
        if self.draining:
            raise EngineUnavailable("the server is draining and admits no new requests; use another replica")
        if request_id and self.output_processor.has_request(request_id):
            raise DuplicateRequest(f"request_id {request_id!r} is already in flight; use a new id")
        if not self.engine_client.is_connected:
            raise EngineUnavailable("no engine is connected; it may be starting or down, retry shortly")
        tool_plan = self.input_processor.plan_tools(prompt, sampling_params)
        request = self.input_processor.process(request_id, prompt, sampling_params, priority=priority,
                                               trace_headers=trace_headers, pooling=pooling, tool_plan=tool_plan)
        if lora_name:
            request = replace(request, lora_name=lora_name)
        n = request.sampling_params.n
        in_flight = self.num_in_flight
        if in_flight + n > self.max_waiting_requests:
            raise TooManyRequests(f"the server is full: {in_flight} requests in flight, the limit is "
                                  f"{self.max_waiting_requests} (--max-waiting-requests); retry later")
        request, stats = self.telemetry.start_request(request)  # its span's context goes into the trace headers
        for listener in self.prompt_listeners:
            listener(request.prompt_token_ids, request.lora_name)
        children = replace(request, request_id=f"{request.request_id}@{next(self._admissions)}").fan_out()
        collector = RequestOutputCollector(request.sampling_params.output_kind)
        self.output_processor.add_request(request.request_id, children, collector, stats, tool_plan,
                                          prompt=prompt.text if isinstance(prompt, TextPrompt) else None)
        try:
            for child in children:
                self.engine_client.add_request(child)
        except (EngineUnavailable, NotFound):  # NotFound: no engine has its LoRA adapter
            self.abort(request.request_id)
            raise
        self._start_output_handler()
        return request.request_id, collector

    # ---- the output handler ---------------------------------------------------------
    def _start_output_handler(self) -> None:
        """Started with the first request sent (on the running loop), restarted if it ever ended."""
        if self._output_handler is None or self._output_handler.done():
            self._output_handler = asyncio.create_task(self._handle_outputs(), name="output handler")

    async def _handle_outputs(self) -> None:
        """The one loop over engine outputs: process each step, then abort what the processor asks."""
        while True:
            outputs = await self.engine_client.get_output()
            try:
                self.engine_client.abort(self._process(outputs))
            except Exception:  # a bug on one step must not stop every stream
                log.exception("error while processing engine outputs")

    def _process(self, outputs: OutputBatch) -> list[str]:
        """Engine request ids to abort: stop strings hit, slow readers cut off, siblings of failed requests."""
        aborts = []
        if outputs.failed:
            aborts += self.output_processor.fail_requests(outputs.failed, outputs.error)
        if outputs.outputs:
            aborts += self.output_processor.process_outputs(outputs.outputs, outputs.timestamp)
        return aborts

    async def shutdown(self) -> None:
        """Stop the output handler (the engine client is closed by whoever started it)."""
        if self._output_handler is not None:
            self._output_handler.cancel()
            await asyncio.gather(self._output_handler, return_exceptions=True)
            self._output_handler = None

    def abort(self, request_ids: str | list[str]) -> list[str]:
        """Abort client requests here and in the engines; returns those that were in flight."""
        aborted = []
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            engine_ids = self.output_processor.abort_request(request_id)
            if engine_ids:
                aborted.append(request_id)
                self.engine_client.abort(engine_ids)
        return aborted

    # ---- health ---------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        """True while no engine is connected (the client keeps reconnecting)."""
        return not self.engine_client.is_connected

    async def check_health(self) -> None:
        if self.errored:
            raise EngineUnavailable("no engine is connected")

    # ---- operator calls (forwarded to every engine) -----------------------------------
    async def pause_generation(self, mode: PauseMode = PauseMode.ABORT) -> list[EngineCallResult]:
        """ABORT (abort in-flight requests first), WAIT (let them finish) or KEEP (freeze them)."""
        if mode is PauseMode.ABORT:
            self.abort(list(self.output_processor.parents))
        return await self.engine_client.call_utility(PauseCall(mode))

    async def resume_generation(self) -> list[EngineCallResult]:
        """Resume the engines; also ends a drain, so new requests are admitted again."""
        self._set_draining(False)
        return await self.engine_client.call_utility(ResumeCall())

    async def sleep(self) -> list[EngineCallResult]:
        return await self.engine_client.call_utility(SleepCall())

    async def wake_up(self) -> list[EngineCallResult]:
        return await self.engine_client.call_utility(WakeUpCall())

    async def reset_prefix_cache(self) -> list[EngineCallResult]:
        return await self.engine_client.call_utility(ResetPrefixCacheCall())

    async def start_profile(self, output_dir: str = "") -> list[EngineCallResult]:
        return await self.engine_client.call_utility(StartProfileCall(output_dir))

    async def stop_profile(self) -> list[EngineCallResult]:
        return await self.engine_client.call_utility(StopProfileCall())

    # ---- LoRA adapters (every engine; docs/lora.md) --------------------------------------
    async def add_lora(self, name: str, path: str) -> list[EngineCallResult]:
        """Load the PEFT adapter folder `path` (on the engines' machines) as `name` into every engine."""
        if not name or not path:
            raise InvalidRequest(f"lora_name and lora_path must both be set (got {name!r}, {path!r})")
        return lora_results(await self.engine_client.call_utility(LoadLoraCall(name, path)))

    async def remove_lora(self, name: str) -> list[EngineCallResult]:
        if not name:
            raise InvalidRequest("lora_name is empty: name the adapter to unload")
        return lora_results(await self.engine_client.call_utility(UnloadLoraCall(name)), missing_ok=True)

    async def pin_lora(self, name: str) -> list[EngineCallResult]:
        if not name:
            raise InvalidRequest("lora_name is empty: name the adapter to pin")
        return lora_results(await self.engine_client.call_utility(PinLoraCall(name)), missing_ok=True)

    async def list_loras(self) -> list[EngineCallResult]:
        return lora_results(await self.engine_client.call_utility(ListLorasCall()))

    async def drain(self, timeout_s: float) -> int:
        """Stop admitting requests and wait up to timeout_s (finite, >= 0) for those in flight; how many are left."""
        if not (math.isfinite(timeout_s) and timeout_s >= 0):
            raise InvalidRequest(f"timeout_s must be a finite number of seconds >= 0, got {timeout_s}")
        self._set_draining(True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.output_processor.parents and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return len(self.output_processor.parents)

    def _set_draining(self, draining: bool) -> None:
        if draining != self.draining:
            self.draining = draining
            log.info("draining: new requests get UNAVAILABLE" if draining else "drain ended: admitting requests")
            self._notify()

