"""smg in front of Tandem vs Tandem's own gRPC, side by side in one run; then cut HTTP streams and count leaks.

1. Throughput and TTFT: `--streams` concurrent streaming chats (the same messages, greedy, `--max-tokens`
   each, EOS ignored so every answer has the same length) straight to the frontend's gRPC `Chat`
   (AsyncTandemClient), then the same through smg over HTTP (`/v1/chat/completions`, stream, one thread per
   client); `--rounds` times, alternating, on one stack. Output tokens per second (all answers' tokens over
   the round's wall time) and TTFT (request sent -> first token's text) p50 per side; the ratio and the
   added TTFT p50 per round. smg's CPU counts: it runs on the same machine and cores as the stack.
2. Leaks: `--cuts` streams through smg, `--cut-concurrency` at a time, each closed after a random number
   of events (0 to 20) or a random delay; then the engine must report 0 running requests and every KV block
   free (it gets `--settle-s` to get there).

Prints a table and writes bench_results/bench_gateway.json.

    python scripts/bench_gateway.py                                  # SmolLM2, 32 streams, 3 rounds, 200 cuts
    python scripts/bench_gateway.py --model /path/tiny --streams 4 --rounds 1 --cuts 10 --max-tokens 16   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clients.async_client import AsyncTandemClient  # noqa: E402
from clients.gateway import Gateway, stream_sse  # noqa: E402
from clients.local_stack import LocalStack, free_port  # noqa: E402
from tests.services.conftest import engine_stats  # noqa: E402 - the engine's exact free-block count (GET_STATS)

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea.",
             "Explain gRPC in one sentence.", "What is 12 times 12?", "Tell me about the Moon."]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="engine --model (default: the embedded SmolLM2)")
    parser.add_argument("--tokenizer", help="frontend and engine --tokenizer (a tiny model needs SmolLM2's)")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cuts", type=int, default=200)
    parser.add_argument("--cut-concurrency", type=int, default=16)
    parser.add_argument("--settle-s", type=float, default=30.0)
    parser.add_argument("--out", default=str(ROOT / "bench_results" / "bench_gateway.json"))
    return parser.parse_args()


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]


# ---- side A: gRPC Chat ----------------------------------------------------------------
async def grpc_round(address: str, streams: int, max_tokens: int) -> dict:
    async with AsyncTandemClient(address, timeout=600) as client:
        async def one(i: int) -> tuple[float, int]:
            start, ttft, tokens = time.perf_counter(), None, 0
            async for chunk in client.chat(messages(i), temperature=0, max_tokens=max_tokens, ignore_eos=True):
                if ttft is None and chunk.text:
                    ttft = time.perf_counter() - start
                tokens += len(chunk.token_ids)
            return ttft or 0.0, tokens
        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(streams)))
        wall = time.perf_counter() - start
    return summary(results, wall)


# ---- side B: HTTP through smg -----------------------------------------------------------------
def http_one(url: str, model: str, i: int, max_tokens: int) -> tuple[float, int]:
    body = {"model": model, "messages": messages(i), "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    start, ttft, tokens = time.perf_counter(), None, 0
    for event in stream_sse(url, body, timeout=600):
        if ttft is None and any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
            ttft = time.perf_counter() - start
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    return ttft or 0.0, tokens


def http_round(gateway: Gateway, model: str, streams: int, max_tokens: int) -> dict:
    url = gateway.url + "/v1/chat/completions"
    with ThreadPoolExecutor(streams) as pool:
        start = time.perf_counter()
        results = list(pool.map(lambda i: http_one(url, model, i, max_tokens), range(streams)))
        wall = time.perf_counter() - start
    return summary(results, wall)


def summary(results: list[tuple[float, int]], wall: float) -> dict:
    tokens = sum(t for _, t in results)
    return {"tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall,
            "ttft_p50_s": statistics.median(t for t, _ in results)}


# ---- leaks -----------------------------------------------------------------------------
def cut_streams(gateway: Gateway, model: str, count: int, concurrency: int, max_tokens: int) -> int:
    """`count` streams, each closed early at a random point; how many were cut before they finished."""
    url = gateway.url + "/v1/chat/completions"
    rng = random.Random(0)
    plans = [(rng.randrange(0, 21), rng.uniform(0.0, 0.5)) for _ in range(count)]
    cut = [0]
    lock = threading.Lock()

    def one(i: int) -> None:
        events_before_cut, delay = plans[i]
        body = {"model": model, "messages": messages(i), "temperature": 0.8, "max_tokens": max_tokens,
                "ignore_eos": True}
        stream = stream_sse(url, body, timeout=600)
        start = time.perf_counter()
        try:
            for n, _event in enumerate(stream):
                if n >= events_before_cut or time.perf_counter() - start > delay:
                    with lock:
                        cut[0] += 1
                    return
        finally:
            stream.close()

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(count)))
    return cut[0]


def wait_for_idle_engine(address: str, settle_s: float) -> dict:
    deadline = time.monotonic() + settle_s
    while True:
        stats = engine_stats(address)
        idle = stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
        if (idle and stats.num_free_blocks == stats.num_total_blocks) or time.monotonic() > deadline:
            return {"running": stats.num_running_reqs, "waiting": stats.num_waiting_reqs,
                    "leaked_blocks": stats.num_total_blocks - stats.num_free_blocks,
                    "total_blocks": stats.num_total_blocks}
        time.sleep(0.2)


def main() -> int:
    args = parse_args()
    engine_args = ["--max-model-len", "2048", "--log-level", "WARNING"]
    frontend_args = ["--log-level", "WARNING"]
    if args.model:
        engine_args += ["--model", args.model]
    if args.tokenizer:
        engine_args += ["--tokenizer", args.tokenizer]
        frontend_args += ["--tokenizer", args.tokenizer]
    rounds = []
    with LocalStack(frontend_port=free_port(), engine_port=free_port(), engine_args=engine_args,
                    frontend_args=frontend_args) as stack:
        with Gateway([stack.frontend_address], port=free_port(), extra_args=["--log-level", "warn"]) as gateway:
            model = gateway.wait_for_model()
            # warm-up: both paths once (kernels, smg's tokenizer caches)
            asyncio.run(grpc_round(stack.frontend_address, 2, 8))
            http_round(gateway, model, 2, 8)
            for r in range(args.rounds):
                grpc_side = asyncio.run(grpc_round(stack.frontend_address, args.streams, args.max_tokens))
                http_side = http_round(gateway, model, args.streams, args.max_tokens)
                rounds.append({"grpc": grpc_side, "smg_http": http_side,
                               "throughput_ratio": http_side["tok_per_s"] / grpc_side["tok_per_s"],
                               "added_ttft_p50_s": http_side["ttft_p50_s"] - grpc_side["ttft_p50_s"]})
                print(f"round {r + 1}: gRPC {grpc_side['tok_per_s']:.1f} tok/s, TTFT p50 "
                      f"{grpc_side['ttft_p50_s'] * 1000:.0f} ms | smg HTTP {http_side['tok_per_s']:.1f} tok/s, "
                      f"TTFT p50 {http_side['ttft_p50_s'] * 1000:.0f} ms | ratio {rounds[-1]['throughput_ratio']:.3f}, "
                      f"added TTFT p50 {rounds[-1]['added_ttft_p50_s'] * 1000:+.0f} ms", flush=True)
            started = time.perf_counter()
            cut = cut_streams(gateway, model, args.cuts, args.cut_concurrency, max(args.max_tokens, 256))
            leaks = wait_for_idle_engine(stack.engine_address, args.settle_s)
            print(f"{args.cuts} HTTP streams ({cut} cut before their end) in {time.perf_counter() - started:.1f} s: "
                  f"engine running {leaks['running']}, waiting {leaks['waiting']}, leaked KV blocks "
                  f"{leaks['leaked_blocks']} of {leaks['total_blocks']}", flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or
              platform.machine(), "args": vars(args), "rounds": rounds,
              "median_throughput_ratio": statistics.median(r["throughput_ratio"] for r in rounds) if rounds else None,
              "median_added_ttft_p50_s": statistics.median(r["added_ttft_p50_s"] for r in rounds) if rounds else None,
              "cuts": {"streams": args.cuts, "cut": cut, **leaks}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0 if leaks["leaked_blocks"] == 0 and leaks["running"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
