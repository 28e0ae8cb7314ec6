"""`tandem serve`: an engine core and a frontend on this machine, from one command line.

    tandem serve [MODEL] [flags] [-- tandem-engine flags]

Flags before `--` are tandem serve's own: the addresses, the model, the flags both services take alike
(tracing, logs, the tokenizer) and the frontend's (metrics, request limits, chat template, tokens).
Flags after `--` go to tandem-engine, whose own parser checks them before anything starts; those that
would break the pair are refused (the engine's address, TLS on the link, the flags serve gives both).
Every port is looked at first: a taken one ends the command in one line (services/ports.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import signal
import sys
from pathlib import Path

from clients.cli.options import HelpFormatter, positive_int
from clients.local_stack import LocalStack, RestartPolicy

ENGINE_EXTRA = "pip install 'tandem[engine]'"
RESTART = RestartPolicy()

EXAMPLES = """examples:
  tandem serve                                  # the embedded SmolLM2; frontend :50051, engine :50061
  tandem serve ./my-llama --port 8001 -- --max-num-seqs 64 --dtype float32
  tandem serve model.gguf --otlp-endpoint http://localhost:4317   # one trace per request across both services
  tandem serve --metrics-port 9100 --max-tokens 512 --log-format json
  tandem serve -- --help                        # the flags tandem-engine takes after --"""

# the flags tandem serve passes on, by their argparse dest; each is given as the service spells it
BOTH_SERVICES = ("otel", "otlp_endpoint", "tokenizer", "log_format", "log_level")
FRONTEND_ONLY = ("metrics_port", "max_tokens", "max_n", "max_prompt_tokens", "max_waiting_requests",
                 "chat_template", "tool_parser", "api_token_file", "admin_token_file", "max_message_bytes")

_OWN_ADDRESS = "the frontend dials the engine core at tandem serve's --host and --engine-port"
_BOTH = "tandem serve gives it to both services"
_PLAINTEXT_LINK = ("tandem serve's frontend dials its engine core in plaintext on this machine; for TLS between "
                   "them run tandem-engine and tandem-frontend on their own (docs/security.md)")
# engine flags after `--` that would break the pair, by dest: why, and how tandem serve takes it instead
REFUSED_ENGINE_FLAGS = {
    "host": (_OWN_ADDRESS, "--host"),
    "port": (_OWN_ADDRESS, "--engine-port"),
    "model": ("tandem serve gives the engine core its model", ""),  # "": the value alone, as MODEL
    "tls_cert": (_PLAINTEXT_LINK, None), "tls_key": (_PLAINTEXT_LINK, None), "tls_client_ca": (_PLAINTEXT_LINK, None),
    "otel": (_BOTH, "--otel"), "otlp_endpoint": (_BOTH, "--otlp-endpoint"), "tokenizer": (_BOTH, "--tokenizer"),
    "log_format": (_BOTH, "--log-format"),
}


class ServeError(ValueError):
    """A command line tandem serve refuses; str() is the one line that says why."""



def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535 (0: a free one), got {value}")
    return value


