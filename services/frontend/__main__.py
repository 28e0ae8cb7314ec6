"""tandem-frontend: the public gRPC server in front of one or more engine cores.

    python -m services.frontend --engine 127.0.0.1:50061 --port 50051
    python -m services.frontend --engine dns:///tandem-engine.default.svc:50061   # every engine behind a name
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from services.cpu_priority import CPU_PRIORITIES, lower_cpu_priority
from services.frontend.async_llm import DEFAULT_MAX_WAITING_REQUESTS, AsyncLLM
from services.frontend.chat.template_choice import choose_chat_setup
from services.frontend.engines.discovery import DEFAULT_RESOLVE_INTERVAL_S, parse_engine_targets
from services.frontend.engines.grpc_client import GrpcEngineClient
from services.frontend.engines.router import DEFAULT_BALANCE_ABS, DEFAULT_BALANCE_REL, Router, RoutingPolicy
from services.frontend.limits import RequestLimits
from services.frontend.output_processor import DEFAULT_MAX_UNSENT_TOKENS
from services.frontend.server import FrontendServer
from services.frontend.telemetry import FrontendTelemetry
from services.frontend.tokenizer import load_tokenizer
from services.frontend.tools.parsers import PARSERS
from services.ports import PortUnavailable, ensure_can_listen, explain_bind_failure
from services.security import flags as security_flags
from services.security.transport import DEFAULT_MAX_MESSAGE_BYTES
from services.telemetry import flags as telemetry_flags
from services.telemetry.metrics import FrontendMetrics, MetricsServer
from services.telemetry.request_log import configure_logging
from services.telemetry.tracing import setup_tracing, shutdown_tracing

log = logging.getLogger("tandem.frontend")


def build_parser() -> argparse.ArgumentParser:
    """tandem-frontend's flags (`tandem serve` reads them to say where a flag it does not take belongs)."""
    parser = argparse.ArgumentParser(prog="tandem-frontend", description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="append", metavar="TARGET",
                        help="engine core address host:port, or dns:///NAME:PORT for every address behind a DNS "
                             "name (a Kubernetes headless Service), re-resolved as engines come and go; repeat "
                             "or separate with commas for several (default: 127.0.0.1:50061)")
    parser.add_argument("--engine-resolve-interval", type=float, default=DEFAULT_RESOLVE_INTERVAL_S, metavar="S",
                        help="seconds between DNS lookups of dns:/// engine targets (also looked up again when an "
                             "engine's stream breaks) (default: %(default)s)")
    parser.add_argument("--routing-policy", default=RoutingPolicy.PREFIX_AWARE.value,
                        choices=[p.value for p in RoutingPolicy],
                        help="which engine gets a request: the one holding the longest cached prefix of its prompt "
                             "unless its load is too far above the least loaded (prefix-aware), the least loaded, "
                             "or each in turn (default: %(default)s)")
    parser.add_argument("--routing-balance-abs", type=int, default=DEFAULT_BALANCE_ABS, metavar="N",
                        help="prefix-aware: an engine more than N requests and more than --routing-balance-rel "
                             "times the least load above the least loaded engine gets no requests for its "
                             "cached prefixes (default: %(default)s)")
    parser.add_argument("--routing-balance-rel", type=float, default=DEFAULT_BALANCE_REL, metavar="R",
                        help="see --routing-balance-abs (default: %(default)s)")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="a .gguf file or a Hugging Face folder with tokenizer.json "
                             "(default: the model path the engine reports)")
    parser.add_argument("--chat-template", metavar="FILE",
                        help="a Jinja chat template to render chats with instead of the model's own (e.g. one with "
                             "a tools branch); default: the model's, or a tool-aware one Tandem ships for the model "
                             "(services/frontend/chat/templates/) when the model's has no tools branch")
    parser.add_argument("--tool-parser", choices=sorted(PARSERS), metavar="NAME",
                        help="how tool calls are read from the model's text: " + ", ".join(sorted(PARSERS))
                             + " (default: the one the chat template's call syntax shows)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: %(default)s, this machine only: plaintext without a "
                             "token is for loopback; 0.0.0.0 for all interfaces, with --tls-cert and "
                             "--api-token-file beyond a trusted network)")
    parser.add_argument("--port", type=int, default=50051, help="port to listen on (default: %(default)s)")
    parser.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                        help="engine requests in flight before new ones get RESOURCE_EXHAUSTED "
                             "(default: %(default)s)")
    parser.add_argument("--max-unsent-tokens", type=int, default=DEFAULT_MAX_UNSENT_TOKENS,
                        help="generated tokens a stream may have waiting for a client that does not read before "
                             "the request is aborted with RESOURCE_EXHAUSTED (default: %(default)s)")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds in-flight streams get to finish on shutdown (default: %(default)s)")
    parser.add_argument("--cpu-priority", default="normal", choices=CPU_PRIORITIES,
                        help="this process's CPU priority; low (nice 19) when it shares cores with a CPU engine, as "
                             "under `tandem serve`: its wake-ups for every token then mostly wait for a core the "
                             "engine's OpenMP team leaves free instead of stalling the engine's step; idle (Linux "
                             "SCHED_IDLE) waits for one always, about a decode step per output; "
                             "normal keeps the priority it "
                             "was started with (default: %(default)s)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log level (default: %(default)s)")
    telemetry_flags.add_telemetry_arguments(parser)
    RequestLimits.add_flags(parser)
    security_flags.add_server_flags(parser, max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES, tokens=True)
    security_flags.add_engine_link_flags(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_unsent_tokens < 1:
        parser.error(f"--max-unsent-tokens must be >= 1, got {args.max_unsent_tokens}")
    if args.chat_template is not None and not Path(args.chat_template).is_file():
        parser.error(f"--chat-template {args.chat_template}: no such file")
    args.engine = args.engine or ["127.0.0.1:50061"]
    try:
        parse_engine_targets(args.engine)
        args.router = Router(RoutingPolicy(args.routing_policy), balance_abs=args.routing_balance_abs,
                             balance_rel=args.routing_balance_rel)
    except ValueError as exc:
        parser.error(str(exc))
    if args.engine_resolve_interval <= 0:
        parser.error(f"--engine-resolve-interval must be > 0 seconds, got {args.engine_resolve_interval}")
    try:
        args.transport = security_flags.server_transport_from_args(args)
        args.engine_link = security_flags.engine_link_from_args(args)
    except ValueError as exc:  # a missing or bad certificate, key or token file
        parser.exit(2, f"tandem-frontend: error: {exc}\n")
    return args


async def serve(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    telemetry, metrics_server = _telemetry_from_args(args)
    client = GrpcEngineClient(args.engine, transport=args.engine_link, router=args.router,
                              resolve_interval_s=args.engine_resolve_interval, metrics=telemetry.metrics)
    await client.start()
    try:
        tokenizer_path = args.tokenizer or await _model_path_from_engine(client, stop, args.engine)
        if tokenizer_path is None:
            return
        tokenizer = load_tokenizer(tokenizer_path)
        chat_setup = choose_chat_setup(tokenizer.chat_template, template_file=args.chat_template,
                                       tool_parser=args.tool_parser)
        llm = AsyncLLM(client, tokenizer, max_waiting_requests=args.max_waiting_requests,
                       limits=RequestLimits.from_args(args), max_unsent_tokens=args.max_unsent_tokens,
                       telemetry=telemetry, chat_setup=chat_setup)
        try:
            server = FrontendServer(llm, f"{args.host}:{args.port}", transport=args.transport)
        except OSError as exc:  # taken since main() looked, while this waited for an engine
            raise explain_bind_failure(args.host, args.port, "--port", exc) from None
        await server.start()
        log.info("frontend listening on %s:%d (tokenizer %s, chat template %s, tool parser %s)", args.host,
                 server.port, tokenizer_path, chat_setup.source, chat_setup.tool_parser)
        await stop.wait()
        log.info("shutting down: health NOT_SERVING, then %gs grace for in-flight streams", args.grace)
        await server.stop(args.grace)
    finally:
        await client.close()
        if metrics_server is not None:
            metrics_server.stop()
        shutdown_tracing(telemetry.tracer_provider)


def _telemetry_from_args(args: argparse.Namespace) -> tuple[FrontendTelemetry, MetricsServer | None]:
    """Tracing per --otel / OTEL_*, and /metrics served from now on (also while waiting for an engine)."""
    metrics = FrontendMetrics() if args.metrics_port is not None else None
    metrics_server = None
    if metrics is not None:
        metrics_server = MetricsServer(metrics.registry, args.host, args.metrics_port)
        port = metrics_server.start()
        log.info("Prometheus metrics on http://%s:%d/metrics", args.host, port)
    tracer_provider = setup_tracing(telemetry_flags.tracing_settings(args, "tandem-frontend"))
    return FrontendTelemetry(tracer_provider, metrics), metrics_server


async def _model_path_from_engine(client: GrpcEngineClient, stop: asyncio.Event, engines: list[str]) -> str | None:
    """Wait for an engine to report its model path (None: shut down while waiting)."""
    log.info("waiting for an engine (%s) to learn the model path; pass --tokenizer to start without one",
             ", ".join(engines))
    engine = asyncio.ensure_future(client.wait_for_engine())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([engine, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not engine.done():
        engine.cancel()
        return None
    return engine.result().model_path


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:  # before waiting for an engine, which can take minutes: a taken port is said at once
        ensure_can_listen(args.host, args.port)
        ensure_can_listen(args.host, args.metrics_port, "--metrics-port")
    except PortUnavailable as exc:
        _exit_unavailable(exc)
    configure_logging(args.log_level, args.log_format)
    lower_cpu_priority(args.cpu_priority)  # before gRPC starts its threads: they inherit it
    try:
        asyncio.run(serve(args))
    except PortUnavailable as exc:
        _exit_unavailable(exc)
    except ValueError as exc:  # an unknown OTLP protocol
        raise SystemExit(f"tandem-frontend: error: {exc}") from None


def _exit_unavailable(exc: PortUnavailable) -> None:
    print(f"tandem-frontend: {exc}", file=sys.stderr)
    raise SystemExit(1)


if __name__ == "__main__":
    main()
