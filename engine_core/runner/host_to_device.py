"""Host values onto the device without making the host wait for the GPU.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory and synchronizes with the
stream, so while a forward is in flight (overlapped steps, engine_core/overlap.py) the host would sit
idle until it ends. On CUDA these go through pinned memory with a non-blocking copy instead; torch's
pinned allocator reuses a buffer only once the copy out of it has run. Elsewhere: plain tensors.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values: list | np.ndarray, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(values).to(dtype)
        if device.type != "cuda":
            return host.to(device)
        return host.pin_memory().to(device, non_blocking=True)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
