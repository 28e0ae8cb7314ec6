"""KV events (vLLM's): the prefix-cache hashes the block pool indexed and evicted since the last report, for
whoever routes requests by prefix. The pool notes each change here once `record_events()` is called; a step
hands the net changes over with its outputs."""

from __future__ import annotations

from collections.abc import Callable

from engine_core.protocol import KVCacheEvents
from engine_core.protocol.block_hash import BlockHash


class KVEventLog:
    def __init__(self) -> None:
        self._changes: dict[BlockHash, bool] = {}  # hash -> cached (True) or evicted (False), last change wins
        self._cleared = False

    def note(self, block_hash: BlockHash, cached: bool) -> None:
        self._changes.pop(block_hash, None)  # re-insert: the order follows the last change
        self._changes[block_hash] = cached

    def clear(self) -> None:
        """Every hash was forgotten (a prefix-cache reset): the next report says so."""
        self._changes.clear()
        self._cleared = True

    def take(self, by_lora: Callable[[list[BlockHash]], dict[str, list[BlockHash]]]) -> KVCacheEvents | None:
        """The net changes since the last call (None when there are none); `by_lora` groups the stored
        hashes that belong to an adapter by its name (the pool knows each cached block's adapter).

        A hash indexed and evicted within one report shows only as removed, and the reverse only
        as stored, so a reader may apply `removed` and `stored` in either order.
        """
        if not self._changes and not self._cleared:
            return None
        stored = [h for h, cached in self._changes.items() if cached]  # each still cached in the pool
        events = KVCacheEvents(stored=stored, removed=[h for h, cached in self._changes.items() if not cached],
                               cleared=self._cleared, stored_lora=by_lora(stored))
        self._changes.clear()
        self._cleared = False
        return events
