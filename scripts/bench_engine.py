"""The engine side by side with its peers and the machine's floor, in one run (`make bench`).

On the same prompts (SmolLM2-135M, synthetic prompts of --input-len tokens, exactly --output-len
generated, greedy, EOS ignored), at 1 and 32 concurrent streams; Tandem's three sides alternate in
--rounds rounds (scripts/bench_sides.py) after each has run every point's shapes once untimed, the peers
run after them:

  floor        ../shared/tools/cpu_floor.py --json: the model's linear layers alone, plain torch
  in-process   LLMEngine stepped on this process's main thread (no transport, no frontend)
  transport    the frontend core (AsyncLLM) over InProcessEngineClient, the engine stepping on the main
               thread (run_beside_engine): the gRPC path less its two gRPC hops and one process
  grpc         `tandem serve`'s two processes (engine + frontend) over loopback, the public API
  llama.cpp    llama.cpp's llama-server (../shared/tools/llama_server.sh) on the same GGUF, -np N

It prints three tables and writes JSON: end-to-end throughput and TTFT with ratios (TTFT added: gRPC's
TTFT p50 less the in-process transport's); the engine's
step time inside the server (its own `tandem:engine_step_duration_seconds`) next to the same
workload's in-process step and the pure-decode step against the floor: the floor of the model's dtype,
and the floor of the kernels the engine's linears run at that batch (each of cpu_floor's rows, bf16, int8
weight-only and W8A8, weighted by the share of the weights whose kernel it stands for); and gRPC against
LLMEngine round by round (tok/s and step ratios and their medians) beside the share of CPU time the
hypervisor gave other guests meanwhile (/proc/stat's steal). Both Tandem sides get the same engine flags
(parsed by tandem-engine's own parser). The machine is noisy: quote ratios.

    python scripts/bench_engine.py                          # everything
    python scripts/bench_engine.py --no-llama -- --dtype float32 --quantization none
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine_core.openmp_env import limit_openmp_spinning  # noqa: E402

limit_openmp_spinning()  # as tandem-engine does, before torch loads: the in-process sides run as the server does

from clients.bench.prompts import synthetic_prompts  # noqa: E402
from scripts.bench_peers import SHARED_TOOLS, build_llama, floor_ms, floor_of_plans, run_floor, run_llama  # noqa: E402
from scripts.bench_sides import (  # noqa: E402
    WARM_UP,
    WARM_UP_TOKENS,
    GrpcSide,
    combine,
    in_process_round,
    transport_round,
    with_steal,
)


# ---- report -----------------------------------------------------------------------------------------------
def ratio(a, b):
    return round(a / b, 2) if a is not None and b else None


def median_of(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 2) if values else None


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
          f"{'decode step ms':>14} {'floor ms':>8} {'ratio':>6} | {'floor, kernels':>14} {'ratio':>6}")
    for streams, row in result["streams"].items():
        step = row["step"]
        print(f"{streams:>7} | {fmt(step['server_ms'], 2):>14} {fmt(step['transport_ms'], 2):>12} "
              f"{fmt(step['in_process_ms'], 2):>15} "
              f"{fmt(step['server_over_in_process'], 2):>6} | {fmt(step['decode_ms'], 2):>14} "
              f"{fmt(step['floor_ms'], 2):>8} {fmt(step['decode_over_floor'], 2):>6} | "
              f"{fmt(step['floor_of_kernels_ms'], 2):>14} {fmt(step['decode_over_floor_of_kernels'], 2):>6}")
    print(f"(ratio: server / LLMEngine; floor: the {result['engine_dtype']} linears; floor, kernels: each floor row "
          "(bf16, int8 weight-only, W8A8) weighted by the share of the weights whose kernel it stands for; "
          "kernels by weight share: " + "; ".join(f"{n}: " + ", ".join(f"{k} {v / sum(ks.values()):.0%}"
                                                                      for k, v in ks.items())
                                                   for n, ks in result["linear_kernels"].items()) + ")")
    print("\ngRPC against LLMEngine round by round (the sides back to back; the median sets aside rounds a"
          " neighbour's burst hit on one side only), and the CPU time the hypervisor gave other guests:")
    print(f"{'streams':>7} | {'tok/s ratio':>11} {'median':>6} | {'step ratio':>10} {'median':>6} | {'steal %':>7}"
          " | by round (tok/s; step)")
    for streams, row in result["streams"].items():
        r, step = row["ratios"], row["step"]
        steal = max(row[side]["steal_percent"] for side in ("in_process", "transport", "grpc"))
        print(f"{streams:>7} | {fmt(r['grpc_over_in_process'], 2):>11} "
              f"{fmt(r['grpc_over_in_process_median_of_rounds'], 2):>6} | {fmt(step['server_over_in_process'], 2):>10} "
              f"{fmt(step['server_over_in_process_median_of_rounds'], 2):>6} | {steal:>7.1f} | "
              f"{r['grpc_over_in_process_by_round']}; {step['server_over_in_process_by_round']}")
    print("\nCPU ms per generated token over gRPC (the processes share the machine's cores; frontend and client"
          " at nice 19):")
    for streams, row in result["streams"].items():
        cpu = row["grpc"]["cpu_ms_per_token"]
        print(f"{streams:>7} | " + "  ".join(f"{name} {ms:.2f}" for name, ms in cpu.items()))


def linear_kernels(engine, rows: int) -> dict[str, int]:
    """The kernel each of the engine's linears runs at `rows` rows, as weight elements per kernel name."""
    from kernels.cpu.linear import CpuLinear

    kernels: dict[str, int] = {}
    for module in engine.engine_core.runner.model.modules():
        if isinstance(module, CpuLinear):
            name = module.kernel_for(rows)
            kernels[name] = kernels.get(name, 0) + module.in_features * module.out_features
    return kernels


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32], help="concurrent streams per point")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    parser.add_argument("--rounds", type=int, default=6,
                        help="rounds, the sides alternating within each: on a noisy machine one round of a side"
                             " ran 0.7-1.1x another side's, so the ratios pool several (default: %(default)s)")
    parser.add_argument("--min-requests", type=int, default=6,
                        help="at least this many requests per point and side (one stream's TTFT p50: not one sample)")
    parser.add_argument("--no-llama", action="store_true", help="skip llama-server")
    parser.add_argument("--no-floor", action="store_true", help="skip cpu_floor.py")
    parser.add_argument("--floor-script", type=Path, default=SHARED_TOOLS / "cpu_floor.py")
    parser.add_argument("--json", type=Path, default=ROOT / "bench_results" / "bench_engine.json")
    args, engine_args = parser.parse_known_args()
    engine_args = [a for a in engine_args if a != "--"]
    if not args.no_floor and not args.floor_script.exists():
        parser.error(f"{args.floor_script} not found: run from the checkout beside ../shared, or pass --no-floor")
    if not args.no_llama:
        build_llama()  # before the long part: a missing tool or failed build ends the run now

    import torch

    from engine_core.loader import default_model_path
    from engine_core.offline.llm_engine import LLMEngine
    from services.engine.__main__ import build_parser, config_from_args
    from services.frontend.tokenizer import load_tokenizer

    config = config_from_args(build_parser().parse_args(engine_args))
    model_path = config.model.model or str(default_model_path())
    tokenizer = load_tokenizer(model_path)
    # Each side sends each point max(streams, --min-requests) requests per round, a closed loop of
    # `streams`; all prompts are distinct, so none finds another's in the prefix cache.
    counts = {n: args.rounds * max(n, args.min_requests // args.rounds) for n in args.streams}
    prompts = synthetic_prompts(sum(counts.values()) + sum(args.streams), args.input_len, args.output_len, seed=0,
                                tokenize=lambda t: tokenizer.encode(t, add_special_tokens=False),
                                detokenize=tokenizer.decode)
    workloads, first = {}, 0
    for n, count in counts.items():
        workloads[n], first = prompts[first:first + count], first + count
    # each side's warm-up: every point's shapes once (n prompts of the workload's length, a few tokens
    # each), so no side's first round pays for first-call work (oneDNN primitives, allocator growth)
    warm_ups = {}
    for n in args.streams:
        warm_ups[n], first = [replace(p, max_tokens=WARM_UP_TOKENS) for p in prompts[first:first + n]], first + n
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
    result["linear_kernels"] = {n: linear_kernels(engine, n) for n in args.streams}
    in_process_round(engine, WARM_UP, 1)
    for n, warm_up in warm_ups.items():
        in_process_round(engine, warm_up, n)
    rounds: dict[int, dict[str, list]] = {n: {"in_process": [], "transport": [], "grpc": []} for n in args.streams}
    with GrpcSide(engine_args) as grpc_side:
        for n, warm_up in warm_ups.items():
            grpc_side.round(warm_up, n)
        for r in range(args.rounds):  # the sides alternate, so a drifting machine weighs on each alike
            for n, prompts in workloads.items():
                part = prompts[r::args.rounds]
                engine.engine_core.reset_prefix_cache()  # the two in-process sides share the core: cold for each
                rounds[n]["in_process"].append(with_steal(in_process_round, engine, part, n))
                engine.engine_core.reset_prefix_cache()
                rounds[n]["transport"].append(with_steal(transport_round, engine, model_path, model_path, part, n))
                rounds[n]["grpc"].append(with_steal(grpc_side.round, part, n))
                print(f"round {r + 1}/{args.rounds}, {n} streams: done", file=sys.stderr, flush=True)
    del engine
    llama = {} if args.no_llama else run_llama({n: p[:max(n, args.min_requests)] for n, p in workloads.items()})

    result["floor"] = floor
    result["streams"] = {}
    for n in args.streams:
        ip, tr, g = (combine(rounds[n][side]) for side in ("in_process", "transport", "grpc"))
        ll = llama.get(n)
        f = floor_ms(floor, result["engine_dtype"], n)
        f_used = floor_of_plans(floor, result["engine_dtype"], result["linear_kernels"][n], n)
        tok_by_round = [ratio(a, b) for a, b in zip(g["rounds_tok_per_s"], ip["rounds_tok_per_s"])]
        step_by_round = [ratio(a, b) for a, b in zip(g["rounds_step_ms"], ip["rounds_step_ms"])]
        result["streams"][n] = {
            "in_process": ip, "transport": tr, "grpc": g, "llama.cpp": ll,
            "ratios": {"grpc_over_llama": ratio(g["output_token_throughput"], ll and ll["output_token_throughput"]),
                       "grpc_over_in_process": ratio(g["output_token_throughput"], ip["output_token_throughput"]),
                       "grpc_over_transport": ratio(g["output_token_throughput"], tr["output_token_throughput"]),
                       "grpc_ttft_added_ms": g["ttft"]["p50_ms"] - tr["ttft"]["p50_ms"],
                       # each round runs the sides back to back: the median of its pairs sets aside the
                       # rounds a neighbour's burst hit on one side only (the pooled ratios keep them)
                       "grpc_over_in_process_by_round": tok_by_round,
                       "grpc_over_in_process_median_of_rounds": median_of(tok_by_round)},
            "step": {"server_ms": g["step_mean_ms"], "in_process_ms": ip["step_mean_ms"],
                     "transport_ms": tr["step_mean_ms"],
                     "server_over_in_process": ratio(g["step_mean_ms"], ip["step_mean_ms"]),
                     "server_over_in_process_by_round": step_by_round,
                     "server_over_in_process_median_of_rounds": median_of(step_by_round),
                     "decode_ms": ip["decode_step_ms"], "floor_ms": f,
                     "decode_over_floor": ratio(ip["decode_step_ms"], f),
                     "floor_of_kernels_ms": f_used,
                     "decode_over_floor_of_kernels": ratio(ip["decode_step_ms"], f_used)},
        }
    print_report(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
