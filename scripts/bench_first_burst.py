"""The first burst after ready (issue 50): start the two-process stack as `tandem serve` does, wait until both
services say SERVING, then fire bursts of N streams one after another, nothing sent in between. A warm engine
serves the first burst as fast as the third: the report gives each burst's TTFT p50 and generated tok/s and
the first burst's TTFT p50 over the third's (the issue's bar: at most 1.1).

    python scripts/bench_first_burst.py                                  # SmolLM2, 3 bursts of 32 streams
    python scripts/bench_first_burst.py -- --no-warm-up                  # the same engine, ready before warm
    python scripts/bench_first_burst.py --model M --tokenizer T --streams 4 --input-len 8 --output-len 4  # quick

Flags after `--` go to tandem-engine. Run it on a quiet machine: a neighbour's burst moves one burst's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clients.async_client import AsyncTandemClient  # noqa: E402
from clients.bench.backends import TandemBackend  # noqa: E402
from clients.bench.loadgen import closed_loop  # noqa: E402
from clients.bench.metrics import summarize  # noqa: E402
from clients.bench.prompts import synthetic_prompts  # noqa: E402
from clients.client import TandemClient  # noqa: E402
from clients.local_stack import LocalStack, free_port  # noqa: E402


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ours, engine_flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face folder or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--tokenizer", help="a .gguf or a tokenizer.json folder, for both services (as tandem serve's)")
    parser.add_argument("--streams", type=int, default=32, help="streams per burst, all sent at once")
    parser.add_argument("--bursts", type=int, default=3, help="bursts, one after another (at least 1)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per stream")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens per stream (EOS ignored)")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds the stack may take to serve")
    parser.add_argument("--output", default="bench_results/first_burst.json", help="where the JSON goes")
    args = parser.parse_args(ours)
    if args.bursts < 1 or args.streams < 1:
        parser.error("--bursts and --streams must be at least 1")
    return args, engine_flags


def main(argv: list[str] | None = None) -> int:
    args, engine_flags = parse_args(sys.argv[1:] if argv is None else argv)
    model = ["--model", args.model] if args.model else []
    both = ["--tokenizer", args.tokenizer] if args.tokenizer else []
    stack = LocalStack(frontend_port=free_port(), engine_port=free_port(), engine_args=[*model, *both, *engine_flags],
                       frontend_args=both, startup_timeout=args.startup_timeout)
    started = time.perf_counter()
    with stack:
        ready_s = time.perf_counter() - started
        with TandemClient(stack.frontend_address, timeout=60) as client:
            bursts = [synthetic_prompts(args.streams, args.input_len, args.output_len, seed,
                                        tokenize=lambda text: client.tokenize(text, add_special_tokens=False).token_ids,
                                        detokenize=client.detokenize)
                      for seed in range(args.bursts)]  # distinct prompts per burst: no prefix-cache hits

        async def fire() -> list[dict]:
            backend = TandemBackend(AsyncTandemClient(stack.frontend_address, timeout=600))
            try:
                return [summarize(*await closed_loop(backend, prompts, args.streams)) for prompts in bursts]
            finally:
                await backend.close()

        summaries = asyncio.run(fire())
    rows = [{"burst": i + 1, "ttft_p50_s": s["ttft"]["p50_ms"] / 1e3, "tok_per_s": s["output_token_throughput"],
             "completed": s["completed"], "failed": s["failed"]} for i, s in enumerate(summaries)]
    result = {"benchmark": "first burst after ready", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "model": args.model or "embedded SmolLM2", "engine_flags": engine_flags, "streams": args.streams,
              "input_len": args.input_len, "output_len": args.output_len, "ready_s": ready_s, "bursts": rows,
              "first_over_last_ttft_p50": rows[0]["ttft_p50_s"] / rows[-1]["ttft_p50_s"]}
    print(f"ready in {ready_s:.1f} s; {args.streams} streams per burst, {args.input_len} prompt tokens, "
          f"{args.output_len} generated")
    for row in rows:
        print(f"burst {row['burst']}: TTFT p50 {row['ttft_p50_s']:.3f} s, {row['tok_per_s']:.0f} tok/s"
              + (f", {row['failed']} failed" if row["failed"] else ""))
    print(f"burst 1 / burst {len(rows)} TTFT p50: {result['first_over_last_ttft_p50']:.2f} (bar: at most 1.1)")
    path = Path(args.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0 if all(row["failed"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
