"""Offline throughput on the embedded SmolLM2: Tandem's LLMEngine vs transformers `generate`.

Same weights, same prompts, same run: each concurrency level runs `concurrency`
requests of about `--prompt-len` prompt tokens that each generate exactly
`--gen-len` tokens (greedy, EOS ignored). Throughput counts generated tokens over
the wall time of the whole batch, prefill included (ANCHORS.md's "total").

    python scripts/bench_offline.py                          # 1, 8, 32 concurrent
    python scripts/bench_offline.py --concurrency 1 32 --skip-transformers
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from clients.bench.transformers_peer import generate_batch, load_transformers  # noqa: E402
from engine_core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from engine_core.loader.registry import default_model_path  # noqa: E402
from engine_core.offline.llm_engine import LLMEngine  # noqa: E402
from engine_core.protocol import OutputKind, SamplingParams  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="auto: bf16 where the CPU has native bf16 (AMX / AVX-512 BF16), else fp32; "
                             "transformers runs in the same dtype")
    parser.add_argument("--skip-transformers", action="store_true", help="run Tandem only")
    parser.add_argument("--output", default="bench_results/offline.json", help="where to write JSON")
    return parser.parse_args()


def make_prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Distinct random prompts (no shared prefix, so the prefix cache cannot flatter us)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size - 100, (count, length), generator=generator).tolist()


def bench_tandem(engine: LLMEngine, prompts: list[list[int]], gen_len: int,
                 lora_names: list[str | None] | None = None) -> dict:
    """All prompts at once, greedy, exactly gen_len tokens each (lora_names: each prompt's adapter, None: base)."""
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True, output_kind=OutputKind.DELTA)
    engine.engine_core.reset_prefix_cache()
    started = time.perf_counter()
    for index, (prompt, lora_name) in enumerate(zip(prompts, lora_names or [None] * len(prompts))):
        engine.add_request(f"bench-{index}", prompt, params, lora_name=lora_name)
    first_token: dict[str, float] = {}
    generated = 0
    while engine.has_unfinished_requests():
        for output in engine.step():  # DELTA (asked for: LLMEngine is CUMULATIVE by default): new tokens only
            first_token.setdefault(output.request_id, time.perf_counter() - started)
            generated += sum(len(c.token_ids) for c in output.completions)
    elapsed = time.perf_counter() - started
    ttfts = sorted(first_token.values())
    return {"seconds": elapsed, "generated_tokens": generated, "tok_per_s": generated / elapsed,
            "ttft_p50_s": ttfts[len(ttfts) // 2]}


def main() -> None:
    args = parse_args()
    max_batch = max(args.concurrency)
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(dtype=args.dtype, max_model_len=args.prompt_len + args.gen_len + 16),
        cache=CacheConfig(kv_cache_memory_gib=1.0),
        scheduler=SchedulerConfig(max_num_seqs=max(max_batch, 1), max_num_batched_tokens=4096),
    ))
    vocab = engine.info.vocab_size
    dtype = getattr(torch, engine.info.dtype)
    engine.generate(make_prompts(2, 16, vocab, seed=99), SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    hf_model = None if args.skip_transformers else load_transformers(default_model_path(), dtype)

    rows = []
    for concurrency in args.concurrency:
        prompts = make_prompts(concurrency, args.prompt_len, vocab, seed=concurrency)
        row = {"concurrency": concurrency, "tandem": bench_tandem(engine, prompts, args.gen_len)}
        if hf_model is not None:
            row["transformers"] = generate_batch(hf_model, prompts, args.gen_len)
            row["ratio"] = row["tandem"]["tok_per_s"] / row["transformers"]["tok_per_s"]
        rows.append(row)
        print_row(row)

    result = {
        "benchmark": "offline throughput", "model": "SmolLM2-135M-Instruct (GGUF, dequantized)",
        "dtype": engine.info.dtype, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
        "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "rows": rows,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


def print_row(row: dict) -> None:
    if not hasattr(print_row, "header"):
        print(f"{'concurrency':>11} | {'tandem tok/s':>12} | {'TTFT p50 s':>10} | "
              f"{'transformers tok/s':>18} | {'ratio':>6}")
        print("-" * 70)
        print_row.header = True
    hf = row.get("transformers", {}).get("tok_per_s")
    hf_text = f"{hf:18.1f}" if hf else f"{'-':>18}"
    ratio = f"{row['ratio']:6.2f}" if "ratio" in row else f"{'-':>6}"
    tandem = row['tandem']
    print(f"{row['concurrency']:>11} | {tandem['tok_per_s']:12.1f} | {tandem['ttft_p50_s']:10.3f} | "
          f"{hf_text} | {ratio}", flush=True)


if __name__ == "__main__":
    main()
