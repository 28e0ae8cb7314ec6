"""Overlapped steps (vLLM's async scheduling): the host works on step N+1 while step N runs on the device.

One call of `step()`:
  1. schedule N+1; each request that step N samples counts as one token ahead (its placeholder);
  2. prepare N+1's inputs and queue its forward; a placeholder input is read from N's sampled ids on the
     device, so nothing waits for them;
  3. wait for N's sampled ids (copied back without blocking when N was queued) and update the scheduler:
     tokens appended, stops checked, outputs built;
  4. build N+1's sampling inputs (grammar masks, penalties, min_tokens: they need N's tokens) and queue
     its sampling;
  5. return N's outputs.
So the device runs N+1's forward while the host does 3 and 4, and N+1's sampling while the host returns
and schedules N+2: the host's work hides behind the device's whenever it is shorter.

Exact (docs/gpu.md#overlapped-steps, tests/engine_core/test_overlap.py): what step 4 builds needs N's tokens,
so it comes after 3; a request that stopped or was aborted while its next step was in flight has that
step's token dropped (the device runs steps in order, so its KV writes land before a new owner's); one
preempted by step 1 still gets N's token; a step with prompt logprobs is finished before the next is
scheduled (their positions are read from `num_computed_tokens`).

The device queue: on CUDA kernel launches are asynchronous already (`InlineQueue`); on CPU one worker
thread runs the forwards and samplings in order (`ThreadQueue`) while the main thread does the rest.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine_core.protocol import EngineCoreOutputs
from engine_core.runner.model_runner import ModelRunner
from engine_core.runner.step_output import StepOutput
from engine_core.scheduling.scheduler import Scheduler
from engine_core.types import ModelRunnerOutput, SchedulerOutput


class InlineQueue:
    """Runs the work at once: right for CUDA, whose kernel launches return before the kernels run."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - raised again by result(), where the caller waits
            future.set_exception(exc)
        return future

    def close(self) -> None:
        pass


class ThreadQueue(ThreadPoolExecutor):
    """One worker thread plays the device's stream: the work runs in submission order, off the caller's thread."""

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="tandem-device")

    def close(self) -> None:
        self.shutdown(wait=True)


@dataclass
class _InFlight:
    scheduler_output: SchedulerOutput
    step: StepOutput
    done: Future  # the step's sampling (and everything before it) has run
    finish_before_next_schedule: bool  # prompt logprobs


class OverlappedSteps:
    """EngineCore.step() with one step in flight; every call returns the previous step's outputs."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, queue: InlineQueue | ThreadQueue) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.queue = queue
        self._in_flight: _InFlight | None = None  # step() is called from one thread, the engine's
        self.mask_timing = None  # the last finished step's structured-output mask timing (metrics only)

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def step(self) -> EngineCoreOutputs:
        outputs = None
        if self._in_flight is not None and self._in_flight.finish_before_next_schedule:
            outputs = self._finish(self._in_flight)
        scheduler_output = self.scheduler.schedule()
        batch = self.runner.prepare_step(scheduler_output)
        hidden = None
        if batch is not None:
            for request in batch.sampling_requests:
                request.num_output_placeholders += 1
            hidden = self.queue.submit(self._forward, batch)
        if self._in_flight is not None:
            outputs = self._finish(self._in_flight)
        if batch is not None:
            masks = self.runner.start_masks(batch)  # the grammars have seen every token before this step's
            metadata = self.runner.sampling_metadata(batch)
            step = self.runner.new_step_output(batch)
            done = self.queue.submit(self._compute_outputs, step, hidden, metadata, masks)
            self._in_flight = _InFlight(scheduler_output, step, done, bool(batch.prompt_logprob_spans))
        if outputs is None:  # nothing finished this call: report aborts and stats as a synchronous step would
            nothing = SchedulerOutput(scheduled_requests=[], num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                                      block_ids={})
            outputs = self.scheduler.update_from_output(nothing, ModelRunnerOutput(sampled_token_ids={}))
        return outputs

    # inference_mode is per thread: entered here, on whichever thread runs the device work
    @torch.inference_mode()
    def _forward(self, batch) -> torch.Tensor:  # noqa: ANN001
        return self.runner.forward(batch)

    @torch.inference_mode()
    def _compute_outputs(self, step: StepOutput, hidden: Future, metadata, masks) -> None:  # noqa: ANN001
        self.runner.compute_outputs(step, hidden.result(), metadata, masks)

    def _finish(self, in_flight: _InFlight) -> EngineCoreOutputs:
        self._in_flight = None
        in_flight.done.result()  # raises what the device work raised
        runner_output = in_flight.step.result()
        for request in in_flight.step.requests:
            request.num_output_placeholders -= 1
        self.mask_timing = runner_output.mask_timing  # the finished step's, for its metrics (never sent)
        return self.scheduler.update_from_output(in_flight.scheduler_output, runner_output)

    def drain(self) -> None:
        """Wait for the step in flight and drop it: for when every request it ran has finished (sleep, close),
        so its outputs would all be dropped anyway."""
        if self._in_flight is not None:
            self._in_flight.done.exception()  # waits; an error there no longer matters to anyone
            for request in self._in_flight.step.requests:
                request.num_output_placeholders -= 1
            self._in_flight = None

    def close(self) -> None:
        """Drain and stop the device queue."""
        self.drain()
        self.queue.close()
