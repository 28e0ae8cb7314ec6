"""torch.profiler around engine steps, written as a chrome trace into a folder on stop."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


class Profiler:
    """One profile at a time, started and stopped on the thread that steps the engine.

    Every refusal is a ValueError with an actionable message: a profile already running (or
    none to stop), no folder given, a folder that cannot be made or a trace that cannot be written.
    """

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
        if self._profile is not None:
            raise ValueError("a profile is already running; stop it first")
        if not folder:
            raise ValueError("a profile needs a folder to write its trace into")
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
        except (OSError, ValueError) as exc:  # e.g. a file in the way, no permission, a NUL in the name
            raise ValueError(f"cannot write a profile into {folder!r}: {exc}") from None
        self._folder = Path(folder)
        self._profile = torch.profiler.profile(activities=self.activities)
        self._profile.start()

    def stop(self) -> Path:
        """Stop the running profile; returns the trace file written."""
        if self._profile is None:
            raise ValueError("no profile is running; start one first")
        profile, self._profile = self._profile, None
        profile.stop()
        path = self._folder / f"engine-core-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**9}.trace.json"
        try:
            profile.export_chrome_trace(str(path))
        except (OSError, ValueError) as exc:
            raise ValueError(f"the profile could not be written: {exc}") from None
        if not path.exists():  # torch logs the failure instead of raising it (e.g. the folder was removed)
            raise ValueError(f"the profile could not be written: torch could not write {str(path)!r}")
        logger.info("wrote a profile to %s", path)
        return path
