"""How long tests wait for a state before they fail, and the one async poll they wait with.

A wait ends the moment its state arrives, so its bound costs nothing when the test passes: it only turns a
hang into a failure. The bounds are therefore generous, sized for a loaded 2-core machine (make test-shake
runs these tests with every core kept busy, where starting an engine subprocess that builds the C++ kernels
took over 60 s), never for how fast a quiet machine is.
"""

from __future__ import annotations

import asyncio

STATE_TIMEOUT_S = 120.0  # a state a running server reaches (connected, paused, a block cached, ...)
STARTUP_TIMEOUT_S = 300.0  # a server process loading its model until health says SERVING


async def wait_until(predicate, timeout_s: float = STATE_TIMEOUT_S, what: str = "a condition") -> None:
    """Poll `predicate()` until it is true; fail the test after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)
