"""Per-request block tables on top of the block pool, with prefix caching.

The scheduler asks two questions: which leading blocks of a new request are already
cached (`get_computed_blocks`), and whether there is room for the tokens it wants to
compute this step (`allocate_slots`). Blocks are cached as soon as they are allocated
for tokens that will fill them, so a request scheduled later in the same step may
already hit them (the runner writes a layer's KV for the whole batch before attention).

When every layer attends through a sliding window of W keys, a request's blocks that no
future query can see (all positions before `num_computed_tokens - W + 1`) go back to the
pool as it advances, the null block taking their place in its block table. They stay
indexed by hash until evicted, so a later request with the same prefix still hits them.
Models that mix sliding and full layers keep every block (the full layers read them).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_core.request import Request
from engine_core.scheduling.block_pool import BlockPool, KVCacheBlock


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, sliding_window: int | None = None
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already indexed
        self.num_freed_blocks: dict[str, int] = {}  # leading blocks given back behind the sliding window
        self.prefix_cache_queries = 0  # tokens
        self.prefix_cache_hits = 0  # tokens

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    # ---- prefix cache lookup ----------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached run of the request's leading full blocks, and its length in tokens.

        Never covers the whole request: at least one token is left to compute so the
        model produces logits for it. Requests that want prompt logprobs, or pool over every
        position (mean, cls), compute everything.
        """
        every_position = request.sampling_params.prompt_logprobs is not None or (
            request.pooling is not None and request.pooling.needs_every_position)
        if not self.enable_caching or every_position:
            return [], 0
        size = self.block_size
        max_blocks = min((request.num_tokens - 1) // size, len(request.block_hashes))
        blocks = []
        for i in range(max_blocks):
            token_ids = tuple(request.all_token_ids[i * size:(i + 1) * size])
            block = self.block_pool.get_cached_block(request.block_hashes[i], token_ids)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * size

    def record_prefix_lookup(self, request: Request, num_computed_tokens: int) -> None:
        """Count a lookup whose request was admitted (the scheduler calls this once it is): a request
        waiting for blocks is looked up again each step but counts once, and a preempted request
        counts again when it resumes (its recompute is work the cache did not save)."""
        if self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_computed_tokens

    def take_prefix_cache_stats(self) -> tuple[int, int]:
        """(queries, hits) in tokens since the last call."""
        stats = (self.prefix_cache_queries, self.prefix_cache_hits)
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        return stats

    # ---- allocation -------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Grow the request's block table to hold `num_new_tokens` more tokens.

        `new_computed_blocks` (prefix hits from `get_computed_blocks`) are appended
        first. Returns the newly allocated blocks, or None (nothing changed) when
        the pool is short.
        """
        if not (new_computed_blocks or num_new_computed_tokens) and self._fits_held_blocks(request, num_new_tokens):
            return []  # most decode steps: nothing to allocate, free or index
        self._free_behind_window(request, request.num_computed_tokens)
        num_held = len(self.req_to_blocks.get(request.request_id, ()))
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - num_held - len(new_computed_blocks)
        # Free cached hits stop counting as free once touched.
        num_hits_in_free_queue = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_needed > self.block_pool.num_free_blocks - num_hits_in_free_queue:
            return None

        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_needed, 0))
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        block_ids = self.req_to_block_ids.setdefault(request.request_id, [])
        for block in (*new_computed_blocks, *new_blocks):
            blocks.append(block)
            block_ids.append(block.block_id)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_tokens)
        if new_computed_blocks:
            self._free_behind_window(request, request.num_computed_tokens + num_new_computed_tokens)
        return new_blocks

    def _fits_held_blocks(self, request: Request, num_new_tokens: int) -> bool:
        """allocate_slots would change nothing: the blocks hold the tokens, none is due back or to be indexed."""
        if self.sliding_window is not None:
            return False
        blocks = self.req_to_blocks.get(request.request_id)
        num_tokens = request.num_computed_tokens + num_new_tokens
        if blocks is None or num_tokens > len(blocks) * self.block_size:
            return False
        return not self.enable_caching or self.num_cached_blocks.get(request.request_id, 0) >= min(
            num_tokens // self.block_size, len(request.block_hashes))

    def _free_behind_window(self, request: Request, num_computed_tokens: int) -> None:
        """Give back the leading blocks no query from position `num_computed_tokens` on can see."""
        blocks = self.req_to_blocks.get(request.request_id)
        if self.sliding_window is None or not blocks:
            return
        start = self.num_freed_blocks.get(request.request_id, 0)
        end = min(max(num_computed_tokens - self.sliding_window + 1, 0) // self.block_size, len(blocks))
        if end <= start:
            return
        freed = blocks[start:end]
        blocks[start:end] = [self.block_pool.null_block] * (end - start)
        self.req_to_block_ids[request.request_id][start:end] = [self.block_pool.null_block.block_id] * (end - start)
        self.num_freed_blocks[request.request_id] = end
        self.block_pool.free_blocks(freed)  # oldest first: evicted first

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        size = self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // size, len(request.block_hashes))
        for i in range(start, end):
            token_ids = tuple(request.all_token_ids[i * size:(i + 1) * size])
            self.block_pool.cache_full_block(blocks[i], request.block_hashes[i], token_ids, request.lora_name)
        self.num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Give back all the request's blocks, last first (so they are evicted first). Idempotent."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        num_freed = self.num_freed_blocks.pop(request.request_id, 0)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks[num_freed:]))

    def free_tail(self, request: Request) -> None:
        """Give back the blocks past the request's tokens (speculative decoding's rejected drafts), last first."""
        blocks, keep = self.req_to_blocks.get(request.request_id, []), -(-request.num_tokens // self.block_size)
        self.block_pool.free_blocks(reversed(blocks[keep:]))
        del blocks[keep:], self.req_to_block_ids.get(request.request_id, [])[keep:]

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's live block table (the same list object while the request holds blocks)."""
        return self.req_to_block_ids.get(request_id, [])

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (nothing done) while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()
