"""EngineCore's utility calls: what its owner (the busy loop, the offline LLMEngine) asks between steps, never
during one: the prefix cache's reset, stats and KV-cache state, sleep and wake-up, and profiling. Kept apart so the
engine's step files stay step code: EngineCore inherits these methods, as it does its LoRA calls
(engine_core/lora/engine_calls.py), and its constructor sets the fields they read."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine_core.protocol import KVCacheEvents, SchedulerStats
from engine_core.readiness import CompileMonitor, WarmUpReport, runs_triton_interpreted, warm_up

if TYPE_CHECKING:
    from engine_core.config import EngineConfig
    from engine_core.overlap import OverlappedSteps
    from engine_core.profiler import Profiler
    from engine_core.runner.model_runner import ModelRunner
    from engine_core.scheduling.block_pool import BlockPool
    from engine_core.scheduling.scheduler import Scheduler


class EngineUtilityCalls:
    config: EngineConfig
    compile_monitor: CompileMonitor
    scheduler: Scheduler
    runner: ModelRunner
    model: torch.nn.Module
    overlapped: OverlappedSteps | None
    asleep: bool
    _block_pool: BlockPool
    _profiler: Profiler

    # ---- ready to serve ---------------------------------------------------------------
    def ready_to_serve(self) -> WarmUpReport | None:
        """Called by the engine's owner before it says it serves: the warm-up (unless config.device.warm_up is
        off; engine_core/readiness/warm_up.py), then every kernel compile counts as one after ready."""
        report = None
        if self.config.device.warm_up and not runs_triton_interpreted(self.attention.name):
            report = self.warm_up()
        self.compile_monitor.mark_ready()
        return report

    def warm_up(self) -> WarmUpReport:
        """Run every batch and token shape a step will meet, leaving no trace (engine_core/readiness/warm_up.py)."""
        with CompileMonitor.starting():
            return warm_up(self)

    # ---- prefix cache, stats and KV-cache state --------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def take_kv_events(self) -> KVCacheEvents | None:
        """Prefix-cache changes not yet in a step's outputs (a reset between steps); None when none."""
        return self._block_pool.take_events()

    def kv_cache_snapshot(self) -> KVCacheEvents:
        """Every prefix-cache hash held now (cleared=True: it replaces what a reader knew)."""
        return self._block_pool.snapshot()

    # ---- sleep and profiling --------------------------------------------------------
    def sleep(self) -> None:
        """Free the KV cache (on CUDA also move the weights to CPU) until `wake_up()`; idempotent.
        Raises ValueError while requests are in flight: their KV blocks would be lost."""
        if self.asleep:
            return
        if self.overlapped is not None and not self.scheduler.has_unfinished_requests():
            self.overlapped.drain()  # a step of finished requests may still be in flight
        if self.has_unfinished_requests():
            raise ValueError(f"{self.get_num_unfinished_requests()} requests are in flight; "
                             "abort them (or let them finish) before sleeping")
        self.runner.free_kv_cache()
        if self.runner.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self.asleep = True

    def wake_up(self) -> None:
        """Allocate the KV cache again (and move the weights back); the prefix cache starts empty."""
        if not self.asleep:
            return
        if self.runner.device.type == "cuda":
            self.model.to(self.runner.device)
        self.runner.allocate_kv_cache()
        self.reset_prefix_cache()  # the cached blocks' contents are gone
        self.asleep = False

    def start_profile(self, folder: str) -> None:
        """Profile the steps from now on (torch.profiler); ValueError when it cannot (engine_core/profiler.py)."""
        self._profiler.start(folder)

    def stop_profile(self) -> Path:
        """Write the running profile into its folder as a chrome trace; returns the file."""
        return self._profiler.stop()
