"""torch.profiler around engine steps, written as a chrome trace into a folder on stop."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


class Profiler:
    """START_PROFILE / STOP_PROFILE: one profile at a time, on the thread that steps the engine."""

    def __init__(self, device: torch.device) -> None:
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile: torch.profiler.profile | None = None
        self._folder = Path(".")

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self, folder: str) -> None:
        self._folder = Path(folder)
        self._folder.mkdir(parents=True, exist_ok=True)
        self._profile = torch.profiler.profile(activities=self.activities)
        self._profile.start()

    def stop(self) -> Path | None:
        """Stop a running profile; returns the trace file written (None when none was running)."""
        if self._profile is None:
            return None
        profile, self._profile = self._profile, None
        profile.stop()
        path = self._folder / f"engine-core-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**9}.trace.json"
        profile.export_chrome_trace(str(path))
        if not path.exists():  # torch logs the failure instead of raising it
            raise OSError(f"torch could not write the trace {str(path)!r}")
        logger.info("wrote a profile to %s", path)
        return path
