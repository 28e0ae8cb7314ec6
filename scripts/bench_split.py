"""Split cost: 32 concurrent streams through frontend + engine core over loopback gRPC vs the
in-process LLMEngine, same prompts, same run.

Every request has `--prompt-len` random prompt token ids and generates exactly `--gen-len`
tokens (greedy, EOS ignored). Prints a table and writes JSON.

    python scripts/bench_split.py
    python scripts/bench_split.py --concurrency 8 --gen-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc  # noqa: E402

from clients.local_stack import LocalStack, free_port  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--output", default="bench_results/split.json")
    return parser.parse_args()


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


async def single_stream_ttft(address: str, prompts: list[list[int]]) -> float:
    """Median time to the first token of one request at a time (no batching, no queueing)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        ttfts = [(await one_stream(stub, p, 1))["ttft"] for p in prompts]
    return statistics.median(ttfts)


def in_process_ttft(engine, prompts: list[list[int]]) -> float:
    from engine_core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ttfts = []
    for prompt in prompts:
        started = time.perf_counter()
        engine.generate([prompt], params)
        ttfts.append(time.perf_counter() - started)
    return statistics.median(ttfts)


def bench_in_process(prompts: list[list[int]], gen_len: int, max_model_len: int, ttft_prompts) -> dict:
    from engine_core.config import EngineConfig, ModelConfig
    from engine_core.llm_engine import LLMEngine
    from engine_core.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=ModelConfig(max_model_len=max_model_len)))
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    single_ttft = in_process_ttft(engine, ttft_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    started = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": elapsed, "generated_tokens": tokens, "tok_per_s": tokens / elapsed,
            "ttft_p50_s": statistics.median(o.first_token_time - o.arrival_time for o in outputs),
            "single_stream_ttft_p50_s": single_ttft}


def main() -> None:
    args = parse_args()
    prompts = make_prompts(args.concurrency, args.prompt_len)
    max_model_len = args.prompt_len + args.gen_len + 32
    engine_args = ["--max-model-len", str(max_model_len), "--max-num-seqs", str(max(args.concurrency, 1))]
    ttft_prompts = make_prompts(9, args.prompt_len, seed=1)
    with LocalStack(frontend_port=free_port(), engine_port=free_port(), engine_args=engine_args) as stack:
        split = asyncio.run(bench_grpc(stack.frontend_address, prompts, args.gen_len))
        split["single_stream_ttft_p50_s"] = asyncio.run(single_stream_ttft(stack.frontend_address, ttft_prompts))
    in_process = bench_in_process(prompts, args.gen_len, max_model_len, ttft_prompts)
    result = {
        "benchmark": "split cost", "concurrency": args.concurrency, "prompt_len": args.prompt_len,
        "gen_len": args.gen_len, "grpc": split, "in_process": in_process,
        "throughput_ratio": split["tok_per_s"] / in_process["tok_per_s"],
        "added_ttft_p50_ms": (split["ttft_p50_s"] - in_process["ttft_p50_s"]) * 1000,
        "added_single_stream_ttft_p50_ms": (split["single_stream_ttft_p50_s"]
                                            - in_process["single_stream_ttft_p50_s"]) * 1000,
    }
    print(f"{'path':>12} | {'tok/s':>8} | {'TTFT p50 s':>10} | {'1-stream TTFT ms':>16} | {'seconds':>8}")
    print("-" * 68)
    for name, row in (("grpc split", split), ("in-process", in_process)):
        print(f"{name:>12} | {row['tok_per_s']:8.1f} | {row['ttft_p50_s']:10.3f} | "
              f"{row['single_stream_ttft_p50_s'] * 1000:16.1f} | {row['seconds']:8.2f}")
    print(f"\nthroughput ratio {result['throughput_ratio']:.3f}, added TTFT p50 {result['added_ttft_p50_ms']:.1f} ms "
          f"at {args.concurrency} streams, {result['added_single_stream_ttft_p50_ms']:.1f} ms for one stream")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
