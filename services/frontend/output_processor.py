"""The one loop over engine outputs (vLLM v1's OutputProcessor.process_outputs).

Per engine request: detokenize incrementally, check stop strings, build the message
for the request's output kind and put it into the client request's collector, which
merges messages while the consumer is behind. Stop-string hits are returned so the
caller can abort them in the engine, and so are the requests of a client that stopped
reading: once more than `max_unsent_tokens` merged DELTA tokens wait in its collector,
the request ends with SlowReader (RESOURCE_EXHAUSTED) and is aborted in the engine.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from engine_core.protocol import (
    CompletionOutput,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    OutputKind,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
    Usage,
)
from services.frontend.detokenizer import Detokenizer, decode_logprobs
from services.frontend.errors import SlowReader
from services.frontend.telemetry import FrontendTelemetry, RequestStats
from services.frontend.tools.output import ToolOutput
from services.frontend.tools.request import ToolPlan

DEFAULT_MAX_UNSENT_TOKENS = 8192


# ---- collector --------------------------------------------------------------------
class RequestOutputCollector:
    """A request's unsent output: one slot, merged into while the consumer is slow (never a growing queue)."""

    def __init__(self, output_kind: OutputKind) -> None:
        self.aggregate = output_kind == OutputKind.DELTA
        self.output: RequestOutput | Exception | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | Exception) -> None:
        if self.output is None or isinstance(output, Exception):
            self.output = output
            self.ready.set()
        elif isinstance(self.output, RequestOutput):
            self.output.merge(output, aggregate=self.aggregate)

    async def get(self) -> RequestOutput:
        while self.output is None:
            await self.ready.wait()
        return self._take()

    @property
    def backlog_tokens(self) -> int:
        """Tokens merged into the unsent DELTA message (what grows while the consumer does not read)."""
        if not self.aggregate or not isinstance(self.output, RequestOutput):
            return 0
        return sum(len(c.token_ids) for c in self.output.outputs)

    def get_nowait(self) -> RequestOutput | None:
        return None if self.output is None else self._take()

    def _take(self) -> RequestOutput:
        output, self.output = self.output, None
        self.ready.clear()
        if isinstance(output, Exception):
            raise output
        return output


# ---- per-request state ------------------------------------------------------------
@dataclass
class ParentRequest:
    """What the n completions of one client request share."""

    request_id: str
    collector: RequestOutputCollector
    num_prompt_tokens: int
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt: str | None = None  # the prompt's text, when it came as text
    children: dict[int, str] = field(default_factory=dict)  # index -> engine request id still running
    completion_tokens: int = 0
    cached_tokens: int = 0
    first_sent: bool = False
    stats: RequestStats | None = None  # timestamps and span, for metrics, tracing and the log line


class RequestState:
    """One engine request (one completion) in flight."""

    def __init__(self, request: EngineCoreRequest, parent: ParentRequest, index: int, tokenizer: Tokenizer,
                 tool_plan: ToolPlan | None = None) -> None:
        self.request_id = request.request_id
        self.parent, self.index = parent, index
        self.output_kind = request.sampling_params.output_kind or OutputKind.DELTA
        self.include_stop = request.sampling_params.include_stop_str_in_output
        self.detokenizer = Detokenizer(tokenizer, request.sampling_params)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs] = []
        # the sampled tokens' logprobs summed (vLLM's cumulative_logprob); None unless logprobs were asked
        self.cumulative_logprob = None if request.sampling_params.logprobs is None else 0.0
        self.tools = None if tool_plan is None else ToolOutput(tool_plan, self.output_kind)

    def completion(self, new: EngineCoreOutput, finish: FinishReason | None, stop_string: str | None,
                   new_logprobs: list[TokenLogprobs]) -> CompletionOutput | None:
        """This step's message for this completion, per output kind (None: nothing to send)."""
        finished = finish is not None
        if self.output_kind == OutputKind.FINAL_ONLY and not finished:
            return None
        delta = self.output_kind == OutputKind.DELTA
        tools = None if self.tools is None else self.tools.step(self.detokenizer.next_text(finished, True), finished)
        text = self.detokenizer.next_text(finished, delta) if tools is None else tools.text
        if delta and not (text or new.new_token_ids or finished or (tools and tools.deltas)):
            return None
        return CompletionOutput(
            index=self.index, text=text,
            token_ids=list(new.new_token_ids) if delta else list(self.token_ids),
            logprobs=new_logprobs if delta else list(self.logprobs),
            finish_reason=finish if tools is None else self.tools.finish_reason(finish), stop_string=stop_string,
            stop_token_id=new.stop_token_id if finish == FinishReason.STOP and not stop_string else None,
            embedding=new.embedding,
            tool_call_deltas=tools.deltas if tools else [], tool_calls=tools.calls if tools else [],
            cumulative_logprob=self.cumulative_logprob,
        )


