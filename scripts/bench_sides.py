"""Tandem's three sides in `make bench` (scripts/bench_engine.py), one round of one workload at a time.

bench_engine.py alternates them round by round (in-process, transport, gRPC, in-process, ...) so a
machine whose speed drifts during the run (these shared hosts do, by 1.5x within minutes) weighs on
every side alike; `combine` pools a side's rounds. One EngineCore serves the first two sides (the
LLMEngine's, each transport round wrapping it in a fresh busy loop); the gRPC stack stays up.

  in-process   LLMEngine stepped on this process's main thread (no transport, no frontend)
  transport    the frontend core (AsyncLLM) over InProcessEngineClient, the engine stepping on the main
               thread (run_beside_engine): the gRPC path less its two gRPC hops and two processes
  grpc         `tandem serve`'s two processes (engine + frontend) over loopback, the public API

The load generator (this process) stands in for clients on other machines: while it drives the gRPC
stack its threads run at nice 19 (`low_priority_client`), leaving the cores to the server, as the
frontend under `tandem serve` does. (llama-server's client stays at normal priority, which it does
as well or better with: bench_peers.py.) The transport side's frontend and client share one
thread beside the engine (run_beside_engine), run at nice 19 as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import statistics
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Callable

from clients.async_client import AsyncTandemClient
from clients.bench.backends import TandemBackend
from clients.bench.loadgen import closed_loop
from clients.bench.metrics import RequestRecord, summarize
from clients.bench.prompts import BenchPrompt
from clients.local_stack import LocalStack, free_port
from scripts.bench_peers import cpu_seconds, steal_seconds
from services.cpu_priority import set_cpu_priority

STEP_METRIC = "tandem:engine_step_duration_seconds"
WARM_UP_TOKENS = 8
WARM_UP = [BenchPrompt(None, (1, 2, 3, 4), WARM_UP_TOKENS)]  # a connection's first request (bench_engine: each point)
PROCESSES = ("engine", "frontend", "client")
_request_ids = itertools.count()


@dataclass
class Round:
    records: list[RequestRecord]
    wall_s: float
    step_s: float = 0.0  # the engine's steps, in seconds, all together
    steps: int = 0
    decode_steps_s: list[float] = field(default_factory=list)  # pure-decode steps with every stream running
    cpu_s: dict[str, float] = field(default_factory=dict)  # gRPC: CPU seconds per process
    steal_s: float = 0.0  # CPU seconds the hypervisor took for other guests meanwhile (/proc/stat)

    @property
    def step_ms(self) -> float:
        return 1000 * self.step_s / max(self.steps, 1)


def with_steal(run_round: Callable[..., Round], *args) -> Round:
    """The round `run_round(*args)` returns, with the steal time over it."""
    before = steal_seconds()
    one = run_round(*args)
    one.steal_s = steal_seconds() - before
    return one


def combine(rounds: list[Round]) -> dict:
    """One side's rounds pooled: the summary of all its requests over the sum of the rounds' walls."""
    summary = summarize([r for one in rounds for r in one.records], sum(one.wall_s for one in rounds))
    summary["rounds_tok_per_s"] = [round(summarize(one.records, one.wall_s)["output_token_throughput"], 1)
                                   for one in rounds]
    summary["rounds_step_ms"] = [round(one.step_ms, 2) for one in rounds]
    summary["steal_percent"] = round(100 * sum(one.steal_s for one in rounds)
                                     / max(os.cpu_count() * sum(one.wall_s for one in rounds), 1e-9), 1)
    summary["step_mean_ms"] = 1000 * sum(one.step_s for one in rounds) / max(sum(one.steps for one in rounds), 1)
    decode = [s for one in rounds for s in one.decode_steps_s]
    summary["decode_step_ms"] = 1000 * statistics.median(decode) if decode else None
    if rounds[0].cpu_s:
        summary["cpu_ms_per_token"] = {  # the processes share the cores: what each took
            name: round(1000 * sum(one.cpu_s[name] for one in rounds) / max(summary["output_tokens"], 1), 3)
            for name in PROCESSES}
    return summary


class TimedSteps:
    """Wraps `core.step` while in use: each step's seconds and scheduler stats."""

    def __init__(self, core) -> None:
        self.core, self.steps = core, []

    def __enter__(self) -> "TimedSteps":
        step = self.original = self.core.step

        def timed():
            t = time.perf_counter()
            out = step()
            self.steps.append((time.perf_counter() - t, out.scheduler_stats))
            return out
        self.core.step = timed
        return self

    def __exit__(self, *exc) -> None:
        self.core.step = self.original

    def decode_steps(self, streams: int) -> list[float]:
        """Seconds of the pure-decode steps with every one of `streams` requests running."""
        return [s for s, stats in self.steps if stats is not None and stats.num_prompt_tokens == 0
                and stats.num_scheduled_tokens == stats.num_generation_tokens == streams]

    def round(self, records, wall_s: float, streams: int) -> Round:
        return Round(records, wall_s, sum(s for s, _ in self.steps), len(self.steps), self.decode_steps(streams))


