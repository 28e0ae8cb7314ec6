"""Prefix-cache changes an engine reports for prefix-aware routing (vLLM's KV events)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVCacheEvents:
    """Blocks indexed and evicted since the last report, by chained hash (engine_core/protocol/block_hash.py).
    `cleared`: forget every hash first (a reset, or a full snapshot)."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False
