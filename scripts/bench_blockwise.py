"""int8_blockwise beside the other W8A8 and the bf16 kernels on SmolLM2's linear shapes: time per call
(one process, candidates interleaved round by round, best of rounds: quote ratios) and, with
--accuracy, each kernel's error against the exact fp32 product on the embedded SmolLM2's own
activations (its first layers run on a sentence).

Weights: the decoder's on the Q4_1 grid, the LM head's on Q8_0's, as the embedded GGUF holds them
(gguf's own quantizers); with --accuracy the model's real weights.

    python scripts/bench_blockwise.py --rows 32 128 512
    python scripts/bench_blockwise.py --accuracy
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine_core.openmp_env import limit_openmp_spinning  # noqa: E402

limit_openmp_spinning()  # as tandem-engine does, before torch loads

import torch  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from kernels.cpu.linear import KERNELS, kernel_fits  # noqa: E402
from kernels.cpu.linear_timing import fastest, rotating  # noqa: E402

HIDDEN, INTER, VOCAB = 576, 1536, 49152
SHAPES = {"qkv": (HIDDEN, HIDDEN + 2 * 192), "o": (HIDDEN, HIDDEN), "gate_up": (HIDDEN, 2 * INTER),
          "down": (INTER, HIDDEN), "lm_head": (HIDDEN, VOCAB)}  # name: (in, out)
COMPARED = ("int8_blockwise", "int8_vnni", "int8_dynamic", "int8_grouped", "linear_onednn", "linear_bf16_packed")


def gguf_grid(weight: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(dequantize(quantize(weight.float().numpy(), qtype), qtype))


def speed(rows_list: list[int], dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    print(f"time per call relative to int8_vnni (lower is faster), {dtype}, {torch.get_num_threads()} threads")
    print(f"{'shape':18s}{'rows':>6s}" + "".join(f"{k:>20s}" for k in COMPARED) + f"{'vnni us':>10s}")
    for name, (in_f, out_f) in SHAPES.items():
        qtype = GGMLQuantizationType.Q8_0 if name == "lm_head" else GGMLQuantizationType.Q4_1
        copies = 1 if name == "lm_head" else 4  # enough to leave the caches between calls, as a real step
        weights = [gguf_grid(torch.randn(out_f, in_f) * in_f**-0.5, qtype).to(dtype) for _ in range(copies)]
        kernels = [k for k in COMPARED if kernel_fits(k, weights[0])]
        states = {k: [KERNELS[k][0](w, None) for w in weights] for k in kernels}
        for rows in rows_list:
            x = torch.randn(rows, in_f, dtype=dtype)
            fit = [k for k in kernels if not (k == "linear_bf16_packed" and rows > 128)]
            with torch.no_grad():
                best = fastest({k: rotating(KERNELS[k][1], states[k], x) for k in fit}, rows,
                               min_rounds=10, max_rounds=40, budget_s=1.0)
            base = best["int8_vnni"]
            print(f"{name + f' {in_f}->{out_f}':18s}{rows:6d}"
                  + "".join(f"{best[k] / base:20.2f}" if k in best else f"{'-':>20s}" for k in COMPARED)
                  + f"{base * 1e6:10.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--accuracy", action="store_true", help="errors on SmolLM2's own activations instead")
    args = parser.parse_args()
    if args.accuracy:
        accuracy(getattr(torch, args.dtype))
    else:
        speed(args.rows, getattr(torch, args.dtype))


ACCURACY_KERNELS = ("int8_blockwise", "int8_vnni", "int8_dynamic", "int8_grouped", "int4", "linear_onednn",
                    "linear_bf16_packed")
LAYERS_SAMPLED = (0, 10, 20, 29)


def smollm2_inputs() -> tuple[object, dict[str, list[torch.Tensor]], dict[str, torch.Tensor]]:
    """The embedded SmolLM2 in fp32 run on the Zen of Python (prose that ships with Python): each sampled
    layer's linear inputs and the LM head's (the final norm's output), by role, and the weights."""
    import codecs
    import this  # noqa: F401 (prints the text once)

    from engine_core.loader import default_model_path
    from engine_core.loader.registry import load_model
    from engine_core.text.tokenizer import load_tokenizer
    from kernels import select_backend
    from tests.engine_core.tiny_models import PagedBatch, run_step

    model, config = load_model(None, torch.float32, torch.device("cpu"), select_backend("cpu", "torch"))
    text = codecs.decode(this.s, "rot13")
    ids = load_tokenizer(default_model_path()).encode(text, add_special_tokens=False)
    inputs: dict[str, list[torch.Tensor]] = {}
    weights: dict[str, torch.Tensor] = {}
    hooks = []
    for i in LAYERS_SAMPLED:
        layer = model.model.layers[i]
        for role, module in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                             ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)):
            weights[f"{role}.{i}"] = module.weight.detach()
            hooks.append(module.register_forward_hook(
                lambda m, args, out, key=f"{role}.{i}": inputs.setdefault(key, []).append(args[0].detach())))
    def keep_head_input(module, args, out):  # the final norm may return (x, residual)
        inputs.setdefault("lm_head", []).append((out[0] if isinstance(out, tuple) else out).detach())
    hooks.append(model.model.norm.register_forward_hook(keep_head_input))
    weights["lm_head"] = model.model.embed_tokens.weight.detach()  # tied: the Q8_0 embedding
    with torch.no_grad():
        run_step(model, PagedBatch(config, 1, len(ids) + 1), [(0, ids)])
    for hook in hooks:
        hook.remove()
    print(f"SmolLM2 on {len(ids)} tokens of the Zen of Python; layers {LAYERS_SAMPLED}")
    return config, {k: [torch.cat(v)] for k, v in inputs.items()}, weights


