"""tandem-frontend: the public gRPC server in front of one or more engine cores.

    python -m services.frontend --engine 127.0.0.1:50061 --port 50051
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from services.frontend.async_llm import DEFAULT_MAX_WAITING_REQUESTS, AsyncLLM
from services.frontend.engine_client import GrpcEngineClient
from services.frontend.sampling import DEFAULT_MAX_N
from services.frontend.server import FrontendServer
from services.frontend.tokenizer import load_tokenizer

log = logging.getLogger("tandem.frontend")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tandem-frontend", description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="append", metavar="ADDR",
                        help="engine core address host:port; repeat for several engines "
                             "(default: 127.0.0.1:50061)")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="a .gguf file or a Hugging Face folder with tokenizer.json "
                             "(default: the model path the engine reports)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=50051, help="port to listen on (default: %(default)s)")
    parser.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                        help="engine requests in flight before new ones get RESOURCE_EXHAUSTED "
                             "(default: %(default)s)")
    parser.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                        help="the largest n (completions per request) accepted (default: %(default)s)")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds in-flight streams get to finish on shutdown (default: %(default)s)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log level (default: %(default)s)")
    args = parser.parse_args(argv)
    args.engine = args.engine or ["127.0.0.1:50061"]
    return args


async def serve(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    client = GrpcEngineClient(args.engine)
    await client.start()
    try:
        tokenizer_path = args.tokenizer or await _model_path_from_engine(client, stop, args.engine)
        if tokenizer_path is None:
            return
        tokenizer = load_tokenizer(tokenizer_path)
        llm = AsyncLLM(client, tokenizer, max_waiting_requests=args.max_waiting_requests, max_n=args.max_n)
        server = FrontendServer(llm, f"{args.host}:{args.port}")
        await server.start()
        log.info("frontend listening on %s:%d (tokenizer %s)", args.host, server.port, tokenizer_path)
        await stop.wait()
        log.info("shutting down: health NOT_SERVING, then %gs grace for in-flight streams", args.grace)
        await server.stop(args.grace)
    finally:
        await client.close()


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
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
