"""Prefix-cache changes an engine reports for prefix-aware routing (vLLM's KV events)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class KVCacheEvents:
    """Blocks indexed and evicted since the last report, by chained hash (engine_core/protocol/block_hash.py).
    `cleared`: forget every hash first (a reset, or a full snapshot). `stored_lora`: of `stored`, the hashes
    stored under each LoRA adapter, by its name (a stored hash under none is a base-model block)."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False
    stored_lora: dict[str, list[int]] = field(default_factory=dict)

    def lora_of(self) -> dict[int, str]:
        """Each adapter block's hash -> its adapter's name."""
        return {h: name for name, hashes in self.stored_lora.items() for h in hashes}


def group_by_lora(adapters: Iterable[tuple[int, str | None]]) -> dict[str, list[int]]:
    """(block hash, its LoRA adapter or None) pairs -> each adapter's hashes by its name, base blocks
    left out: `KVCacheEvents.stored_lora`."""
    groups: dict[str, list[int]] = {}
    for block_hash, lora_name in adapters:
        if lora_name is not None:
            groups.setdefault(lora_name, []).append(block_hash)
    return groups
