"""Int8 weights for CPU linear layers: symmetric, one scale per output channel (absmax / 127).

Three kernels over them: weight-only (`torch._weight_int8pack_mm`: float activations, int8
weights dequantized on the fly; memory-bound decode), weight-only for a few rows through
Tandem's C++ GEMV (`int8_gemv`, where the C++ kernels are built) and dynamic W8A8 (activations
rounded to int8 per token, int8 x int8 -> int32 through `torch._int_mm` on VNNI/AMX;
compute-bound batches).
Each kernel is prepare(weight, bias) -> state, run(state, x [N, in]) -> [N, out].
References (kernels/reference/linear.py): `int8_weight_only` for the weight-only kernels,
`int8_per_token` for W8A8 (`int8_dynamic`, `int8_vnni`), `int8_grouped` for `int8_grouped`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels.cpu import extension as cpu_extension
from kernels.cpu.packed_weights import pack_columns, padded_columns

_NO_BIAS = torch.empty(0)  # the C++ rescale's "no bias"


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] float -> (int8 [out, in], fp32 scale [out]) with weight ≈ q * scale[:, None]."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


@functools.cache
def int_mm_is_exact() -> bool:
    """Whether `torch._int_mm` sums int8 products exactly on this machine. Without VNNI, oneDNN's
    AVX2 path adds pairs of u8 x s8 products in saturating 16-bit lanes (vpmaddubsw), so large
    activations clip: an output 4.9 off on a spread of 31 under an AVX2-only oneDNN. Probed once,
    with the worst case (every product at full scale); W8A8 is not a candidate where it fails."""
    a = torch.full((32, 64), 127, dtype=torch.int8)
    a[1::2] = -127
    b = torch.full((64, 32), 127, dtype=torch.int8)
    b[:, 1::2] = -127
    try:
        got = torch._int_mm(a, b)
    except RuntimeError:  # no int8 GEMM in this build
        return False
    return torch.equal(got, (a.double() @ b.double()).to(torch.int32))


# ---- the kernels ----

def prepare_int8_weight_only(w, b):
    q, scale = quantize_int8(w)
    return q, scale.to(w.dtype), b


def run_int8_weight_only(state, x):
    q, scale, b = state
    y = torch._weight_int8pack_mm(x.contiguous(), q, scale)
    return y if b is None else y + b


def prepare_int8_gemv(w, b):
    """The int8 weight as int8_gemv reads it, in blocks of 16 output columns: with AVX512-VNNI (and
    K a multiple of 4) q + 128 as uint8 in vpdpbusd's order, [ceil(N/16), K/4, 16, 4]; else
    int8, [ceil(N/16), K, 16]."""
    if not cpu_extension.load():
        raise RuntimeError("int8_gemv needs Tandem's C++ CPU kernels (see kernels/cpu/extension.py)")
    q, scale = quantize_int8(w)
    if int8_vnni_supported() and q.shape[1] % 4 == 0:
        packed = pack_columns((q.to(torch.int16) + 128).to(torch.uint8), 4)
    else:
        packed = pack_columns(q, 1).squeeze(-1)
    return packed, scale, b, q.shape[0]


def run_int8_gemv(state, x):
    """Weight-only int8 for a few rows (decode), scaled per output column; the C++ kernel streams
    the weight at close to the memory's speed. Its sums are fp32 (x times the widened weight) or,
    on the VNNI packing, exact integer sums over x rounded to 16 bits per row (finer than bf16)."""
    packed, scale, b, out_f = state
    y = torch.empty((x.shape[0], out_f), dtype=x.dtype)
    torch.ops.tandem.int8_gemv(y, x if x.stride(-1) == 1 else x.contiguous(), packed, scale)
    return y if b is None else y + b


def prepare_int8_dynamic(w, b):
    q, scale = quantize_int8(w)
    fused = cpu_extension.load()  # the C++ passes around the GEMM (kernels/cpu/csrc/int8_rows.cpp)
    return q.t(), scale, None if b is None else b.float(), w.dtype, fused


def run_int8_dynamic(state, x):
    """W8A8: each row of x quantized on the fly to int8 with its own scale (per token, as torchao's
    int8 dynamic-activation config does), int8 x int8 -> int32 on VNNI/AMX, then rescaled.

    The quantize and rescale passes are C++ where the kernels are built: in torch they are ten
    ops that cost more than the GEMM at decode batch sizes (`_run_int8_dynamic_torch` is the
    same arithmetic, and the fallback).

    torch's fbgemm `quantized.linear_dynamic` is not used: its one activation scale for the whole
    batch lets one outlier token crush the others' precision, which changed SmolLM2's greedy answer.
    """
    qt, w_scale, b, dtype, fused = state
    if not fused or x.dtype not in (torch.float32, torch.bfloat16):
        return _run_int8_dynamic_torch(state, x)
    rows = x.shape[0]
    xq = torch.empty(x.shape, dtype=torch.int8)
    x_scale = torch.empty(rows, dtype=torch.float32)
    torch.ops.tandem.quantize_rows_int8(xq, x_scale, x if x.stride(-1) == 1 else x.contiguous())
    y = torch.empty((rows, qt.shape[1]), dtype=dtype)
    torch.ops.tandem.scale_int32_rows(y, torch._int_mm(xq, qt), x_scale, w_scale, _NO_BIAS if b is None else b)
    return y


@functools.cache
def int8_vnni_supported() -> bool:
    """Whether Tandem's C++ kernels are built with the AVX512-VNNI W8A8 GEMM (int8_vnni_gemm)."""
    return cpu_extension.load() and torch.ops.tandem.int8_vnni_available()


