"""Weights packed in blocks of 16 output columns, the layout Tandem's C++ GEMV and GEMMs stream.

`pack_columns(w, per_lane)` turns [N, K] into [ceil(N/16), K/per_lane, 16, per_lane]: for each
block, `per_lane` consecutive k of its 16 columns side by side, one load per k group. per_lane 1
is int8_gemv's layout, 4 vpdpbusd's (int8_vnni), 2 vdpbf16ps's (linear_bf16_packed). Padding
columns are zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

COLUMNS = 16  # output columns per block: one 16-lane fp32 / int32 vector


def padded_columns(out_features: int) -> int:
    return -(-out_features // COLUMNS) * COLUMNS


def pack_columns(w: torch.Tensor, per_lane: int) -> torch.Tensor:
    out_f, in_f = w.shape
    padded = F.pad(w, (0, 0, 0, padded_columns(out_f) - out_f))
    blocks = padded.reshape(-1, COLUMNS, in_f // per_lane, per_lane)
    return blocks.transpose(1, 2).contiguous()
