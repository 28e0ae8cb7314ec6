"""The frontend's observability per client request: a span, latency metrics and the finish log line.

`start_request` opens the request's span (a child of the gRPC server span, or of the trace
headers given to AsyncLLM) and puts its context into the engine request's trace headers, so
the engine's span continues the same trace. `observe` runs in the OutputProcessor's one loop
for each engine output; `finish` / `fail` close the request. Times: arrival, first and last
token are frontend clock; queued, scheduled and the engine-side token times are engine clock,
so every interval is measured on one clock (vLLM v1's RequestStateStats).

With n > 1 the client request is measured as a whole: the first token of any completion, the
time between successive outputs, the finish reason of the completion that finished last.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import grpc

from engine_core.protocol import EngineCoreEventType, EngineCoreOutput, EngineCoreRequest, FinishReason, Usage
from services.telemetry.metrics import FrontendMetrics
from services.telemetry.request_log import log_request
from services.telemetry.tracing import (
    TRACE_HEADERS,
    SpanAttributes,
    extract_context,
    inject_headers,
    trace_id_from_headers,
    trace_id_of,
)


@dataclass
class RequestStats:
    """One client request's timestamps and its span (None when tracing is off)."""

    request_id: str
    arrival_time: float  # frontend clock
    span: object | None = None
    trace_id: str | None = None
    queued_ts: float = 0.0  # engine clock
    scheduled_ts: float = 0.0  # engine clock
    first_token_ts: float = 0.0  # frontend clock
    last_token_ts: float = 0.0  # frontend clock
    first_token_engine_ts: float = 0.0
    last_token_engine_ts: float = 0.0

    def intervals(self, now: float) -> dict[str, float | None]:
        """Seconds: e2e, ttft, queue, prefill, decode (None where the request never got there)."""
        first = self.first_token_ts
        scheduled = self.scheduled_ts
        return {
            "e2e": now - self.arrival_time,
            "ttft": first - self.arrival_time if first else None,
            "queue": scheduled - self.queued_ts if scheduled and self.queued_ts else None,
            "prefill": self.first_token_engine_ts - scheduled if first and scheduled else None,
            "decode": self.last_token_engine_ts - self.first_token_engine_ts if first else None,
        }


