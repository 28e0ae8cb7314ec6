"""Scheduler with a fake runner: budgets, preemption, prefix cache, aborts, stops (block accounting
under random operations: test_scheduler_properties.py)."""

import pytest

from engine_core.protocol import FinishReason
from engine_core.request import RequestStatus
from tests.engine_core.fake_runner import FakeRunner, run_step, run_to_completion
from tests.engine_core.scheduler_harness import BLOCK, all_blocks_free, check_accounting, make_request, make_scheduler


# ---- preemption ------------------------------------------------------------------
def eight_requests():
    shared = list(range(100, 108))
    return [
        make_request(f"r{i}", (shared if i % 2 else []) + [i, i + 1, i + 2], max_tokens=12,
                     prompt_logprobs=1 if i % 3 == 0 else None, logprobs=0)
        for i in range(8)
    ]


def collect(scheduler, runner):
    tokens, prompt_logprobs, finish, preemptions, num_cached = {}, {}, {}, 0, {}
    while scheduler.has_unfinished_requests():
        outputs = run_step(scheduler, runner)
        check_accounting(scheduler)
        preemptions += outputs.scheduler_stats.num_preemptions
        for out in outputs.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            num_cached.setdefault(out.request_id, set()).add(out.num_cached_tokens)
            assert (out.new_logprobs is not None) == bool(out.new_token_ids)
            for lp in out.new_prompt_logprobs or []:
                prompt_logprobs.setdefault(out.request_id, []).append(lp.token_ids[0])
            if out.finished:
                finish[out.request_id] = out.finish_reason
    assert all(len(values) == 1 for values in num_cached.values())  # fixed at the first schedule
    return tokens, prompt_logprobs, finish, preemptions


def test_preemption_gives_the_same_output_as_an_unconstrained_run():
    roomy = make_scheduler(num_blocks=100, max_model_len=24, budget=32)
    for request in eight_requests():
        roomy.add_request(request)
    expected, _, _, roomy_preemptions = collect(roomy, FakeRunner(BLOCK))
    assert roomy_preemptions == 0

    tight = make_scheduler(num_blocks=13, max_model_len=24, budget=32)  # room for about two
    requests = eight_requests()
    for request in requests:
        tight.add_request(request)
    tokens, prompt_logprobs, finish, preemptions = collect(tight, FakeRunner(BLOCK))

    assert preemptions > 0 and preemptions == sum(r.num_preemptions for r in requests)
    assert tokens == expected
    assert all(len(t) == 12 for t in tokens.values())
    assert set(finish.values()) == {FinishReason.LENGTH} and len(finish) == 8
    for request in requests:  # sent once each, in order, even across preemptions
        if request.sampling_params.prompt_logprobs is not None:
            assert prompt_logprobs[request.request_id] == request.prompt_token_ids[1:]
    assert all_blocks_free(tight)


def test_preempted_request_resumes_first():
    scheduler = make_scheduler(num_blocks=5, max_model_len=16, caching=False)
    runner = FakeRunner(BLOCK)
    scheduler.add_request(make_request("a", range(7), max_tokens=8))
    run_step(scheduler, runner)
    scheduler.add_request(make_request("b", range(20, 27), max_tokens=8))
    scheduler.add_request(make_request("c", range(40, 42), max_tokens=8))
    run_step(scheduler, runner)  # a decodes, b takes the last two blocks
    out = scheduler.schedule()
    assert out.preempted_request_ids == {"b"}  # fcfs: the tail goes
    assert [r.request_id for r in out.scheduled_requests] == ["a"]
    assert scheduler.waiting.peek().request_id == "b"
    assert scheduler.get_request("b").status == RequestStatus.PREEMPTED


def test_priority_policy_preempts_the_least_important_request():
    scheduler = make_scheduler(num_blocks=5, max_model_len=16, policy="priority", caching=False)
    runner = FakeRunner(BLOCK)
    scheduler.add_request(make_request("low", range(7), max_tokens=8, priority=1, arrival_time=1.0))
    run_step(scheduler, runner)
    scheduler.add_request(make_request("high", range(20, 27), max_tokens=8, priority=0, arrival_time=2.0))
    run_step(scheduler, runner)
    assert [r.request_id for r in scheduler.running] == ["low", "high"]
    out = scheduler.schedule()
    assert out.preempted_request_ids == {"low"}  # not the tail: the lowest priority
    assert [r.request_id for r in out.scheduled_requests] == ["high"]


