"""The scheduler's per-request events (vLLM v1's EngineCoreEvent) and step token counts."""

from __future__ import annotations

from engine_core.config import CacheConfig, SchedulerConfig
from engine_core.protocol import EngineCoreEventType, SamplingParams
from engine_core.request import Request
from engine_core.scheduling.scheduler import Scheduler
from tests.engine_core.fake_runner import FakeRunner, run_step

BLOCK = 4
QUEUED, SCHEDULED, PREEMPTED = EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED, EngineCoreEventType.PREEMPTED


def make_scheduler(num_blocks: int, log_stats: bool) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16),
                     CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
                     num_blocks=num_blocks, max_model_len=16, log_stats=log_stats)


def make_request(request_id: str, token_ids, max_tokens: int = 8) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=max_tokens), block_size=BLOCK)


def run(scheduler: Scheduler, runner: FakeRunner, events: dict, tokens: dict) -> list:
    step = run_step(scheduler, runner)
    for output in step.outputs:
        events.setdefault(output.request_id, []).extend(output.events or [])
        tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return step


def test_events_arrive_with_outputs_in_order_including_a_preemption():
    scheduler, runner = make_scheduler(num_blocks=5, log_stats=True), FakeRunner(BLOCK)
    events: dict = {}
    tokens: dict = {}
    scheduler.add_request(make_request("a", range(7)))
    run(scheduler, runner, events, tokens)
    scheduler.add_request(make_request("b", range(20, 27)))
    run(scheduler, runner, events, tokens)  # b takes the last two blocks
    while scheduler.has_unfinished_requests():  # a needs b's blocks: b is preempted, then resumes
        run(scheduler, runner, events, tokens)

    assert [e.type for e in events["a"]] == [QUEUED, SCHEDULED]
    assert [e.type for e in events["b"]] == [QUEUED, SCHEDULED, PREEMPTED, SCHEDULED]
    for request_events in events.values():
        stamps = [e.timestamp for e in request_events]
        assert stamps == sorted(stamps) and stamps[0] > 0
    assert len(tokens["a"]) == len(tokens["b"]) == 8


def test_step_stats_count_prompt_and_generated_tokens():
    scheduler, runner = make_scheduler(num_blocks=64, log_stats=False), FakeRunner(BLOCK)
    scheduler.add_request(make_request("a", range(7), max_tokens=3))
    scheduler.add_request(make_request("b", range(20, 25), max_tokens=3))
    prompt = generated = 0
    while scheduler.has_unfinished_requests():
        step = run_step(scheduler, runner)
        prompt += step.scheduler_stats.num_prompt_tokens
        generated += step.scheduler_stats.num_generation_tokens
        assert all(output.events is None for output in step.outputs)  # off: nothing recorded
    assert (prompt, generated) == (7 + 5, 3 + 3)
