"""Scheduler block accounting under random sequences of adds, steps and aborts (hypothesis)."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_core.request import RequestStatus
from tests.engine_core.fake_runner import FakeRunner, run_to_completion
from tests.engine_core.scheduler_harness import all_blocks_free, check_accounting, make_request, make_scheduler


def check_step(scheduler, out, budget):
    """Prompt chunks within the budget; every running decode in the step (decodes ride on top)."""
    decodes = {r.request_id for r in out.scheduled_requests
               if out.num_scheduled_tokens[r.request_id] == 1 and r.num_computed_tokens == r.num_tokens}
    assert sum(n for request_id, n in out.num_scheduled_tokens.items() if request_id not in decodes) <= budget
    if not out.preempted_request_ids:
        assert all(r.request_id in out.num_scheduled_tokens for r in scheduler.running)


# ---- property: block accounting ------------------------------------------------------
PREFIXES = [list(range(k * 30, k * 30 + 16)) for k in range(3)]
add_op = st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 14), st.integers(1, 4), st.integers(1, 10),
                   st.integers(0, 2))
abort_op = st.tuples(st.just("abort"), st.integers(0, 30))
step_op = st.tuples(st.just("step"), st.integers(1, 6))
abort_between_op = st.tuples(st.just("abort_between"), st.integers(0, 30))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(st.one_of(add_op, abort_op, step_op, abort_between_op), max_size=30),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
    drain_by_abort=st.booleans(),
)
def test_block_accounting_survives_any_sequence(ops, policy, caching, drain_by_abort):
    block_size, max_model_len = 2, 20
    scheduler = make_scheduler(num_blocks=11, max_model_len=max_model_len, budget=6, max_num_seqs=4,
                               policy=policy, caching=caching, block_size=block_size)
    runner = FakeRunner(block_size)
    ids = []
    for op in ops:
        if op[0] == "add":
            _, prefix, prefix_len, suffix_len, max_tokens, priority = op
            request_id = f"r{len(ids)}"
            prompt = PREFIXES[prefix][:prefix_len] + [200 + len(ids)] * suffix_len
            scheduler.add_request(make_request(request_id, prompt, max_tokens=max_tokens, priority=priority,
                                               block_size=block_size, max_model_len=max_model_len))
            ids.append(request_id)
        elif op[0] == "abort" and ids:
            scheduler.finish_requests(ids[op[1] % len(ids)], RequestStatus.FINISHED_ABORTED)
        elif op[0] == "step":
            for _ in range(op[1]):
                out = scheduler.schedule()
                check_step(scheduler, out, budget=6)
                scheduler.update_from_output(out, runner.execute(out))
        elif op[0] == "abort_between" and ids:
            out = scheduler.schedule()
            scheduler.finish_requests(ids[op[1] % len(ids)], RequestStatus.FINISHED_ABORTED)
            check_accounting(scheduler)
            scheduler.update_from_output(out, runner.execute(out))
        check_accounting(scheduler)

    if drain_by_abort:
        scheduler.finish_requests(list(ids), RequestStatus.FINISHED_ABORTED)
    else:
        run_to_completion(scheduler, runner, max_steps=500)
    check_accounting(scheduler)
    assert all_blocks_free(scheduler)