def llama_cpp_like(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """llama.cpp's q8_1 / q8_0 activations (blocks of 32, fp16 scale) times the whole dequantized weight."""
    xb = x.double().reshape(x.shape[0], -1, 32)
    scale = (xb.abs().amax(-1, keepdim=True) / 127).to(torch.float16).double().clamp(min=1e-12)
    return (torch.round(xb / scale).clamp(-127, 127) * scale).reshape(x.shape) @ weight.double().t()


def accuracy(dtype: torch.dtype) -> None:
    from kernels.cpu.int8_blockwise import int8_blockwise_is_exact

    _, inputs, weights = smollm2_inputs()
    columns = ("llama.cpp (emulated)",) + ACCURACY_KERNELS
    print(f"error vs the exact product of the GGUF's weights (fp64), max |err| / max |y| and mean |err| / mean |y| "
          f"in %; kernels in {dtype} (x rounded to it too), int4 always bf16")
    print(f"{'role':10s}" + "".join(f"{c:>24s}" for c in columns))
    for role in ("qkv", "o", "gate_up", "down", "lm_head"):
        keys = [k for k in weights if k.split(".")[0] == role]
        errors: dict[str, list[tuple[float, float]]] = {c: [] for c in columns}
        for key in keys:
            w, x = weights[key], inputs[key][0]
            assert int8_blockwise_is_exact(w), key
            exact = x.double() @ w.double().t()
            results = {"llama.cpp (emulated)": llama_cpp_like(x, w)}
            for kernel in ACCURACY_KERNELS:
                wk = w.to(dtype)
                if kernel_fits(kernel, wk) and not (kernel == "int4" and key == "lm_head"):
                    results[kernel] = KERNELS[kernel][1](KERNELS[kernel][0](wk, None), x.to(dtype)).double()
            for name, y in results.items():
                err = (y - exact).abs()
                errors[name].append((float(err.max() / exact.abs().max()), float(err.mean() / exact.abs().mean())))
        cells = []
        for c in columns:
            pairs = errors[c]
            cells.append(f"{max(p[0] for p in pairs) * 100:11.3f} / {sum(p[1] for p in pairs) / len(pairs) * 100:6.3f}"
                         if pairs else f"{'-':>24s}")
        print(f"{role:10s}" + "".join(f"{c:>24s}" for c in cells))


if __name__ == "__main__":
    main()
