"""Overlapped steps on or off (engine_core/overlap.py): decode tokens/s of one engine, the two sides in rounds.

The embedded SmolLM2 (or --model) in-process, greedy, EOS ignored, prompts of --context tokens; each round times
--steps decode steps with overlap off, then on, on the same engine (same weights, kernels and KV cache), so the
machine's drift hits both sides alike. This decides `--overlap auto` on CPU (docs/gpu.md); on CUDA
scripts/gpu_check.py measures the same at 64x512.

    .venv/bin/python scripts/bench_overlap.py                      # batch 1 and 32, 4 rounds
    .venv/bin/python scripts/bench_overlap.py --batch 32 --rounds 6 --json bench_results/overlap.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_core.openmp_env import limit_openmp_spinning  # noqa: E402

limit_openmp_spinning()  # before torch loads, as tandem-engine does: idle OpenMP threads must not spin

import torch  # noqa: E402

from engine_core.config import DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from engine_core.engine_core import EngineCore  # noqa: E402
from scripts.gpu_check import decode_rate, set_overlap  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a Hugging Face folder or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--batch", type=int, action="append", help="concurrent requests (default 1 and 32)")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per side and round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    batches = args.batch or [1, 32]
    core = EngineCore(EngineConfig(model=ModelConfig(model=args.model),
                                   scheduler=SchedulerConfig(max_num_seqs=max(batches)),
                                   device=DeviceConfig(device=args.device)))
    device = core.runner.device.type
    results = []
    print(f"{core.info.model_name} on {device} ({core.info.dtype}), prompts of {args.context}, {args.steps} steps")
    print(f"{'batch':>5} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7}  (medians of {args.rounds} rounds)")
    for batch in batches:
        rates: dict[bool, list[float]] = {False: [], True: []}
        for round_index in range(args.rounds + 1):  # round 0 warms both sides up, untimed
            for overlap in (False, True):
                set_overlap(core, overlap)
                row = decode_rate(core, batch, args.context, args.steps, device, seed=2 * round_index + overlap)
                if round_index:
                    rates[overlap].append(row["tok_per_s"])
        off, on = statistics.median(rates[False]), statistics.median(rates[True])
        ratios = [b / a for a, b in zip(rates[False], rates[True])]
        results.append({"batch": batch, "off_tok_per_s": rates[False], "on_tok_per_s": rates[True],
                        "median_ratio_of_pairs": statistics.median(ratios)})
        print(f"{batch:>5} {off:10.1f} {on:10.1f} {statistics.median(ratios):7.3f}", flush=True)
    set_overlap(core, False)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": device, "torch": torch.__version__, "context": args.context,
                                         "steps": args.steps, "rows": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
