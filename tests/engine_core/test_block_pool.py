"""BlockPool: the null block, LRU eviction, confirmed prefix hits, reset."""

import pytest

from engine_core.scheduling.block_pool import BlockPool


def test_null_block_is_never_handed_out():
    pool = BlockPool(num_blocks=5)
    blocks = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    with pytest.raises(RuntimeError):
        pool.free_blocks([pool.null_block])


def test_freed_blocks_are_reused_least_recently_freed_first():
    pool = BlockPool(num_blocks=5)
    a, b, c, d = pool.get_new_blocks(4)
    pool.free_blocks([c, a])
    pool.free_blocks([d])
    assert [blk.block_id for blk in pool.get_new_blocks(3)] == [c.block_id, a.block_id, d.block_id]


def test_negative_ref_count_raises():
    pool = BlockPool(num_blocks=3)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="negative"):
        pool.free_blocks([block])


def test_eviction_drops_the_hash():
    pool = BlockPool(num_blocks=2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, 123, (1, 2))
    pool.free_blocks([block])
    assert pool.get_cached_block(123, (1, 2)) is block  # free but still cached
    (reused,) = pool.get_new_blocks(1)
    assert reused is block and block.block_hash is None
    assert pool.get_cached_block(123, (1, 2)) is None


def test_hit_is_confirmed_by_tokens():
    pool = BlockPool(num_blocks=3)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, 7, (1, 2))
    assert pool.get_cached_block(7, (1, 2)) is block
    assert pool.get_cached_block(7, (1, 3)) is None  # same hash, other tokens: a collision
    assert pool.get_cached_block(8, (1, 2)) is None


def test_hash_taken_by_another_block_is_not_overwritten():
    pool = BlockPool(num_blocks=3)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_block(first, 7, (1, 2))
    pool.cache_full_block(second, 7, (1, 2))
    assert pool.get_cached_block(7, (1, 2)) is first and second.block_hash is None
    pool.free_blocks([first, second])
    pool.get_new_blocks(2)  # evicting both must not fail


def test_touch_takes_a_free_cached_block_out_of_the_queue():
    pool = BlockPool(num_blocks=4)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_block(b, 1, (5,))
    pool.free_blocks([c, b, a])
    assert pool.num_free_blocks == 3
    pool.touch([pool.get_cached_block(1, (5,))])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 2
    assert [blk.block_id for blk in pool.get_new_blocks(2)] == [c.block_id, a.block_id]
    pool.touch([b])  # shared by a second owner
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 0


def test_caching_disabled_caches_nothing():
    pool = BlockPool(num_blocks=3, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, 1, (1,))
    assert pool.get_cached_block(1, (1,)) is None


def test_reset_prefix_cache_only_when_all_blocks_are_free():
    pool = BlockPool(num_blocks=3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 1, (1,))
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(1, (1,)) is a
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(1, (1,)) is None and a.block_hash is None


# ---- KV events (what a prefix-aware router learns) ------------------------------------
def test_events_report_net_changes_since_the_last_take():
    pool = BlockPool(num_blocks=4)
    assert pool.take_events() is None  # not recording: nothing accumulates
    pool.record_events()
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_block(a, 11, (1,))
    pool.cache_full_block(b, 22, (2,))
    events = pool.take_events()
    assert events.stored == [11, 22] and events.removed == [] and not events.cleared
    assert pool.take_events() is None
    pool.free_blocks([a, b])
    pool.cache_full_block(c, 33, (3,))
    (evicted,) = pool.get_new_blocks(1)  # a: least recently freed, its hash 11 is evicted
    pool.cache_full_block(evicted, 11, (1,))  # ... and cached again in the same step: net stored
    pool.free_blocks([c])
    pool.get_new_blocks(2)  # evicts b (22) and c (33: stored and evicted in one step, never reported)
    events = pool.take_events()
    assert sorted(events.stored) == [11] and sorted(events.removed) == [22, 33]


def test_reset_reports_cleared_and_snapshot_lists_every_cached_hash():
    pool = BlockPool(num_blocks=4)
    pool.record_events()
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 11, (1,))
    pool.cache_full_block(b, 22, (2,))
    snapshot = pool.snapshot()
    assert snapshot.cleared and sorted(snapshot.stored) == [11, 22]
    pool.free_blocks([a, b])
    pool.take_events()
    assert pool.reset_prefix_cache()
    events = pool.take_events()
    assert events.cleared and events.stored == [] and events.removed == []
    assert pool.snapshot().stored == []


def test_events_and_snapshot_name_the_adapter_of_each_adapter_block():
    pool = BlockPool(num_blocks=6)
    pool.record_events()
    base, x1, x2, y1, reused = pool.get_new_blocks(5)
    pool.cache_full_block(base, 10, (1,))
    pool.cache_full_block(x1, 21, (1,), lora_name="x")
    pool.cache_full_block(x2, 22, (2,), lora_name="x")
    pool.cache_full_block(y1, 31, (1,), lora_name="y")
    events = pool.take_events()
    assert events.stored == [10, 21, 22, 31]  # every stored hash, the base's and the adapters'
    assert events.stored_lora == {"x": [21, 22], "y": [31]}  # the base block is in no group
    assert pool.snapshot().stored_lora == {"x": [21, 22], "y": [31]}
    pool.free_blocks([x2, reused])
    pool.get_new_blocks(2)  # evicts x2 (22); the block that held it forgets its adapter
    pool.cache_full_block(x2, 40, (3,))  # now a base block
    events = pool.take_events()
    assert events.removed == [22] and events.stored == [40] and events.stored_lora == {}
    assert pool.snapshot().stored_lora == {"x": [21], "y": [31]}