def add_parser(subcommands) -> argparse.ArgumentParser:
    serve = subcommands.add_parser(
        "serve", help="start an engine core and a frontend locally",
        usage="tandem serve [MODEL] [flags] [-- tandem-engine flags]",
        description="Start tandem-engine and tandem-frontend as two processes and serve until "
                    "SIGINT/SIGTERM (both then drain and stop; exit 0). A service that exits on its own is "
                    f"restarted after a backoff ({RESTART.backoff_initial_s:g} s, doubling up to "
                    f"{RESTART.backoff_max_s:g} s); {RESTART.max_restarts} quick failures in a row (each within "
                    f"{RESTART.stable_s:g} s of starting) end the stack (exit 1). A port in use ends it at once "
                    f"(exit 1). Needs the engine: {ENGINE_EXTRA}. Flags after `--` are passed to tandem-engine "
                    "(`tandem serve -- --help` lists them), except those that would break the pair: its "
                    "--host, --port and TLS, and the flags below that go to both services. The frontend's other "
                    "flags (TLS, routing, the other request limits): run the two services on their own "
                    "(docs/deployment.md).",
        epilog=EXAMPLES, formatter_class=HelpFormatter,
    )
    serve.add_argument("model_path", nargs="?", metavar="MODEL",
                       help="HF folder or .gguf file, as `vllm serve MODEL`; unset: the embedded SmolLM2")
    serve.add_argument("--model", default=None, help="the same as MODEL")
    serve.add_argument("--host", default="127.0.0.1", help="address both services listen on")
    serve.add_argument("--port", type=_port, default=50051, help="the frontend's (public API) port")
    serve.add_argument("--engine-port", type=_port, default=50061, help="the engine core's port")

    both = serve.add_argument_group("both services")
    both.add_argument("--otel", action="store_true", default=argparse.SUPPRESS,
                      help="trace over OTLP, one trace per request across the frontend and the engine core "
                           "(endpoint from --otlp-endpoint or the OTEL_* variables; docs/observability.md)")
    both.add_argument("--otlp-endpoint", metavar="URL", default=argparse.SUPPRESS,
                      help="the OTLP collector, e.g. http://localhost:4317; implies --otel")
    both.add_argument("--log-format", choices=("text", "json"), default=argparse.SUPPRESS,
                      help="text, or json: one JSON object per line (default: text)")
    both.add_argument("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"), default=argparse.SUPPRESS,
                      help="the services' log level (default: INFO); `-- --log-level` sets the engine core's alone")
    both.add_argument("--tokenizer", metavar="PATH", default=argparse.SUPPRESS,
                      help="a .gguf or a folder with tokenizer.json: the frontend tokenizes with it, the engine core "
                           "builds structured-output masks from it (default: the model's own)")

    frontend = serve.add_argument_group("the frontend")
    frontend.add_argument("--metrics-port", type=_port, metavar="PORT", default=argparse.SUPPRESS,
                          help="the frontend's Prometheus /metrics (0 picks a free one; default: none); the engine "
                               "core's: `-- --metrics-port PORT`")
    frontend.add_argument("--max-tokens", type=positive_int, metavar="N", default=argparse.SUPPRESS,
                          help="the largest max_tokens accepted, and the value when a request leaves it unset "
                               "(default: up to the model's max_model_len)")
    frontend.add_argument("--max-n", type=positive_int, metavar="N", default=argparse.SUPPRESS,
                          help="the largest n (completions per request) accepted (default: tandem-frontend's)")
    frontend.add_argument("--max-prompt-tokens", type=positive_int, metavar="N", default=argparse.SUPPRESS,
                          help="the longest prompt accepted, in tokens (default: max_model_len - 1)")
    frontend.add_argument("--max-waiting-requests", type=positive_int, metavar="N", default=argparse.SUPPRESS,
                          help="requests in flight before new ones get RESOURCE_EXHAUSTED (default: tandem-frontend's)")
    frontend.add_argument("--chat-template", metavar="FILE", default=argparse.SUPPRESS,
                          help="render chats with this Jinja template (see tandem-frontend --help)")
    frontend.add_argument("--tool-parser", metavar="NAME", default=argparse.SUPPRESS,
                          help="how the frontend reads tool calls: hermes, llama3_json, mistral or pythonic")
    frontend.add_argument("--api-token-file", metavar="PATH", default=argparse.SUPPRESS,
                          help="require 'authorization: Bearer <token>' with this token ($TANDEM_API_TOKEN works too)")
    frontend.add_argument("--admin-token-file", metavar="PATH", default=argparse.SUPPRESS,
                          help="a separate token for tandem.v1.AdminService calls")
    frontend.add_argument("--max-message-bytes", type=positive_int, metavar="N", default=argparse.SUPPRESS,
                          help="the frontend's largest message (default: tandem-frontend's)")
    serve.set_defaults(engine_args=[])
    return serve


def split_engine_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """`serve ... -- ENGINE FLAGS` -> (argv up to `--`, the engine's flags); other commands are left whole.
    Split before argparse, so that MODEL can stand anywhere before `--` without taking the flags after it."""
    if argv[:1] == ["serve"] and "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def unknown_flags_message(unknown: list[str]) -> str:
    """Why tandem serve does not take `unknown`, and where each flag goes instead."""
    from services.engine.__main__ import build_parser as engine_parser  # torch-free: the flags only
    from services.frontend.__main__ import build_parser as frontend_parser

    engine_flags, frontend_flags = engine_parser()._option_string_actions, frontend_parser()._option_string_actions
    hints = []
    for arg in unknown:
        flag = arg.split("=", 1)[0]
        if flag in engine_flags:
            hints.append(f"{flag} is tandem-engine's: give it after `--` (tandem serve [MODEL] [flags] -- {flag} ...)")
        elif flag in frontend_flags:
            hints.append(f"{flag} is a tandem-frontend flag tandem serve does not pass on: run tandem-engine and "
                         "tandem-frontend on their own (docs/deployment.md)")
    return "; ".join([f"unrecognized arguments: {' '.join(unknown)}", *hints])


def parse_engine_flags(engine_args: list[str]) -> argparse.Namespace:
    """The flags given after `--`, as tandem-engine reads them (only those given are set); ServeError with
    tandem-engine's own complaint about a flag it does not take. `-- --help` prints tandem-engine's help."""
    from services.engine.__main__ import build_parser  # torch-free: the flags only

    def refuse(message: str):
        raise ServeError(f"flags after `--` go to tandem-engine, which says: {message}")

    checked, given = build_parser(), build_parser()
    checked.error = given.error = refuse
    checked.parse_args(engine_args)  # with the real defaults, so that --help shows them
    for action in given._actions:  # only what was given lands in the namespace
        action.default = argparse.SUPPRESS
    return given.parse_args(engine_args)


