"""A model runner without a model, for scheduler tests.

It keeps a fake KV cache (one token id per slot) so that every step checks the
scheduler's block tables: tokens computed this step are written to their slots,
then every position the request attends to must hold the request's own token
(a stale prefix-cache hit, a block shared by mistake or a lost block shows up
here). The next token is a pure function of the sequence, so recomputing after a
preemption produces the same output.
"""

from __future__ import annotations

from engine_core.protocol import EngineCoreOutputs, TokenLogprobs
from engine_core.request import Request
from engine_core.scheduling.scheduler import Scheduler
from engine_core.types import ModelRunnerOutput, SchedulerOutput


def next_token(token_ids: list[int], vocab_size: int) -> int:
    """Deterministic 'model': the next token depends on the whole sequence."""
    return (31 * token_ids[-1] + 7 * len(token_ids) + sum(token_ids)) % vocab_size


class FakeRunner:
    def __init__(self, block_size: int, vocab_size: int = 97) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.kv: dict[tuple[int, int], int] = {}  # (block id, slot) -> token id written there
        self.num_steps = 0

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        chunks = []
        for request in scheduler_output.scheduled_requests:
            num_new = scheduler_output.num_scheduled_tokens[request.request_id]
            end = request.num_computed_tokens  # already advanced by schedule()
            chunks.append((request, scheduler_output.block_ids[request.request_id], end - num_new, end))

        # Like each attention layer: write the whole batch's KV, then read.
        for request, block_ids, start, end in chunks:
            for pos in range(start, end):
                self.kv[self._slot(block_ids, pos)] = request.all_token_ids[pos]
        output = ModelRunnerOutput(sampled_token_ids={})
        for request, block_ids, start, end in chunks:
            self._check_kv(request, block_ids, end)
            self._add_prompt_logprobs(output, request, start, end)
            if end >= request.num_tokens:
                token_id = next_token(request.all_token_ids, self.vocab_size)
                output.sampled_token_ids[request.request_id] = token_id
                if request.sampling_params.logprobs is not None:
                    output.logprobs[request.request_id] = TokenLogprobs([token_id], [-1.0], 1)
        self.num_steps += 1
        return output

    def _slot(self, block_ids: list[int], pos: int) -> tuple[int, int]:
        block_id = block_ids[pos // self.block_size]
        assert block_id != 0, "the null block was handed out"
        return block_id, pos % self.block_size

    def _check_kv(self, request: Request, block_ids: list[int], end: int) -> None:
        for pos in range(end):
            found = self.kv.get(self._slot(block_ids, pos))
            assert found == request.all_token_ids[pos], (
                f"{request.request_id}: KV slot of position {pos} holds {found}, "
                f"expected {request.all_token_ids[pos]}"
            )

    def _add_prompt_logprobs(self, output: ModelRunnerOutput, request: Request, start: int, end: int) -> None:
        if request.sampling_params.prompt_logprobs is None:
            return
        # Position pos gives the logprob of prompt token pos + 1.
        positions = range(start, min(end, request.num_prompt_tokens - 1))
        if positions:
            output.prompt_logprobs[request.request_id] = [
                TokenLogprobs([request.prompt_token_ids[pos + 1]], [-float(pos + 1)], 1) for pos in positions
            ]


def run_step(scheduler: Scheduler, runner: FakeRunner) -> EngineCoreOutputs:
    """One engine step: schedule, execute, update."""
    scheduler_output = scheduler.schedule()
    return scheduler.update_from_output(scheduler_output, runner.execute(scheduler_output))


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> dict[str, list[int]]:
    """Step until no request is left; returns each request's output token ids."""
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        for out in run_step(scheduler, runner).outputs:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")
