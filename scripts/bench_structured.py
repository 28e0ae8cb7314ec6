"""Structured output's cost, in one run: 32 streams under a JSON schema vs the same 32 unconstrained.

Both runs go through `tandem serve`'s two processes (engine + frontend over loopback) on the embedded
SmolLM2, with the same chat prompts and exactly --max-tokens generated per stream: the schema asks
for a long array of records, so no constrained stream finishes early, and the unconstrained ones
ignore EOS. The runs alternate (--rounds times each) and the best of each is compared.

Printed and written to bench_results/structured.json:
  throughput   generated tokens per second, constrained / unconstrained (the aim: >= 0.9)
  mask time    per constrained token (a step's mask computation over its rows): mean and p99, from the
               engine's own `tandem:structured_mask_seconds` histogram (p99 interpolated in its buckets)
  mask wait    per step, how long sampling waited for the masks after the forward (what was not hidden)

    python scripts/bench_structured.py
    python scripts/bench_structured.py --streams 16 --max-tokens 64 -- --dtype float32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clients.async_client import AsyncTandemClient  # noqa: E402
from clients.local_stack import LocalStack, free_port  # noqa: E402

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "designer", "manager", "scientist"]},
        "city": {"type": "string", "maxLength": 20},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "city", "skills"],
    "additionalProperties": False,
}
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": RECORD, "minItems": 100}},
          "required": ["people"], "additionalProperties": False}
TOPICS = ["a startup", "a hospital", "a university lab", "a film crew", "a football club", "a bakery", "an airline",
          "a newsroom"]
MASK_METRIC, WAIT_METRIC = "tandem:structured_mask_seconds", "tandem:structured_mask_wait_seconds"


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"List the people who work at {TOPICS[i % len(TOPICS)]} (team {i}) as JSON."}]


async def run_streams(address: str, streams: int, max_tokens: int, constrained: bool) -> dict:
    """`streams` concurrent chats; generated tokens and wall time."""
    sampling = {"temperature": 0.7, "max_tokens": max_tokens}
    sampling.update({"json_schema": SCHEMA} if constrained else {"ignore_eos": True})

    async with AsyncTandemClient(address, timeout=1800) as client:
        async def one(i: int) -> tuple[int, str | None]:
            tokens, finish = 0, None
            async for chunk in client.chat(messages(i), seed=i, **sampling):
                tokens += len(chunk.token_ids)
                finish = chunk.finish_reason or finish
            return tokens, finish

        started = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(streams)))
        wall = time.perf_counter() - started
    tokens = sum(t for t, _ in results)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "finish_reasons": sorted({f for _, f in results if f})}


# ---- the engine's histograms ------------------------------------------------------------------------
def scrape(url: str) -> dict[str, dict]:
    """{metric: {"sum", "count", "buckets": [(le, cumulative count)]}} for the two mask histograms."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found = {name: {"sum": 0.0, "count": 0.0, "buckets": []} for name in (MASK_METRIC, WAIT_METRIC)}
    for line in text.splitlines():
        for name, entry in found.items():
            if line.startswith(name + "_sum"):
                entry["sum"] = float(line.split()[-1])
            elif line.startswith(name + "_count"):
                entry["count"] = float(line.split()[-1])
            elif line.startswith(name + "_bucket"):
                le = line.split('le="')[1].split('"')[0]
                entry["buckets"].append((float(le), float(line.split()[-1])))
    return found


def delta(after: dict, before: dict) -> dict:
    return {"sum": after["sum"] - before["sum"], "count": after["count"] - before["count"],
            "buckets": [(le, a - b) for (le, a), (_, b) in zip(after["buckets"], before["buckets"])]}


def quantile(hist: dict, q: float) -> float | None:
    """Prometheus' histogram_quantile: linear inside the bucket that holds rank q * count."""
    if not hist["count"]:
        return None
    rank, lower, below = q * hist["count"], 0.0, 0.0
    for le, cumulative in hist["buckets"]:
        if cumulative >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / max(cumulative - below, 1e-12)
        lower, below = le, cumulative
    return lower


