"""Hold an in-process engine's steps until the test's next input has arrived, so a request the test started is
still in flight when that input is handled, however fast this machine steps (no sleep decides it).

The busy loop (services/engine/busy_loop.py) handles its queued inputs after every step. Inside
`steps_held_until`, a step waits once every request in the engine has its first token, until the awaited
input (a utility call, an abort) is queued; a step still runs when some other input is queued, so each input
the test sends meanwhile costs at most one token of progress. Requests of many tokens (ignore_eos, a long
max_tokens) therefore cannot finish first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from engine_core.protocol import UtilityCall
from services.engine.busy_loop_items import Abort

HOLD_TIMEOUT_S = 30.0  # an input that never comes fails the test instead of hanging it
_POLL_S = 0.005  # how often a held step looks for other queued inputs


def utility_call(kind: type) -> Callable[[object], bool]:
    """A control call of class `kind` (PauseCall, SleepCall, ...)."""
    return lambda item: isinstance(item, UtilityCall) and isinstance(item.call, kind)


def abort(item) -> bool:
    return isinstance(item, Abort)


@contextmanager
def steps_held_until(busy_loop, arrives: Callable[[object], bool]) -> Iterator[threading.Event]:
    """Within the block, hold the busy loop's steps as the module says until an input with `arrives(input)`
    is queued; yields the event set when it is. Steps run freely again after the block."""
    engine, submit = busy_loop.engine, busy_loop.submit
    step = engine.step
    arrived = threading.Event()

    def watching_submit(connection: int, item) -> None:
        submit(connection, item)
        if arrives(item):
            arrived.set()

    def everyone_started() -> bool:
        return all(request.num_output_tokens > 0 for request in engine.scheduler.requests.values())

    def held_step():
        waited = 0.0
        while everyone_started() and busy_loop._inputs.empty() and not arrived.wait(_POLL_S):
            waited += _POLL_S
            if waited > HOLD_TIMEOUT_S:
                raise TimeoutError(f"the input the test awaited did not reach the engine in {HOLD_TIMEOUT_S} s")
        return step()

    busy_loop.submit, engine.step = watching_submit, held_step
    try:
        yield arrived
    finally:
        arrived.set()  # a step waiting now goes on
        del busy_loop.submit, engine.step  # the classes' methods again
