"""The engine side by side with its peers and the machine's floor, in one run (`make bench`).

On the same prompts (SmolLM2-135M, synthetic prompts of --input-len tokens, exactly --output-len
generated, greedy, EOS ignored), at 1 and 32 concurrent streams:

  floor        ../shared/tools/cpu_floor.py --json: the model's linear layers alone, plain torch
  in-process   LLMEngine stepped on this process's main thread (no transport, no frontend)
  transport    the frontend core (AsyncLLM) over InProcessEngineClient, the engine stepping on the main
               thread (run_beside_engine): the gRPC path less its two gRPC hops and one process
  grpc         `tandem serve`'s two processes (engine + frontend) over loopback, the public API
  llama.cpp    llama.cpp's llama-server (../shared/tools/llama_server.sh) on the same GGUF, -np N

It prints two tables and writes JSON: end-to-end throughput and TTFT with ratios (TTFT added: gRPC's
TTFT p50 less the in-process transport's), and the engine's
step time inside the server (its own `tandem:engine_step_duration_seconds`) next to the same
workload's in-process step and the pure-decode step against the floor. Both Tandem sides get the
same engine flags (parsed by tandem-engine's own parser). The machine is noisy: quote ratios.

    python scripts/bench_engine.py                          # everything
    python scripts/bench_engine.py --no-llama -- --dtype float32 --quantization none
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine_core.openmp_env import limit_openmp_spinning  # noqa: E402

limit_openmp_spinning()  # as tandem-engine does, before torch loads: the in-process sides run as the server does

from clients.async_client import AsyncTandemClient  # noqa: E402
from clients.bench.backends import TandemBackend  # noqa: E402
from clients.bench.metrics import RequestRecord, summarize  # noqa: E402
from clients.bench.prompts import BenchPrompt, synthetic_prompts  # noqa: E402
from clients.local_stack import LocalStack, free_port  # noqa: E402
from scripts.bench_peers import SHARED_TOOLS, cpu_seconds, floor_ms, run_closed_loop, run_floor, run_llama  # noqa: E402

STEP_METRIC = "tandem:engine_step_duration_seconds"


# ---- in-process: LLMEngine on the main thread ------------------------------------------------------
def run_in_process(engine, prompts: list[BenchPrompt], streams: int) -> dict:
    """A closed loop of `streams`, stepped here: the requests are all the same length, so it runs
    in rounds of `streams` prompts added at once, each round stepped until it finishes."""
    from engine_core.sampling_params import SamplingParams

    core = engine.engine_core
    steps: list[tuple[float, object]] = []  # (seconds, scheduler stats)
    records: dict[str, RequestRecord] = {}
    step = core.step

    def timed_step():
        t = time.perf_counter()
        out = step()
        steps.append((time.perf_counter() - t, out.scheduler_stats))
        return out

    started = time.perf_counter()
    core.step = timed_step
    try:
        for first in range(0, len(prompts), streams):
            for i, prompt in enumerate(prompts[first:first + streams], start=first):
                request_id = f"bench-{i}"
                records[request_id] = RequestRecord(start=time.perf_counter(), prompt_tokens=len(prompt.token_ids))
                engine.add_request(request_id, list(prompt.token_ids),
                                   SamplingParams(temperature=0.0, max_tokens=prompt.max_tokens, ignore_eos=True))
            while engine.has_unfinished_requests():
                for output in engine.step():
                    now = time.perf_counter()
                    record = records[output.request_id]
                    record.add_tokens(len(output.outputs[0].new_token_ids), now)
                    if output.finished:
                        record.end = now
    finally:
        core.step = step
    summary = summarize(list(records.values()), time.perf_counter() - started)
    decode = [s for s, stats in steps
              if stats.num_prompt_tokens == 0 and stats.num_scheduled_tokens == stats.num_generation_tokens
              == streams]
    summary["step_mean_ms"] = 1000 * sum(s for s, _ in steps) / len(steps)
    summary["decode_step_ms"] = 1000 * statistics.median(decode) if decode else None
    return summary


# ---- the in-process transport: the same frontend core, no gRPC ---------------------------------
def run_transport(config, tokenizer_path: str, workloads: dict[int, list[BenchPrompt]]) -> dict[int, dict]:
    from clients.bench.backends import InProcessBackend
    from engine_core.engine_core import EngineCore
    from services.engine.busy_loop import EngineBusyLoop
    from services.engine.process import run_beside_engine
    from services.frontend.in_process import engine_info_from_core

    core = EngineCore(config, log_stats=True)
    busy_loop = EngineBusyLoop(core)
    steps: list[float] = []
    step = core.step

    def timed_step():
        t = time.perf_counter()
        out = step()
        steps.append(time.perf_counter() - t)
        return out
    core.step = timed_step

    async def main() -> dict[int, dict]:
        backend = InProcessBackend(config.model.model, tokenizer_path,
                                   engine=(busy_loop, engine_info_from_core(core.info)))
        try:
            await run_closed_loop(backend, [BenchPrompt(None, (1, 2, 3, 4), 8)])  # warm up
            results = {}
            for streams, prompts in workloads.items():
                first = len(steps)
                results[streams] = await run_closed_loop(backend, prompts, streams)
                results[streams]["step_mean_ms"] = 1000 * statistics.fmean(steps[first:])
            return results
        finally:
            await backend.close()

    return run_beside_engine(busy_loop, main)


# ---- over gRPC: the two-service stack ----------------------------------------------------------------
def scrape_step_metric(url: str) -> tuple[float, float]:
    """(sum of seconds, count) of the engine's step histogram."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        for suffix in ("_sum", "_count"):
            if line.startswith(STEP_METRIC + suffix):
                values[suffix] = float(line.split()[-1])
    return values["_sum"], values["_count"]


