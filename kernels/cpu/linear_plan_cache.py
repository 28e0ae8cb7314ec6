"""Load-time kernel choices kept on disk, so only the first load on a machine pays for timing.

`kernels/cpu/linear.py` times each linear kernel on the model's shapes at load (a few seconds for
SmolLM2) and `dtype=auto` races bf16 against fp32. Both answers depend only on the machine, the
torch build, the thread count, the kernels' own code and the shapes, so they are written to
`~/.cache/tandem/linear_plans.json` (`TANDEM_CACHE_DIR` moves it) under a key naming all of
those (a changed kernel is timed again rather than judged by its old speed), and read back by
the next load with the same key. `TANDEM_REMEASURE=1` times again and overwrites (to see the
timings in the log).

Only answers timed on a quiet machine are kept (`keep`): a race that stayed noisy after its retakes
(kernels/cpu/linear_timing.py) serves its load and is timed again by the next. Each kept answer records
when it was measured and how noisy its races were, and each key a readable `machine` entry, for
`tandem plans` (clients/cli/plans_command.py reads this file without torch):

    {KEY: {"machine": {"cpu": ..., "torch": ..., "threads": ..., "kernels": ...},
           ENTRY: {"answer": ..., "measured_at": ISO time, "noise": ..., "retakes": ..., "one_thread_takes": ...}}}

An entry in the older format (the bare answer, with no record of its noise) is not trusted: it is
timed again and replaced.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path

import torch

from kernels.cpu.extension import build_name, cache_root, cpu_signature
from kernels.cpu.linear_timing import NOISE_LIMIT, Race

logger = logging.getLogger(__name__)

_ENV_THAT_CHANGES_KERNELS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                             "MKL_CBWR", "TANDEM_CPU_ARCH")
_KERNEL_SOURCES = ("linear.py", "int4_linear.py", "int8_linear.py", "int8_blockwise.py", "bf16_linear.py",
                   "onednn_linear.py")
MACHINE = "machine"  # each key's entry that describes it (never an answer's entry name)


def cache_path() -> Path:
    return cache_root() / "linear_plans.json"


def machine_key() -> str:
    """The CPU model and flags, torch's version and threads, the env that steers kernels, and the
    kernels' code (their Python modules and the C++ library's sources and flags)."""
    env = {name: os.environ.get(name, "") for name in _ENV_THAT_CHANGES_KERNELS}
    text = json.dumps([cpu_signature(), torch.__version__, torch.get_num_threads(), env, kernels_digest()],
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.cache
def kernels_digest() -> str:
    """A digest of the linear kernels' Python modules and the C++ library's build name."""
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256(build_name().encode())
    for name in _KERNEL_SOURCES:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:16]


def remeasure() -> bool:
    return os.environ.get("TANDEM_REMEASURE", "") not in ("", "0")


def machine_description() -> dict:
    """What `machine_key` digests, readable: the CPU's model, torch's version and threads, the kernels' digest."""
    cpu = cpu_signature().splitlines()[0]
    return {"cpu": cpu.split(":", 1)[-1].strip(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "kernels": kernels_digest()}


def lookup(entry: str) -> object | None:
    """The stored answer for `entry` on this machine, or None (absent, unreadable, in the older
    format without its noise, TANDEM_REMEASURE)."""
    if remeasure():
        return None
    try:
        stored = json.loads(cache_path().read_text())
        record = stored.get(machine_key(), {}).get(entry)
    except (OSError, ValueError, AttributeError):
        return None
    return record.get("answer") if isinstance(record, dict) else None


def keep(entry: str, answer: object, races: Iterable[Race]) -> bool:
    """Store `answer` for `entry` with when and how noisy its races were, unless one of them stayed
    noisy after its retakes: then it serves this load only, one line says so, and False is returned."""
    races = list(races)
    noise = max((race.noise for race in races), default=0.0)
    retakes = sum(race.retakes for race in races)
    one_thread_takes = sum(race.one_thread_takes for race in races)
    if any(race.noisy for race in races):
        logger.warning("%s: timed while the machine was busy (halves of rounds %.0f %% apart, limit %.0f %%; "
                       "%d of its races ranked on one thread; %d retakes): used for this load, not cached",
                       entry, noise * 100, NOISE_LIMIT * 100, sum(race.contended for race in races), retakes)
        return False
    store(entry, {"answer": answer, "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "noise": round(noise, 4), "retakes": retakes, "one_thread_takes": one_thread_takes})
    return True


def store(entry: str, record: dict) -> None:
    """Write `record` for `entry` on this machine; a cache that cannot be written is only logged."""
    path = cache_path()
    try:
        stored = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        stored = {}
    if not isinstance(stored, dict):
        stored = {}
    key = machine_key()
    if not isinstance(stored.get(key), dict):
        stored[key] = {}
    stored[key][MACHINE] = machine_description()
    stored[key][entry] = record
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stored, indent=1, sort_keys=True))
        tmp.replace(path)  # atomic: two engines loading at once never read half a file
    except OSError as exc:
        logger.warning("could not write the linear plan cache %s: %s", path, exc)
