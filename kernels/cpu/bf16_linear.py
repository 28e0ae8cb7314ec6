"""bf16 linear layers for decode batches through Tandem's C++ GEMM over a weight packed once in
vdpbf16ps's operand order (kernels/cpu/csrc/bf16_packed.cpp), where the CPU has AVX512-BF16.

A float kernel like the others in kernels/cpu/linear.py: prepare(weight, bias) -> state,
run(state, x [N, in]) -> [N, out]; bf16 weights and activations, fp32 sums rounded once.
Reference: `bf16_linear` in kernels/reference/linear.py.
"""

from __future__ import annotations

import functools

import torch

from kernels.cpu import extension as cpu_extension
from kernels.cpu.packed_weights import pack_columns


@functools.cache
def bf16_packed_supported() -> bool:
    """Whether Tandem's C++ kernels are built with the AVX512-BF16 GEMM (bf16_packed_gemm)."""
    return cpu_extension.load() and torch.ops.tandem.bf16_packed_available()


def prepare_bf16_packed(w, b):
    """The weight as [ceil(N/16), K/2, 16, 2] bf16: 2 consecutive k of 16 output columns per 64 bytes."""
    if not bf16_packed_supported():
        raise RuntimeError("bf16_packed needs Tandem's C++ kernels built for a CPU with AVX512-BF16")
    packed = pack_columns(w.detach().to(torch.bfloat16), 2)
    return packed, torch.empty(0) if b is None else b.detach().float().contiguous(), w.shape[0]


def run_bf16_packed(state, x):
    packed, b, out_f = state
    y = torch.empty((x.shape[0], out_f), dtype=torch.bfloat16)
    torch.ops.tandem.bf16_packed_gemm(y, x if x.stride(-1) == 1 else x.contiguous(), packed, b)
    return y