def run_grpc(engine_args: list[str], workloads: dict[int, list[BenchPrompt]]) -> dict[int, dict]:
    metrics_port = free_port()
    stack = LocalStack(frontend_port=free_port(), engine_port=free_port(),
                       engine_args=[*engine_args, "--metrics-port", str(metrics_port), "--log-level", "WARNING"],
                       frontend_args=["--log-level", "WARNING"])
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    results = {}
    with stack:
        async def one(prompts, streams=1):
            backend = TandemBackend(AsyncTandemClient(stack.frontend_address, timeout=600))
            try:
                return await run_closed_loop(backend, prompts, streams)
            finally:
                await backend.close()

        asyncio.run(one([BenchPrompt(None, (1, 2, 3, 4), 8)]))  # warm up
        for streams, prompts in workloads.items():
            before, cpu_before = scrape_step_metric(metrics_url), cpu_seconds(stack.pids)
            summary = asyncio.run(one(prompts, streams))
            after, cpu_after = scrape_step_metric(metrics_url), cpu_seconds(stack.pids)
            summary["step_mean_ms"] = 1000 * (after[0] - before[0]) / max(after[1] - before[1], 1)
            summary["cpu_ms_per_token"] = {  # the three processes share the cores: what each took
                name: round(1000 * (cpu_after[i] - cpu_before[i]) / summary["output_tokens"], 3)
                for i, name in enumerate(("engine", "frontend", "client"))}
            results[streams] = summary
    return results


# ---- report -----------------------------------------------------------------------------------------------
def ratio(a, b):
    return round(a / b, 2) if a is not None and b else None


