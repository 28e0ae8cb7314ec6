"""How long OpenMP's idle workers spin (GOMP_SPINCOUNT) against the decode step, alone and beside a
neighbour: the measurement behind engine_core/openmp_env.py.

For each spin count (libgomp's default of 300,000 and the given ones) a fresh process loads
LLMEngine (SmolLM2, the engine's default flags) and times the median decode step at batch 1 and
32 alone, then beside a neighbour: another torch process multiplying matrices on every core with
libgomp's default spinning (as any torch program does). libgomp reads the variable once, when torch
loads it, hence one process per setting. Prints a table and writes JSON; the machine is noisy, so
compare the columns of one run.

    python scripts/bench_openmp_spin.py
    python scripts/bench_openmp_spin.py --spin-counts 1000 3000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEIGHBOUR = "import torch\na, b = torch.randn(256, 256), torch.randn(256, 256)\nwhile True:\n    torch.mm(a, b)\n"
DEFAULT = "default"


def median_step_ms(engine, batch: int, max_tokens: int, budget_s: float) -> float:
    """Median decode step of `batch` requests (64-token prompts), stopping after `budget_s`."""
    from engine_core.protocol import SamplingParams

    tag = f"b{batch}-{time.monotonic_ns()}"
    for i in range(batch):
        prompt = [1000 + (i * 7 + j) % 30000 for j in range(64)]
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                ignore_eos=True))
    times, started = [], time.monotonic()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
        if time.monotonic() - started > budget_s:
            engine.abort_request([f"{tag}-{i}" for i in range(batch)])
            break
    return 1000 * statistics.median(times[1:] or times)  # the first step is the prefill


def child(budget_s: float) -> None:
    """One setting: alone, then beside the neighbour; one JSON line on stdout."""
    sys.path.insert(0, str(ROOT))
    from engine_core.offline.llm_engine import LLMEngine
    from services.engine.__main__ import build_parser, config_from_args

    engine = LLMEngine(config_from_args(build_parser().parse_args([])))
    median_step_ms(engine, 1, 8, budget_s)  # warm up
    result = {"alone": {b: median_step_ms(engine, b, 48, budget_s) for b in (1, 32)}}
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR], env=env)
    try:
        time.sleep(2)
        result["beside a torch process"] = {b: median_step_ms(engine, b, 48, budget_s) for b in (1, 32)}
    finally:
        neighbour.kill()
        neighbour.wait()
    print(json.dumps(result))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spin-counts", type=int, nargs="+", default=[1000, 3000, 10000])
    parser.add_argument("--budget-s", type=float, default=15.0, help="most seconds per measurement")
    parser.add_argument("--json", type=Path, default=ROOT / "bench_results" / "openmp_spin.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.budget_s)
        return 0
    results = {}
    for spin in [DEFAULT, *map(str, args.spin_counts)]:
        env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
        if spin != DEFAULT:
            env["GOMP_SPINCOUNT"] = spin
        out = subprocess.run([sys.executable, __file__, "--child", "--budget-s", str(args.budget_s)], env=env,
                             check=True, capture_output=True, text=True).stdout
        results[spin] = json.loads(out.strip().splitlines()[-1])
        print(f"measured GOMP_SPINCOUNT={spin}", file=sys.stderr, flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"\nCPU: {cpu}, {os.cpu_count()} cores; median decode step, ms")
    print(f"{'GOMP_SPINCOUNT':>14} | {'alone b1':>9} {'alone b32':>9} | {'beside b1':>9} {'beside b32':>10}")
    for spin, r in results.items():
        alone, beside = r["alone"], r["beside a torch process"]
        print(f"{spin:>14} | {alone['1']:>9.1f} {alone['32']:>9.1f} | {beside['1']:>9.1f} {beside['32']:>10.1f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"cpu": cpu, "cores": os.cpu_count(), "results": results}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