@contextlib.contextmanager
def low_priority_client():
    """This process's threads (the load generator) at nice 19 while it drives the gRPC stack: it stands
    in for clients on other machines, so it leaves the cores to the server instead of stalling the
    engine's OpenMP team (services/cpu_priority.py)."""
    set_cpu_priority("low")
    try:
        yield
    finally:
        set_cpu_priority("normal")


# ---- in-process: LLMEngine on the main thread ------------------------------------------------------
def in_process_round(engine, prompts: list[BenchPrompt], streams: int) -> Round:
    """A closed loop of `streams`, stepped here: the requests are all the same length, so it runs
    in batches of `streams` prompts added at once, each stepped until it finishes."""
    from engine_core.protocol import OutputKind, SamplingParams

    records: dict[str, RequestRecord] = {}
    started = time.perf_counter()
    with TimedSteps(engine.engine_core) as timed:
        for first in range(0, len(prompts), streams):
            for prompt in prompts[first:first + streams]:
                request_id = f"bench-{next(_request_ids)}"
                records[request_id] = RequestRecord(start=time.perf_counter(), prompt_tokens=len(prompt.token_ids))
                engine.add_request(request_id, list(prompt.token_ids),
                                   SamplingParams(temperature=0.0, max_tokens=prompt.max_tokens, ignore_eos=True,
                                                  output_kind=OutputKind.DELTA))
            while engine.has_unfinished_requests():
                for output in engine.step():
                    now = time.perf_counter()
                    record = records[output.request_id]
                    record.add_tokens(len(output.completions[0].token_ids), now)
                    if output.finished:
                        record.end = now
    return timed.round(list(records.values()), time.perf_counter() - started, streams)


# ---- the in-process transport: the same frontend core, no gRPC ---------------------------------
def transport_round(engine, model: str, tokenizer_path: str, prompts: list[BenchPrompt], streams: int) -> Round:
    """The LLMEngine's core under a fresh busy loop stepping on the main thread, the frontend beside it."""
    from clients.bench.backends import InProcessBackend
    from services.engine.busy_loop import EngineBusyLoop
    from services.engine.processes.engine_process import run_beside_engine

    core = engine.engine_core
    busy_loop = EngineBusyLoop(core)
    timed = TimedSteps(core)

    async def main() -> tuple[list[RequestRecord], float]:
        backend = InProcessBackend(model, tokenizer_path, engine=(busy_loop, core.info))
        try:
            await closed_loop(backend, WARM_UP, 1)
            timed.steps.clear()  # the warm-up's steps are not the round's
            return await closed_loop(backend, prompts, streams)
        finally:
            await backend.close()

    with timed:  # the frontend and the client at low priority, as the gRPC side's are
        records, wall = run_beside_engine(busy_loop, main, io_cpu_priority="low")
    return timed.round(records, wall, streams)


# ---- over gRPC: the two-service stack ----------------------------------------------------------------
class GrpcSide:
    """`tandem serve`'s stack, up from `with` to its end; `round()` runs one workload through it."""

    def __init__(self, engine_args: list[str]) -> None:
        metrics_port = free_port()
        self.stack = LocalStack(
            frontend_port=free_port(), engine_port=free_port(),
            engine_args=[*engine_args, "--metrics-port", str(metrics_port), "--log-level", "WARNING"],
            frontend_args=["--log-level", "WARNING"])
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

    def __enter__(self) -> "GrpcSide":
        self.stack.start()
        try:
            asyncio.run(self._closed_loop(WARM_UP, 1))
        except BaseException:
            self.stack.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stack.stop()

    async def _closed_loop(self, prompts, streams):
        backend = TandemBackend(AsyncTandemClient(self.stack.frontend_address, timeout=600))
        try:
            return await closed_loop(backend, prompts, streams)
        finally:
            await backend.close()

    def round(self, prompts: list[BenchPrompt], streams: int) -> Round:
        before, cpu_before = self._step_metric(), cpu_seconds(self.stack.pids)
        with low_priority_client():
            records, wall = asyncio.run(self._closed_loop(prompts, streams))
        after, cpu_after = self._step_metric(), cpu_seconds(self.stack.pids)
        cpu = {name: cpu_after[i] - cpu_before[i] for i, name in enumerate(PROCESSES)}
        return Round(records, wall, after[0] - before[0], int(after[1] - before[1]), cpu_s=cpu)

    def _step_metric(self) -> tuple[float, float]:
        """(sum of seconds, count) of the engine's own step histogram."""
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        values = {}
        for line in text.splitlines():
            for suffix in ("_sum", "_count"):
                if line.startswith(STEP_METRIC + suffix):
                    values[suffix] = float(line.split()[-1])
        return values["_sum"], values["_count"]