def fmt(value, digits=1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_report(result: dict) -> None:
    print(f"\nCPU: {result['cpu']}, torch threads {result['threads']}, engine dtype {result['engine_dtype']}")
    sides = (("llama.cpp", "llama.cpp"), ("grpc", "gRPC"), ("transport", "in-proc transport"),
             ("in_process", "LLMEngine"))
    print("generated tok/s end to end (TTFT p50 s):")
    print(f"{'streams':>7} | " + " | ".join(f"{label:>22}" for _, label in sides)
          + f" | {'gRPC/llama':>10} {'gRPC/transport':>14} {'gRPC/LLMEngine':>14} {'TTFT added ms':>13}")
    for streams, row in result["streams"].items():
        cells = []
        for side, _ in sides:
            s = row.get(side)
            cells.append(f"{fmt(s['output_token_throughput']):>13} ({fmt(s['ttft']['p50_ms'] / 1000, 2):>5})"
                         if s else f"{'-':>22}")
        r = row["ratios"]
        print(f"{streams:>7} | " + " | ".join(f"{c:>22}" for c in cells)
              + f" | {fmt(r['grpc_over_llama'], 2):>10} {fmt(r['grpc_over_transport'], 2):>14}"
              f" {fmt(r['grpc_over_in_process'], 2):>14} {fmt(r['grpc_ttft_added_ms'], 1):>13}")
    print(f"\n{'streams':>7} | {'server step ms':>14} {'transport ms':>12} {'in-proc step ms':>15} {'ratio':>6} | "
          f"{'decode step ms':>14} {'floor ms':>8} {'ratio':>6} (ratio: server / LLMEngine; floor: dtype used)")
    for streams, row in result["streams"].items():
        step = row["step"]
        print(f"{streams:>7} | {fmt(step['server_ms'], 2):>14} {fmt(step['transport_ms'], 2):>12} "
              f"{fmt(step['in_process_ms'], 2):>15} "
              f"{fmt(step['server_over_in_process'], 2):>6} | {fmt(step['decode_ms'], 2):>14} "
              f"{fmt(step['floor_ms'], 2):>8} {fmt(step['decode_over_floor'], 2):>6}")
    print("\nCPU ms per generated token over gRPC (the processes share the machine's cores):")
    for streams, row in result["streams"].items():
        cpu = row["grpc"]["cpu_ms_per_token"]
        print(f"{streams:>7} | " + "  ".join(f"{name} {ms:.2f}" for name, ms in cpu.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32], help="concurrent streams per point")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    parser.add_argument("--min-requests", type=int, default=6,
                        help="at least this many requests per point, so one stream's TTFT p50 is not one sample")
    parser.add_argument("--no-llama", action="store_true", help="skip llama-server")
    parser.add_argument("--no-floor", action="store_true", help="skip cpu_floor.py")
    parser.add_argument("--floor-script", type=Path, default=SHARED_TOOLS / "cpu_floor.py")
    parser.add_argument("--json", type=Path, default=ROOT / "bench_results" / "bench_engine.json")
    args, engine_args = parser.parse_known_args()
    engine_args = [a for a in engine_args if a != "--"]

    import torch

    from engine_core.llm_engine import LLMEngine
    from engine_core.loader import default_model_path
    from services.engine.__main__ import build_parser, config_from_args
    from services.frontend.tokenizer import load_tokenizer

    config = config_from_args(build_parser().parse_args(engine_args))
    model_path = config.model.model or str(default_model_path())
    tokenizer = load_tokenizer(model_path)
    # Each point sends max(streams, --min-requests) requests, a closed loop of `streams`; the points'
    # prompts are disjoint, so no point finds another's prompts in the prefix cache.
    counts = {n: max(n, args.min_requests) for n in args.streams}
    prompts = synthetic_prompts(sum(counts.values()), args.input_len, args.output_len, seed=0,
                                tokenize=lambda t: tokenizer.encode(t, add_special_tokens=False),
                                detokenize=tokenizer.decode)
    workloads, first = {}, 0
    for n, count in counts.items():
        workloads[n], first = prompts[first:first + count], first + count
    result = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "input_len": args.input_len, "output_len": args.output_len, "engine_args": engine_args}
    try:
        result["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                             if line.startswith("model name"))
    except (OSError, StopIteration):
        pass

    floor = None if args.no_floor else run_floor(args.floor_script, args.streams)
    engine = LLMEngine(config)
    result["engine_dtype"] = str(engine.engine_core.runner.dtype).removeprefix("torch.")
    run_in_process(engine, [BenchPrompt(None, (1, 2, 3, 4), 8)], 1)  # warm up
    in_process = {n: run_in_process(engine, p, n) for n, p in workloads.items()}
    del engine
    transport = run_transport(config, model_path, workloads)
    grpc = run_grpc(engine_args, workloads)
    llama = {} if args.no_llama else run_llama(workloads)

    floor_dtype = {"float32": "float32", "bfloat16": "bfloat16"}.get(result["engine_dtype"], result["engine_dtype"])
    result["floor"] = floor
    result["streams"] = {}
    for n in args.streams:
        ip, tr, g, ll = in_process[n], transport[n], grpc[n], llama.get(n)
        f = floor_ms(floor, floor_dtype, n)
        result["streams"][n] = {
            "in_process": ip, "transport": tr, "grpc": g, "llama.cpp": ll,
            "ratios": {"grpc_over_llama": ratio(g["output_token_throughput"], ll and ll["output_token_throughput"]),
                       "grpc_over_in_process": ratio(g["output_token_throughput"], ip["output_token_throughput"]),
                       "grpc_over_transport": ratio(g["output_token_throughput"], tr["output_token_throughput"]),
                       "grpc_ttft_added_ms": g["ttft"]["p50_ms"] - tr["ttft"]["p50_ms"]},
            "step": {"server_ms": g["step_mean_ms"], "in_process_ms": ip["step_mean_ms"],
                     "transport_ms": tr["step_mean_ms"],
                     "server_over_in_process": ratio(g["step_mean_ms"], ip["step_mean_ms"]),
                     "decode_ms": ip["decode_step_ms"], "floor_ms": f,
                     "decode_over_floor": ratio(ip["decode_step_ms"], f)},
        }
    print_report(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
