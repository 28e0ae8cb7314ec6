"""--kv-cache-dtype on the CPU: engines with a bf16 and an int8 KV cache side by side, in one process, alternating
rounds, on the embedded SmolLM2 (bf16, the same memory budget for both caches). Issue 53's three speed figures:

  prefill     one --long-prompt-token prompt (default 6,000), its prompt tokens per second (to its first token)
  1 stream    that request's decode after it: --gen-len tokens, per second from its first token to its last
  N streams   --streams distinct --prompt-len-token prompts (default 32 x 1,024) decoding --gen-len tokens
              together: tokens per second from the last stream's first token to the end (decode only)

Each figure is the best of --rounds rounds (each round runs every KV dtype once, in turn); the ratios against
bf16 are printed beside the issue's bars (1 stream >= 1.5x, N streams >= 1.1x, prefill >= 0.95x), and everything
goes to --output as JSON. Prompts are random token ids, distinct per round, and the prefix cache is reset before
each request, so nothing is served from it. The engines load once each (plans timed fresh in a temporary
TANDEM_CACHE_DIR unless one is set); the first engine's linear plans are pinned in the others
(--linear-kernels), so the KV cache is all that differs. Run it on a quiet machine: it measures speed.

    python scripts/bench_kv_dtype.py                                    # bf16 vs int8, 3 rounds (~10 min)
    python scripts/bench_kv_dtype.py --kv-dtypes bf16 int8 fp32 --rounds 5
    python scripts/bench_kv_dtype.py --rounds 1 --long-prompt-len 512 --streams 4 --prompt-len 128 --gen-len 8  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_core.openmp_env import limit_openmp_spinning  # noqa: E402

limit_openmp_spinning()  # before torch loads, as tandem-engine does

import torch  # noqa: E402

from engine_core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from engine_core.offline.llm_engine import LLMEngine  # noqa: E402
from engine_core.protocol import OutputKind, SamplingParams  # noqa: E402
from scripts.bench_offline import make_prompts  # noqa: E402

BARS = {"one_stream_decode": 1.5, "streams_decode": 1.1, "prefill": 0.95}  # issue 53: int8 against bf16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-dtypes", nargs="+", default=["bf16", "int8"], help="the first is the baseline")
    parser.add_argument("--long-prompt-len", type=int, default=6000, help="the prefill and one-stream prompt")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=1024, help="each of the N streams' prompts")
    parser.add_argument("--gen-len", type=int, default=64, help="tokens each request generates")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"], help="the model's")
    parser.add_argument("--kv-cache-memory-gib", type=float, default=2.0, help="the same budget for every KV dtype")
    parser.add_argument("--output", default="bench_results/kv_dtype.json")
    return parser.parse_args()


def run(engine: LLMEngine, prompts: list[list[int]], gen_len: int) -> tuple[float, float, float]:
    """All prompts at once, greedy, exactly gen_len tokens each: (seconds to the first token of the first
    request, seconds from the last request's first token to the end, tokens generated in that span)."""
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True, output_kind=OutputKind.DELTA)
    engine.engine_core.reset_prefix_cache()
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"kv-{index}", prompt, params)
    first: dict[str, float] = {}
    steps = []  # (seconds since the start, tokens the step generated)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter() - started
        for output in outputs:
            if any(c.token_ids for c in output.completions):
                first.setdefault(output.request_id, now)
        steps.append((now, sum(len(c.token_ids) for output in outputs for c in output.completions)))
    decode_start = max(first.values())
    decoded = sum(tokens for at, tokens in steps if at > decode_start)
    return min(first.values()), steps[-1][0] - decode_start, decoded


def plan_pins(engine: LLMEngine) -> str:
    """The engine's measured linear plans as a --linear-kernels spec (each linear's name, bucket by bucket)."""
    from kernels.cpu.linear import CpuLinear

    plans = {}
    for name, module in engine.engine_core.model.named_modules():
        if isinstance(module, CpuLinear):
            plans.setdefault(name.rpartition(".")[2], module.plan)
    return ",".join(f"{layer}@{rows}={kernel}" for layer, plan in plans.items() for rows, kernel in plan)


