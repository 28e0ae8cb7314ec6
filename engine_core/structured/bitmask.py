"""Token masks onto logits: every token a row's grammar does not allow gets -inf."""

from __future__ import annotations

import numpy as np
import torch

from engine_core.runner.host_to_device import to_device


def apply_token_mask(logits: torch.Tensor, disallowed: np.ndarray, rows: list[int]) -> None:
    """In place. logits: [N, V]; disallowed: [len(rows), V] uint8, 1 = not allowed
    (masks.disallowed_tokens); rows: the logits rows its rows belong to, ascending."""
    mask = to_device(disallowed, torch.uint8, logits.device).view(torch.bool)  # 0/1 bytes: a zero-copy view
    if len(rows) == logits.shape[0]:  # every row constrained: one pass, no gather
        logits.masked_fill_(mask, float("-inf"))
        return
    index = to_device(rows, torch.int64, logits.device)
    logits[index] = logits[index].masked_fill_(mask, float("-inf"))