def _flag_args(args: argparse.Namespace, dests: tuple[str, ...]) -> list[str]:
    """The given flags among `dests`, spelled for a service's command line."""
    out: list[str] = []
    for dest in dests:
        if dest in args:
            value = getattr(args, dest)
            out += ["--" + dest.replace("_", "-")] + ([] if value is True else [str(value)])
    return out


def build_stack(args: argparse.Namespace) -> tuple[LocalStack, list[str]]:
    """The stack the command line describes and what tandem serve says it does with the flags; ServeError
    (a refused command line) or PortUnavailable (a taken port), each a ValueError of one line."""
    from services.ports import ensure_can_listen

    if args.model_path and args.model:
        raise ServeError(f"the model is given twice ({args.model_path} and --model {args.model}): give it once")
    model = args.model_path or args.model
    for what, path, wanted in (
            ("model", model, "a Hugging Face folder or a .gguf file"),
            ("tokenizer", getattr(args, "tokenizer", None), "a folder with tokenizer.json or a .gguf file"),
            ("chat template", getattr(args, "chat_template", None), "a Jinja file")):
        if path is not None and not Path(path).exists():  # said now, not after the engine has loaded
            raise ServeError(f"{what} {path} not found: give {wanted}")
    engine_flags = parse_engine_flags(args.engine_args)
    for dest, (why, instead) in REFUSED_ENGINE_FLAGS.items():
        if dest in engine_flags:
            value = [] if getattr(engine_flags, dest) is True else [str(getattr(engine_flags, dest))]
            given = " ".join(["--" + dest.replace("_", "-"), *value])
            fix = "" if instead is None else f"; give `{' '.join(['tandem serve', *filter(None, [instead]), *value])}`"
            raise ServeError(f"`-- {given}` is refused: {why}{fix}")

    ports = [(args.port, "--port"), (args.engine_port, "--engine-port"),
             (getattr(args, "metrics_port", None), "--metrics-port"),
             (getattr(engine_flags, "metrics_port", None), "-- --metrics-port")]
    ports = [(port, flag) for port, flag in ports if port]  # None: not served; 0: the OS picks
    for i, (port, flag) in enumerate(ports):
        twice = [other for other_port, other in ports[:i] if other_port == port]
        if twice:
            raise ServeError(f"{twice[0]} and {flag} are both {port}: each server needs a port of its own")
    for port, flag in ports:  # before anything starts: a taken port is one line, not a stack that half starts
        ensure_can_listen(args.host, port, flag)

    both, frontend_only = _flag_args(args, BOTH_SERVICES), _flag_args(args, FRONTEND_ONLY)
    engine_args = [*(["--model", model] if model else []), *both, *args.engine_args]
    stack = LocalStack(host=args.host, frontend_port=args.port, engine_port=args.engine_port,
                       engine_args=engine_args, frontend_args=[*both, *frontend_only])
    return stack, _describe(args, engine_flags, frontend_only)


def _describe(args: argparse.Namespace, engine_flags: argparse.Namespace, frontend_only: list[str]) -> list[str]:
    """One line per flag whose effect is worth saying (where it goes, what it turns on)."""
    lines = []
    if "otel" in args or "otlp_endpoint" in args:
        endpoint = getattr(args, "otlp_endpoint", None) or "$OTEL_EXPORTER_OTLP_ENDPOINT (else http://localhost:4317)"
        lines.append(f"tracing on in the frontend and the engine core, one trace per request, over OTLP to {endpoint}")
    if "tokenizer" in args:
        lines.append(f"the frontend tokenizes with {args.tokenizer}; the engine core builds structured-output masks "
                     "from it")
    logs = _flag_args(args, ("log_format", "log_level"))
    if logs:
        lines.append(f"both services log with {' '.join(logs)}")
    if "metrics_port" in args:
        engine_metrics = getattr(engine_flags, "metrics_port", None)
        engine_part = (f"the engine core's on port {engine_metrics}" if engine_metrics is not None
                       else "the engine core's with `-- --metrics-port PORT`")
        lines.append(f"the frontend's Prometheus /metrics on {args.host}:{args.metrics_port}; {engine_part}")
    if frontend_only:
        lines.append(f"to the frontend: {' '.join(frontend_only)}")
    if args.engine_args:
        lines.append(f"to the engine core: {' '.join(args.engine_args)}")
    return lines


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("torch") is None:
        print(f"tandem: serve runs an engine core, which needs torch; this install has the client and the frontend "
              f"only. Install the engine with: {ENGINE_EXTRA}", file=sys.stderr)
        return 1
    try:
        stack, described = build_stack(args)
    except ServeError as exc:
        print(f"tandem serve: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a taken port (services.ports.PortUnavailable)
        print(f"tandem: {exc}", file=sys.stderr)
        return 1
    for line in described:
        print(f"tandem: {line}", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop() runs in the finally below
    try:
        stack.start()
        engine_pid, frontend_pid = stack.pids
        print(f"tandem: serving on {stack.frontend_address} (engine core at {stack.engine_address}, pid {engine_pid}; "
              f"frontend pid {frontend_pid}); a service that exits is restarted; Ctrl-C to stop", flush=True)
        return stack.supervise()
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
