"""Engine server test harness: prompts, an offline LLMEngine to compare with, block and health checks
(tests/services/test_engine_server*.py)."""

from __future__ import annotations

import random
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LONG = dict(temperature=0.0, ignore_eos=True)  # runs to max_model_len: ~90 steps


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 256) for _ in range(rng.randint(1, 20))] for _ in range(n)]


def assert_all_blocks_free(stream) -> None:
    stats = stream.stats()
    assert stats.num_free_blocks == stats.num_total_blocks > 0
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0


def health_status(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def wait_health(target: str, status: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while health_status(target) != status:
        assert time.monotonic() < deadline, f"health never became {status}"
        time.sleep(0.05)
