"""Float CPU linear layers on weights prepacked once into oneDNN's blocked layout.

`F.linear` hands oneDNN (or MKL) a plain row-major weight and lets it reorder the weight
into its blocked layout, or run a slower path, on every call; inductor's CPU backend
instead reorders once at compile time (`torch.ops.mkldnn._reorder_linear_weight`) and
calls `torch.ops.mkldnn._linear_pointwise` on the packed weight. This module does the
same without compiling. The packed weight is an opaque mkldnn tensor: it works for any
number of rows, the batch size given when packing only tunes the layout.
Reference: `float_linear` in kernels/reference/linear.py.
"""

from __future__ import annotations

import torch


def onednn_supported(dtype: torch.dtype) -> bool:
    """Whether this torch build packs `dtype` weights for oneDNN (fp32, and bf16 where the CPU has it)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def prepare_onednn(weight: torch.Tensor, bias: torch.Tensor | None, rows_hint: int = 32):
    """Pack a float weight [out, in] for `run_onednn` (same values, oneDNN's blocked layout)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows_hint)
    return packed, None if bias is None else bias.detach().contiguous(), weight.shape[0]


def run_onednn(state, x: torch.Tensor) -> torch.Tensor:
    packed, bias, out_features = state
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [None], "")
