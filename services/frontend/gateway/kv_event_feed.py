"""The engines' prefix-cache changes and load, as one worker's feed for a gateway (SubscribeKvEvents, GetLoads).

Engines report the chained hashes of the blocks they index and evict (engine_core/protocol/block_hash.py) and their
load, on every frontend's Connect stream; the engine client hands each report here. A gateway such as
smg keeps its own radix tree of token ids per worker, so a stored block must carry its token ids: the
feed learns them from the prompts that pass through the frontend (every request's, through either API)
and the gateway's finished sequences (`learn_tokens`), and announces a block once both the engine holds
it and its tokens are known (a block another frontend's request filled stays unannounced). A block of a
LoRA adapter's request is hashed under the adapter (engine_core/protocol/block_hash.py) and announced with
its name (`KvBlocksStored.lora_name`, which smg folds into its own hashes); its chain's first block has
no parent. Several engines behind this frontend look like one worker: a hash is stored while any engine
holds it and removed when the last one drops it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine_core.protocol import KVCacheEvents, SchedulerStats
from engine_core.protocol.block_hash import BlockHash, hash_block_tokens, root_hash

MAX_KNOWN_BLOCKS = 1 << 16  # token ids remembered per block hash (~20 MB at 16 tokens a block; oldest go first)
MAX_QUEUED_BATCHES = 1024  # a subscriber further behind than this is dropped (it resubscribes)


@dataclass(frozen=True)
class StoredBlock:
    block_hash: BlockHash
    parent_hash: BlockHash | None  # None: the first block of its chain
    token_ids: tuple[int, ...]
    lora_name: str | None = None  # the LoRA adapter it was stored under; None: the base model


@dataclass
class KVFeedBatch:
    """What changed, in order: cleared first (forget everything), then removed, then stored."""

    stored: list[StoredBlock] = field(default_factory=list)
    removed: list[BlockHash] = field(default_factory=list)
    cleared: bool = False
    block_size: int = 0


@dataclass(frozen=True)
class WorkerLoad:
    """The engines' load as they last reported it, summed over the engines."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # the mean over engines, 0..1
    num_used_blocks: int = 0
    num_total_blocks: int = 0


class SubscriberGone(Exception):
    """The subscriber fell too far behind and was dropped."""


class KVEventFeed:
    def __init__(self) -> None:
        self.block_size = 0
        self._known: OrderedDict[BlockHash, StoredBlock] = OrderedDict()
        self._held: dict[str, set[BlockHash]] = {}  # engine address -> hashes it holds
        self._holders: dict[BlockHash, int] = {}  # hash -> how many engines hold it
        self._announced: set[BlockHash] = set()
        self._stats: dict[str, SchedulerStats] = {}
        self._subscribers: set[asyncio.Queue] = set()

    # ---- what passes through the frontend ---------------------------------------------
    def learn_tokens(self, token_ids: Sequence[int], lora_name: str | None = None) -> None:
        """Remember the full blocks of this sequence under the LoRA adapter `lora_name` (None: the base
        model); announce the ones engines already hold."""
        if self.block_size <= 0:
            return
        chain, parent, fresh = root_hash(lora_name), None, []
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            tokens = tuple(token_ids[start:start + self.block_size])
            block_hash = hash_block_tokens(chain if parent is None else parent, tokens)
            if block_hash not in self._known:
                self._known[block_hash] = StoredBlock(block_hash, parent, tokens, lora_name)
                if block_hash in self._holders:
                    fresh.append(block_hash)
            self._known.move_to_end(block_hash)
            parent = block_hash
        while len(self._known) > MAX_KNOWN_BLOCKS:
            self._known.popitem(last=False)
        if fresh:
            self._publish(KVFeedBatch(stored=self._announce(fresh)))

    # ---- what the engines report --------------------------------------------------------
    def on_engine_report(self, address: str, block_size: int, stats: SchedulerStats | None,
                         events: KVCacheEvents | None) -> None:
        if stats is not None:
            self._stats[address] = stats
        if events is None:
            return
        self.block_size = self.block_size or block_size
        held = self._held.setdefault(address, set())
        removed = []
        if events.cleared:
            removed += self._drop(held, list(held))
        removed += self._drop(held, [h for h in events.removed if h in held])
        added = [h for h in events.stored if h not in held]
        held.update(added)
        newly_held = []
        for block_hash in added:
            self._holders[block_hash] = self._holders.get(block_hash, 0) + 1
            if self._holders[block_hash] == 1:
                newly_held.append(block_hash)
        batch = KVFeedBatch(stored=self._announce(newly_held), removed=removed)
        if batch.stored or batch.removed:
            self._publish(batch)

    def _drop(self, held: set[BlockHash], hashes: list[BlockHash]) -> list[BlockHash]:
        """Forget these hashes for one engine; the announced ones no engine holds any more."""
        gone = []
        for block_hash in hashes:
            held.discard(block_hash)
            count = self._holders.get(block_hash, 0) - 1
            if count > 0:
                self._holders[block_hash] = count
                continue
            self._holders.pop(block_hash, None)
            if block_hash in self._announced:
                self._announced.discard(block_hash)
                gone.append(block_hash)
        return gone

    def _announce(self, hashes: list[BlockHash]) -> list[StoredBlock]:
        """The blocks among `hashes` whose tokens are known and that are not yet announced, parents first."""
        blocks = []
        for block_hash in hashes:
            block = self._known.get(block_hash)
            if block is not None and block_hash not in self._announced:
                self._announced.add(block_hash)
                blocks.append(block)
        return blocks

    # ---- subscribers --------------------------------------------------------------------
    def subscribe(self) -> asyncio.Queue:
        """A queue of KVFeedBatch, starting with the worker's state now (cleared, then every announced block)."""
        queue: asyncio.Queue = asyncio.Queue(MAX_QUEUED_BATCHES)
        queue.put_nowait(KVFeedBatch(stored=self._snapshot(), cleared=True, block_size=self.block_size))
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._subscribers.discard(queue)

    def _snapshot(self) -> list[StoredBlock]:
        """Every announced block, each parent before its children."""
        ordered, seen = [], set()
        for block_hash in self._announced:
            chain = []
            while block_hash is not None and block_hash not in seen and block_hash in self._announced:
                seen.add(block_hash)
                chain.append(self._known[block_hash])
                block_hash = self._known[block_hash].parent_hash
            ordered.extend(reversed(chain))
        return ordered

    def _publish(self, batch: KVFeedBatch) -> None:
        batch.block_size = self.block_size
        for queue in list(self._subscribers):
            if queue.full():  # never block the engine client's loop on a slow subscriber
                self._subscribers.discard(queue)
                queue.get_nowait()
                queue.put_nowait(SubscriberGone())
            else:
                queue.put_nowait(batch)

    # ---- load -----------------------------------------------------------------------------
    def load(self) -> WorkerLoad:
        stats = list(self._stats.values())
        if not stats:
            return WorkerLoad()
        return WorkerLoad(
            running=sum(s.num_running_reqs for s in stats), waiting=sum(s.num_waiting_reqs for s in stats),
            kv_usage=sum(s.kv_cache_usage for s in stats) / len(stats),
            num_used_blocks=sum(max(s.num_total_blocks - s.num_free_blocks, 0) for s in stats),
            num_total_blocks=sum(s.num_total_blocks for s in stats))
