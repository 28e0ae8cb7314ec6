"""The `tandem` command line: run a local stack, talk to a frontend, benchmark it.

    tandem serve                              # engine core + frontend on this machine (ports 50061, 50051)
    tandem generate "Once upon a time" --max-tokens 32 --temperature 0
    tandem chat                               # interactive; streams tokens, keeps the history
    tandem tokenize "Hello world"             tandem info        tandem health
    tandem embed "first text" "second text" --pooling mean
    tandem admin pause --mode keep            # operator calls: pause, resume, sleep, wake, drain, profile, ...
    tandem bench --concurrency 1 4 16 --num-requests 64 --plot sweep.png
    tandem plans                              # the CPU kernel plans cached on this machine; --clear deletes them

Every command has --help with examples. Errors print "tandem: CODE: message" and exit 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import signal
import sys

from clients import admin_command, chat_session, commands, plans_command
from clients.bench import command as bench_command
from clients.cli_options import HelpFormatter, connection_parent, sampling_parent
from clients.errors import TandemError
from clients.local_stack import LocalStack, RestartPolicy

ENGINE_EXTRA = "pip install 'tandem[engine]'"
_RESTART = RestartPolicy()

_EXAMPLES = {
    "serve": """examples:
  tandem serve                                  # the embedded SmolLM2; frontend :50051, engine :50061
  tandem serve --model ./my-llama --port 8001 -- --max-num-seqs 64 --dtype float32""",
    "generate": """examples:
  tandem generate "The capital of France is" --max-tokens 16 --temperature 0
  tandem generate --token-ids 1,4093,198 --max-tokens 8 --json
  tandem generate "A haiku about gRPC:" --n 3 --temperature 0.8 --max-tokens 32   # three samples, labelled
  tandem generate "Tell a story" --stop "The end" --seed 7 --address gpu-box:50051 --tls-ca ca.pem
  tandem generate "A user profile as JSON:" --json-schema docs/examples/person.schema.json --max-tokens 128
  tandem generate "Is gRPC fast? Answer:" --choice yes --choice no""",
    "chat": """examples:
  tandem chat                                   # on a terminal: you> ... assistant> ...
  tandem chat --system "Answer in one sentence." --temperature 0
  printf 'Hi!\\nWhat did I just say?\\n' | tandem chat --max-tokens 32   # one turn per line
  tandem chat --tools tools.json --tool-choice required   # calls printed as {"tool_call": ...} lines""",
    "tokenize": """examples:
  tandem tokenize "Hello world"
  tandem tokenize "Hello world" --chat --json    # as the chat template renders a user message
  tandem tokenize --decode 19556 905""",
    "embed": """examples:
  tandem embed "Hello world"                     # JSON: one vector per input, and token usage
  tandem embed "a cat" "a dog" --pooling mean --no-normalize
  tandem embed --ids "1 2 3" --ids 42 --pooling cls""",
    "info": """examples:
  tandem info
  tandem info --json --address 10.0.0.5:50051""",
    "health": """examples:
  tandem health                                 # prints SERVING and exits 0, else exits 1
  tandem health --service tandem.v1.GenerationService --timeout 2
  tandem health --service tandem.v1.AdminService   # SERVING while the frontend runs, drained or not""",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    subcommands = parser.add_subparsers(dest="command", required=True)
    serve = subcommands.add_parser(
        "serve", help="start an engine core and a frontend locally",
        description="Start tandem-engine and tandem-frontend as two processes and serve until "
                    "SIGINT/SIGTERM (both then drain and stop; exit 0). A service that exits on its own is "
                    f"restarted after a backoff ({_RESTART.backoff_initial_s:g} s, doubling up to "
                    f"{_RESTART.backoff_max_s:g} s); {_RESTART.max_restarts} quick failures in a row (each within "
                    f"{_RESTART.stable_s:g} s of starting) end the stack (exit 1). Needs the engine: {ENGINE_EXTRA}. "
                    "Flags after `--` are passed to tandem-engine (see tandem-engine --help).",
        epilog=_EXAMPLES["serve"], formatter_class=HelpFormatter,
    )
    serve.add_argument("--host", default="127.0.0.1", help="address both services listen on")
    serve.add_argument("--port", type=int, default=50051, help="the frontend's (public API) port")
    serve.add_argument("--engine-port", type=int, default=50061, help="the engine core's port")
    serve.add_argument("--model", default=None, help="HF folder or .gguf file; unset: the embedded SmolLM2")
    serve.add_argument("--api-token-file", metavar="PATH", default=argparse.SUPPRESS,
                       help="the frontend requires 'authorization: Bearer <token>' with this token "
                            "($TANDEM_API_TOKEN works too)")
    serve.add_argument("--admin-token-file", metavar="PATH", default=argparse.SUPPRESS,
                       help="a separate token for tandem.v1.AdminService calls")
    serve.add_argument("--max-message-bytes", type=int, metavar="N", default=argparse.SUPPRESS,
                       help="the frontend's largest message (default: tandem-frontend's)")
    serve.add_argument("--chat-template", metavar="FILE", default=argparse.SUPPRESS,
                       help="the frontend renders chats with this Jinja template (see tandem-frontend --help)")
    serve.add_argument("--tool-parser", metavar="NAME", default=argparse.SUPPRESS,
                       help="how the frontend reads tool calls: hermes, llama3_json, mistral or pythonic")
    serve.add_argument("engine_args", nargs=argparse.REMAINDER, help="-- then flags for tandem-engine")

    connection, sampling = connection_parent(), sampling_parent()
    generate = _add(subcommands, "generate", "stream a completion of a prompt", [connection, sampling],
                    "Stream the completion of a text prompt (or of token ids) to stdout; a summary line "
                    "(tokens, finish reason, timings) goes to stderr.")
    generate.add_argument("prompt", nargs="?", help="the text prompt")
    generate.add_argument("--token-ids", metavar="IDS", help="prompt as token ids (comma or space separated)")
    generate.add_argument("--n", type=int, default=1, metavar="N",
                          help="completions of the prompt; with N > 1 each is printed, labelled, once it finishes")
    generate.add_argument("--request-id", help="the request's id (default: the server makes one)")
    generate.add_argument("--json", action="store_true",
                          help="one JSON object (index, text, token_ids, finish_reason, usage) per completion "
                               "in each streamed message")
    generate.set_defaults(run=commands.generate)

    chat = _add(subcommands, "chat", "chat in the terminal (streams tokens, keeps history)", [connection, sampling],
                chat_session.__doc__.strip())
    chat.add_argument("--system", help="a system message that starts the conversation")
    chat.add_argument("--tools", metavar="FILE", help="a JSON file with a list of tools the model may call: "
                      '[{"name": ..., "description": ..., "parameters": JSON schema}]; see docs/tools.md')
    chat.add_argument("--tool-choice", metavar="CHOICE", help="auto (default), none, required, or a tool's name "
                      "to force that call")
    chat.set_defaults(run=chat_session.run)

    tokenize = _add(subcommands, "tokenize", "token ids of text (or text of token ids)", [connection],
                    "Print the token ids and token strings the server's tokenizer makes of TEXT.")
    tokenize.add_argument("text", nargs="?", help="the text to tokenize")
    tokenize.add_argument("--chat", action="store_true", help="tokenize TEXT as a user message in the chat template")
    tokenize.add_argument("--no-special", action="store_true", help="no special tokens (e.g. BOS)")
    tokenize.add_argument("--decode", nargs="+", metavar="ID", help="detokenize these ids instead")
    tokenize.add_argument("--keep-special", action="store_true", help="with --decode: keep special tokens")
    tokenize.add_argument("--json", action="store_true", help="print JSON")
    tokenize.set_defaults(run=commands.tokenize)

    embed = _add(subcommands, "embed", "embeddings of texts or token ids", [connection],
                 "Print, as JSON, one vector per input pooled from the model's final hidden states.")
    embed.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed, one vector each")
    embed.add_argument("--ids", action="append", default=[], metavar="IDS", help="token ids to embed (repeatable)")
    embed.add_argument("--pooling", choices=("last", "mean", "cls"), default="last", help="which hidden states")
    embed.add_argument("--no-normalize", action="store_true", help="keep the raw vector (default: unit L2 norm)")
    embed.set_defaults(run=commands.embed)
    info = _add(subcommands, "info", "the served model, the frontend's state and its engines", [connection],
                "Print the model (name, path, context length, vocabulary), whether the frontend serves new "
                "requests (or drains, or its engines are paused or asleep) and each engine's state.")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(run=commands.info)

    health = _add(subcommands, "health", "the grpc.health.v1 status of a server", [connection],
                  "Ask grpc.health.v1 for the server's status; exit 0 only when it is SERVING. A frontend's \"\" and "
                  "tandem.v1.GenerationService (its readiness) say NOT_SERVING while it drains or none of its "
                  "engines takes new requests (none connected, or all paused or asleep: `tandem info` says "
                  "which); tandem.v1.AdminService stays SERVING while it runs.")
    health.add_argument("--service", default="", help="a service name (default: the whole server)")
    health.set_defaults(run=commands.health)

    admin_command.add_parser(subcommands)
    bench_command.add_parser(subcommands, connection)
    plans_command.add_parser(subcommands)
    return parser


