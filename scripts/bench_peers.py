"""The engine's peers in `make bench` (scripts/bench_engine.py): the machine's floor and llama.cpp.

The floor is ../shared/tools/cpu_floor.py (the model's linear layers alone, plain torch); llama.cpp's
`llama-server` is built and served on the same GGUF by ../shared/tools/llama_server.sh.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from clients.bench.backends import LlamaServerBackend
from clients.bench.loadgen import closed_loop
from clients.bench.metrics import summarize
from clients.bench.prompts import BenchPrompt
from clients.local_stack import free_port

SHARED_TOOLS = Path(__file__).resolve().parents[2] / "shared" / "tools"


async def run_closed_loop(backend, prompts: list[BenchPrompt], streams: int = 1) -> dict:
    """`prompts` sent by `streams` concurrent streams (closed loop), summarized."""
    records, wall = await closed_loop(backend, prompts, streams)
    return summarize(records, wall)


def cpu_seconds(pids: list[int | None]) -> list[float]:
    """User + system CPU seconds of each process and its live children (tandem-engine's gRPC server
    process), from /proc, then of this one (the client)."""
    ticks = os.sysconf("SC_CLK_TCK")

    def of(pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks  # utime, stime

    def children(pid: int) -> list[int]:
        try:
            return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except OSError:
            return []

    return [*(of(pid) + sum(of(child) for child in children(pid)) for pid in pids), time.process_time()]


def steal_seconds() -> float:
    """CPU seconds the hypervisor gave other guests instead of this machine, all CPUs (/proc/stat's steal;
    0 where there is none): a shared host's neighbours, made visible next to each round."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


# ---- the machine's floor ------------------------------------------------------------------------
def run_floor(path: Path, batches: list[int]) -> dict | None:
    if not path.exists():
        print(f"floor: {path} not found, skipped", file=sys.stderr)
        return None
    cmd = [sys.executable, str(path), "--json", "--batches", *map(str, batches)]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def floor_ms(floor: dict | None, dtype: str, batch: int) -> float | None:
    for row in (floor or {}).get("linears_only", []):
        if row["dtype"] == dtype and row["batch"] == batch and "step_ms" in row:
            return row["step_ms"]
    return None


# the floor's row for each of the engine's linear kernels: what the kernel's weights and arithmetic are
FLOOR_ROW_OF_KERNEL = {"int8_weight_only": "int8-weight-only", "int8_gemv": "int8-weight-only",
                       # no int4 row: int8 reads 1.6-2x int4's bytes, a lenient floor
                       "int4": "int8-weight-only", "int4_gemv": "int8-weight-only",
                       "int8_dynamic": "int8-dynamic-w8a8", "int8_vnni": "int8-dynamic-w8a8"}


def floor_of_plans(floor: dict | None, float_dtype: str, kernels: dict[str, int], batch: int) -> float | None:
    """The floor of the dtypes the engine's linears use at `batch`: each floor row weighted by the share of
    the weights (multiply-adds) whose kernel it stands for. kernels: kernel name -> weight elements."""
    total = sum(kernels.values())
    shares: dict[str, float] = {}
    for kernel, elements in kernels.items():
        row = FLOOR_ROW_OF_KERNEL.get(kernel, float_dtype)  # float kernels: the model's dtype
        shares[row] = shares.get(row, 0.0) + elements / total
    parts = [(share, floor_ms(floor, row, batch)) for row, share in shares.items()]
    if not total or any(ms is None for _, ms in parts):
        return None
    return sum(share * ms for share, ms in parts)


# ---- llama.cpp's llama-server -------------------------------------------------------------------------
LLAMA_SCRIPT = SHARED_TOOLS / "llama_server.sh"


def build_llama() -> None:
    """Build llama-server (once; later calls find it built). Run before Tandem's rounds, so a missing
    tool or a failed build ends the bench before its long part rather than after it."""
    if not LLAMA_SCRIPT.exists():
        raise SystemExit(f"{LLAMA_SCRIPT} not found: run make bench from the checkout beside ../shared, "
                         "or pass --no-llama")
    built = subprocess.run(["bash", str(LLAMA_SCRIPT), "build"], capture_output=True, text=True)
    if built.returncode != 0:
        raise SystemExit(f"building llama-server failed (exit {built.returncode}):\n{built.stderr[-2000:]}")


def run_llama(workloads: dict[int, list[BenchPrompt]]) -> dict[int, dict]:
    """llama-server with -np N for each workload of N streams, warmed up, then the same prompts
    (after `build_llama()`)."""
    results = {}
    for streams, prompts in workloads.items():
        port = free_port()
        server = subprocess.Popen(["bash", str(LLAMA_SCRIPT), "serve", str(streams), str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while True:
                try:
                    if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                        break
                except OSError:
                    if time.monotonic() > deadline or server.poll() is not None:
                        raise RuntimeError("llama-server did not become healthy") from None
                    time.sleep(0.5)
            # the client at normal priority (as before): with it at SCHED_IDLE llama-server measured the same at
            # 1 stream and 91-105 vs 103-106 tok/s at 32 streams, so it keeps the setting it does best with
            asyncio.run(run_closed_loop(LlamaServerBackend(url), [BenchPrompt(None, (1, 2, 3, 4), 8)]))
            results[streams] = asyncio.run(run_closed_loop(LlamaServerBackend(url), prompts, streams))
        finally:
            server.terminate()
            server.wait(30)
    return results
