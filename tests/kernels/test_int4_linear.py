"""Int4 linear weights (kernels/cpu/int4_linear.py): GGUF Q4_0 / Q4_1 blocks come back exactly,
float weights round to their group's grid, and the kernel matches its reference (`int4_weight_only`,
kernels/reference/linear.py) on its own weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kernels.cpu.int4_linear import (
    GROUP_SIZE,
    dequantize_int4,
    int4_supported,
    prepare_int4,
    quantize_int4,
    run_int4,
)
from kernels.reference.linear import int4_weight_only

Q4_0, Q4_1 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1


def gguf_codes(blocks: np.ndarray, qtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode raw GGUF 4-bit rows [out, bytes] into (codes [out, in], fp16 scales d [out, groups]).
    A block is d (fp16) [, m (fp16) for Q4_1] then 16 bytes: low nibbles hold weights 0-15,
    high nibbles weights 16-31."""
    header = 2 if qtype == Q4_0 else 4
    out_f = blocks.shape[0]
    b = blocks.reshape(out_f, -1, header + 16)
    d = torch.from_numpy(b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    qs = b[..., header:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(out_f, -1)
    return torch.from_numpy(codes.astype(np.uint8)), d


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1])
def test_gguf_4bit_blocks_come_back_exactly(qtype):
    torch.manual_seed(0)
    weight = torch.randn(48, 128) * torch.linspace(0.01, 0.5, 48)[:, None]
    blocks = quantize(weight.numpy(), qtype)
    dequantized = torch.from_numpy(dequantize(blocks, qtype))
    codes, scales, zeros = quantize_int4(dequantized)
    # the file's weights exactly (fp32 rounding of the recovered scale aside)
    back = dequantize_int4(codes, scales, zeros)
    assert (back - dequantized).abs().max() <= 1e-6 * dequantized.abs().max()
    file_codes, file_scales = gguf_codes(blocks, qtype)
    if qtype == Q4_1:  # and its own codes and scales (a Q4_0 group spanning all 16 codes may come
        # back on the mirrored Q4_1 grid instead: the same values, codes 15 - q)
        assert torch.equal(codes, file_codes)
        torch.testing.assert_close(scales, file_scales, rtol=1e-6, atol=0)

def test_smollm2_gguf_tensor_comes_back_exactly():
    from engine_core.loader.gguf import read_gguf
    from engine_core.loader.registry import default_model_path

    tensor = read_gguf(default_model_path()).tensors["blk.0.ffn_down.weight"]
    assert tensor.qtype == Q4_1
    dequantized = torch.from_numpy(dequantize(tensor.data, tensor.qtype).copy())
    codes, scales, zeros = quantize_int4(dequantized)
    assert torch.equal(codes, gguf_codes(tensor.data, tensor.qtype)[0])
    assert (dequantize_int4(codes, scales, zeros) - dequantized).abs().max() <= 1e-6 * dequantized.abs().max()


def test_float_weights_round_to_the_nearest_step_of_their_group():
    torch.manual_seed(1)
    weight = torch.randn(32, 96) * torch.linspace(0.01, 3.0, 32)[:, None]  # rows of very different ranges
    weight[0, :GROUP_SIZE] = 0.25  # a constant group: scale 0, every weight exact
    codes, scales, zeros = quantize_int4(weight)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and scales.shape == zeros.shape == (32, 3)
    error = dequantize_int4(codes, scales, zeros) - weight
    groups = weight.reshape(32, 3, GROUP_SIZE)
    q4_1_step = (groups.amax(-1) - groups.amin(-1)) / 15
    # each group keeps the better of two grids: never worse than the min/max grid's round to
    # nearest (at most half a step per weight)
    assert ((error.reshape(32, 3, GROUP_SIZE) ** 2).sum(-1) <= GROUP_SIZE * (q4_1_step / 2) ** 2 + 1e-9).all()
    assert error[0, :GROUP_SIZE].abs().max() == 0
    # a quantized weight is a fixed point (its values; a group may come back on the mirrored grid)
    once = dequantize_int4(codes, scales, zeros)
    torch.testing.assert_close(dequantize_int4(*quantize_int4(once)), once, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_linear_on_its_own_weights(dtype, rows, bias):
    torch.manual_seed(rows)
    weight, x = torch.randn(64, 96, dtype=dtype), torch.randn(rows, 96, dtype=dtype)
    b = torch.randn(64, dtype=dtype) if bias else None
    y = run_int4(prepare_int4(weight, b), x)
    expected = int4_weight_only(x, weight, b)
    assert y.shape == (rows, 64) and y.dtype == dtype
    # The kernel takes bf16 activations and bf16 scales and zeros (8-bit mantissas): each
    # product is off by up to ~2 x 2^-9 relatively, so a 96-term dot product of random signs
    # stays within ~1 % of the output's spread; 2 % leaves room for bf16 outputs.
    assert (y.float() - expected).abs().max() <= 2e-2 * expected.abs().max()


def test_shapes_torch_cannot_pack_are_reported():
    assert int4_supported(960, 576) and int4_supported(49152, 576)
    assert not int4_supported(24, 64)  # out_features must be a multiple of 16
    assert not int4_supported(64, 80)  # in_features must be whole groups of 32
    with pytest.raises(ValueError, match="group size"):
        quantize_int4(torch.randn(16, 80))
