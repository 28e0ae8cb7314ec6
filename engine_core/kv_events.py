"""KV events (vLLM's): the prefix-cache hashes the block pool indexed and evicted since the last report, for
whoever routes requests by prefix. The pool notes each change here once `record_events()` is called; a step
hands the net changes over with its outputs."""

from __future__ import annotations

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

    def take(self) -> KVCacheEvents | None:
        """The net changes since the last call (None when there are none).

        A hash indexed and evicted within one report shows only as removed, and the reverse only
        as stored, so a reader may apply `removed` and `stored` in either order.
        """
        if not self._changes and not self._cleared:
            return None
        events = KVCacheEvents(stored=[h for h, cached in self._changes.items() if cached],
                               removed=[h for h, cached in self._changes.items() if not cached],
                               cleared=self._cleared)
        self._changes.clear()
        self._cleared = False
        return events
