"""Who hears of a kernel compiled or a kernel plan timed in this process: the engine's compile monitor
(engine_core/readiness/compile_monitor.py), which counts those that happen after the engine said it was ready.

Two sources, each reported to every watcher as (kind, what):
- "triton": Triton's JIT compiled a kernel for a new specialization (its post-compile hook; before Triton's
  `knobs`, `JITFunction.compiled_hook` or `cache_hook`). The hook is installed once per process, when
  kernels/triton is first imported (every Triton kernel of Tandem's is reached through it) or when a watcher
  arrives after someone else imported triton; it chains to the hook that was there before. triton is never
  imported here: a CPU engine that runs no Triton kernel never loads it.
- "plan": a CPU kernel race (kernels/cpu/linear_timing.py) timed candidates: a linear's plan, the float dtype,
  the one-op decode layers, LoRA's kernel per bucket.
"""

from __future__ import annotations

import sys
from typing import Callable

from kernels.cpu import linear_timing

Watcher = Callable[[str, str], None]  # (kind, what): kind "triton" or "plan"

_watchers: list[Watcher] = []
_triton_hooked = False


def watch_compiles(watcher: Watcher) -> None:
    """Tell `watcher` of every Triton compile and CPU plan timing in this process from now on."""
    _watchers.append(watcher)
    if "triton" in sys.modules:
        install_triton_hook()


def unwatch_compiles(watcher: Watcher) -> None:
    if watcher in _watchers:
        _watchers.remove(watcher)


def report(kind: str, what: str) -> None:
    for watcher in list(_watchers):
        watcher(kind, what)


def _report_race(candidates: list[str], rows: int) -> None:
    report("plan", f"{', '.join(candidates)} at {rows} rows")


linear_timing.race_watchers.append(_report_race)


def install_triton_hook() -> None:
    """Chain a reporting hook in front of Triton's JIT compile hook; once per process."""
    global _triton_hooked
    if _triton_hooked:
        return
    try:
        import triton
    except ImportError:
        return
    _triton_hooked = True
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs.runtime, "jit_post_compile_hook"):
        knobs.runtime.jit_post_compile_hook = _chained(knobs.runtime.jit_post_compile_hook)
        return
    from triton.runtime.jit import JITFunction

    name = "compiled_hook" if hasattr(JITFunction, "compiled_hook") else "cache_hook"
    setattr(JITFunction, name, _chained(getattr(JITFunction, name, None)))


def _chained(previous: Callable | None) -> Callable:
    def hook(*args, **kwargs):  # Triton calls it with keywords: key, repr, fn, compile, ...
        report("triton", describe_triton_compile(kwargs))
        return previous(*args, **kwargs) if previous is not None else None  # True from a cache hook skips a compile

    return hook


def describe_triton_compile(hook_kwargs: dict) -> str:
    """The kernel's name and the specialization it was compiled for, from a JIT hook's arguments."""
    fn = hook_kwargs.get("fn")
    name = getattr(fn, "name", None) or getattr(getattr(fn, "jit_function", None), "__name__", "a Triton kernel")
    key = hook_kwargs.get("key")
    return f"{name} (key {key})" if key is not None else str(name)
