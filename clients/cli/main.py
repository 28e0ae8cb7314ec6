"""The `tandem` command line: run a local stack, talk to a frontend, benchmark it.

    tandem serve [MODEL]                      # engine core + frontend on this machine (ports 50061, 50051)
    tandem generate "Once upon a time" --max-tokens 32 --temperature 0
    tandem chat                               # interactive; streams tokens, keeps the history
    tandem tokenize "Hello world"             tandem info        tandem health
    tandem embed "first text" "second text" --pooling mean
    tandem admin pause --mode keep            # operator calls: pause, resume, sleep, wake, drain, profile, ...
    tandem bench --concurrency 1 4 16 --num-requests 64 --plot sweep.png
    tandem plans                              # the CPU kernel plans cached on this machine; --clear deletes them

Every command has --help with examples; `tandem --version` prints the installed version. Errors print
"tandem: CODE: message" and exit 1.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

from clients.bench import command as bench_command
from clients.cli import admin_command, chat_session, commands, plans_command, serve_command
from clients.cli.options import HelpFormatter, connection_parent, sampling_parent
from clients.errors import TandemError

_EXAMPLES = {
    "generate": """examples:
  tandem generate "The capital of France is" --max-tokens 16 --temperature 0
  tandem generate --token-ids 1,4093,198 --max-tokens 8 --json
  tandem generate "A haiku about gRPC:" --n 3 --temperature 0.8 --max-tokens 32   # three samples, labelled
  tandem generate "Tell a story" --stop "The end" --seed 7 --address gpu-box:50051 --tls-ca ca.pem
  tandem generate "A user profile as JSON:" --json-schema docs/examples/person.schema.json --max-tokens 128
  tandem generate "Is gRPC fast? Answer:" --choice yes --choice no
  tandem generate "SELECT" --lora sql --max-tokens 32    # with the loaded LoRA adapter sql""",
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
    parser.add_argument("--version", action="version", version=f"tandem {package_version()}")
    subcommands = parser.add_subparsers(dest="command", required=True)
    serve_command.add_parser(subcommands)

    connection, sampling = connection_parent(), sampling_parent()
    generate = _add(subcommands, "generate", "stream a completion of a prompt", [connection, sampling],
                    "Stream the completion of a text prompt (or of token ids) to stdout; a summary line "
                    "(tokens, finish reason, timings) goes to stderr.")
    generate.add_argument("prompt", nargs="?", help="the text prompt")
    generate.add_argument("--token-ids", metavar="IDS", help="prompt as token ids (comma or space separated)")
    generate.add_argument("--n", type=int, default=1, metavar="N",
                          help="completions of the prompt; with N > 1 each is printed, labelled, once it finishes")
    generate.add_argument("--request-id", help="the request's id (default: the server makes one)")
    _add_lora_flag(generate)
    generate.add_argument("--json", action="store_true",
                          help="one JSON object (index, text, token_ids, finish_reason, usage) per completion "
                               "in each streamed message")
    generate.set_defaults(run=commands.generate)

    chat = _add(subcommands, "chat", "chat in the terminal (streams tokens, keeps history)", [connection, sampling],
                chat_session.__doc__.strip())
    chat.add_argument("--system", help="a system message that starts the conversation")
    _add_lora_flag(chat)
    chat.add_argument("--tools", metavar="FILE", help="a JSON file with a list of tools the model may call: "
                      '[{"name": ..., "description": ..., "parameters": JSON schema}]; see docs/tools.md')
    chat.add_argument("--tool-choice", metavar="CHOICE", help="auto (default), none, required, or a tool's name "
                      "to force that call; a forced choice (required or a name) applies to the answer to each "
                      "message you type, and the turn after a /tool result uses auto so the model can answer")
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


def package_version() -> str:
    """The installed package's version (what pip shows), or why there is none."""
    try:
        return importlib.metadata.version("tandem")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown: run from a source tree that is not installed)"


def _add_lora_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora", metavar="NAME", help="answer with this loaded LoRA adapter (docs/lora.md); "
                        "NOT_FOUND when no engine has it")


def _add(subcommands, name: str, help_text: str, parents: list, description: str) -> argparse.ArgumentParser:
    return subcommands.add_parser(name, help=help_text, description=description, epilog=_EXAMPLES[name],
                               parents=parents, formatter_class=HelpFormatter)


def main(argv: list[str] | None = None) -> int:
    argv, engine_args = serve_command.split_engine_args(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command == "serve":
        if unknown:
            print(f"tandem serve: error: {serve_command.unknown_flags_message(unknown)}", file=sys.stderr)
            return 2
        args.engine_args = engine_args
        return serve_command.run(args)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
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
