"""`tandem admin`: the operator calls (tandem.v1.AdminService) of a frontend, forwarded to its engines.

    tandem admin pause --mode keep        tandem admin resume
    tandem admin sleep                    tandem admin wake
    tandem admin drain --wait 30          tandem admin reset-prefix-cache
    tandem admin profile start --output-dir /tmp/trace    tandem admin profile stop
    tandem admin lora load NAME PATH      tandem admin lora list      tandem admin lora pin NAME
    tandem admin lora unload NAME

Each prints what happened and exits 0, or prints why an engine refused and exits 1. The frontend's
readiness (`tandem health`) says NOT_SERVING while it drains or its engines are paused or asleep; `tandem
info` says which. With --admin-token-file on the server, give the admin token (--token-file, or
$TANDEM_ADMIN_TOKEN; else $TANDEM_API_TOKEN).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from clients.admin import PAUSE_MODES
from clients.cli.options import ADMIN_TOKEN_ENV, TOKEN_ENV, HelpFormatter, client_from_args, connection_parent

DEFAULT_DRAIN_WAIT_S = 30.0
EXAMPLES = """examples:
  tandem admin pause --mode keep                # freeze; new requests wait; readiness NOT_SERVING
  tandem admin resume                           # continue (also ends a drain)
  tandem admin pause && tandem admin sleep      # abort what runs, then free the KV cache
  tandem admin wake && tandem admin resume
  tandem admin drain --wait 60 --address 10.0.0.7:50051   # one replica: refuse new calls, let streams finish
  tandem admin reset-prefix-cache
  tandem admin profile start --output-dir /tmp/trace && sleep 10 && tandem admin profile stop
  tandem admin lora load sql /models/adapters/sql   # a PEFT adapter folder on the engines' machines
  tandem admin lora list --json"""
_PAUSE_HELP = "What happens to requests in flight (in every mode new requests wait until resume):\n" + "\n".join(
    f"  {name:<6} {meaning}" for name, (_, meaning) in PAUSE_MODES.items())


def add_parser(subcommands) -> argparse.ArgumentParser:
    connection = connection_parent(token_envs=(ADMIN_TOKEN_ENV, TOKEN_ENV))
    parser = subcommands.add_parser("admin", help="operator calls: pause, resume, sleep, wake, drain, profile, ...",
                                    description=__doc__.strip(), epilog=EXAMPLES, formatter_class=HelpFormatter)
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    def action(name: str, help_text: str, description: str, run) -> argparse.ArgumentParser:
        sub = actions.add_parser(name, help=help_text, description=description, parents=[connection],
                                 formatter_class=HelpFormatter)
        sub.set_defaults(run=run)
        return sub

    pause = action("pause", "stop generating; new requests wait until resume",
                   "Pause every engine behind the frontend.\n\n" + _PAUSE_HELP, _pause)
    pause.add_argument("--mode", choices=list(PAUSE_MODES), default="abort", help="see above")
    action("resume", "continue after pause (also ends a drain)",
           "Resume every engine, and admit new requests again on a draining frontend.", _call("resume"))
    action("sleep", "free the engines' KV cache until wake",
           "Put every engine to sleep: its KV cache is freed (on CUDA the weights move to CPU) and new requests "
           "get UNAVAILABLE until wake. Refused while requests are in flight: pause (mode abort) first.",
           _call("sleep"))
    action("wake", "undo sleep", "Wake every engine: the KV cache is allocated again, with an empty prefix cache.",
           _call("wake_up"))
    action("reset-prefix-cache", "empty the prefix cache",
           "Empty every engine's prefix cache; refused while requests in flight hold KV blocks.",
           _call("reset_prefix_cache"))
    drain = action("drain", "this frontend refuses new requests (UNAVAILABLE) and lets those in flight finish",
                   "Drain the frontend at --address (not its engines): new requests get UNAVAILABLE and health says "
                   "NOT_SERVING, so balancers move traffic away; waits up to --wait seconds for the requests in "
                   "flight and exits 1 if some are left. resume ends the drain.", _drain)
    drain.add_argument("--wait", type=float, default=DEFAULT_DRAIN_WAIT_S, metavar="S",
                       help="seconds to wait for the requests in flight (0: answer at once)")
    profile = action("profile", "start or stop the torch profiler in every engine",
                     "start: profile every engine's steps from now on; stop: write each engine's chrome trace into "
                     "the --output-dir given to start (a folder on the engine's machine).", _profile)
    profile.add_argument("step", choices=("start", "stop"), help="start or stop the profiler")
    profile.add_argument("--output-dir", metavar="DIR", help="with start: the folder for the traces (made if missing)")
    lora = action("lora", "load, unload, list or pin LoRA adapters in every engine",
                  "LoRA adapters (docs/lora.md). load NAME PATH: read the PEFT adapter folder PATH (on the engines' "
                  "machines) into every engine as NAME, which requests then name; unload NAME (refused while "
                  "requests use it); list; pin NAME (kept in the engines' host memory).", _lora)
    lora.add_argument("step", choices=("load", "unload", "list", "pin"), help="what to do")
    lora.add_argument("name", nargs="?", help="the adapter's name (load, unload, pin)")
    lora.add_argument("path", nargs="?", help="with load: the PEFT adapter folder")
    lora.add_argument("--json", action="store_true", help="print the adapters as JSON, one object per engine")
    return parser


def _pause(args: argparse.Namespace) -> int:
    with client_from_args(args) as client:
        return _report(args, client.pause(args.mode))


def _call(method: str):
    def run(args: argparse.Namespace) -> int:
        with client_from_args(args) as client:
            return _report(args, getattr(client, method)())
    return run


def _drain(args: argparse.Namespace) -> int:
    if not args.wait >= 0 or args.wait >= args.timeout:
        raise ValueError(f"--wait must be >= 0 and shorter than --timeout ({args.timeout:g} s, the call's "
                         f"deadline), got {args.wait:g}")
    with client_from_args(args) as client:
        return _report(args, client.drain(args.wait))


def _profile(args: argparse.Namespace) -> int:
    with client_from_args(args) as client:
        if args.step == "stop":
            return _report(args, client.stop_profile())
        if not args.output_dir:
            raise ValueError("profile start needs --output-dir DIR, the folder for the traces on the engine's machine")
        return _report(args, client.start_profile(args.output_dir))


def _lora(args: argparse.Namespace) -> int:
    if args.step != "list" and not args.name:
        raise ValueError(f"lora {args.step} needs the adapter's NAME")
    if args.step == "load" and not args.path:
        raise ValueError("lora load needs NAME and PATH, the PEFT adapter folder on the engines' machines")
    with client_from_args(args) as client:
        if args.step == "unload":
            print(f"unloaded {args.name} from {', '.join(client.unload_lora(args.name))}")
            return 0
        adapters = {"load": lambda: client.load_lora(args.name, args.path), "list": client.list_loras,
                    "pin": lambda: client.pin_lora(args.name)}[args.step]()
    if args.json:
        print(json.dumps([dataclasses.asdict(a) for a in adapters], indent=2))
    for adapter in [] if args.json else adapters:
        fields = [adapter.name, f"rank {adapter.rank}", ",".join(adapter.target_modules), adapter.location,
                  "pinned" if adapter.pinned else "unpinned", adapter.engine, adapter.path]
        print("\t".join(fields))
    return 0


def _report(args: argparse.Namespace, result) -> int:
    if result.ok:
        print(result.detail)
        return 0
    print(f"tandem: admin {args.action} did not complete: {result.detail}", file=sys.stderr)
    return 1
