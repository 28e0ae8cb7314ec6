"""Closing the event loops that test harnesses make themselves."""

from __future__ import annotations

import asyncio


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel the loop's leftover tasks (e.g. RPC handlers a stopped grpc.aio server is still unwinding),
    let them finish, close its async generators, then close it: what asyncio.run does on the way out.

    Without this, tasks left pending are destroyed later by the garbage collector, inside whatever test
    runs then, and grpc logs "Task was destroyed but it is pending" / GeneratorExit to that test's stderr.
    The loop must not be running (a harness thread running it has been stopped and joined).
    """
    try:
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        if tasks:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()
