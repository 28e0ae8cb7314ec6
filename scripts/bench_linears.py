"""SmolLM2-135M's linear layers alone, each CPU kernel of kernels/cpu/linear.py per batch size,
beside ../shared/tools/cpu_floor.py in the same run; optionally the in-process decode step.

One step = the 30 layers' qkv, o, gate_up and down projections plus the LM head (random weights,
no attention), as cpu_floor.py times it. The decoder weights are rounded onto int4's grid, as
the embedded Q4_1 GGUF holds them (so `auto` may take int4 there, as it does on that file); the
LM head stays float. Rows: every kernel forced, then the plan `use_measured_linears` chooses on
this machine for each --quantization. Timed on the main thread, candidates interleaved round by
round, best of the rounds (the machine is shared: quote ratios).

--decode times LLMEngine's pure-decode step at 1 and 32 streams (main thread, SmolLM2) for
each set of engine flags given, e.g. --decode "--quantization none" "--quantization auto".

    python scripts/bench_linears.py                      # table
    python scripts/bench_linears.py --json out.json      # and JSON
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine_core.openmp_env import limit_openmp_spinning  # noqa: E402

limit_openmp_spinning()  # as tandem-engine does, before torch loads

import torch  # noqa: E402
from torch import nn  # noqa: E402

from kernels.cpu.int4_linear import dequantize_int4, quantize_int4  # noqa: E402
from kernels.cpu.linear import KERNELS, CpuLinear, kernel_fits, use_measured_linears  # noqa: E402
from kernels.cpu.linear_timing import fastest  # noqa: E402

HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
QKV = HIDDEN + 2 * 192
FLOOR = ROOT.parent / "shared" / "tools" / "cpu_floor.py"


class Linears(nn.Module):
    """The model's linear layers with its real shapes, called as one decode step calls them."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        def linear(i, o, on_int4_grid=True):
            weight = torch.randn(o, i) * i**-0.5
            if on_int4_grid:
                weight = dequantize_int4(*quantize_int4(weight))
            layer = nn.Linear(i, o, bias=False)
            layer.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
            return layer
        self.layers = nn.ModuleList(
            nn.ModuleList([linear(HIDDEN, QKV), linear(HIDDEN, HIDDEN), linear(HIDDEN, 2 * INTER),
                           linear(INTER, HIDDEN)]) for _ in range(LAYERS))
        self.lm_head = linear(HIDDEN, VOCAB, on_int4_grid=False)

    def step(self, x: torch.Tensor, xi: torch.Tensor) -> None:
        for qkv, o, gate_up, down in self.layers:
            qkv(x), o(x), gate_up(x), down(xi)
        self.lm_head(x)


def sharing(model: Linears, make=lambda m: _linear_over(m.weight)) -> Linears:
    """A copy of `model` over the same weights, each layer rebuilt by `make`."""
    copy = Linears.__new__(Linears)
    nn.Module.__init__(copy)
    copy.layers = nn.ModuleList(nn.ModuleList(make(m) for m in layer) for layer in model.layers)
    copy.lm_head = make(model.lm_head)
    return copy


def _linear_over(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer


def run_floor(batches: list[int]) -> dict | None:
    if not FLOOR.exists():
        print(f"floor: {FLOOR} not found, skipped", file=sys.stderr)
        return None
    cmd = [sys.executable, str(FLOOR), "--json", "--batches", *map(str, batches)]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def linears(args, dtype: torch.dtype) -> tuple[dict, dict]:
    torch.manual_seed(0)
    base = Linears(dtype)
    steps = {f"forced {k}": sharing(base, lambda m, k=k: CpuLinear(m.weight, None, [(1, k)]))
             for k in KERNELS if kernel_fits(k, base.lm_head.weight)}
    plans = {}
    for quantization in ("none", "int8", "int4", "auto"):
        model = sharing(base)
        plans[quantization] = {f"{o}x{i}": p for (o, i), p in use_measured_linears(model, quantization).items()}
        steps[f"measured {quantization}"] = model
    rows = {}
    for batch in args.batches:
        x, xi = torch.randn(batch, HIDDEN, dtype=dtype), torch.randn(batch, INTER, dtype=dtype)
        with torch.no_grad():
            best = fastest({name: (lambda m=m: m.step(x, xi)) for name, m in steps.items()}, batch,
                           min_rounds=3, budget_s=0.5)
        rows[batch] = {name: round(seconds * 1e3, 2) for name, seconds in best.items()}
    return rows, plans


def decode_steps(flag_sets: list[str]) -> dict[str, dict]:
    """Pure-decode step (ms, median) at 1 and 32 streams, stepped here, for each engine flag set."""
    from clients.bench.prompts import synthetic_prompts
    from engine_core.loader import default_model_path
    from engine_core.offline.llm_engine import LLMEngine
    from scripts.bench_sides import WARM_UP, combine, in_process_round
    from services.engine.__main__ import build_parser, config_from_args
    from services.frontend.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    prompts = synthetic_prompts(32, 64, 16, seed=0, tokenize=lambda t: tokenizer.encode(t, add_special_tokens=False),
                                detokenize=tokenizer.decode)
    results = {}
    for flags in flag_sets:
        engine = LLMEngine(config_from_args(build_parser().parse_args(shlex.split(flags))))
        in_process_round(engine, WARM_UP, 1)
        results[flags] = {n: combine([in_process_round(engine, prompts[:n], n)])["decode_step_ms"] for n in (1, 32)}
        del engine
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--no-floor", action="store_true", help="skip cpu_floor.py")
    parser.add_argument("--decode", nargs="*", metavar="FLAGS", help="engine flag sets to time decode steps for")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    floor = None if args.no_floor else run_floor(args.batches)
    rows, plans = linears(args, getattr(torch, args.dtype))
    if floor:  # the floor's rows beside ours, same run
        for r in floor["linears_only"]:
            if "step_ms" in r and r["batch"] in rows:
                rows[r["batch"]][f"cpu_floor {r['dtype']}"] = r["step_ms"]
    print(f"{args.dtype} activations, torch threads {torch.get_num_threads()}; ms per step, linears only"
          + (f"; read bandwidth {floor['read_GB_per_s']} GB/s" if floor else ""))
    print(f"{'':30s}" + "".join(f"{'batch ' + str(b):>12s}" for b in args.batches))
    for name in rows[args.batches[0]]:
        print(f"{name:30s}" + "".join(f"{rows[b].get(name, float('nan')):12.2f}" for b in args.batches))
    for quantization, plan in plans.items():
        print(f"plan {quantization}: " + "; ".join(f"{shape} {p}" for shape, p in plan.items()))
    decode = decode_steps(args.decode) if args.decode else {}
    for flags, steps in decode.items():
        print(f"decode step, in process, main thread [{flags or 'defaults'}]: "
              + ", ".join(f"batch {n} {ms:.2f} ms" for n, ms in steps.items()))
    if args.json:
        args.json.write_text(json.dumps({"dtype": args.dtype, "threads": torch.get_num_threads(), "step_ms": rows,
                                         "plans": plans, "floor": floor, "decode_step_ms": decode}, indent=1))


if __name__ == "__main__":
    main()
