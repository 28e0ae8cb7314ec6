"""Counts the kernel compiles and CPU plan timings that happen after the engine said it was ready. None should:
the warm-up (engine_core/readiness/warm_up.py) ran every shape a step meets before health said SERVING, so a
compile after it is a step that waited for a compiler (docs/gpu.md#ready-means-warm).

What it hears (kernels.watch_compiles): Triton's JIT compiles, the CPU kernel races (linear plans, the float dtype,
the one-op decode layers, LoRA buckets), and torch.compile's compiles (dynamo's on_compile_start) when
torch._dynamo is loaded. The engine never compiles through dynamo itself, and importing it only to listen costs
start-up time, so an engine of a process that never loaded it has nothing to hear from it.

Compiles are the process's: while any engine of this process is starting (`CompileMonitor.starting()`: building
its parts, warming up), what compiles belongs to that start and no monitor counts it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import weakref
from collections.abc import Iterator

from kernels import watch_compiles

logger = logging.getLogger(__name__)

KEPT = 32  # compiles after ready whose names are kept (the count goes on)


class CompileMonitor:
    """One per engine: `mark_ready()` once it serves; then `compiles_after_ready` counts, `compiled_after_ready`
    names the first KEPT ("kind: what"), and the first one logs a WARNING line."""

    _starting = 0  # engines of this process between the start of their build and their ready
    _lock = threading.Lock()

    def __init__(self, name: str = "engine") -> None:
        """`name`: the engine's, in the warning line (several engines may share a process)."""
        self.name = name
        self.ready = False
        self.compiles_before_ready = 0  # at start-up and in the warm-up: expected
        self.compiles_after_ready = 0
        self.compiled_after_ready: list[str] = []
        _listen(self)

    @classmethod
    @contextlib.contextmanager
    def starting(cls) -> Iterator[None]:
        """While an engine of this process starts: its compiles are its own, not another engine's after ready."""
        with cls._lock:
            cls._starting += 1
        try:
            yield
        finally:
            with cls._lock:
                cls._starting -= 1

    def mark_ready(self) -> None:
        """From now on every compile counts (and the first one is logged)."""
        _listen_to_dynamo()  # loaded since start-up, by whatever loaded it
        self.ready = True

    def record(self, kind: str, what: str) -> None:
        """One compile (`kind`: triton, plan or torch) of `what`, a kernel and its specialization."""
        if not self.ready or CompileMonitor._starting:
            self.compiles_before_ready += 1
            return
        self.compiles_after_ready += 1
        if len(self.compiled_after_ready) < KEPT:
            self.compiled_after_ready.append(f"{kind}: {what}")
        if self.compiles_after_ready == 1:
            logger.warning("%s: %s compiled after the engine said it was ready (%s): a step waited for it; the "
                           "warm-up missed this shape (docs/gpu.md#ready-means-warm). Later ones are only counted "
                           "(tandem:compiles_after_ready)", self.name, kind, what)


# ---- the process's listeners: one of each, telling every live monitor -----------------------------------
_monitors: weakref.WeakSet[CompileMonitor] = weakref.WeakSet()
_listening = False
_dynamo_listening = False


def _listen(monitor: CompileMonitor) -> None:
    global _listening
    _monitors.add(monitor)
    if not _listening:
        _listening = True
        watch_compiles(_tell_monitors)
    _listen_to_dynamo()


def _tell_monitors(kind: str, what: str) -> None:
    for monitor in list(_monitors):
        monitor.record(kind, what)


def _listen_to_dynamo() -> None:
    global _dynamo_listening
    if _dynamo_listening or "torch._dynamo" not in sys.modules:
        return
    try:
        from torch._dynamo.callback import on_compile_start
    except ImportError:  # a torch without compile callbacks
        return
    _dynamo_listening = True
    on_compile_start(lambda args: _tell_monitors("torch", f"torch.compile frame {args.compile_id}"))
