"""Token bitmasks onto logits: every token a row's grammar does not allow gets -inf."""

from __future__ import annotations

import numpy as np
import torch


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
    """In place. logits: [N, V]; bitmask: [len(rows), ceil(V / 32)] int32, bit t of a row = token t
    allowed (llguidance's layout); rows: the logits rows the bitmask rows belong to."""
    vocab_size = logits.shape[1]
    # little-endian int32 words -> bytes -> bits, lowest bit first: bit index == token id
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab_size, bitorder="little")  # [R, V]
    disallowed = torch.from_numpy(allowed).to(logits.device) == 0
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(disallowed, float("-inf")))
