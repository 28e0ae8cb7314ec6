"""KVCacheManager: block tables, prefix hits, room checks, freeing."""

from engine_core.protocol import SamplingParams
from engine_core.request import Request
from engine_core.scheduling.kv_cache_manager import KVCacheManager

BLOCK = 4


def make_request(request_id, token_ids, **params):
    return Request(request_id, list(token_ids), SamplingParams(**params), block_size=BLOCK)


def admit(manager, request):
    """What the scheduler does for a waiting request: look up the prefix, allocate the rest."""
    blocks, num_computed = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_computed, blocks, num_computed)
    assert new is not None
    manager.record_prefix_lookup(request, num_computed)
    request.num_computed_tokens = request.num_tokens
    return num_computed


def test_allocate_grows_the_live_block_table():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK)
    request = make_request("a", range(6))
    admit(manager, request)
    ids = manager.get_block_ids("a")
    assert len(ids) == 2 and 0 not in ids
    request.append_output_token_ids([6, 7, 8])
    manager.allocate_slots(request, 3)
    assert manager.get_block_ids("a") is ids and len(ids) == 3
    manager.free(request)
    manager.free(request)  # idempotent
    assert manager.num_free_blocks == 9 and manager.get_block_ids("a") == []


def test_prefix_hit_is_capped_below_the_whole_prompt():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK)
    admit(manager, make_request("a", range(8)))
    assert manager.take_prefix_cache_stats() == (8, 0)
    same = make_request("b", range(8))
    blocks, num_computed = manager.get_computed_blocks(same)
    assert num_computed == 4 and len(blocks) == 1  # the last token must be computed
    longer = make_request("c", range(9))
    assert manager.get_computed_blocks(longer)[1] == 8
    assert manager.take_prefix_cache_stats() == (0, 0)  # looked up, not admitted: not counted yet
    manager.record_prefix_lookup(same, 4)
    manager.record_prefix_lookup(longer, 8)
    assert manager.take_prefix_cache_stats() == (17, 12)
    assert manager.take_prefix_cache_stats() == (0, 0)


def test_hit_stops_at_the_first_different_block():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK)
    admit(manager, make_request("a", range(12)))
    other = make_request("b", [0, 1, 2, 3, 99, 5, 6, 7, 8, 9, 10, 11, 12])
    assert manager.get_computed_blocks(other)[1] == 4


def test_shared_blocks_are_reference_counted():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK)
    a, b = make_request("a", range(9)), make_request("b", range(10))
    admit(manager, a)
    assert admit(manager, b) == 8
    assert manager.get_block_ids("a")[:2] == manager.get_block_ids("b")[:2]
    assert manager.num_free_blocks == 9 - 4
    manager.free(a)
    assert manager.num_free_blocks == 9 - 3
    manager.free(b)
    assert manager.num_free_blocks == 9


def test_hit_on_a_free_cached_block_counts_against_room():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)  # 3 usable blocks
    a = make_request("a", range(8))
    admit(manager, a)
    manager.free(a)  # both blocks free and cached
    b = make_request("b", list(range(8)) + [50, 51, 52, 53, 54])  # 4 blocks: 2 hits + 2 new
    blocks, num_computed = manager.get_computed_blocks(b)
    assert num_computed == 8
    assert manager.allocate_slots(b, 5, blocks, num_computed) is None
    assert manager.num_free_blocks == 3  # nothing changed
    c = make_request("c", list(range(8)) + [50])
    blocks, num_computed = manager.get_computed_blocks(c)
    assert len(manager.allocate_slots(c, 1, blocks, num_computed)) == 1
    assert manager.num_free_blocks == 0


def test_blocks_cached_when_allocated_for_tokens_that_fill_them():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK)
    a = make_request("a", range(10))
    manager.allocate_slots(a, 6)  # a chunk: only the first block becomes full
    a.num_computed_tokens = 6
    probe = make_request("p", range(10))
    assert manager.get_computed_blocks(probe)[1] == 4
    manager.allocate_slots(a, 4)
    assert manager.get_computed_blocks(probe)[1] == 8


def test_caching_disabled_never_hits():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK, enable_caching=False)
    admit(manager, make_request("a", range(9)))
    assert manager.get_computed_blocks(make_request("b", range(9))) == ([], 0)
    assert manager.take_prefix_cache_stats() == (0, 0)


def test_prompt_logprobs_requests_skip_the_cache():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK)
    admit(manager, make_request("a", range(9)))
    assert manager.get_computed_blocks(make_request("b", range(9), prompt_logprobs=1))[1] == 0


def test_free_releases_the_tail_first():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)
    a = make_request("a", range(12))
    admit(manager, a)
    head, middle, tail = manager.get_block_ids("a")
    manager.free(a)
    (first_reused,) = manager.allocate_slots(make_request("x", [99]), 1)
    assert first_reused.block_id == tail
    assert manager.get_computed_blocks(make_request("b", range(12)))[1] == 8  # head and middle kept


def test_reset_prefix_cache():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK)
    a = make_request("a", range(9))
    admit(manager, a)
    assert manager.reset_prefix_cache() is False
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request("b", range(9)))[1] == 0


# ---- sliding window ---------------------------------------------------------------------------
def test_blocks_behind_the_sliding_window_go_back_to_the_pool():
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK, sliding_window=6)
    request = make_request("a", range(22))
    admit(manager, request)  # 22 tokens computed: the next query (position 22) sees keys 17..22
    table = manager.get_block_ids("a")
    assert len(table) == 6 and manager.num_free_blocks == 13
    request.append_output_token_ids([100])
    manager.allocate_slots(request, 1)  # frees blocks 0..3 (positions 0..15), before any new room
    assert table[:4] == [0, 0, 0, 0] and 0 not in table[4:]
    assert manager.num_free_blocks == 13 + 4
    manager.free(request)
    assert manager.num_free_blocks == 19  # every block back once, the null block never


def test_freed_window_blocks_still_serve_prefix_hits():
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK, sliding_window=6)
    first = make_request("a", range(22))
    admit(manager, first)
    first.append_output_token_ids([100])
    manager.allocate_slots(first, 1)
    second = make_request("b", range(21))
    assert admit(manager, second) == 20  # blocks 0..3 were freed by "a" but are still indexed
    assert manager.get_block_ids("b")[:3] == [0, 0, 0]  # and go back at once: "b" is past them too
    manager.free(first)
    manager.free(second)
    assert manager.num_free_blocks == 19


def test_models_with_full_layers_keep_every_block():
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK)
    request = make_request("a", range(22))
    admit(manager, request)
    request.append_output_token_ids([100])
    manager.allocate_slots(request, 1)
    assert 0 not in manager.get_block_ids("a")
