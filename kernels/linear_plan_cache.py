"""Load-time kernel choices kept on disk, so only the first load on a machine pays for timing.

`kernels/cpu_linear.py` times each linear kernel on the model's shapes at load (a few seconds for
SmolLM2) and `dtype=auto` races bf16 against fp32. Both answers depend only on the machine, the
torch build, the thread count, the kernels' own code and the shapes, so they are written to
`~/.cache/tandem/linear_plans.json` (`TANDEM_CACHE_DIR` moves it) under a key naming all of
those (a changed kernel is timed again rather than judged by its old speed), and read back by
the next load with the same key. `TANDEM_REMEASURE=1` times again and overwrites (after a noisy
first load, or to see the timings in the log).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from kernels.cpu_extension import build_name, cache_root, cpu_signature

logger = logging.getLogger(__name__)

_ENV_THAT_CHANGES_KERNELS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                             "MKL_CBWR", "TANDEM_CPU_ARCH")
_KERNEL_SOURCES = ("cpu_linear.py", "int4_linear.py", "int8_linear.py", "onednn_linear.py")


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


def lookup(entry: str) -> object | None:
    """The stored answer for `entry` on this machine, or None (absent, unreadable, TANDEM_REMEASURE)."""
    if remeasure():
        return None
    try:
        stored = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return None
    return stored.get(machine_key(), {}).get(entry)


def store(entry: str, answer: object) -> None:
    """Record `answer` for `entry` on this machine; a cache that cannot be written is only logged."""
    path = cache_path()
    try:
        stored = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        stored = {}
    stored.setdefault(machine_key(), {})[entry] = answer
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stored, indent=1, sort_keys=True))
        tmp.replace(path)  # atomic: two engines loading at once never read half a file
    except OSError as exc:
        logger.warning("could not write the linear plan cache %s: %s", path, exc)
