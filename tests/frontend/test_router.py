"""The router's policies on made-up engine states (pure: no servers), and the shared block hash."""

from __future__ import annotations

import hashlib
import struct

import pytest

from engine_core.protocol import KVCacheEvents, SamplingParams
from engine_core.protocol.block_hash import hash_block_tokens, hash_prompt_blocks
from engine_core.request import Request
from services.frontend.engines.router import EngineLoad, PrefixIndex, Router, RoutingPolicy

BLOCK = 4
SYSTEM_A = list(range(100, 124))  # 6 blocks
SYSTEM_B = list(range(200, 224))


def holding(*prompts: list[int], block_size: int = BLOCK, **load) -> EngineLoad:
    """An engine whose prefix cache holds the full blocks of `prompts`."""
    engine = EngineLoad(block_size=block_size, **load)
    for prompt in prompts:
        engine.prefix.apply(KVCacheEvents(stored=hash_prompt_blocks(prompt, block_size)))
    return engine


def test_the_frontend_hashes_a_prompt_as_the_engine_does():
    """The router's hashes are the engine's Request.block_hashes (one function, stable across processes)."""
    prompt = list(range(7, 50))
    request = Request("r", prompt, SamplingParams(), block_size=BLOCK)
    assert hash_prompt_blocks(prompt, BLOCK) == request.block_hashes
    assert hash_prompt_blocks(prompt, BLOCK, limit=3) == request.block_hashes[:3]
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(hash_block_tokens(None, [0, 0]), [1, 2])
    # the scheme as tandem.v1.KVCacheEvents documents it, so a frontend in any language computes the same
    first = hashlib.blake2b(bytes(8) + struct.pack("<4i", 1, 2, 3, 4), digest_size=8, person=b"tandem-kv-v1")
    assert hash_block_tokens(None, [1, 2, 3, 4]) == int.from_bytes(first.digest(), "little") == 0xC83504D174F5626C
    second = hashlib.blake2b(first.digest() + struct.pack("<2i", 49151, 0), digest_size=8, person=b"tandem-kv-v1")
    assert hash_prompt_blocks([1, 2, 3, 4, 49151, 0], 4)[-1] != int.from_bytes(second.digest(), "little")  # 1 block
    assert hash_block_tokens(0xC83504D174F5626C, [49151, 0]) == int.from_bytes(second.digest(), "little")


def test_prefix_aware_sends_a_prompt_where_its_longest_prefix_is_cached():
    router = Router(RoutingPolicy.PREFIX_AWARE)
    engines = [holding(SYSTEM_B), holding(SYSTEM_A[:12]), holding(SYSTEM_A)]
    decision = router.choose(engines, SYSTEM_A + [1, 2, 3])
    assert decision.index == 2 and decision.matched_tokens == len(SYSTEM_A)
    assert router.choose(engines, SYSTEM_B + [9]).index == 0
    # the prompt's last token is always computed: a block ending at the prompt's end is no hit
    assert router.choose([holding(SYSTEM_A)], SYSTEM_A).matched_tokens == len(SYSTEM_A) - BLOCK


def test_prefix_aware_gives_way_to_load_beyond_the_balance_thresholds():
    router = Router(RoutingPolicy.PREFIX_AWARE, balance_abs=4, balance_rel=1.0)
    prompt = SYSTEM_A + [1]
    within = [holding(SYSTEM_A, running=6, waiting=2), holding(in_flight=4)]  # 8 <= 4 + max(4, 4)
    assert router.choose(within, prompt).index == 0
    beyond = [holding(SYSTEM_A, running=6, waiting=3), holding(in_flight=4)]  # 9 > 8
    assert router.choose(beyond, prompt).index == 1
    full = [holding(SYSTEM_A, kv_usage=0.99), holding(kv_usage=0.5)]  # the cache is nearly full
    assert router.choose(full, prompt).index == 1
    all_full = [holding(SYSTEM_A, kv_usage=0.99), holding(kv_usage=0.99)]
    assert router.choose(all_full, prompt).index == 0


def test_without_a_hit_the_least_loaded_then_the_smallest_cache_wins():
    router = Router(RoutingPolicy.PREFIX_AWARE)
    engines = [holding(SYSTEM_A, in_flight=1), holding(SYSTEM_B), holding(in_flight=2), holding()]
    assert router.choose(engines, list(range(300, 330))).index == 3  # idle and empty: a new prompt spreads out


def test_requests_routed_but_not_yet_reported_count_as_expected_there():
    """A burst of one prompt stays together before the engine's first KV events arrive."""
    router = Router(RoutingPolicy.PREFIX_AWARE)
    engines = [holding(), holding(), holding()]
    first = router.choose(engines, SYSTEM_A + [1])
    engines[first.index].prefix.expect(first.prefix_hashes)
    engines[first.index].in_flight = 1
    second = router.choose(engines, SYSTEM_A + [2])
    assert second.index == first.index and second.matched_tokens == len(SYSTEM_A)
    engines[first.index].prefix.unexpect(first.prefix_hashes)
    assert not engines[first.index].prefix.expected


def test_least_loaded_and_round_robin_ignore_the_cache():
    engines = [holding(SYSTEM_A, in_flight=3), holding(in_flight=1), holding(in_flight=1)]
    least = Router(RoutingPolicy.LEAST_LOADED)
    picks = [least.choose(engines, SYSTEM_A + [1]).index for _ in range(4)]
    assert set(picks) == {1, 2}, "ties are broken in turn"
    rr = Router(RoutingPolicy.ROUND_ROBIN)
    picks = [rr.choose(engines, SYSTEM_A + [1]) for _ in range(6)]
    assert [d.index for d in picks] == [0, 1, 2, 0, 1, 2]
    assert picks[0].matched_tokens == len(SYSTEM_A) and picks[1].matched_tokens == 0  # hits are still counted


def test_engines_with_other_block_sizes_are_matched_at_their_own():
    router = Router(RoutingPolicy.PREFIX_AWARE)
    engines = [holding(SYSTEM_B, block_size=8), holding(SYSTEM_A, block_size=8), holding(block_size=16)]
    decision = router.choose(engines, SYSTEM_A + [5])
    assert decision.index == 1 and decision.matched_tokens == 24
    assert decision.prefix_hashes == hash_prompt_blocks(SYSTEM_A, 8)


def test_prefix_index_applies_kv_events():
    index = PrefixIndex()
    a, b, c = hash_prompt_blocks(SYSTEM_A, BLOCK)[:3]
    index.apply(KVCacheEvents(stored=[a, b, c]))
    assert index.match([a, b, c]) == 3
    index.apply(KVCacheEvents(removed=[b]))
    assert index.match([a, b, c]) == 1
    index.apply(KVCacheEvents(stored=[c], cleared=True))
    assert index.match([a, b, c]) == 0 and index.cached == {c}
    index.expect([a, a])
    index.unexpect([a])
    assert index.match([a]) == 1
    index.unexpect([a])
    assert index.match([a]) == 0 and len(index) == 1


def test_router_refuses_bad_settings_and_no_engines():
    with pytest.raises(ValueError, match="balance"):
        Router(balance_abs=-1)
    with pytest.raises(ValueError, match="no engine"):
        Router().choose([], [1, 2, 3])