def test_a_request_scheduled_earlier_in_the_pass_can_still_be_preempted():
    scheduler = make_scheduler(num_blocks=9, max_model_len=16, budget=4, policy="priority",
                               caching=False, block_size=2)
    runner = FakeRunner(2)
    arrivals = {0: (1, 1), 1: (3, 1), 2: (3, 0), 3: (2, 2), 4: (6, 0), 5: (5, 2)}  # step: (prompt len, priority)
    for step in range(6):
        if step in arrivals:
            length, priority = arrivals[step]
            scheduler.add_request(make_request(
                f"r{step}", range(10 * step, 10 * step + length), max_tokens=8, priority=priority,
                arrival_time=1.0 + step, block_size=2, max_model_len=16,
            ))
        run_step(scheduler, runner)
        check_accounting(scheduler)
    assert [r.request_id for r in scheduler.running] == ["r0", "r2", "r4"]
    out = scheduler.schedule()
    # r0's decode was scheduled first, then r0 was preempted to make room for r2's: it leaves the step
    # (a decode spends no budget, so nothing is given back) and r4 finishes its prompt.
    assert out.preempted_request_ids == {"r0"}
    assert out.num_scheduled_tokens == {"r2": 1, "r4": 2}
    scheduler.update_from_output(out, runner.execute(out))
    check_accounting(scheduler)


def test_priority_policy_admits_in_priority_then_arrival_order():
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    for request_id, priority, arrival in [("c", 2, 1.0), ("b2", 1, 3.0), ("a", 0, 4.0), ("b1", 1, 2.0)]:
        scheduler.add_request(
            make_request(request_id, [1, 2, 3], max_tokens=2, priority=priority, arrival_time=arrival)
        )
    order, runner = [], FakeRunner(BLOCK)
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        order += [r.request_id for r in out.scheduled_requests if r.request_id not in order]
        scheduler.update_from_output(out, runner.execute(out))
    assert order == ["a", "b1", "b2", "c"]


# ---- prefix cache ----------------------------------------------------------------
@pytest.mark.parametrize("caching", [True, False])
def test_shared_prefix_is_not_recomputed(caching):
    scheduler = make_scheduler(caching=caching)
    runner = FakeRunner(BLOCK)
    prefix = list(range(50, 50 + 3 * BLOCK))
    scheduler.add_request(make_request("first", prefix + [1, 2], max_tokens=1))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request("second", prefix + [7, 8, 9], max_tokens=1))
    out = scheduler.schedule()
    num_cached = 3 * BLOCK if caching else 0
    assert out.num_scheduled_tokens == {"second": 3 * BLOCK + 3 - num_cached}
    outputs = scheduler.update_from_output(out, runner.execute(out))
    assert outputs.outputs[0].num_cached_tokens == num_cached
    assert outputs.scheduler_stats.prefix_cache_hits == num_cached
    assert all_blocks_free(scheduler)


def test_stats_between_steps_do_not_take_the_steps_prefix_counts():
    """A utility call's make_stats() is a read: the step's own stats still carry its prefix-cache counts."""
    scheduler = make_scheduler()
    runner = FakeRunner(BLOCK)
    prefix = list(range(50, 50 + 2 * BLOCK))
    scheduler.add_request(make_request("first", prefix + [1], max_tokens=1))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request("second", prefix + [2], max_tokens=1))
    out = scheduler.schedule()
    assert scheduler.make_stats() == scheduler.make_stats()  # reading twice changes nothing
    step_stats = scheduler.update_from_output(out, runner.execute(out)).scheduler_stats
    assert (step_stats.prefix_cache_queries, step_stats.prefix_cache_hits) == (2 * BLOCK + 1, 2 * BLOCK)
    between = scheduler.make_stats()
    assert (between.prefix_cache_queries, between.prefix_cache_hits) == (2 * BLOCK + 1, 2 * BLOCK)


def test_a_request_waiting_for_blocks_is_one_prefix_lookup():
    """The hit rate counts admitted lookups: a request left waiting for KV blocks for several steps
    is looked up each step but counted once, when it is admitted."""
    scheduler = make_scheduler(num_blocks=9, max_model_len=8 * BLOCK)  # 8 usable blocks
    runner = FakeRunner(BLOCK)
    scheduler.add_request(make_request("big", range(7 * BLOCK), max_tokens=BLOCK))  # 7 blocks, then 8
    scheduler.add_request(make_request("late", range(1000, 1000 + 2 * BLOCK), max_tokens=1))
    queries = steps_waited = 0
    while scheduler.has_unfinished_requests():
        stats = run_step(scheduler, runner).scheduler_stats
        queries += stats.prefix_cache_queries
        steps_waited += len(scheduler.waiting) == 1  # "late", behind "big"
    assert steps_waited > 1  # it really waited
    assert queries == 7 * BLOCK + 2 * BLOCK


def test_reset_prefix_cache_waits_for_idle():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(10)))
    run_step(scheduler, FakeRunner(BLOCK))
    assert scheduler.reset_prefix_cache() is False
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert scheduler.reset_prefix_cache() is True


# ---- budgets -----------------------------------------------------------------------
def test_chunked_prefill_respects_the_token_budget():
    scheduler = make_scheduler(budget=8)
    runner = FakeRunner(BLOCK)
    scheduler.add_request(make_request("long", range(20), max_tokens=3))
    scheduler.add_request(make_request("short", range(30, 35), max_tokens=3))
    steps = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        assert out.total_num_scheduled_tokens <= 8
        steps.append(dict(out.num_scheduled_tokens))
        outputs = scheduler.update_from_output(out, runner.execute(out))
        assert outputs.scheduler_stats.num_scheduled_tokens == out.total_num_scheduled_tokens
        for o in outputs.outputs:  # tokens only once the prompt is fully computed
            assert scheduler.requests.get(o.request_id) is None or o.new_token_ids
    assert steps[:4] == [{"long": 8}, {"long": 8}, {"long": 4, "short": 4}, {"long": 1, "short": 1}]


