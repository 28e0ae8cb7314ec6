"""The decode step beside a light neighbour: what a co-located frontend and client cost the engine.

Over gRPC at one stream, the frontend and the client together spend about 1 ms of CPU per generated
token (`make bench` prints it: "CPU ms per generated token"), woken once per engine step. On a
machine whose cores all run the engine's OpenMP team, each wake-up preempts one of its threads, and
every parallel region then waits at its barrier for that thread: the step loses more than the CPU
the neighbour took. This measures it without gRPC: LLMEngine steps on this process's main thread,
alone and beside a process that burns --burn-ms of CPU every --period-ms (one wake-up per period),
in interleaved rounds. Prints a table and writes JSON; quote ratios, the machine is noisy.

    python scripts/bench_colocation.py
    python scripts/bench_colocation.py --burn-ms 0.5 1.0 --period-ms 8 -- --dtype float32
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine_core.openmp_env import limit_openmp_spinning  # noqa: E402

limit_openmp_spinning()  # as tandem-engine does, before torch loads

from scripts.bench_sides import TimedSteps  # noqa: E402

# burns argv[1] ms of CPU, then sleeps until argv[2] ms have passed since it woke; forever
NEIGHBOUR = """import sys, time
burn, period = float(sys.argv[1]) / 1000, float(sys.argv[2]) / 1000
while True:
    woke = time.perf_counter()
    while time.perf_counter() - woke < burn:
        pass
    time.sleep(max(0.0, period - (time.perf_counter() - woke)))
"""


def median_decode_step_ms(engine, batch: int, steps: int, tag: str) -> float:
    """Median pure-decode step (every request decoding) of `batch` requests after 128-token prompts."""
    from engine_core.protocol import SamplingParams

    for i in range(batch):
        prompt = [1000 + (sum(map(ord, tag)) + i * 7 + j) % 30000 for j in range(128)]
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
    with TimedSteps(engine.engine_core) as timed:
        while engine.has_unfinished_requests():
            engine.step()
    return 1000 * statistics.median(timed.decode_steps(batch))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--burn-ms", type=float, nargs="+", default=[0.5, 1.0], help="neighbour CPU per period")
    parser.add_argument("--period-ms", type=float, default=8.0, help="one neighbour wake-up per this many ms")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64, help="decode steps per measurement")
    parser.add_argument("--json", type=Path, default=ROOT / "bench_results" / "colocation.json")
    parser.add_argument("engine_args", nargs="*", help="tandem-engine flags, after --")
    args = parser.parse_args()

    from engine_core.offline.llm_engine import LLMEngine
    from services.engine.__main__ import build_parser, config_from_args

    engine = LLMEngine(config_from_args(build_parser().parse_args(args.engine_args)))
    median_decode_step_ms(engine, 1, 8, "warm-up")
    settings = [0.0, *args.burn_ms]
    samples: dict[int, dict[float, list[float]]] = {b: {burn: [] for burn in settings} for b in args.batches}
    for round_ in range(args.rounds):
        for burn in settings:
            neighbour = None if burn == 0 else subprocess.Popen(
                [sys.executable, "-c", NEIGHBOUR, str(burn), str(args.period_ms)])
            try:
                time.sleep(0.2)
                for batch in args.batches:
                    samples[batch][burn].append(
                        median_decode_step_ms(engine, batch, args.steps, f"r{round_}-{burn}-{batch}"))
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
        print(f"round {round_ + 1}/{args.rounds}: done", file=sys.stderr, flush=True)

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    import torch

    print(f"\nCPU: {cpu}, torch threads {torch.get_num_threads()}; median decode step, ms (ratio to alone)")
    print(f"{'batch':>5} | {'alone':>7} | " + " | ".join(f"{f'beside {b:g}/{args.period_ms:g} ms':>22}"
                                                      for b in args.burn_ms))
    table = {}
    for batch, by_burn in samples.items():
        alone = statistics.median(by_burn[0.0])
        row = {burn: statistics.median(v) for burn, v in by_burn.items()}
        table[batch] = {"alone_ms": alone, "beside": {str(b): {"step_ms": row[b], "ratio": row[b] / alone}
                                                      for b in args.burn_ms}}
        print(f"{batch:>5} | {alone:>7.2f} | " + " | ".join(f"{row[b]:>14.2f} ({row[b] / alone:4.2f}x)"
                                                          for b in args.burn_ms))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"cpu": cpu, "threads": torch.get_num_threads(), "period_ms": args.period_ms,
                                     "steps": table, "samples": {b: {str(k): v for k, v in s.items()}
                                                                 for b, s in samples.items()}}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
