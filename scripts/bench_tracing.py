"""Tracing cost: throughput at 32 concurrent streams with OpenTelemetry tracing on vs off, same run.

Two engine + frontend pairs (real processes, loopback gRPC, the embedded SmolLM2 unless --model)
are started side by side: one plain, one with --otlp-endpoint pointing at a small OTLP/gRPC sink
in this process, so spans are really batched, encoded and exported. Loads alternate between
the two (off-on, on-off, ...); the table shows each configuration's best round, and the ratio
is also given per back-to-back pair (their median), which cancels most of a busy machine's
drift. The CPU time both services use per generated token is measured too (from /proc): on a
shared machine it shows tracing's cost better than wall-clock throughput. Prometheus metrics are
on in both, so only tracing differs. Prints a table, writes JSON.

    python scripts/bench_tracing.py
    python scripts/bench_tracing.py --concurrency 8 --gen-len 64 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402
from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc  # noqa: E402

from clients.local_stack import LocalStack, free_port  # noqa: E402


# ---- load: concurrent greedy streams of random prompt ids ----
def make_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


async def one_stream(stub, prompt: list[int], gen_len: int) -> dict:
    request = generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=prompt),
        sampling_params=common_pb2.SamplingParams(
            temperature=0.0, max_tokens=gen_len, ignore_eos=True, output_kind=common_pb2.OUTPUT_KIND_DELTA,
        ),
    )
    started = time.perf_counter()
    first, tokens = None, 0
    async for response in stub.Generate(request):
        for chunk in response.completions:
            if chunk.token_ids and first is None:
                first = time.perf_counter() - started
            tokens += len(chunk.token_ids)
    return {"ttft": first, "tokens": tokens}


async def bench_grpc(address: str, prompts: list[list[int]], gen_len: int) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        await one_stream(stub, prompts[0][:16], 4)  # warm-up
        started = time.perf_counter()
        results = await asyncio.gather(*(one_stream(stub, p, gen_len) for p in prompts))
        elapsed = time.perf_counter() - started
    tokens = sum(r["tokens"] for r in results)
    return {"seconds": elapsed, "generated_tokens": tokens, "tok_per_s": tokens / elapsed,
            "ttft_p50_s": statistics.median(r["ttft"] for r in results)}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="loads per configuration, alternating")
    parser.add_argument("--model", help="engine --model (default: the embedded SmolLM2)")
    parser.add_argument("--engine-arg", action="append", default=[], help="extra tandem-engine flag (repeatable)")
    parser.add_argument("--output", default="bench_results/tracing.json")
    return parser.parse_args()


class SpanSink(trace_service_pb2_grpc.TraceServiceServicer):
    """A stand-in OpenTelemetry collector: accepts OTLP/gRPC trace exports and counts the spans."""

    def __init__(self) -> None:
        self.spans = 0
        self._lock = threading.Lock()

    def Export(self, request, context):
        count = sum(len(scope.spans) for resource in request.resource_spans for scope in resource.scope_spans)
        with self._lock:
            self.spans += count
        return trace_service_pb2.ExportTraceServiceResponse()


def start_sink() -> tuple[grpc.Server, SpanSink, int]:
    sink = SpanSink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, sink, port


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes have used so far (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def stack_args(args: argparse.Namespace, tracing_flags: list[str]) -> tuple[list[str], list[str]]:
    max_model_len = args.prompt_len + args.gen_len + 32
    common = ["--log-level", "WARNING", "--metrics-port", "0", *tracing_flags]
    engine = ["--max-model-len", str(max_model_len), "--max-num-seqs", str(max(args.concurrency, 1)),
              *(["--model", args.model] if args.model else []), *args.engine_arg, *common]
    return engine, common


def main() -> None:
    args = parse_args()
    prompts = make_prompts(args.concurrency, args.prompt_len)
    sink_server, sink, sink_port = start_sink()
    configs = {"tracing off": [], "tracing on": ["--otlp-endpoint", f"http://127.0.0.1:{sink_port}"]}
    stacks = {}
    try:
        for name, flags in configs.items():
            engine_args, frontend_args = stack_args(args, flags)
            stacks[name] = LocalStack(frontend_port=free_port(), engine_port=free_port(), engine_args=engine_args,
                                      frontend_args=frontend_args).start()
        rounds: dict[str, list[dict]] = {name: [] for name in configs}
        for i in range(args.rounds):
            order = list(stacks) if i % 2 == 0 else list(reversed(stacks))  # off-on, on-off, ...: no order bias
            for name in order:
                cpu_before = cpu_seconds(stacks[name].pids)
                result = asyncio.run(bench_grpc(stacks[name].frontend_address, prompts, args.gen_len))
                result["cpu_ms_per_token"] = (cpu_seconds(stacks[name].pids) - cpu_before) * 1e3 / result[
                    "generated_tokens"]
                rounds[name].append(result)
                print(f"round {i + 1} {name}: {result['tok_per_s']:.1f} tok/s, "
                      f"{result['cpu_ms_per_token']:.2f} CPU ms/token", flush=True)
    finally:
        for stack in stacks.values():
            stack.stop()
        sink_server.stop(0)

    best = {name: max(runs, key=lambda r: r["tok_per_s"]) for name, runs in rounds.items()}
    ratio = best["tracing on"]["tok_per_s"] / best["tracing off"]["tok_per_s"]
    # each round's on/off pair ran back to back, so its ratio shares that moment's load on the machine
    pair_ratios = [on["tok_per_s"] / off["tok_per_s"] for on, off in zip(rounds["tracing on"], rounds["tracing off"])]
    median_ratio = statistics.median(pair_ratios)
    # CPU time per token of the two services: what tracing costs, little affected by other load on the machine
    cpu = {name: statistics.median(r["cpu_ms_per_token"] for r in runs) for name, runs in rounds.items()}
    cpu_ratio = cpu["tracing off"] / cpu["tracing on"]
    requests_traced = (args.rounds * (args.concurrency + 1))  # + the warm-up request of each round
    result = {
        "benchmark": "tracing cost", "concurrency": args.concurrency, "prompt_len": args.prompt_len,
        "gen_len": args.gen_len, "rounds": rounds, "best": best, "throughput_ratio_on_over_off": ratio,
        "pair_ratios": pair_ratios, "median_pair_ratio": median_ratio,
        "cpu_ms_per_token_median": cpu, "cpu_efficiency_ratio_on_over_off": cpu_ratio,
        "spans_exported": sink.spans, "requests_traced": requests_traced,
    }
    print(f"\n{'config':>12} | {'best tok/s':>10} | {'TTFT p50 s':>10} | {'CPU ms/token (median)':>21}")
    print("-" * 63)
    for name, row in best.items():
        print(f"{name:>12} | {row['tok_per_s']:10.1f} | {row['ttft_p50_s']:10.3f} | {cpu[name]:21.2f}")
    print(f"\nthroughput ratio (on / off): best rounds {ratio:.3f}, median of back-to-back pairs {median_ratio:.3f} "
          f"({', '.join(f'{r:.3f}' for r in pair_ratios)}) at {args.concurrency} streams; "
          f"CPU per token off / on {cpu_ratio:.3f}; "
          f"{sink.spans} spans exported for {requests_traced} traced requests")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