def test_decodes_ride_on_top_of_the_prompt_budget():
    # Counted against the budget, a's decode would cut b's chunk to 7 and push b's last token, and
    # its first output, into the next step.
    scheduler = make_scheduler(budget=8)
    runner = FakeRunner(BLOCK)
    for request_id, first in (("a", 0), ("b", 20), ("c", 40)):
        scheduler.add_request(make_request(request_id, range(first, first + 8), max_tokens=4))
    steps = []
    for _ in range(3):
        out = scheduler.schedule()
        steps.append(dict(out.num_scheduled_tokens))
        outputs = scheduler.update_from_output(out, runner.execute(out))
        assert {o.request_id for o in outputs.outputs if o.new_token_ids} == set(steps[-1])  # each step's prompt done
    assert steps == [{"a": 8}, {"a": 1, "b": 8}, {"a": 1, "b": 1, "c": 8}]


def test_without_chunked_prefill_a_prompt_waits_for_room_in_the_budget():
    scheduler = make_scheduler(budget=16, max_model_len=16, chunked=False)
    scheduler.add_request(make_request("a", range(10)))
    scheduler.add_request(make_request("b", range(20, 30)))
    runner = FakeRunner(BLOCK)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 10}
    scheduler.update_from_output(out, runner.execute(out))
    assert scheduler.schedule().num_scheduled_tokens == {"a": 1, "b": 10}
    with pytest.raises(ValueError, match="chunked prefill"):
        make_scheduler(budget=8, max_model_len=16, chunked=False)


def test_max_num_seqs_is_respected():
    scheduler = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(BLOCK)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", [i, i + 1], max_tokens=3))
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        assert len(out.scheduled_requests) <= 2 and len(scheduler.running) <= 2
        scheduler.update_from_output(out, runner.execute(out))
    assert all_blocks_free(scheduler)


def test_too_small_kv_cache_and_too_long_prompt_are_rejected():
    with pytest.raises(ValueError, match="KV cache"):
        make_scheduler(num_blocks=4, max_model_len=16)
    scheduler = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(make_request("a", range(9)))


# ---- aborts --------------------------------------------------------------------
def test_abort_is_idempotent_at_any_moment():
    scheduler = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(BLOCK)
    for request_id in ("running", "between", "waiting"):
        scheduler.add_request(make_request(request_id, range(6)))
    run_step(scheduler, runner)
    assert scheduler.get_request("waiting").status == RequestStatus.WAITING

    scheduler.finish_requests(["waiting", "unknown"], RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests("waiting", RequestStatus.FINISHED_ABORTED)
    out = scheduler.schedule()
    assert out.finished_request_ids == {"waiting"}
    scheduler.finish_requests("between", RequestStatus.FINISHED_ABORTED)  # after schedule, before update
    outputs = scheduler.update_from_output(out, runner.execute(out))
    assert [o.request_id for o in outputs.outputs] == ["running"]
    assert outputs.finished_request_ids == {"waiting", "between"}

    scheduler.finish_requests(["running", "running"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.schedule().finished_request_ids == {"between", "running"}
    assert not scheduler.has_unfinished_requests() and scheduler.get_num_unfinished_requests() == 0
    assert all_blocks_free(scheduler)
    with pytest.raises(ValueError):
        scheduler.finish_requests("x", RequestStatus.RUNNING)


# ---- stops -----------------------------------------------------------------------
def generate(request, scheduler=None):
    scheduler = scheduler or make_scheduler()
    scheduler.add_request(request)
    runner = FakeRunner(BLOCK)
    finished = []
    while scheduler.has_unfinished_requests():
        finished += [o for o in run_step(scheduler, runner).outputs if o.finished]
    assert len(finished) == 1 and all_blocks_free(scheduler)
    return request.output_token_ids, finished[0]


def test_finish_reasons():
    prompt = [5, 6, 7]
    free_run, last = generate(make_request("a", prompt, max_tokens=6))
    assert len(free_run) == 6 and last.finish_reason == FinishReason.LENGTH

    stop_at = next(i for i, t in enumerate(free_run) if i > 0 and t not in free_run[:i])
    tokens, last = generate(make_request("b", prompt, max_tokens=6, stop_token_ids=[free_run[stop_at]]))
    assert tokens == free_run[:stop_at + 1]
    assert (last.finish_reason, last.stop_token_id) == (FinishReason.STOP, free_run[stop_at])

    tokens, last = generate(make_request("c", prompt, max_tokens=6, eos=[free_run[stop_at]]))
    assert tokens == free_run[:stop_at + 1]
    assert (last.finish_reason, last.stop_token_id) == (FinishReason.STOP, None)

    tokens, last = generate(make_request("d", prompt, max_tokens=None), make_scheduler(max_model_len=8))
    assert len(tokens) == 5 and last.finish_reason == FinishReason.LENGTH
