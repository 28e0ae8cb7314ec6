"""`tandem plans`: the CPU kernel plans cached on this machine, and `--clear` to delete them.

On a CPU the engine times each allowed linear kernel per layer shape and batch bucket when it loads
a model, and races bf16 against fp32 for dtype=auto (docs/cpu-kernels.md). Answers timed while the
machine was quiet are kept in ~/.cache/tandem/linear_plans.json ($TANDEM_CACHE_DIR moves the folder),
under a key naming the CPU, torch's version and threads and the kernels' code, and the next load
with the same key reuses them instead of timing. This command reads that file (no engine, no
torch): per key, each entry's plan (rows: kernel, up to those rows), when it was measured and how
noisy its timing was (how far the two halves of its rounds disagreed; over 25 % is not kept).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from clients.cli.options import HelpFormatter

EXAMPLES = """examples:
  tandem plans                                  # each cached plan: kernel per batch bucket, when, how noisy
  tandem plans --json                           # the file itself
  tandem plans --clear                          # delete it: the next engine load times every kernel again
  TANDEM_CACHE_DIR=/srv/tandem-cache tandem plans   # the cache of engines started with that folder"""
MACHINE = "machine"  # each key's description (kernels/cpu/linear_plan_cache.py writes it)


def plan_cache_path() -> Path:
    """Where the engine keeps its plans (kernels/cpu/linear_plan_cache.py's cache_path, without torch)."""
    return Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem") / "linear_plans.json"


def add_parser(subcommands) -> argparse.ArgumentParser:
    parser = subcommands.add_parser("plans", help="show or clear the CPU kernel plans cached on this machine",
                                    description=__doc__.strip(), epilog=EXAMPLES, formatter_class=HelpFormatter)
    parser.add_argument("--clear", action="store_true",
                        help="delete the plan cache: the next engine load on this machine times its kernels again")
    parser.add_argument("--json", action="store_true", help="print the cache file as it is")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    path = plan_cache_path()
    if args.clear:
        return _clear(path)
    if not path.exists():
        print(f"no plan cache at {path} (no engine has measured plans here yet, or it was cleared)")
        return 0
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"tandem: the plan cache {path} cannot be read ({exc}); the next load times its kernels again "
              f"and rewrites it (or: tandem plans --clear)", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(cache, indent=1, sort_keys=True))
        return 0
    print(f"plan cache: {path}")
    if not isinstance(cache, dict):
        print("  (not a plan cache: the next load times its kernels again and rewrites it)")
        return 0
    for key, entries in cache.items():
        print("\n".join(_describe_key(key, entries)))
    return 0


def _clear(path: Path) -> int:
    try:
        path.unlink()
    except FileNotFoundError:
        print(f"no plan cache at {path}: nothing to clear")
        return 0
    except OSError as exc:
        print(f"tandem: could not delete the plan cache {path}: {exc}", file=sys.stderr)
        return 1
    print(f"deleted the plan cache {path}: the next engine load on this machine times its kernels again")
    return 0


def _describe_key(key: str, entries: object) -> list[str]:
    if not isinstance(entries, dict):
        return [f"key {key}: (unreadable; ignored by every load)"]
    machine = entries.get(MACHINE)
    if isinstance(machine, dict):
        about = (f"{machine.get('cpu', '?')}, torch {machine.get('torch', '?')}, "
                 f"{machine.get('threads', '?')} threads, kernels {machine.get('kernels', '?')}")
    else:
        about = "written before plans recorded their noise"
    lines = [f"key {key}: {about}"]
    for name, record in sorted(entries.items()):
        if name != MACHINE:
            lines += [f"  {name}", f"    {_describe_record(record)}"]
    return lines


def _describe_record(record: object) -> str:
    if not (isinstance(record, dict) and "answer" in record):
        return "older format, noise unknown: not used; the next load times it again"
    answer = record["answer"]
    if isinstance(answer, list) and all(isinstance(step, list) and len(step) == 2 for step in answer):
        answer = ", ".join(f"{rows}: {kernel}" for rows, kernel in answer)
    noise = record.get("noise")
    noise = f"{noise * 100:.1f} %" if isinstance(noise, (int, float)) else "?"
    return (f"{answer}  (measured {record.get('measured_at', '?')}, noise {noise}, "
            f"{record.get('retakes', '?')} retakes, one-thread check fired in {record.get('one_thread_takes', '?')})")
