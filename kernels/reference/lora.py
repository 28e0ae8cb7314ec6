"""LoRA's shrink and expand in plain torch, row by row: the reference of kernels/cpu/lora.py's five
CPU kernels (csrc/lora.cpp's among them) and kernels/triton/lora.py.

y [T, out], x [T, in], the slot tensors A [S, R, in] and B [S, R, out] (the scaling folded in), and
each row's slot (-1: the base model's row, left as it is).
"""

from __future__ import annotations

import torch


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots) -> torch.Tensor:
    """y + (x A_s^T) B_s for each row's slot s, in fp32, as a new tensor (the kernels add in place)."""
    out = y.clone().float()
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            out[row] += (x[row].float() @ a[slot].float().t()) @ b[slot].float()
    return out
