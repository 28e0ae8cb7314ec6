"""The `tandem` command line.

    tandem serve                              # engine core + frontend on this machine (ports 50061, 50051)
    tandem serve --model ./my-llama --port 8001 -- --max-num-seqs 64
                                              # flags after `--` go to tandem-engine
"""

from __future__ import annotations

import argparse
import signal
import sys

from clients.local_stack import LocalStack


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="start an engine core and a frontend locally",
        description="Start tandem-engine and tandem-frontend as two processes and serve until "
                    "SIGINT/SIGTERM. Flags after `--` are passed to tandem-engine (see tandem-engine --help).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument("--host", default="127.0.0.1", help="address both services listen on")
    serve.add_argument("--port", type=int, default=50051, help="the frontend's (public API) port")
    serve.add_argument("--engine-port", type=int, default=50061, help="the engine core's port")
    serve.add_argument("--model", default=None, help="HF folder or .gguf file; unset: the embedded SmolLM2")
    serve.add_argument("engine_args", nargs=argparse.REMAINDER, help="-- then flags for tandem-engine")
    return parser


def serve(args: argparse.Namespace) -> int:
    engine_args = [a for a in args.engine_args if a != "--"]
    if args.model:
        engine_args = ["--model", args.model, *engine_args]
    stack = LocalStack(host=args.host, frontend_port=args.port, engine_port=args.engine_port,
                       engine_args=engine_args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop() runs in the finally below
    try:
        stack.start()
        print(f"tandem: serving on {stack.frontend_address} (engine core at {stack.engine_address}); "
              "Ctrl-C to stop", flush=True)
        return stack.wait()
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"tandem: {e}", file=sys.stderr)
        return 1
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
