"""Both /metrics endpoints scraped during and after a small load: counters and histograms move exactly."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from prometheus_client import CollectorRegistry, Counter
from tandem.v1 import admin_pb2, common_pb2

from engine_core.protocol import PauseCall
from services.telemetry.metrics import MetricsServer, metrics_port, one_two_five_buckets
from tests.held_steps import steps_held_until, utility_call
from tests.observability.conftest import metric

N = 4  # concurrent streams
PROMPT_LEN = 9  # two full KV blocks of 4 and one token
MAX_TOKENS = 40


def prompt(i: int) -> list[int]:
    return [100 + i] + list(range(1, PROMPT_LEN))  # distinct first tokens: no prefix shared between requests


def delta(after: dict, before: dict, name: str, **labels) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


async def load_with_a_pause(stack):
    """Start N streams, wait for every first token, freeze the engine, scrape, resume, drain the streams."""
    with steps_held_until(stack.engine.server.busy_loop, utility_call(PauseCall)):  # none ends first
        calls = [stack.stub.Generate(stack.generate_request(prompt(i), MAX_TOKENS)) for i in range(N)]
        tokens = [len((await call.read()).completions[0].token_ids) for call in calls]
        assert (await stack.admin.Pause(admin_pb2.PauseRequest(mode=common_pb2.PAUSE_MODE_KEEP))).ok
    during = stack.scrape("engine"), stack.scrape("frontend")
    assert (await stack.admin.Resume(admin_pb2.ResumeRequest())).ok
    for i, call in enumerate(calls):
        while (response := await call.read()) != grpc.aio.EOF:
            tokens[i] += len(response.completions[0].token_ids)
    assert tokens == [MAX_TOKENS] * N
    return during


def test_engine_and_frontend_metrics_during_and_after_a_load(make_stack):
    stack = make_stack(metrics=True)
    engine0, frontend0 = stack.scrape("engine"), stack.scrape("frontend")
    engine1, frontend1 = stack.run(load_with_a_pause(stack))
    engine2, frontend2 = stack.scrape("engine"), stack.scrape("frontend")

    # ---- before: the engine's warm-up ran before it served, and no metric counted it
    assert metric(engine0, "tandem:prompt_tokens_total") == metric(engine0, "tandem:generation_tokens_total") == 0
    assert metric(engine0, "tandem:iteration_tokens_total_count") == 0

    # ---- during: every stream open, every request running in the (frozen) engine
    assert metric(engine1, "tandem:num_requests_running") == N
    assert metric(engine1, "tandem:num_requests_waiting") == 0
    assert 0 < metric(engine1, "tandem:kv_cache_usage_perc") < 1
    assert metric(engine1, "tandem:kv_cache_total_blocks") == metric(engine2, "tandem:kv_cache_total_blocks") > 0
    assert metric(frontend1, "tandem:num_streams_in_flight") == N
    assert delta(frontend1, frontend0, "tandem:time_to_first_token_seconds_count") == N
    assert delta(frontend1, frontend0, "tandem:e2e_request_latency_seconds_count") == 0
    assert delta(engine1, engine0, "tandem:prompt_tokens_total") == N * PROMPT_LEN

    # ---- after: the engine's counters
    assert metric(engine2, "tandem:num_requests_running") == 0
    assert metric(engine2, "tandem:kv_cache_usage_perc") == 0
    assert delta(engine2, engine0, "tandem:prompt_tokens_total") == N * PROMPT_LEN
    assert delta(engine2, engine0, "tandem:generation_tokens_total") == N * MAX_TOKENS
    assert delta(engine2, engine0, "tandem:prefix_cache_queries_total") == N * PROMPT_LEN
    assert delta(engine2, engine0, "tandem:prefix_cache_hits_total") == 0
    assert delta(engine2, engine0, "tandem:num_preemptions_total") == 0
    assert metric(engine2, "tandem:compiles_after_ready") == 0  # the warm-up covered the load's shapes
    # every computed token: the prompts, then one per request per decode step (the last token is never fed back)
    assert delta(engine2, engine0, "tandem:iteration_tokens_total_sum") == N * (PROMPT_LEN + MAX_TOKENS - 1)
    steps = delta(engine2, engine0, "tandem:iteration_tokens_total_count")
    assert steps >= MAX_TOKENS and delta(engine2, engine0, "tandem:engine_step_duration_seconds_count") == steps

    # ---- after: the frontend's histograms and counters
    assert metric(frontend2, "tandem:num_streams_in_flight") == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert delta(frontend2, frontend0, f"tandem:{name}_count") == N, name
        assert delta(frontend2, frontend0, f"tandem:{name}_sum") > 0 or name == "request_queue_time_seconds"
    assert delta(frontend2, frontend0, "tandem:inter_token_latency_seconds_count") == N * (MAX_TOKENS - 1)
    assert delta(frontend2, frontend0, "tandem:request_success_total", finished_reason="length") == N
    assert delta(frontend2, frontend0, "tandem:request_success_total", finished_reason="stop") == 0
    assert delta(frontend2, frontend0, "tandem:request_prompt_tokens_sum") == N * PROMPT_LEN
    assert delta(frontend2, frontend0, "tandem:request_generation_tokens_sum") == N * MAX_TOKENS
    # the pause shows in e2e latency but not in time to first token
    e2e = delta(frontend2, frontend0, "tandem:e2e_request_latency_seconds_sum")
    assert e2e > delta(frontend2, frontend0, "tandem:time_to_first_token_seconds_sum")


def test_prefix_hits_and_errors_are_counted(make_stack):
    stack = make_stack(metrics=True)
    stack.run(stack.generate(prompt(0), 2))
    engine0, frontend0 = stack.scrape("engine"), stack.scrape("frontend")
    stack.run(stack.generate(prompt(0), 2))  # the same prompt: its two full blocks come from the cache
    with pytest.raises(grpc.aio.AioRpcError):
        stack.run(stack.generate([10_000], 2))  # out of the tiny model's vocabulary
    engine1, frontend1 = stack.scrape("engine"), stack.scrape("frontend")
    assert delta(engine1, engine0, "tandem:prefix_cache_queries_total") == PROMPT_LEN
    assert delta(engine1, engine0, "tandem:prefix_cache_hits_total") == 8
    assert delta(frontend1, frontend0, "tandem:request_errors_total", code="INVALID_ARGUMENT") == 1
    assert delta(frontend1, frontend0, "tandem:request_success_total") == 1


def test_metrics_port_flag_values():
    assert [metrics_port(v) for v in ("0", "9100", "off", "-1", "OFF")] == [0, 9100, None, None, None]
    with pytest.raises(Exception, match="port number"):
        metrics_port("nine")
    assert one_two_five_buckets(100) == (1, 2, 5, 10, 20, 50, 100)


# Prometheus 2.x's default Accept header: OpenMetrics first (prometheus-client escapes ':' there)
PROMETHEUS_2_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                       "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def test_a_prometheus_scrape_keeps_the_colons_of_the_metric_names():
    registry = CollectorRegistry()
    Counter("tandem:prompt_tokens", "Prompt tokens.", registry=registry).inc(3)
    server = MetricsServer(registry, "127.0.0.1", 0)
    port = server.start()
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": PROMETHEUS_2_ACCEPT})
        with urllib.request.urlopen(request, timeout=10) as response:
            content_type, text = response.headers["Content-Type"], response.read().decode()
    finally:
        server.stop()
    assert content_type.startswith("text/plain; version=0.0.4")
    assert "\ntandem:prompt_tokens_total 3.0\n" in text and "tandem_prompt_tokens" not in text


def test_speculative_decoding_is_counted_and_turned_off_per_request(make_stack, observed_engine_config):
    """tandem:spec_decode_* move with verified drafts; sampling_params.speculative false keeps a request's steps
    plain, over the wire, with the same tokens."""
    from dataclasses import replace

    from engine_core.config import SpeculativeConfig
    from tests.engine_core.test_spec_decode import prompts

    config = replace(observed_engine_config, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    stack = make_stack(metrics=True, engine_config=config)
    looping = prompts()[6]  # the tiny model's greedy output repeats itself here
    before = stack.scrape("engine")
    plain = stack.run(stack.generate(looping, 24, temperature=0.0, speculative=False))
    after_plain = stack.scrape("engine")
    assert delta(after_plain, before, "tandem:spec_decode_num_drafts_total") == 0
    spec = stack.run(stack.generate(looping, 24, temperature=0.0))
    after = stack.scrape("engine")
    tokens = [[t for r in responses for t in r.completions[0].token_ids] for responses in (plain, spec)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 24
    drafts = delta(after, after_plain, "tandem:spec_decode_num_drafts_total")
    draft_tokens = delta(after, after_plain, "tandem:spec_decode_num_draft_tokens_total")
    accepted = delta(after, after_plain, "tandem:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= draft_tokens <= 3 * drafts
    assert delta(after, after_plain, "tandem:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    assert sum(delta(after, after_plain, "tandem:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
               for i in range(3)) == accepted
    # every step but the prompt's emits at least one token: fewer steps than tokens once drafts are accepted
    assert delta(after, after_plain, "tandem:generation_tokens_total") == 24
    assert delta(after, after_plain, "tandem:iteration_tokens_total_count") == 24 - accepted
