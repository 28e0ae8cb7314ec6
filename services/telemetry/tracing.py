"""OpenTelemetry tracing: a tracer provider from a flag and the standard OTEL_* variables, W3C propagation.

Each service builds its own provider (never the global one), so two services in one process
(tests, benchmarks) keep their spans apart. With tracing off `setup_tracing` returns None and
the services create no interceptor and no span objects.

Honoured variables: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES (resource),
OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT / _PROTOCOL / _HEADERS / _INSECURE (exporter),
OTEL_TRACES_SAMPLER[_ARG] (sampler), OTEL_BSP_* (batching), OTEL_PROPAGATORS (propagation).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import propagate, trace
from opentelemetry.context import Context

TRACE_HEADERS = ("traceparent", "tracestate")
PROTOCOLS = ("grpc", "http/protobuf")


class SpanAttributes:
    """vLLM's GenAI span attribute names (vllm/tracing.py), so trace dashboards port over."""

    REQUEST_ID = "gen_ai.request.id"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_N = "gen_ai.request.n"
    RESPONSE_MODEL = "gen_ai.response.model"
    RESPONSE_FINISH_REASON = "gen_ai.response.finish_reasons"
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    USAGE_CACHED_TOKENS = "gen_ai.usage.cached_tokens"
    USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    LATENCY_E2E = "gen_ai.latency.e2e"
    LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


@dataclass(frozen=True)
class TracingSettings:
    """What the --otel / --otlp-endpoint flags say; unset fields fall back to OTEL_* variables."""

    enabled: bool = False
    endpoint: str | None = None  # None: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else the exporter's default
    protocol: str | None = None  # grpc | http/protobuf; None: OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL, else grpc
    service_name: str = "tandem"  # used when OTEL_SERVICE_NAME is not set


def setup_tracing(settings: TracingSettings, span_processor=None):
    """A TracerProvider exporting over OTLP (or into `span_processor`), or None when tracing is off."""
    if not settings.enabled:
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: settings.service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(span_processor or BatchSpanProcessor(otlp_exporter(settings)))
    return provider


def otlp_exporter(settings: TracingSettings):
    """The OTLP span exporter for the configured protocol (ValueError names the accepted ones)."""
    protocol = (settings.protocol or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=settings.endpoint)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = settings.endpoint
        if endpoint and not endpoint.rstrip("/").endswith("/v1/traces"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"  # the flag names the collector, as the env var does
        return OTLPSpanExporter(endpoint=endpoint)
    raise ValueError(f"OTLP protocol {protocol!r} is not supported: use one of {', '.join(PROTOCOLS)}")


def shutdown_tracing(provider) -> None:
    """Flush and stop the provider's exporters (no-op for None)."""
    if provider is not None:
        provider.shutdown()


# ---- W3C propagation ------------------------------------------------------------------
def extract_context(headers: Mapping[str, str] | None) -> Context | None:
    """The remote parent carried in `headers` (traceparent / tracestate), or None."""
    return propagate.extract(headers) if headers else None


def inject_headers(span) -> dict[str, str]:
    """W3C headers that make `span` the parent of whoever receives them."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def trace_id_of(span) -> str:
    return format(span.get_span_context().trace_id, "032x")


def trace_id_from_headers(headers: Mapping[str, str] | None) -> str | None:
    """The trace id in a W3C traceparent ("00-<trace id>-<parent id>-<flags>"), without the SDK."""
    parts = (headers or {}).get("traceparent", "").split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None
