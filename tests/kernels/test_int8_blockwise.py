"""W8A8 in blocks of 32 k on GGUF block-quantized weights (kernels/cpu/int8_blockwise.py,
kernels/cpu/csrc/int8_blockwise.cpp): the weight's own codes, exactly; activations rounded to int8 per row
and block of 32 (llama.cpp's q8_1 rounding); integer block sums; fp32 scales.

Against its reference (`int8_blockwise`, kernels/reference/linear.py), the same rounding in float64:
the int32 block sums are exact, so what differs is the fp32 adding of the blocks (a few ulp of fp32
of the sums' magnitude) and the output's own rounding (bf16: half an ulp).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

import kernels.cpu.int8_blockwise as blockwise
from engine_core.loader.registry import prepare_for_cpu
from engine_core.loader.safetensors import load_hf
from engine_core.models.llama import LlamaForCausalLM
from kernels import LinearRole, select_backend
from kernels.cpu.int8_blockwise import (
    BLOCK,
    dequantize_blockwise,
    int8_blockwise_fits,
    int8_blockwise_is_exact,
    prepare_int8_blockwise,
    quantize_activation_blocks,
    quantize_blockwise,
    run_int8_blockwise,
)
from kernels.cpu.int8_linear import int8_vnni_supported
from kernels.cpu.linear import CpuLinear, _kernels_for
from kernels.reference.linear import float_linear, int8_blockwise
from tests.engine_core.tiny_models import PagedBatch, run_step, write_tiny_model

Q = GGMLQuantizationType
needs_vnni = pytest.mark.skipif(not int8_vnni_supported(),
                                reason="int8_blockwise's C++ kernel needs a build for a CPU with AVX512-VNNI")


def gguf(weight: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """The weight as a GGUF of `qtype` stores it, dequantized to fp32 (what our GGUF loader yields)."""
    return torch.from_numpy(dequantize(quantize(weight.float().numpy(), qtype), qtype))


def within_rounding(got: torch.Tensor, want: torch.Tensor) -> bool:
    """fp32: a few ulp of the sums' magnitude; bf16: half an ulp of the output, plus that."""
    fp32_slack = 16 * torch.finfo(torch.float32).eps * want.abs().max()
    output_rounding = 0.0 if got.dtype == torch.float32 else torch.finfo(got.dtype).eps / 2 * want.abs()
    return bool(((got.double() - want).abs() <= output_rounding + fp32_slack).all())


# K: 3 and 5 blocks (not a multiple of any tile), 18 (SmolLM2's 576) and 48 (1536); N: partial 16-column
# blocks and 48-column tiles; rows: 4-row register tiles inside 8-row tiles and 128-row blocks, with tails
SHAPES = [(1, 96, 20), (3, 160, 50), (8, 576, 100), (32, 1536, 48), (128, 96, 17), (513, 160, 64)]


