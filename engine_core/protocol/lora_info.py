"""What an engine says of a loaded LoRA adapter (list_loras, the admin calls)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoraInfo:
    """One adapter as `list_loras` reports it."""

    name: str
    path: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    pinned: bool
    location: str  # "device" (in a slot), "host" (in host memory) or "disk" (read again when used)
    lora_id: int = 0  # 1, 2, ... in load order (vLLM's lora_int_id)
