"""The scheduler's LoRA rule: no step holds more than `max_loras` distinct adapters, and no request
waits for a slot forever.

A waiting request whose adapter would be one too many is passed over for the requests behind it
(those of adapters already running, or of the base model, keep the batch full), and goes back to
the front of the queue. Once it has been passed over `max_wait_steps` times it holds the queue:
nothing behind it is admitted, the running adapters' requests finish (each has a length limit),
a slot frees, and it runs. The wait is so bounded by `max_wait_steps` plus the longest running
request's remaining tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine_core.request import Request, RequestStatus


class LoraAdmission:
    def __init__(self, max_loras: int, max_wait_steps: int) -> None:
        self.max_loras = max_loras
        self.max_wait_steps = max_wait_steps
        self.active: set[str] = set()
        self._passed_over: dict[str, int] = {}  # request id -> steps it was passed over

    def start_step(self, running: list[Request]) -> None:
        """The adapters already in this step: those of the running requests."""
        self.active = {r.lora_name for r in running if r.lora_name is not None}

    def admits(self, request: Request) -> bool:
        name = request.lora_name
        return name is None or name in self.active or len(self.active) < self.max_loras

    def admit(self, request: Request) -> None:
        if request.lora_name is not None:
            self.active.add(request.lora_name)
        self._passed_over.pop(request.request_id, None)

    def pass_over(self, request: Request) -> bool:
        """Count one step passed over; True while requests behind it may still go first."""
        count = self._passed_over.get(request.request_id, 0) + 1
        self._passed_over[request.request_id] = count
        return count <= self.max_wait_steps

    def forget(self, request_id: str) -> None:
        self._passed_over.pop(request_id, None)

    @staticmethod
    def request_counts(requests: Iterable[Request]) -> tuple[dict[str, int], dict[str, int]]:
        """Requests per adapter, (running, waiting), for the stats (vLLM's lora_requests_info)."""
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for request in requests:
            if request.lora_name is not None:
                counts = running if request.status == RequestStatus.RUNNING else waiting
                counts[request.lora_name] = counts.get(request.lora_name, 0) + 1
        return running, waiting