class FrontendTelemetry:
    """Spans (with a tracer provider), Prometheus metrics (with `metrics`) and request log lines."""

    def __init__(self, tracer_provider=None, metrics: FrontendMetrics | None = None) -> None:
        self.tracer_provider = tracer_provider
        self.tracer = tracer_provider.get_tracer("tandem.frontend") if tracer_provider is not None else None
        self.metrics = metrics

    @property
    def tracing(self) -> bool:
        return self.tracer is not None

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """OpenTelemetry's gRPC server interceptor (reads W3C context from metadata); none when tracing is off."""
        if self.tracer_provider is None:
            return []
        from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

        untraced = filters.any_of(filters.health_check(), filters.service_prefix("grpc.reflection"))
        return [aio_server_interceptor(self.tracer_provider, filter_=filters.negate(untraced))]

    def count_error(self, code: grpc.StatusCode) -> None:
        if self.metrics is not None:
            self.metrics.errors.labels(code.name).inc()

    # ---- one request ---------------------------------------------------------------------
    def start_request(self, request: EngineCoreRequest) -> tuple[EngineCoreRequest, RequestStats]:
        """The request to send (its trace headers now name this request's span) and its stats."""
        stats = RequestStats(request.request_id, request.arrival_time)
        if self.tracer is None:
            stats.trace_id = trace_id_from_headers(request.trace_headers)
            return request, stats
        params = request.sampling_params
        span = self.tracer.start_span("llm_request", context=extract_context(request.trace_headers), attributes={
            SpanAttributes.REQUEST_ID: request.request_id,
            SpanAttributes.REQUEST_TEMPERATURE: params.temperature,
            SpanAttributes.REQUEST_TOP_P: params.top_p,
            SpanAttributes.REQUEST_MAX_TOKENS: params.max_tokens,
            SpanAttributes.REQUEST_N: params.n,
            SpanAttributes.USAGE_PROMPT_TOKENS: len(request.prompt_token_ids),
        })
        stats.span, stats.trace_id = span, trace_id_of(span)
        headers = {k: v for k, v in inject_headers(span).items() if k in TRACE_HEADERS}
        return replace(request, trace_headers=headers), stats

    def observe(self, stats: RequestStats, output: EngineCoreOutput, now: float, engine_ts: float) -> None:
        """One engine output of the request (engine_ts: its step's time, engine clock): engine events, first
        token, inter-token latency."""
        for event in output.events or ():
            if event.type == EngineCoreEventType.QUEUED and not stats.queued_ts:
                stats.queued_ts = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED and not stats.scheduled_ts:
                stats.scheduled_ts = event.timestamp
        if not output.new_token_ids:
            return
        if not stats.first_token_ts:
            stats.first_token_ts, stats.first_token_engine_ts = now, engine_ts
            if self.metrics is not None:
                self.metrics.ttft.observe(now - stats.arrival_time)
        elif self.metrics is not None:
            self.metrics.itl.observe(now - stats.last_token_ts)
        stats.last_token_ts, stats.last_token_engine_ts = now, engine_ts

    def finish(self, stats: RequestStats, usage: Usage, finish_reason: FinishReason | None) -> None:
        """The request finished (stop, length or abort): metrics, span attributes, the log line."""
        reason = finish_reason.name.lower() if finish_reason is not None else "abort"
        intervals = stats.intervals(time.time())
        if self.metrics is not None:
            self._observe_finished(intervals, usage, reason)
        if stats.span is not None:
            self._end_span(stats.span, intervals, usage, reason)
        log_request(self._log_fields(stats, intervals, reason, usage))

    def fail(self, stats: RequestStats, error: Exception) -> None:
        """The request ended with an error (its status code is counted by the servicer)."""
        intervals = stats.intervals(time.time())
        if stats.span is not None:
            from opentelemetry.trace import Status, StatusCode

            stats.span.set_status(Status(StatusCode.ERROR, str(error)))
            stats.span.set_attribute(SpanAttributes.LATENCY_E2E, intervals["e2e"])
            stats.span.end()
        fields = self._log_fields(stats, intervals, "error", None)
        fields["error"] = f"{type(error).__name__}: {error}"
        log_request(fields)

    # ---- pieces ------------------------------------------------------------------------------
    def _observe_finished(self, intervals: dict, usage: Usage, reason: str) -> None:
        m = self.metrics
        m.e2e.observe(intervals["e2e"])
        for histogram, key in ((m.queue_time, "queue"), (m.prefill_time, "prefill"), (m.decode_time, "decode")):
            if intervals[key] is not None:
                histogram.observe(intervals[key])
        m.prompt_tokens.observe(usage.prompt_tokens)
        m.generation_tokens.observe(usage.completion_tokens)
        m.count_success(reason)

    @staticmethod
    def _end_span(span, intervals: dict, usage: Usage, reason: str) -> None:
        attributes = {
            SpanAttributes.USAGE_COMPLETION_TOKENS: usage.completion_tokens,
            SpanAttributes.USAGE_CACHED_TOKENS: usage.cached_tokens,
            SpanAttributes.RESPONSE_FINISH_REASON: [reason],
            SpanAttributes.LATENCY_E2E: intervals["e2e"],
        }
        for name, key in ((SpanAttributes.LATENCY_TIME_TO_FIRST_TOKEN, "ttft"),
                          (SpanAttributes.LATENCY_TIME_IN_QUEUE, "queue"),
                          (SpanAttributes.LATENCY_TIME_IN_MODEL_PREFILL, "prefill"),
                          (SpanAttributes.LATENCY_TIME_IN_MODEL_DECODE, "decode")):
            if intervals[key] is not None:
                attributes[name] = intervals[key]
        if intervals["prefill"] is not None:
            attributes[SpanAttributes.LATENCY_TIME_IN_MODEL_INFERENCE] = intervals["prefill"] + intervals["decode"]
        span.set_attributes(attributes)
        span.end()

    @staticmethod
    def _log_fields(stats: RequestStats, intervals: dict, reason: str, usage: Usage | None) -> dict:
        return {
            "request_id": stats.request_id,
            "trace_id": stats.trace_id,
            "finish_reason": reason,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None,
            "cached_tokens": usage.cached_tokens if usage else None,
            "e2e_s": round(intervals["e2e"], 6),
            "ttft_s": None if intervals["ttft"] is None else round(intervals["ttft"], 6),
            "queue_s": None if intervals["queue"] is None else round(intervals["queue"], 6),
        }
