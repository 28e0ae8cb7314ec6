"""What --batch-invariant costs: the default engine and the batch-invariant one side by side, in one process,
alternating rounds, on the embedded SmolLM2 (bf16 where the CPU multiplies it natively).

Each round runs `concurrency` distinct random prompts of --prompt-len tokens that each generate exactly
--gen-len tokens (greedy, EOS ignored, prefix cache reset), as scripts/bench_offline.py counts them:
generated tokens over the whole batch's wall time, prefill included.

    python scripts/bench_batch_invariant.py                      # 1 and 32 streams, 2 rounds each
    python scripts/bench_batch_invariant.py --concurrency 32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine_core.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from engine_core.offline.llm_engine import LLMEngine  # noqa: E402
from engine_core.protocol import SamplingParams  # noqa: E402
from scripts.bench_offline import bench_tandem, make_prompts  # noqa: E402

MODES = {"default": False, "batch-invariant": True}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per mode and concurrency")
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--output", default="bench_results/batch_invariant.json", help="where to write JSON")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    engines = {mode: LLMEngine(EngineConfig(
        model=ModelConfig(dtype=args.dtype, max_model_len=args.prompt_len + args.gen_len + 16),
        cache=CacheConfig(kv_cache_memory_gib=1.0),
        scheduler=SchedulerConfig(max_num_seqs=max(args.concurrency)),
        device=DeviceConfig(batch_invariant=invariant),
    )) for mode, invariant in MODES.items()}
    vocab = engines["default"].info.vocab_size
    for engine in engines.values():  # warm-up
        engine.generate(make_prompts(2, 16, vocab, seed=99), SamplingParams(max_tokens=4, ignore_eos=True))
    rows = []
    for concurrency in args.concurrency:
        prompts = make_prompts(concurrency, args.prompt_len, vocab, seed=concurrency)
        tok_s: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode, engine in engines.items():
                tok_s[mode].append(bench_tandem(engine, prompts, args.gen_len)["tok_per_s"])
        ratio = sum(tok_s["batch-invariant"]) / sum(tok_s["default"])
        rows.append({"concurrency": concurrency, "tok_per_s": tok_s, "ratio": ratio})
        print(f"{concurrency:>3} streams: default {' / '.join(f'{t:.0f}' for t in tok_s['default'])} tok/s, "
              f"batch-invariant {' / '.join(f'{t:.0f}' for t in tok_s['batch-invariant'])} tok/s: {ratio:.2f}x",
              flush=True)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = platform.processor() or platform.machine()
    out.write_text(json.dumps({"benchmark": "batch-invariant cost", "dtype": engines["default"].info.dtype,
                               "prompt_len": args.prompt_len, "gen_len": args.gen_len,
                               "threads": torch.get_num_threads(), "machine": machine, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
