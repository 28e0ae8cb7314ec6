"""LoRA's shrink and expand in Triton (CUDA, or the CPU interpreter under TRITON_INTERPRET=1).

BGMV-style, as in Punica and vLLM's `lora/ops/triton_ops`: one program per row for the shrink
(u = x A_s^T, every rank at once) and one per row and block of outputs for the expand
(y += u B_s), each program reading its row's slot; rows of slot -1 (the base model) load and store
nothing. The slot tensors: A [S, R, in], B [S, R, out] (the scaling folded in), as in
kernels/cpu/lora.py. u is kept in fp32. Reference: `add_lora` in kernels/reference/lora.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_index import LoraStepIndex


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, u_ptr, slots_ptr, K, R, stride_x, stride_a_slot, stride_a_rank, stride_u,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    k_end = tl.where(slot >= 0, K, 0)  # a base row reads nothing
    slot = tl.maximum(slot, 0)
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + ks, mask=ks < k_end, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_a_slot + ranks[:, None] * stride_a_rank + ks[None, :],
                    mask=(ranks[:, None] < R) & (ks[None, :] < k_end), other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(u_ptr + row * stride_u + ranks, acc, mask=ranks < R)


@triton.jit
def _expand_kernel(u_ptr, b_ptr, y_ptr, slots_ptr, N, R, stride_u, stride_b_slot, stride_b_rank, stride_y,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    n_end = tl.where(slot >= 0, N, 0)  # a base row reads and writes nothing
    slot = tl.maximum(slot, 0)
    ranks = tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    u = tl.load(u_ptr + row * stride_u + ranks, mask=ranks < R, other=0.0)
    b = tl.load(b_ptr + slot * stride_b_slot + ranks[:, None] * stride_b_rank + cols[None, :],
                mask=(ranks[:, None] < R) & (cols[None, :] < n_end), other=0.0).to(tl.float32)
    delta = tl.sum(u[:, None] * b, axis=0)
    out_mask = cols < n_end
    y = tl.load(y_ptr + row * stride_y + cols, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (y + delta).to(y_ptr.dtype.element_ty), mask=out_mask)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, in], A [S, R, in], slots [T] -> u [T, R] fp32 (zero for base rows)."""
    rows, k = x.shape
    rank = a.shape[1]
    u = torch.empty(rows, rank, dtype=torch.float32, device=x.device)
    block_k = min(triton.next_power_of_2(k), 128)
    _shrink_kernel[(rows,)](x, a, u, slots, k, rank, x.stride(0), a.stride(0), a.stride(1), u.stride(0),
                            BLOCK_R=triton.next_power_of_2(rank), BLOCK_K=block_k)
    return u


def lora_expand(y: torch.Tensor, u: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> None:
    """y [T, out] += u [T, R] B_s [R, out] for each row's slot s, in place."""
    rows, n = y.shape
    rank = b.shape[1]
    block_n = min(triton.next_power_of_2(n), 128)
    _expand_kernel[(rows, triton.cdiv(n, block_n))](u, b, y, slots, n, rank, u.stride(0), b.stride(0), b.stride(1),
                                                     y.stride(0), BLOCK_R=triton.next_power_of_2(rank),
                                                     BLOCK_N=block_n)


def add_lora_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    index: LoraStepIndex) -> None:
    """The same contract as kernels/cpu/lora.py's kernels; x, A and B contiguous in their last dim."""
    if y.stride(1) != 1:
        raise ValueError("lora_expand writes rows of y in place: its last dim must be contiguous")
    x = x if x.stride(1) == 1 else x.contiguous()
    lora_expand(y, lora_shrink(x, a, index.slots), b, index.slots)
