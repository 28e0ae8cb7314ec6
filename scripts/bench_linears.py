"""SmolLM2-135M's linear layers alone, each CPU kernel of kernels/cpu_linear.py per batch size.

One step = the 30 layers' qkv, o, gate_up and down projections plus the LM head (random weights,
no attention), as ../shared/tools/cpu_floor.py times it. Rows: every kernel forced, then the plan
`use_measured_linears` chooses on this machine for each --quantization. Timed on the main
thread, candidates interleaved round by round, best of the rounds (the machine is shared).

    python scripts/bench_linears.py                      # table
    python scripts/bench_linears.py --json out.json      # and JSON
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.cpu_linear import KERNELS, CpuLinear, fastest, use_measured_linears  # noqa: E402

HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
QKV = HIDDEN + 2 * 192


class Linears(nn.Module):
    """The model's linear layers with its real shapes, called as one decode step calls them."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        def linear(i, o):
            layer = nn.Linear(i, o, bias=False)
            layer.weight = nn.Parameter(torch.randn(o, i, dtype=dtype) * i**-0.5, requires_grad=False)
            return layer
        self.layers = nn.ModuleList(
            nn.ModuleList([linear(HIDDEN, QKV), linear(HIDDEN, HIDDEN), linear(HIDDEN, 2 * INTER),
                           linear(INTER, HIDDEN)]) for _ in range(LAYERS))
        self.lm_head = linear(HIDDEN, VOCAB)

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    base = Linears(dtype)
    steps = {f"forced {k}": sharing(base, lambda m, k=k: CpuLinear(m.weight, None, [(1, k)])) for k in KERNELS}
    plans = {}
    for quantization in ("none", "int8", "auto"):
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
    print(f"{args.dtype} activations, torch threads {torch.get_num_threads()}; ms per step, linears only")
    print(f"{'':26s}" + "".join(f"{'batch ' + str(b):>12s}" for b in args.batches))
    for name in steps:
        print(f"{name:26s}" + "".join(f"{rows[b][name]:12.2f}" for b in args.batches))
    for quantization, plan in plans.items():
        print(f"plan {quantization}: " + "; ".join(f"{shape} {p}" for shape, p in plan.items()))
    if args.json:
        args.json.write_text(json.dumps({"dtype": args.dtype, "threads": torch.get_num_threads(),
                                         "step_ms": rows, "plans": plans}, indent=1))


if __name__ == "__main__":
    main()
