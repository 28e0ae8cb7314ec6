"""The KV cache's blocks: reference counts, an LRU free queue and the prefix-cache index.

Pure bookkeeping (no tensors): a block id is an index into the model runner's KV
tensors. Block 0 is the null block: never handed out, used to pad block tables.
A free block keeps its cached hash until it is evicted (reused for new tokens), so
a later request with the same prefix can take it back out of the free queue.

With `record_events()` the pool also notes which hashes it indexed and evicted (vLLM's KV
events, engine_core/scheduling/kv_events.py), for whoever routes requests by prefix: `take_events()` hands
them over once a step.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine_core.protocol import KVCacheEvents
from engine_core.protocol.block_hash import BlockHash
from engine_core.protocol.kv_events import group_by_lora
from engine_core.scheduling.kv_events import KVEventLog


class KVCacheBlock:
    """One block of KV slots. `token_ids` confirms a prefix-cache hit."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "lora_name", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] = ()
        self.lora_name: str | None = None  # the LoRA adapter it was cached under (None: the base model)
        # Links of the free queue; None while the block is not in it.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, least recently freed first; O(1) removal anywhere."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: no None checks at the ends
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        block.prev_free, block.next_free = last, self._tail
        last.next_free = self._tail.prev_free = block
        self._len += 1

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> KVCacheBlock:
        if self._len == 0:
            raise RuntimeError("no free blocks")
        block = self._head.next_free
        self.remove(block)
        return block

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """Hands out blocks, takes them back, and indexes full blocks by their chained hash."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        self.events: KVEventLog | None = None  # None: not recording

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner, including evictable cached ones."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) that are owned."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    # ---- allocation -----------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the head of the free queue (evicting their hashes), ref 1 each."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block (prefix hits), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0 and block is not self.null_block:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; unowned ones join the tail of the free queue.

        Pass a request's blocks in reverse order so its last blocks are evicted first.
        """
        for block in blocks:
            if block is self.null_block:
                raise RuntimeError("the null block is never allocated, so never freed")
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"{block}: reference count went negative")
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    # ---- prefix cache ---------------------------------------------------------
    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash, token_ids: tuple[int, ...],
                         lora_name: str | None = None) -> None:
        """Index a full block by hash, under the LoRA adapter its request uses (None: the base model; the
        KV events name it). A block already cached, or a hash already taken, is left as is."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached_blocks:
            return
        block.block_hash, block.token_ids, block.lora_name = block_hash, token_ids, lora_name
        self.cached_blocks[block_hash] = block
        self._note(block_hash, cached=True)

    def get_cached_block(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> KVCacheBlock | None:
        """The cached block with this hash, only if it holds exactly these tokens."""
        block = self.cached_blocks.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is owned."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.cached_blocks.values():
            block.block_hash, block.token_ids, block.lora_name = None, (), None
        self.cached_blocks.clear()
        if self.events is not None:
            self.events.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        del self.cached_blocks[block.block_hash]
        self._note(block.block_hash, cached=False)
        block.block_hash, block.token_ids, block.lora_name = None, (), None

    # ---- KV events ------------------------------------------------------------
    def record_events(self) -> None:
        """From now on note the hashes indexed and evicted, for `take_events()`."""
        if self.events is None:
            self.events = KVEventLog()

    def take_events(self) -> KVCacheEvents | None:
        """The net changes since the last call (None when there are none or nothing is recorded); adapter
        blocks among the stored are also grouped by adapter (`stored_lora`)."""
        return None if self.events is None else self.events.take(self._by_lora)

    def snapshot(self) -> KVCacheEvents:
        """Every hash indexed now, as a report that replaces whatever a reader knew."""
        stored = list(self.cached_blocks)
        return KVCacheEvents(stored=stored, cleared=True, stored_lora=self._by_lora(stored))

    def _by_lora(self, stored: list[BlockHash]) -> dict[str, list[BlockHash]]:
        """The adapter blocks among these cached hashes, grouped by adapter."""
        return group_by_lora((block_hash, self.cached_blocks[block_hash].lora_name) for block_hash in stored)

    def _note(self, block_hash: BlockHash, cached: bool) -> None:
        if self.events is not None:
            self.events.note(block_hash, cached)