def prepare_int8_vnni(w, b):
    """The int8 weight in VNNI order, [ceil(N/16), K/4, 16, 4], and the sums that undo the
    activations' +128 (vpdpbusd multiplies unsigned by signed bytes): 128 * sum_k q[n, k]."""
    if not int8_vnni_supported():
        raise RuntimeError("int8_vnni needs Tandem's C++ kernels built for a CPU with AVX512-VNNI")
    q, scale = quantize_int8(w)
    out_f = q.shape[0]
    offsets = F.pad(q.sum(dim=1, dtype=torch.int32) * 128, (0, padded_columns(out_f) - out_f))
    return pack_columns(q, 4), scale, offsets, _NO_BIAS if b is None else b.float().contiguous(), out_f, w.dtype


def run_int8_vnni(state, x):
    """W8A8 as int8_dynamic computes it (per-token int8 activations, the same int32 sums and
    rescale, the same bits) in one C++ op: quantize, VNNI GEMM over the prepacked weight, rescale.
    Faster than torch._int_mm, which takes the weight as a plain matrix each call, at decode's
    batch sizes; x must be in the weight's dtype."""
    packed, w_scale, offsets, b, out_f, dtype = state
    y = torch.empty((x.shape[0], out_f), dtype=dtype)
    torch.ops.tandem.int8_vnni_gemm(y, x if x.stride(-1) == 1 else x.contiguous(), packed, w_scale, offsets, b)
    return y


ACTIVATION_GROUP = 128  # k per activation scale in int8_grouped


def int8_grouped_fits(weight: torch.Tensor) -> bool:
    return (weight.dtype in (torch.float32, torch.bfloat16) and weight.shape[1] % ACTIVATION_GROUP == 0
            and int8_vnni_supported())


def prepare_int8_grouped(w, b):
    """int8_vnni's packing, with the sums that undo the activations' +128 per group of
    ACTIVATION_GROUP k: [K / group, ceil(N / 16) * 16]."""
    if not int8_grouped_fits(w):
        raise RuntimeError(f"int8_grouped needs Tandem's C++ kernels built for a CPU with AVX512-VNNI and K a "
                           f"multiple of {ACTIVATION_GROUP}, got a {w.dtype} weight of {tuple(w.shape)}")
    q, scale = quantize_int8(w)
    out_f, in_f = q.shape
    group_sums = q.reshape(out_f, in_f // ACTIVATION_GROUP, ACTIVATION_GROUP).sum(dim=2, dtype=torch.int32) * 128
    offsets = F.pad(group_sums.t(), (0, padded_columns(out_f) - out_f)).contiguous()
    return pack_columns(q, 4), scale, offsets, _NO_BIAS if b is None else b.float().contiguous(), out_f, w.dtype


def run_int8_grouped(state, x):
    """W8A8 for inputs with outlier channels: each row of x rounded to int8 per group of
    ACTIVATION_GROUP k with its own scale, so an outlier coarsens only its group; int32 sums per
    group on VNNI, added in fp32 with the group's scale (kernels/cpu/csrc/int8_grouped.cpp)."""
    packed, w_scale, offsets, b, out_f, dtype = state
    y = torch.empty((x.shape[0], out_f), dtype=dtype)
    torch.ops.tandem.int8_grouped_gemm(y, x if x.stride(-1) == 1 else x.contiguous(), packed, w_scale, offsets, b)
    return y


def _run_int8_dynamic_torch(state, x):
    qt, w_scale, b, dtype, _ = state
    xf = x.float()
    x_scale = (xf.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
    xq = torch.round(xf / x_scale).to(torch.int8)
    y = torch._int_mm(xq, qt) * (x_scale * w_scale)
    if b is not None:
        y = y + b
    return y if dtype == torch.float32 else y.to(dtype)