@needs_vnni
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k, n", SHAPES)
def test_kernel_matches_its_reference(qtype, dtype, rows, k, n):
    g = torch.Generator().manual_seed(rows * k + n)
    w = gguf(torch.randn(n, k, generator=g) * 0.05, qtype).to(dtype)
    x = (torch.randn(rows, k, generator=g) * 2).to(dtype)
    x[0, : k // 2] = 0  # whole zero blocks: their scale is the floor, their sums 0
    bias = torch.randn(n, generator=g).to(dtype) if rows % 2 else None  # with and without
    got = run_int8_blockwise(prepare_int8_blockwise(w, bias), x)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert within_rounding(got, int8_blockwise(x.float(), w, None if bias is None else bias.float()))


@needs_vnni
def test_kernel_reads_strided_rows_and_sums_full_scale_products_exactly():
    g = torch.Generator().manual_seed(0)
    w = gguf(torch.randn(40, 128, generator=g), Q.Q8_0)
    wide = torch.randn(9, 256, generator=g)
    for x in (wide[:, :128], wide[:, ::2]):  # a row stride of 256; a column stride of 2
        assert within_rounding(run_int8_blockwise(prepare_int8_blockwise(w, None), x), int8_blockwise(x, w))
    # every code and activation at +-127 over K = 1536: the +128 is undone exactly, nothing saturates
    w = torch.ones(32, 1536)
    w[1::2] = -1.0
    x = torch.ones(4, 1536)
    x[1::2] = -1.0
    assert torch.equal(run_int8_blockwise(prepare_int8_blockwise(w, None), x), x @ w.t())


def test_the_torch_fallback_matches_the_reference(monkeypatch):
    """Where the kernel is not built (no AVX512-VNNI) the same arithmetic runs in torch."""
    monkeypatch.setattr(blockwise, "int8_blockwise_fits", lambda weight: False)
    g = torch.Generator().manual_seed(3)
    w = gguf(torch.randn(24, 96, generator=g) * 0.05, Q.Q4_1)
    x, bias = torch.randn(5, 96, generator=g), torch.randn(24, generator=g)
    assert within_rounding(run_int8_blockwise(prepare_int8_blockwise(w, bias), x), int8_blockwise(x, w, bias))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_gguf_weights_are_recovered_exactly(qtype):
    torch.manual_seed(0)
    w = gguf(torch.randn(64, 256) * 0.05, qtype)
    codes, scales, offsets = quantize_blockwise(w)
    # fp32: the file's own values back, to the fp32 rounding of code * scale + offset
    assert (dequantize_blockwise(codes, scales, offsets) - w).abs().max() <= 4e-7 * w.abs().max()
    assert int8_blockwise_is_exact(w) and int8_blockwise_is_exact(w.bfloat16())
    # Q4_1 keeps its offsets; Q4_0 and Q8_0 have none, so the kernel skips that term
    assert bool(offsets.any()) == (qtype == Q.Q4_1)
    assert int(codes.abs().max()) <= (127 if qtype == Q.Q8_0 else 15)


def test_a_float_checkpoint_is_not_exact():
    torch.manual_seed(1)
    w = torch.randn(64, 256) * 0.05
    assert not int8_blockwise_is_exact(w) and not int8_blockwise_is_exact(w.bfloat16())
    assert not int8_blockwise_is_exact(gguf(w, Q.Q4_1)[:, :250])  # not whole blocks
    assert not int8_blockwise_fits(torch.empty(8, 100))
    # a float weight still quantizes (on Q8_0's grid, --quantization int8): half a step at most
    codes, scales, offsets = quantize_blockwise(w)
    error = (dequantize_blockwise(codes, scales, offsets) - w).reshape(64, -1, BLOCK).abs()
    assert (error <= scales[..., None] / 2 * (1 + 1e-6)).all()


def llama_cpp_q8_1_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What llama.cpp computes for Q4_1 x q8_1 (ggml_vec_dot_q4_1_q8_1): activations per block of 32
    with an fp16 scale, the Q4_1 min times the *rounded* block sum, in float64."""
    codes, scales, offsets = quantize_blockwise(weight)
    xb = x.double().reshape(x.shape[0], -1, BLOCK)
    scale = (xb.abs().amax(-1, keepdim=True) / 127).to(torch.float16).double().clamp(min=1e-12)
    rounded = torch.round(xb / scale).clamp(-127, 127) * scale  # x as q8_1 holds it
    w = dequantize_blockwise(codes, scales, offsets).double()
    return rounded.reshape(x.shape) @ w.t()


def test_error_is_bounded_and_no_worse_than_llama_cpps():
    """Against the exact fp32 product of the same weights: each activation is off by at most half its
    block's step, s / 2, and only the codes' part of the weight sees that, so
    |error[m, n]| <= sum_b s[m, b] / 2 * d[n, b] * sum_k |c[n, k]| (+ fp32 slack). llama.cpp's
    q8_1 multiplies the whole weight, offset included, by the rounded activations (and rounds s to
    fp16): its error is at least as large on average. Activations with outlier channels, as an MLP's
    SiLU·mul products carry."""
    g = torch.Generator().manual_seed(5)
    k, n = 1536, 96
    w = gguf(torch.randn(n, k, generator=g) * 0.03 + 0.01, Q.Q4_1)
    x = torch.randn(64, k, generator=g)
    x[:, [7, 300, 1000]] *= 40
    exact = float_linear(x, w)
    got = run_int8_blockwise(prepare_int8_blockwise(w, None), x).double()
    codes, scales, _ = quantize_blockwise(w)
    _, x_scale, _ = quantize_activation_blocks(x)
    code_mass = codes.double().abs().reshape(n, -1, BLOCK).sum(-1) * scales.double()  # [n, blocks]
    bound = (x_scale.squeeze(-1).double() / 2) @ code_mass.t()
    assert ((got - exact).abs() <= bound + 1e-5 * exact.abs().max()).all()
    ours, llama = (got - exact).square().mean().sqrt(), (llama_cpp_q8_1_product(x, w) - exact).square().mean().sqrt()
    assert ours <= llama, (float(ours), float(llama))


def test_auto_takes_it_only_where_exact_and_then_instead_of_per_channel_w8a8():
    torch.manual_seed(2)
    exact, plain = gguf(torch.randn(64, 128) * 0.05, Q.Q4_1), torch.randn(64, 128) * 0.05
    for role in (LinearRole.ANY, LinearRole.OUTLIER_INPUT, LinearRole.OUTPUT_HEAD):
        chosen = _kernels_for("auto", [exact], role)
        if int8_blockwise_fits(exact):
            assert "int8_blockwise" in chosen
        assert not {"int8_vnni", "int8_dynamic", "int8_grouped"} & set(chosen)
        assert "int8_blockwise" not in _kernels_for("auto", [plain], role)
    if int8_blockwise_fits(plain):
        assert "int8_blockwise" in _kernels_for("int8", [plain], LinearRole.ANY)  # asked for: int8 allows it
    assert "int8_blockwise" not in _kernels_for("none", [exact], LinearRole.ANY)


def prefer(kernel: str):
    """A deterministic timer under which `kernel` is fastest wherever it is a candidate."""
    def timer(name, rows, fn):
        fn()
        return 1.0 if name == kernel else 2.0
    return timer


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_generation_with_the_kernel_pinned_follows_fp32(tmp_path, dtype):
    """A tiny Llama on GGUF weights (decoder Q4_1, tied embedding / LM head Q8_0, as SmolLM2's file):
    greedy tokens from the fp32 model, then the same tokens through the model on int8_blockwise
    everywhere. W8A8 logits are held to 5 % relative RMS of the fp32 ones (docs/cpu-kernels.md#accuracy),
    and the greedy pick agrees wherever fp32's top two are further apart than the largest error."""
    folder = write_tiny_model(tmp_path, tie_word_embeddings=True, hidden_size=128, intermediate_size=256)
    config, weights = load_hf(folder)
    weights = {name: gguf(t, Q.Q8_0 if "embed" in name else Q.Q4_1) if t.ndim == 2 else t for name, t in weights}

    def build(quantization: str, model_dtype: torch.dtype) -> LlamaForCausalLM:
        with torch.device("meta"):
            model = LlamaForCausalLM(config, select_backend("cpu", "torch"))
        model.load_weights(weights.items(), torch.device("cpu"), model_dtype)
        prepare_for_cpu(model, quantization, timer=prefer("int8_blockwise"))  # int8: asked for, past auto's budget
        return model.eval()

    pinned, reference = build("int8", dtype), build("none", torch.float32)
    layers = [m for m in pinned.modules() if isinstance(m, CpuLinear)]
    assert len(layers) == 4 * config.num_hidden_layers + 1
    assert all(name == "int8_blockwise" for layer in layers for _, name in layer.plan)

    prompts = [[3, 17, 42, 5, 9, 100, 7, 12, 64], [250, 1, 2, 33]]
    chunks = list(enumerate(prompts))
    tokens: list[list[int]] = [list(p) for p in prompts]
    want, steps = [], [chunks]
    ref_batch, pinned_batch = PagedBatch(config, 2, 32), PagedBatch(config, 2, 32)
    with torch.no_grad():
        for _ in range(12):  # prefill, then decode steps, fp32 choosing each next token
            logits = run_step(reference, ref_batch, steps[-1])
            want.append(torch.cat(logits))
            nxt = [int(chunk[-1].argmax()) for chunk in logits]
            for seq, token in zip(tokens, nxt):
                seq.append(token)
            steps.append([(i, [t]) for i, t in enumerate(nxt)])
        got = torch.cat([torch.cat(run_step(pinned, pinned_batch, step)) for step in steps[:-1]]).float()
    want = torch.cat(want)
    error = got - want
    assert error.square().mean().sqrt() <= 5e-2 * want.square().mean().sqrt()
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * error.abs().max()
    assert clear.sum() >= len(want) // 4
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
