"""The engine's observability: a span per request continuing the frontend's trace, and step metrics.

Used only from the busy-loop thread. Spans are keyed by engine request id (services/engine/routing.py).
Each span gets the scheduler's events (queued, scheduled, preempted) at the engine's own
timestamps, a first_token event and a finished event. Without a tracer provider nothing
here creates span objects; without metrics no metric is touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import trace

from engine_core.protocol import EngineCoreEventType, EngineCoreOutputs, EngineCoreRequest, FinishReason
from services.telemetry.metrics import EngineMetrics
from services.telemetry.tracing import SpanAttributes, extract_context

if TYPE_CHECKING:
    from engine_core.structured.masks import MaskTiming

_EVENT_NAMES = {
    EngineCoreEventType.QUEUED: "queued",
    EngineCoreEventType.SCHEDULED: "scheduled",
    EngineCoreEventType.PREEMPTED: "preempted",
}


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


@dataclass
class _OpenSpan:
    span: trace.Span
    num_output_tokens: int = 0
    num_preemptions: int = 0


class EngineTelemetry:
    """Request spans (when `tracer_provider` is given) and step metrics (when `metrics` is given)."""

    def __init__(self, tracer_provider=None, metrics: EngineMetrics | None = None) -> None:
        self.tracer = tracer_provider.get_tracer("tandem.engine") if tracer_provider is not None else None
        self.metrics = metrics
        self._spans: dict[str, _OpenSpan] = {}

    @property
    def num_open_spans(self) -> int:
        return len(self._spans)

    # ---- requests ---------------------------------------------------------------------
    def start_request(self, engine_id: str, request: EngineCoreRequest, start_time_ns: int | None = None) -> None:
        """Open the request's span (at `start_time_ns`, default now), a child of the span in its trace headers."""
        if self.tracer is None:
            return
        params = request.sampling_params
        attributes = {
            SpanAttributes.REQUEST_ID: request.request_id,
            SpanAttributes.USAGE_PROMPT_TOKENS: len(request.prompt_token_ids),
            SpanAttributes.REQUEST_TEMPERATURE: params.temperature,
            SpanAttributes.REQUEST_TOP_P: params.top_p,
            "tandem.request.priority": request.priority,
        }
        if request.lora_name is not None:
            attributes["tandem.request.lora_name"] = request.lora_name
        if params.max_tokens is not None:
            attributes[SpanAttributes.REQUEST_MAX_TOKENS] = params.max_tokens
        span = self.tracer.start_span("engine_core.request", context=extract_context(request.trace_headers),
                                      kind=trace.SpanKind.INTERNAL, attributes=attributes, start_time=start_time_ns)
        self._spans[engine_id] = _OpenSpan(span)

    def end_requests(self, engine_ids, finish_reason: FinishReason = FinishReason.ABORT) -> None:
        """Close the spans of requests that ended outside a step (aborts, a closed connection)."""
        if not self._spans:
            return
        for engine_id in engine_ids:
            self._end(engine_id, finish_reason)

    def close(self) -> None:
        """End every open span (the busy loop stopped with requests in flight)."""
        self.end_requests(list(self._spans))

    # ---- steps ------------------------------------------------------------------------
    def record_step(self, step: EngineCoreOutputs, step_seconds: float, mask_timing: MaskTiming | None = None) -> None:
        """Metrics for the step (mask_timing: its structured-output masks, if any); events, first token and finish
        onto the spans of its requests."""
        if self.metrics is not None and step.scheduler_stats is not None:
            self.metrics.record_step(step.scheduler_stats, step_seconds)
        if self.metrics is not None and mask_timing is not None:
            self.metrics.record_masks(mask_timing)
        if not self._spans:
            return
        timestamp = _ns(step.timestamp)
        for output in step.outputs:
            open_span = self._spans.get(output.request_id)
            if open_span is None:
                continue
            for event in output.events or ():
                open_span.span.add_event(_EVENT_NAMES[event.type], timestamp=_ns(event.timestamp))
                open_span.num_preemptions += event.type == EngineCoreEventType.PREEMPTED
            if output.new_token_ids:
                if not open_span.num_output_tokens:
                    open_span.span.add_event("first_token", timestamp=timestamp)
                open_span.num_output_tokens += len(output.new_token_ids)
            if output.finish_reason is not None:
                self._end(output.request_id, output.finish_reason, output.num_cached_tokens, timestamp)
        for engine_id in step.finished_request_ids:  # aborted without an output
            self._end(engine_id, FinishReason.ABORT)

    def _end(self, engine_id: str, finish_reason: FinishReason, num_cached_tokens: int | None = None,
             timestamp: int | None = None) -> None:
        open_span = self._spans.pop(engine_id, None)
        if open_span is None:
            return
        span = open_span.span
        span.set_attribute(SpanAttributes.USAGE_COMPLETION_TOKENS, open_span.num_output_tokens)
        span.set_attribute(SpanAttributes.RESPONSE_FINISH_REASON, [str(finish_reason)])
        span.set_attribute("tandem.request.num_preemptions", open_span.num_preemptions)
        if num_cached_tokens is not None:
            span.set_attribute(SpanAttributes.USAGE_CACHED_TOKENS, num_cached_tokens)
        span.add_event("finished", {"finish_reason": str(finish_reason)}, timestamp=timestamp)
        span.end(end_time=timestamp)
