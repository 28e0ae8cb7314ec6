"""Prometheus metrics: one registry per service, vLLM's metric names under `tandem:`, a /metrics server.

Names follow vLLM v1 (vllm/v1/metrics/loggers.py) with `vllm:` -> `tandem:` so its dashboards
port over; counters get prometheus-client's `_total` suffix as vLLM's do. Every metric carries
vLLM's `model_name` label.
"""

from __future__ import annotations

import argparse
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily

from services.ports import port_unavailable

# ---- buckets (vLLM's, extended downwards for CPU-sized latencies) -------------------------
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
MASK_BUCKETS = (0.00001, 0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
                0.25, 1.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def one_two_five_buckets(largest: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `largest` (vLLM's build_1_2_5_buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > largest:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


TOKEN_COUNT_BUCKETS = one_two_five_buckets(1_000_000)


# ---- the engine's metrics -------------------------------------------------------------------
class EngineMetrics:
    """Scheduler state and per-step counters; fed once per engine step from the busy-loop thread."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels, r = ["model_name"], self.registry

        def bind(metric):
            return metric.labels(model_name)

        self.num_requests_running = bind(Gauge("tandem:num_requests_running", "Requests in the running batch.",
                                               labels, registry=r))
        self.num_requests_waiting = bind(Gauge("tandem:num_requests_waiting", "Requests waiting to be scheduled.",
                                               labels, registry=r))
        self.kv_cache_usage = bind(Gauge("tandem:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.",
                                         labels, registry=r))
        self.kv_cache_total_blocks = bind(Gauge(
            "tandem:kv_cache_total_blocks",
            "KV blocks the cache holds, counted at its element type (--kv-cache-dtype: an int8 cache holds about "
            "twice the blocks of a bf16 one in the same memory).", labels, registry=r))
        # read from the engine's compile monitor when scraped (`set_function`): engine_core/readiness
        self.compiles_after_ready = bind(Gauge(
            "tandem:compiles_after_ready",
            "Kernel compiles and CPU kernel plan timings since the engine said it was ready: each made a step wait "
            "(docs/gpu.md#ready-means-warm); 0 when the warm-up covered every shape.", labels, registry=r))
        self.prefix_cache_queries = bind(Counter("tandem:prefix_cache_queries",
                                                 "Prompt tokens looked up in the prefix cache.", labels, registry=r))
        self.prefix_cache_hits = bind(Counter("tandem:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                              labels, registry=r))
        self.num_preemptions = bind(Counter("tandem:num_preemptions", "Cumulative number of preemptions.",
                                            labels, registry=r))
        self.prompt_tokens = bind(Counter("tandem:prompt_tokens", "Prompt tokens of requests that finished prefill.",
                                          labels, registry=r))
        self.generation_tokens = bind(Counter("tandem:generation_tokens", "Generated tokens.", labels, registry=r))
        self.iteration_tokens = bind(Histogram("tandem:iteration_tokens_total", "Tokens computed per engine step.",
                                               labels, buckets=ITERATION_TOKEN_BUCKETS, registry=r))
        self.step_duration = bind(Histogram("tandem:engine_step_duration_seconds",
                                            "Wall time of one engine step (schedule, forward, update).",
                                            labels, buckets=STEP_BUCKETS, registry=r))
        self.structured_mask = bind(Histogram(
            "tandem:structured_mask_seconds",
            "Structured output: time to compute one constrained token's mask (a step's mask time over its rows).",
            labels, buckets=MASK_BUCKETS, registry=r))
        # vLLM's vllm:lora_requests_info: one series per state, its value the time it was set
        self.lora_requests_info = Gauge(
            "tandem:lora_requests_info", "LoRA adapters of the running and waiting requests (comma-separated).",
            ["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
        self.model_name = model_name
        self.structured_mask_wait = bind(Histogram(
            "tandem:structured_mask_wait_seconds",
            "Structured output: time a step's sampler waited for its masks after the forward (not hidden by it).",
            labels, buckets=MASK_BUCKETS, registry=r))

        # speculative decoding (vLLM's vllm:spec_decode_*); mean acceptance length = 1 + accepted / drafts
        self.spec_decode_num_drafts = bind(Counter(
            "tandem:spec_decode_num_drafts", "Speculative decoding: requests whose drafts a step verified.",
            labels, registry=r))
        self.spec_decode_num_draft_tokens = bind(Counter(
            "tandem:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.", labels, registry=r))
        self.spec_decode_num_accepted_tokens = bind(Counter(
            "tandem:spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.", labels,
            registry=r))
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            "tandem:spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted at each position (0: a request's first draft).",
            ["model_name", "position"], registry=r)

    def record_step(self, stats, step_seconds: float) -> None:
        """`stats` is the step's engine_core.protocol.SchedulerStats (gauges now, counters for this step)."""
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.kv_cache_total_blocks.set(stats.num_total_blocks)
        if stats.prefix_cache_queries:
            self.prefix_cache_queries.inc(stats.prefix_cache_queries)
            self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        if stats.num_preemptions:
            self.num_preemptions.inc(stats.num_preemptions)
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        if stats.spec_decode_num_drafts:
            self.spec_decode_num_drafts.inc(stats.spec_decode_num_drafts)
            self.spec_decode_num_draft_tokens.inc(stats.spec_decode_num_draft_tokens)
            self.spec_decode_num_accepted_tokens.inc(stats.spec_decode_num_accepted_tokens)
            for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                self.spec_decode_num_accepted_tokens_per_pos.labels(self.model_name, str(position)).inc(count)
        self.iteration_tokens.observe(stats.num_scheduled_tokens)
        self.step_duration.observe(step_seconds)
        if stats.max_lora:
            self.lora_requests_info.labels(self.model_name, str(stats.max_lora),
                                           ",".join(sorted(stats.running_lora_adapters)),
                                           ",".join(sorted(stats.waiting_lora_adapters))).set(time.time())

    def record_masks(self, timing) -> None:
        """`timing`: a step's engine_core.structured.masks.MaskTiming; one observation per constrained token."""
        per_token = timing.compute_seconds / timing.num_rows
        for _ in range(timing.num_rows):
            self.structured_mask.observe(per_token)
        self.structured_mask_wait.observe(timing.wait_seconds)


# ---- the frontend's metrics -------------------------------------------------------------------
class FrontendMetrics:
    """Per-request latencies and sizes, observed by the frontend's one loop over engine outputs."""

    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        labels, r = ["model_name"], self.registry
        self._ttft = Histogram("tandem:time_to_first_token_seconds", "Time to first token.", labels,
                               buckets=TTFT_BUCKETS, registry=r)
        self._itl = Histogram("tandem:inter_token_latency_seconds", "Time between two streamed tokens.", labels,
                              buckets=ITL_BUCKETS, registry=r)
        self._e2e = Histogram("tandem:e2e_request_latency_seconds", "End-to-end request latency.", labels,
                              buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self._queue = Histogram("tandem:request_queue_time_seconds", "Time a request waited in the engine's queue.",
                                labels, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self._prefill = Histogram("tandem:request_prefill_time_seconds",
                                  "Time from first scheduled to first token in the engine.", labels,
                                  buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self._decode = Histogram("tandem:request_decode_time_seconds", "Time from first to last token in the engine.",
                                 labels, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self._prompt_tokens = Histogram("tandem:request_prompt_tokens", "Prompt tokens per request.", labels,
                                        buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self._generation_tokens = Histogram("tandem:request_generation_tokens", "Generated tokens per request.",
                                            labels, buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self._success = Counter("tandem:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.errors = Counter("tandem:request_errors", "Requests that ended with a gRPC error, by status code.",
                              ["code"], registry=r)
        self.streams_in_flight = Gauge("tandem:num_streams_in_flight", "Client streams open on this frontend.",
                                       registry=r)
        # ---- the router (services/frontend/engines/router.py)
        self.router_prefix_hit_tokens = Counter(
            "tandem:router_prefix_hit_tokens",
            "Prompt tokens the chosen engine held in its prefix cache when the router sent a request there "
            "(by the engines' KV events).", ["policy"], registry=r)
        self.router_prompt_tokens = Counter("tandem:router_prompt_tokens", "Prompt tokens of the requests routed.",
                                            ["policy"], registry=r)
        self._engines = _EngineRequestsCollector()
        r.register(self._engines)
        self.set_model(model_name)

    def set_model(self, model_name: str) -> None:
        """Bind the per-model children (the frontend learns the model when an engine connects)."""
        self.model_name = model_name
        self.ttft, self.itl, self.e2e = (m.labels(model_name) for m in (self._ttft, self._itl, self._e2e))
        self.queue_time, self.prefill_time, self.decode_time = (
            m.labels(model_name) for m in (self._queue, self._prefill, self._decode))
        self.prompt_tokens, self.generation_tokens = (
            m.labels(model_name) for m in (self._prompt_tokens, self._generation_tokens))

    def count_success(self, finished_reason: str) -> None:
        self._success.labels(self.model_name, finished_reason).inc()

    def track_streams(self, count: Callable[[], int]) -> None:
        """The in-flight gauge reads `count()` at scrape time: no cost per request."""
        self.streams_in_flight.set_function(count)

    def track_engines(self, snapshot: Callable[[], Iterable[tuple[str, int]]]) -> None:
        """tandem:router_requests_in_flight{engine} reads `snapshot()` ((address, in flight) pairs) at scrape time."""
        self._engines.snapshot = snapshot


class _EngineRequestsCollector:
    """Per-engine requests in flight from this frontend, for engines that come and go (DNS discovery)."""

    def __init__(self) -> None:
        self.snapshot: Callable[[], Iterable[tuple[str, int]]] = lambda: ()

    def describe(self):
        return [GaugeMetricFamily("tandem:router_requests_in_flight", "", labels=["engine"])]

    def collect(self):
        family = GaugeMetricFamily("tandem:router_requests_in_flight",
                                   "Requests this frontend has in flight on each engine.", labels=["engine"])
        for address, count in self.snapshot():
            family.add_metric([address], count)
        yield family


# ---- the /metrics endpoint ----------------------------------------------------------------------
def metrics_port(value: str) -> int | None:
    """argparse type for --metrics-port: a port, 0 for a free one, or `off` / a negative number for none."""
    if value.strip().lower() in ("off", "none", "no", ""):
        return None
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--metrics-port must be a port number, 0 or 'off', got {value!r}") from None
    if port > 65535:
        raise argparse.ArgumentTypeError(f"--metrics-port must be at most 65535, got {port}")
    return None if port < 0 else port


TEXT_FORMAT_0_0_4 = "text/plain; version=0.0.4; charset=utf-8"  # newer text formats escape ':' as well


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_port = False  # the port is this server's alone, whatever a Python version's default


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # a scrape every few seconds is not worth a log line
        pass


def text_format_only(app):
    """Answer every scrape in the Prometheus text format (0.0.4), whatever the scraper's Accept header says.

    prometheus-client's OpenMetrics output, which Prometheus 2.x asks for first, escapes the `:` of our
    (vLLM's) metric names to `_` (prometheus/client_python#1177), so Prometheus would store `tandem_*` where
    the docs and dashboards query `tandem:*`; the text format keeps the names as they are.
    """
    def wrapped(environ, start_response):
        return app({**environ, "HTTP_ACCEPT": TEXT_FORMAT_0_0_4}, start_response)

    return wrapped


class MetricsServer:
    """A /metrics HTTP server for one registry on its own port (a daemon thread), in the text format."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.registry, self.host, self.requested_port = registry, host, port
        self._server = None
        self.port: int | None = None

    def start(self) -> int:
        """Bind (port 0 picks a free one) and serve; returns the port. PortUnavailable (a ValueError) if it
        cannot bind (no SO_REUSEPORT: a taken port fails here)."""
        try:
            family = socket.getaddrinfo(self.host, self.requested_port, type=socket.SOCK_STREAM)[0][0]
            server_class = type("MetricsHTTPServer", (_ThreadingWSGIServer,), {"address_family": family})
            self._server = make_server(self.host, self.requested_port, text_format_only(make_wsgi_app(self.registry)),
                                       server_class, handler_class=_QuietHandler)
        except OSError as exc:
            raise port_unavailable(self.host, self.requested_port, "--metrics-port", exc) from None
        self.port = self._server.server_port
        threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True).start()
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
