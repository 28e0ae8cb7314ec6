"""Scheduler test harness: a scheduler and requests with small blocks, and the block-accounting
invariants every scheduler test checks (tests/engine_core/test_scheduler*.py)."""

from engine_core.config import CacheConfig, SchedulerConfig
from engine_core.protocol import SamplingParams
from engine_core.request import Request
from engine_core.scheduling.scheduler import Scheduler

BLOCK = 4


def make_scheduler(
    num_blocks=64, max_model_len=64, budget=64, max_num_seqs=16, policy="fcfs",
    chunked=True, caching=True, block_size=BLOCK,
):
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
            policy=policy, enable_chunked_prefill=chunked,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
    )


def make_request(
    request_id, token_ids, max_tokens=4, priority=0, arrival_time=0.0,
    eos=(), block_size=BLOCK, max_model_len=None, **params,
):
    return Request(
        request_id, list(token_ids), SamplingParams(max_tokens=max_tokens, **params),
        block_size=block_size, eos_token_ids=frozenset(eos), arrival_time=arrival_time,
        priority=priority, max_model_len=max_model_len,
    )


def all_blocks_free(scheduler):
    manager = scheduler.kv_cache_manager
    return manager.num_free_blocks == manager.num_blocks - 1 and not manager.req_to_blocks


def check_accounting(scheduler):
    """Every reference is a block-table entry, and the free queue is exactly the unowned blocks."""
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    owners = {}
    for blocks in manager.req_to_blocks.values():
        for block in blocks:
            owners[block.block_id] = owners.get(block.block_id, 0) + 1
    for block in pool.blocks[1:]:
        assert block.ref_cnt == owners.get(block.block_id, 0) >= 0
    assert {b.block_id for b in pool.free_queue} == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
    assert len(pool.free_queue) == pool.num_free_blocks
    assert pool.null_block.ref_cnt == 0 and 0 not in owners
    assert all(block.block_hash == h for h, block in pool.cached_blocks.items())
    assert set(manager.req_to_blocks) == {r.request_id for r in scheduler.running}
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    for request in scheduler.running:
        assert len(manager.get_block_ids(request.request_id)) * manager.block_size >= request.num_computed_tokens