# ---- the processor ----------------------------------------------------------------
class OutputProcessor:
    """Owns every in-flight request's state; the only code that turns engine outputs into client messages."""

    def __init__(self, tokenizer: Tokenizer, max_unsent_tokens: int = DEFAULT_MAX_UNSENT_TOKENS,
                 telemetry: FrontendTelemetry | None = None) -> None:
        self.tokenizer = tokenizer
        self.telemetry = telemetry or FrontendTelemetry()
        self.max_unsent_tokens = max_unsent_tokens
        self.requests: dict[str, RequestState] = {}  # engine request id -> state
        self.parents: dict[str, ParentRequest] = {}  # client request id -> parent

    @property
    def num_requests(self) -> int:
        """Engine requests in flight (an n > 1 request counts n)."""
        return len(self.requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.parents

    def add_request(self, request_id: str, children: list[EngineCoreRequest], collector: RequestOutputCollector,
                    stats: RequestStats | None = None, tool_plan: ToolPlan | None = None,
                    prompt: str | None = None) -> None:
        """Track a client request and its engine requests (one per completion; tool_plan: parse tool calls;
        prompt: its text, when it came as text)."""
        parent = ParentRequest(request_id, collector, len(children[0].prompt_token_ids),
                               list(children[0].prompt_token_ids), prompt,
                               stats=stats or RequestStats(request_id, children[0].arrival_time))
        self.parents[request_id] = parent
        for index, child in enumerate(children):
            parent.children[index] = child.request_id
            self.requests[child.request_id] = RequestState(child, parent, index, self.tokenizer, tool_plan)

    # ---- the loop ------------------------------------------------------------------
    def process_outputs(self, outputs: list[EngineCoreOutput], engine_ts: float = 0.0) -> list[str]:
        """Process one engine step (engine_ts: its time, engine clock); return the engine request ids to abort
        (stop strings, slow readers)."""
        stopped = []
        now = time.time()
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:  # aborted or finished already
                continue
            self.telemetry.observe(state.parent.stats, out, now, engine_ts)
            finish = out.finish_reason
            skip_last = finish == FinishReason.STOP and out.stop_token_id is not None and not state.include_stop
            stop_string = state.detokenizer.update(out.new_token_ids, skip_last=skip_last)
            if stop_string is not None:
                finish = FinishReason.STOP
                if out.finish_reason is None:
                    stopped.append(out.request_id)
                out = state.detokenizer.cut(out)  # no token past the stop string's last
            state.token_ids.extend(out.new_token_ids)
            new_logprobs = decode_logprobs(self.tokenizer, out.new_logprobs)
            state.logprobs.extend(new_logprobs)
            if state.cumulative_logprob is not None:
                state.cumulative_logprob += sum(entry.logprobs[0] for entry in new_logprobs)
            state.prompt_logprobs.extend(decode_logprobs(self.tokenizer, out.new_prompt_logprobs))
            state.parent.cached_tokens = max(state.parent.cached_tokens, out.num_cached_tokens)
            completion = state.completion(out, finish, stop_string, new_logprobs)
            self._emit(state, completion, finished=finish is not None)
            if state.parent.children and state.parent.collector.backlog_tokens > self.max_unsent_tokens:
                stopped += self._cut_off(state.parent)
        return stopped

    def abort_request(self, request_id: str) -> list[str]:
        """Finish a client request with ABORT; return its engine request ids that were still running."""
        parent = self.parents.get(request_id)
        if parent is None:
            return []
        running = list(parent.children.values())
        for engine_id in running:
            state = self.requests[engine_id]
            finish = EngineCoreOutput(engine_id, [], finish_reason=FinishReason.ABORT)
            self._emit(state, state.completion(finish, FinishReason.ABORT, None, []), finished=True)
        return running

    def fail_requests(self, engine_ids: list[str], error: Exception) -> list[str]:
        """End the client requests of these engine requests with `error`; return their other running children."""
        siblings = []
        for engine_id in engine_ids:
            state = self.requests.get(engine_id)
            if state is not None:
                siblings += [c for c in self._fail_parent(state.parent, error) if c not in engine_ids]
        return siblings

    def _cut_off(self, parent: ParentRequest) -> list[str]:
        """End a request whose client stopped reading (its backlog is dropped); its running engine ids."""
        return self._fail_parent(parent, SlowReader(
            f"the client did not read the stream: more than {self.max_unsent_tokens} generated tokens were "
            "waiting to be sent (--max-unsent-tokens); the request was aborted"))

    def _fail_parent(self, parent: ParentRequest, error: Exception) -> list[str]:
        """End a client request with `error`; return the engine ids of its children that were still running."""
        self.parents.pop(parent.request_id, None)
        running = list(parent.children.values())
        for engine_id in running:
            self.requests.pop(engine_id, None)
        parent.children.clear()
        parent.collector.put(error)
        self.telemetry.fail(parent.stats, error)
        return running

    # ---- messages -------------------------------------------------------------------
    def _emit(self, state: RequestState, completion: CompletionOutput | None, finished: bool) -> None:
        parent = state.parent
        if finished:
            self.requests.pop(state.request_id, None)
            parent.children.pop(state.index, None)
            parent.completion_tokens += len(state.token_ids)
        done = finished and not parent.children
        if completion is None and not done:
            return
        output = RequestOutput(parent.request_id, [completion] if completion else [], finished=done,
                               prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids,
                               metrics=self._metrics(parent))
        if not parent.first_sent:
            parent.first_sent = True
            output.num_prompt_tokens = parent.num_prompt_tokens
            output.prompt_logprobs = state.prompt_logprobs
        if done:
            self.parents.pop(parent.request_id, None)
            output.usage = Usage(parent.num_prompt_tokens, parent.completion_tokens, parent.cached_tokens)
            self.telemetry.finish(parent.stats, output.usage, completion.finish_reason if completion else None)
        parent.collector.put(output)

    def _metrics(self, parent: ParentRequest) -> RequestMetrics:
        stats = parent.stats
        running = sum(len(self.requests[engine_id].token_ids) for engine_id in parent.children.values()
                      if engine_id in self.requests)
        return RequestMetrics(stats.arrival_time, stats.first_token_ts, stats.last_token_ts,
                              parent.completion_tokens + running)
