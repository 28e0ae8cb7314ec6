"""One trace per request: client traceparent -> frontend gRPC span -> llm_request span -> engine span."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from opentelemetry.trace import SpanKind, StatusCode
from tandem.v1 import admin_pb2, common_pb2

from engine_core.protocol import PauseCall
from services.frontend.telemetry import FrontendTelemetry
from services.telemetry.tracing import TracingSettings, otlp_exporter, trace_id_from_headers
from tests.held_steps import steps_held_until, utility_call
from tests.observability.conftest import metric

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
PROMPT = [11, 12, 13, 14, 15, 16, 17]
MAX_TOKENS = 5


def by_name(spans, name):
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"expected one {name!r} span, got {[s.name for s in spans]}"
    return found[0]


def test_client_trace_continues_through_frontend_and_engine(make_stack):
    stack = make_stack(tracing=True)
    responses = stack.run(stack.generate(PROMPT, MAX_TOKENS, request_id="traced-1", temperature=0.5, top_p=0.9,
                                         metadata=(("traceparent", TRACEPARENT), ("tracestate", "vendor=1"))))
    assert responses[-1].usage.completion_tokens == MAX_TOKENS
    spans = stack.exporter.get_finished_spans()

    rpc = by_name(spans, "/tandem.v1.GenerationService/Generate")
    request = by_name(spans, "llm_request")
    engine = by_name(spans, "engine_core.request")
    # one trace id, and each hop is the child of the one before
    for span in (rpc, request, engine):
        assert format(span.context.trace_id, "032x") == CLIENT_TRACE_ID
    assert rpc.kind == SpanKind.SERVER and format(rpc.parent.span_id, "016x") == CLIENT_SPAN_ID
    assert rpc.parent.is_remote
    assert request.parent.span_id == rpc.context.span_id
    assert engine.parent.span_id == request.context.span_id
    assert rpc.resource.attributes["service.name"] == "tandem-frontend"
    assert engine.resource.attributes["service.name"] == "tandem-engine"

    # vLLM's GenAI attributes on the frontend span
    a = request.attributes
    assert a["gen_ai.request.id"] == "traced-1"
    assert (a["gen_ai.request.temperature"], a["gen_ai.request.top_p"]) == (0.5, pytest.approx(0.9))
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.n"]) == (MAX_TOKENS, 1)
    assert (a["gen_ai.usage.prompt_tokens"], a["gen_ai.usage.completion_tokens"]) == (len(PROMPT), MAX_TOKENS)
    assert a["gen_ai.usage.cached_tokens"] == 0
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    for name in ("time_in_queue", "time_in_model_prefill", "time_in_model_decode"):
        assert a[f"gen_ai.latency.{name}"] >= 0
    assert a["gen_ai.latency.time_in_model_inference"] == pytest.approx(
        a["gen_ai.latency.time_in_model_prefill"] + a["gen_ai.latency.time_in_model_decode"])
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)

    # the engine span: scheduler events in order, at non-decreasing times, inside the span
    names = [event.name for event in engine.events]
    assert names == ["queued", "scheduled", "first_token", "finished"]
    stamps = [event.timestamp for event in engine.events]
    assert stamps == sorted(stamps) and engine.start_time <= stamps[0] and stamps[-1] <= engine.end_time
    # the engine request's own id: the client's, with the frontend's admission count (docs/request-lifecycle.md)
    assert engine.attributes["gen_ai.request.id"].startswith("traced-1@")
    assert engine.attributes["gen_ai.usage.completion_tokens"] == MAX_TOKENS
    assert engine.attributes["gen_ai.usage.prompt_tokens"] == len(PROMPT)


def test_a_preemption_shows_on_the_engine_span_and_in_the_metrics(make_stack, observed_engine_config):
    # 25 usable blocks of 4 tokens: room for one 88-token request and a bit, so the second one is preempted
    config = dataclasses.replace(observed_engine_config,
                                 cache=dataclasses.replace(observed_engine_config.cache, num_blocks=26))
    stack = make_stack(tracing=True, metrics=True, engine_config=config)

    async def two_long_requests():
        return await asyncio.gather(*(stack.generate([20 + i] + PROMPT, 80, request_id=f"long-{i}")
                                      for i in range(2)))

    for responses in stack.run(two_long_requests()):
        assert sum(len(r.completions[0].token_ids) for r in responses) == 80
    engines = {s.attributes["gen_ai.request.id"]: s for s in stack.exporter.get_finished_spans()
               if s.name == "engine_core.request"}
    preempted = [s for s in engines.values() if any(e.name == "preempted" for e in s.events)]
    assert len(preempted) == 1
    names = [e.name for e in preempted[0].events]
    assert names[:2] == ["queued", "scheduled"] and names[-1] == "finished"
    assert names.index("preempted") < len(names) - 2 and names[names.index("preempted") + 1] == "scheduled"
    assert preempted[0].attributes["tandem.request.num_preemptions"] == names.count("preempted")
    assert metric(stack.scrape("engine"), "tandem:num_preemptions_total") == names.count("preempted")


def test_without_a_client_context_each_request_gets_its_own_trace(make_stack):
    stack = make_stack(tracing=True)
    stack.run(stack.generate(PROMPT, 2))
    stack.run(stack.generate(PROMPT, 2))
    requests = [s for s in stack.exporter.get_finished_spans() if s.name == "llm_request"]
    engines = [s for s in stack.exporter.get_finished_spans() if s.name == "engine_core.request"]
    assert len(requests) == len(engines) == 2
    assert requests[0].context.trace_id != requests[1].context.trace_id
    assert {e.parent.span_id for e in engines} == {r.context.span_id for r in requests}


def test_a_refused_request_is_traced_with_its_status_code(make_stack):
    stack = make_stack(tracing=True)
    stack.run(_expect_invalid(stack))
    spans = stack.exporter.get_finished_spans()
    rpc = by_name(spans, "/tandem.v1.GenerationService/Generate")
    assert rpc.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert format(rpc.context.trace_id, "032x") == CLIENT_TRACE_ID
    assert not [s for s in spans if s.name != rpc.name]  # refused before it reached the engine


async def _expect_invalid(stack):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stack.generate([10_000], 2, metadata=(("traceparent", TRACEPARENT),))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_an_engine_lost_mid_request_ends_both_spans(make_stack):
    stack = make_stack(tracing=True, metrics=True)

    async def lose_the_engine() -> grpc.StatusCode:
        with steps_held_until(stack.engine.server.busy_loop, utility_call(PauseCall)):
            call = stack.stub.Generate(stack.generate_request(PROMPT, 80, "lost-1"),
                                       metadata=(("traceparent", TRACEPARENT),))
            await call.read()  # the first token
            await stack.admin.Pause(admin_pb2.PauseRequest(mode=common_pb2.PAUSE_MODE_KEEP))  # it cannot finish now
        await asyncio.to_thread(stack.engine.shutdown)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            while await call.read() != grpc.aio.EOF:
                pass
        return error.value.code()

    assert stack.run(lose_the_engine()) == grpc.StatusCode.UNAVAILABLE
    spans = stack.exporter.get_finished_spans()
    request, engine = by_name(spans, "llm_request"), by_name(spans, "engine_core.request")
    assert request.status.status_code == StatusCode.ERROR and "disconnected" in request.status.description
    assert engine.parent.span_id == request.context.span_id
    assert tuple(engine.attributes["gen_ai.response.finish_reasons"]) == ("abort",)
    assert engine.events[-1].name == "finished"
    frontend = stack.scrape("frontend")
    assert metric(frontend, "tandem:request_errors_total", code="UNAVAILABLE") == 1
    assert metric(frontend, "tandem:request_success_total") == 0


def test_tracing_off_creates_no_spans_and_passes_the_client_headers_on(make_stack):
    stack = make_stack(tracing=False)
    assert stack.telemetry.server_interceptors() == [] and not stack.telemetry.tracing
    seen = []
    original = stack.client.add_request
    stack.client.add_request = lambda request: (seen.append(request.trace_headers), original(request))[1]
    stack.run(stack.generate(PROMPT, 2, metadata=(("traceparent", TRACEPARENT),)))
    assert stack.exporter.get_finished_spans() == ()
    assert seen == [{"traceparent": TRACEPARENT}]


def test_tracing_settings_honour_the_otel_variables(monkeypatch):
    assert FrontendTelemetry().server_interceptors() == []
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    exporter = otlp_exporter(TracingSettings(True, endpoint="http://collector:4318"))
    assert type(exporter).__module__.endswith("http.trace_exporter")
    assert exporter._endpoint == "http://collector:4318/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert type(otlp_exporter(TracingSettings(True))).__module__.endswith("grpc.trace_exporter")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "thrift")
    with pytest.raises(ValueError, match="grpc, http/protobuf"):
        otlp_exporter(TracingSettings(True))
    assert trace_id_from_headers({"traceparent": TRACEPARENT}) == CLIENT_TRACE_ID
    assert trace_id_from_headers({"traceparent": "garbage"}) is None
