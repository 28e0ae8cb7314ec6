"""One step's model-runner output as the device produces it.

The sampled token ids stay on the device, where the next step's inputs read them when steps
overlap (engine_core/overlap.py), and come back to the host through a copy that does not block:
on CUDA into pinned memory with an event, waited for only when the scheduler needs the ids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine_core.types import ModelRunnerOutput

if TYPE_CHECKING:
    from engine_core.runner.model_runner import _Batch


class StepOutput:
    def __init__(self, batch: _Batch) -> None:
        self.batch = batch
        self.requests = batch.sampling_requests  # batch order: row i sampled requests[i]'s token
        self.row_of = {request.request_id: row for row, request in enumerate(self.requests)}
        self.output = ModelRunnerOutput(sampled_token_ids={})  # filled in by the runner, but the tokens
        self.sampled: torch.Tensor | None = None  # [N] int64 on the device
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def set_sampled(self, sampled: torch.Tensor) -> None:
        self.sampled = sampled
        if sampled.device.type != "cuda":
            self._host = sampled
            return
        self._host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
        self._host.copy_(sampled, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def result(self) -> ModelRunnerOutput:
        """The output with the sampled ids on the host (waits for their copy)."""
        if self._copied is not None:
            self._copied.synchronize()
        if self._host is not None:
            self.output.sampled_token_ids = dict(zip(self.row_of, self._host.tolist()))
        return self.output