def main() -> None:
    args = parse_args()
    os.environ.setdefault("TANDEM_CACHE_DIR", tempfile.mkdtemp(prefix="tandem-kv-dtype-"))  # plans timed here
    max_len = max(args.long_prompt_len, args.prompt_len) + args.gen_len + 16
    engines: dict[str, LLMEngine] = {}
    pins = None
    for kv in args.kv_dtypes:
        engines[kv] = LLMEngine(EngineConfig(
            model=ModelConfig(dtype=args.dtype, max_model_len=max_len, linear_kernels=pins),
            cache=CacheConfig(kv_cache_memory_gib=args.kv_cache_memory_gib, kv_cache_dtype=kv),
            scheduler=SchedulerConfig(max_num_seqs=max(args.streams, 1)),
        ))
        pins = pins or plan_pins(engines[kv]) or None
        info = engines[kv].info
        print(f"{kv}: {info.num_blocks} blocks of {info.block_size} ({info.num_blocks * info.block_size} tokens) "
              f"in {args.kv_cache_memory_gib} GiB, model {info.dtype}", flush=True)
    vocab = engines[args.kv_dtypes[0]].info.vocab_size
    for engine in engines.values():  # warm-up: every step shape once
        run(engine, make_prompts(2, 64, vocab, seed=99), 4)
    best: dict[str, dict[str, float]] = {kv: {} for kv in args.kv_dtypes}
    rounds = []
    for r in range(args.rounds):
        long_prompt = make_prompts(1, args.long_prompt_len, vocab, seed=1000 + r)
        prompts = make_prompts(args.streams, args.prompt_len, vocab, seed=2000 + r)
        for kv, engine in engines.items():
            ttft, decode_s, tokens = run(engine, long_prompt, args.gen_len)
            figures = {"prefill": args.long_prompt_len / ttft, "one_stream_decode": tokens / decode_s}
            _, decode_s, tokens = run(engine, prompts, args.gen_len)
            figures["streams_decode"] = tokens / decode_s
            rounds.append({"round": r, "kv_cache_dtype": kv, **figures})
            for name, value in figures.items():
                best[kv][name] = max(best[kv].get(name, 0.0), value)
            print(f"round {r} {kv:>5}: prefill {figures['prefill']:7.0f} tok/s, "
                  f"1 stream {figures['one_stream_decode']:6.1f} tok/s, "
                  f"{args.streams} streams {figures['streams_decode']:7.1f} tok/s", flush=True)
    base = args.kv_dtypes[0]
    print(f"\nbest of {args.rounds} rounds; ratio against {base} (issue 53's bar for int8)")
    labels = {"prefill": f"prefill ({args.long_prompt_len}-token prompt)",
              "one_stream_decode": f"1 stream decode after {args.long_prompt_len}",
              "streams_decode": f"{args.streams} streams decode after {args.prompt_len}"}
    for name, label in labels.items():
        cells = [f"{kv} {best[kv][name]:.1f} ({best[kv][name] / best[base][name]:.2f}x)" for kv in args.kv_dtypes]
        print(f"  {label:<34} " + ", ".join(cells) + f"   bar {BARS[name]}x")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "KV cache dtype speed", "date": time.strftime("%Y-%m-%d"), "machine": platform.processor()
        or platform.machine(), "threads": torch.get_num_threads(), "model_dtype": args.dtype,
        "long_prompt_len": args.long_prompt_len, "streams": args.streams, "prompt_len": args.prompt_len,
        "gen_len": args.gen_len, "kv_cache_memory_gib": args.kv_cache_memory_gib,
        "num_blocks": {kv: engine.info.num_blocks for kv, engine in engines.items()}, "linear_kernels": pins,
        "best": best, "bars": BARS, "rounds": rounds}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
