"""The scheduler's waiting queues: first come first served, or by priority."""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from engine_core.request import Request


class FcfsQueue:
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def push_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)


class PriorityQueue:
    """Lowest (priority, arrival_time) first, ties in insertion order.

    A preempted request goes back to its place: its key is its own, not its queue time.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, request: Request) -> None:
        entry = (request.priority, request.arrival_time, next(self._counter), request)
        heapq.heappush(self._heap, entry)

    push_front = push

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)