# ---- the run --------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per stream")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternating; the best counts")
    parser.add_argument("--json", type=Path, default=ROOT / "bench_results" / "structured.json")
    parser.add_argument("engine_args", nargs=argparse.REMAINDER, help="-- then flags for tandem-engine")
    args = parser.parse_args()
    engine_args = [a for a in args.engine_args if a != "--"]

    metrics_port = free_port()
    stack = LocalStack(frontend_port=free_port(), engine_port=free_port(),
                       engine_args=[*engine_args, "--max-num-seqs", str(max(args.streams, 1)), "--metrics-port",
                                    str(metrics_port), "--log-level", "WARNING"],
                       frontend_args=["--log-level", "WARNING"])
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    runs: dict[str, list[dict]] = {"unconstrained": [], "json_schema": []}
    with stack:
        for constrained in (False, True):  # warm up: the batch shapes, llguidance's vocabulary and grammar
            asyncio.run(run_streams(stack.frontend_address, args.streams, 8, constrained=constrained))
        before = scrape(url)
        for _ in range(args.rounds):
            for mode in runs:
                result = asyncio.run(run_streams(stack.frontend_address, args.streams, args.max_tokens,
                                                 constrained=mode == "json_schema"))
                runs[mode].append(result)
                print(f"  {mode:<14} {result['tokens']:>6} tokens in {result['wall_s']:6.1f} s "
                      f"= {result['tokens_per_s']:7.1f} tok/s  finish: {', '.join(result['finish_reasons'])}")
        after = scrape(url)
    best = {mode: max(results, key=lambda r: r["tokens_per_s"]) for mode, results in runs.items()}
    mask, wait = delta(after[MASK_METRIC], before[MASK_METRIC]), delta(after[WAIT_METRIC], before[WAIT_METRIC])
    report = {
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                    "note": "shared machines give noisy absolute numbers: compare the ratio"},
        "streams": args.streams, "max_tokens": args.max_tokens, "rounds": args.rounds, "engine_args": engine_args,
        "runs": runs, "best": best,
        "throughput_ratio": best["json_schema"]["tokens_per_s"] / best["unconstrained"]["tokens_per_s"],
        "mask_per_token_ms": {"mean": 1000 * mask["sum"] / max(mask["count"], 1),
                              "p99": 1000 * (quantile(mask, 0.99) or 0.0), "tokens": mask["count"]},
        "mask_wait_per_step_ms": {"mean": 1000 * wait["sum"] / max(wait["count"], 1),
                                  "p99": 1000 * (quantile(wait, 0.99) or 0.0), "steps": wait["count"]},
    }
    print_report(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


def print_report(report: dict) -> None:
    free, constrained = report["best"]["unconstrained"], report["best"]["json_schema"]
    print(f"\n{report['streams']} streams x {report['max_tokens']} tokens, SmolLM2 over gRPC (best of "
          f"{report['rounds']})")
    print(f"{'mode':<16}{'tokens':>8}{'wall s':>9}{'tok/s':>9}")
    for mode, row in (("unconstrained", free), ("json_schema", constrained)):
        print(f"{mode:<16}{row['tokens']:>8}{row['wall_s']:>9.1f}{row['tokens_per_s']:>9.1f}")
    print(f"throughput ratio (json_schema / unconstrained): {report['throughput_ratio']:.3f}  (aim >= 0.9)")
    mask, wait = report["mask_per_token_ms"], report["mask_wait_per_step_ms"]
    print(f"mask time per constrained token: mean {mask['mean']:.3f} ms, p99 {mask['p99']:.3f} ms "
          f"({mask['tokens']:.0f} tokens)")
    print(f"sampler's wait for masks per step: mean {wait['mean']:.3f} ms, p99 {wait['p99']:.3f} ms "
          f"({wait['steps']:.0f} steps)")


if __name__ == "__main__":
    sys.exit(main())
