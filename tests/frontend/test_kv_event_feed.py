"""The KV event feed a gateway subscribes to: engines' hashes joined with the token ids the frontend saw, several
engines seen as one worker, snapshots with parents first; and its protocol form (int64 hashes)."""

from __future__ import annotations

import asyncio

from smg_grpc_proto.generated import common_pb2

from engine_core.protocol import KVCacheEvents, SchedulerStats
from engine_core.protocol.block_hash import hash_prompt_blocks
from services.frontend.gateway import convert
from services.frontend.gateway.kv_event_feed import KVEventFeed, KVFeedBatch, StoredBlock

BLOCK = 4
PROMPT = list(range(100, 111))  # two full blocks and three tokens


def drain(queue: asyncio.Queue) -> list[KVFeedBatch]:
    batches = []
    while not queue.empty():
        batches.append(queue.get_nowait())
    return batches


def feed_with_block_size() -> KVEventFeed:
    feed = KVEventFeed()
    feed.on_engine_report("a", BLOCK, None, KVCacheEvents(cleared=True))  # the snapshot of an empty cache
    return feed


def test_a_stored_block_is_announced_with_its_tokens_once_both_are_known():
    feed = feed_with_block_size()
    queue = feed.subscribe()
    assert [(b.cleared, b.stored) for b in drain(queue)] == [(True, [])]
    hashes = hash_prompt_blocks(PROMPT, BLOCK)
    feed.on_engine_report("a", BLOCK, None, KVCacheEvents(stored=hashes))  # tokens not known yet: held back
    assert drain(queue) == []
    feed.learn_tokens(PROMPT)
    [batch] = drain(queue)
    assert batch.stored == [StoredBlock(hashes[0], None, tuple(PROMPT[:4])),
                            StoredBlock(hashes[1], hashes[0], tuple(PROMPT[4:8]))]
    feed.on_engine_report("a", BLOCK, None, KVCacheEvents(removed=[hashes[1]]))
    assert [b.removed for b in drain(queue)] == [[hashes[1]]]


def test_two_engines_are_one_worker_a_block_goes_when_the_last_engine_drops_it():
    feed = feed_with_block_size()
    feed.learn_tokens(PROMPT)
    queue = feed.subscribe()
    drain(queue)
    first = hash_prompt_blocks(PROMPT, BLOCK)[:1]
    feed.on_engine_report("a", BLOCK, None, KVCacheEvents(stored=first))
    feed.on_engine_report("b", BLOCK, None, KVCacheEvents(stored=first))
    assert [len(b.stored) for b in drain(queue)] == [1]
    feed.on_engine_report("a", BLOCK, None, KVCacheEvents(cleared=True))
    assert drain(queue) == []
    feed.on_engine_report("b", BLOCK, None, KVCacheEvents(removed=first))
    assert [b.removed for b in drain(queue)] == [first]


def test_a_new_subscriber_starts_from_a_snapshot_parents_first():
    feed = feed_with_block_size()
    feed.learn_tokens(PROMPT)
    hashes = hash_prompt_blocks(PROMPT, BLOCK)
    feed.on_engine_report("a", BLOCK, None, KVCacheEvents(stored=list(reversed(hashes))))
    [snapshot] = drain(feed.subscribe())
    assert snapshot.cleared and [b.block_hash for b in snapshot.stored] == hashes


def test_load_sums_the_engines():
    feed = KVEventFeed()
    feed.on_engine_report("a", BLOCK, SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.5,
                                                     num_free_blocks=5, num_total_blocks=10), None)
    feed.on_engine_report("b", BLOCK, SchedulerStats(num_running_reqs=1, kv_cache_usage=0.1, num_free_blocks=10,
                                                     num_total_blocks=10), None)
    load = feed.load()
    assert (load.running, load.waiting, load.num_used_blocks, load.num_total_blocks) == (3, 1, 5, 20)
    assert abs(load.kv_usage - 0.3) < 1e-9


def test_the_protocol_batch_carries_int64_hashes_and_a_parent():
    big = (1 << 64) - 5
    batch = KVFeedBatch(stored=[StoredBlock(big, 7, (1, 2, 3, 4))], removed=[big], cleared=True, block_size=BLOCK)
    proto = convert.kv_event_batch(batch, 3, 10, 1.5, common_pb2.EngineLoad(running_requests=2))
    assert [e.WhichOneof("data") for e in proto.events] == ["cleared", "removed", "stored"]
    assert [e.event_id for e in proto.events] == [10, 11, 12] and proto.sequence_number == 3
    stored = proto.events[2].stored
    assert stored.blocks[0].block_hash == -5 and stored.parent_block_hash == 7
    assert list(stored.blocks[0].token_ids) == [1, 2, 3, 4] and stored.blocks[0].block_size == BLOCK
    assert list(proto.events[1].removed.block_hashes) == [-5] and proto.load.running_requests == 2


def test_an_adapters_blocks_are_announced_under_its_name_and_the_base_blocks_under_none():
    feed = feed_with_block_size()
    base, x = hash_prompt_blocks(PROMPT, BLOCK), hash_prompt_blocks(PROMPT, BLOCK, lora_name="x")
    feed.on_engine_report("a", BLOCK, None, KVCacheEvents(stored=base + x, stored_lora={"x": x}))
    queue = feed.subscribe()
    drain(queue)
    feed.learn_tokens(PROMPT, "x")  # an adapter's request: its chain is rooted in the adapter's name
    [batch] = drain(queue)
    assert batch.stored == [StoredBlock(x[0], None, tuple(PROMPT[:4]), "x"),  # the first block has no parent
                            StoredBlock(x[1], x[0], tuple(PROMPT[4:8]), "x")]
    feed.learn_tokens(PROMPT)
    [base_batch] = drain(queue)
    assert [(b.block_hash, b.lora_name) for b in base_batch.stored] == [(base[0], None), (base[1], None)]
    proto = convert.kv_event_batch(KVFeedBatch(stored=batch.stored + base_batch.stored, block_size=BLOCK), 1, 1,
                                   0.0, common_pb2.EngineLoad())
    stored = [e.stored for e in proto.events]
    assert [s.lora_name if s.HasField("lora_name") else None for s in stored] == ["x", "x", None, None]
    assert [s.HasField("parent_block_hash") for s in stored] == [False, True, False, True]