def _add(subcommands, name: str, help_text: str, parents: list, description: str) -> argparse.ArgumentParser:
    return subcommands.add_parser(name, help=help_text, description=description, epilog=_EXAMPLES[name],
                               parents=parents, formatter_class=HelpFormatter)


def serve(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("torch") is None:
        print(f"tandem: serve runs an engine core, which needs torch; this install has the client and the frontend "
              f"only. Install the engine with: {ENGINE_EXTRA}", file=sys.stderr)
        return 1
    engine_args = [a for a in args.engine_args if a != "--"]
    if args.model:
        engine_args = ["--model", args.model, *engine_args]
    passed = ("api_token_file", "admin_token_file", "max_message_bytes",  # to tandem-frontend, when given
              "chat_template", "tool_parser")
    frontend_args = [arg for name in passed if name in args
                     for arg in ("--" + name.replace("_", "-"), str(getattr(args, name)))]
    stack = LocalStack(host=args.host, frontend_port=args.port, engine_port=args.engine_port,
                       engine_args=engine_args, frontend_args=frontend_args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop() runs in the finally below
    try:
        stack.start()
        engine_pid, frontend_pid = stack.pids
        print(f"tandem: serving on {stack.frontend_address} (engine core at {stack.engine_address}, pid {engine_pid}; "
              f"frontend pid {frontend_pid}); a service that exits is restarted; Ctrl-C to stop", flush=True)
        return stack.supervise()
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
    try:
        return args.run(args)
    except TandemError as e:
        print(f"tandem: {e.code.name}: {e.message}", file=sys.stderr)
    except (TypeError, ValueError) as e:  # a bad flag value caught before any call
        print(f"tandem: INVALID_ARGUMENT: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
    return 1


if __name__ == "__main__":
    sys.exit(main())
