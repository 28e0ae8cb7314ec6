"""Which engine gets a request: prefix-aware, least-loaded or round-robin (pure policy, no I/O).

Prefix-aware (the default, as SGLang's cache-aware router and vLLM's KV-event routing): each
engine reports the chained hashes of the prefix-cache blocks it holds (`PrefixIndex`, fed by the
Connect stream's KVCacheEvents); a request goes to the engine holding the longest run of its
prompt's leading blocks, unless that engine's load is too far above the least loaded one's
(more than `balance_abs` requests and more than `balance_rel` times the least load above it), or
its KV cache is nearly full while another's is not. Without any hit it goes to the least loaded
engine, ties broken by the smallest prefix cache (so distinct prompts spread over the engines)
and then in turn.

Load is `max(requests this frontend has in flight there, running + waiting as the engine last
reported)`: the first counts a burst routed before the engine's next step, the second the other
frontends' requests.
"""

from __future__ import annotations

import enum
import itertools
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine_core.protocol import KVCacheEvents
from engine_core.protocol.block_hash import BlockHash, hash_prompt_blocks
from engine_core.protocol.kv_events import group_by_lora

DEFAULT_BALANCE_ABS = 8
DEFAULT_BALANCE_REL = 1.0
DEFAULT_KV_USAGE_LIMIT = 0.95


class RoutingPolicy(enum.Enum):
    PREFIX_AWARE = "prefix-aware"
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


class PrefixIndex:
    """One engine's prefix-cache hashes as it reported them, plus those of requests routed there and
    not yet finished (expected soon: a burst of one prompt stays on one engine before it reports).
    `lora_of` names the adapter of each cached adapter block (matching needs only the hashes: an
    adapter's chain is rooted in its name)."""

    def __init__(self) -> None:
        self.cached: set[BlockHash] = set()
        self.lora_of: dict[BlockHash, str] = {}
        self.expected: Counter[BlockHash] = Counter()

    def __len__(self) -> int:
        return len(self.cached) + len(self.expected)

    def apply(self, events: KVCacheEvents) -> None:
        """One KVCacheEvents report (removed and stored never share a hash, so the order is free)."""
        if events.cleared:
            self.cached.clear()
            self.lora_of.clear()
        self.cached.difference_update(events.removed)
        for block_hash in events.removed:
            self.lora_of.pop(block_hash, None)
        self.cached.update(events.stored)
        self.lora_of.update(events.lora_of())

    def cached_loras(self) -> Counter[str]:
        """Cached blocks per LoRA adapter: which adapters have prefixes cached on this engine."""
        return Counter(self.lora_of.values())

    def snapshot(self) -> KVCacheEvents:
        """The cached hashes as one report that replaces whatever a reader knew (adapters named)."""
        return KVCacheEvents(stored=list(self.cached), cleared=True, stored_lora=group_by_lora(self.lora_of.items()))

    def expect(self, hashes: Iterable[BlockHash]) -> None:
        self.expected.update(hashes)

    def unexpect(self, hashes: Iterable[BlockHash]) -> None:
        for block_hash in hashes:  # only these keys: the cost follows the request, not the index
            count = self.expected.get(block_hash, 0) - 1
            if count > 0:
                self.expected[block_hash] = count
            else:
                self.expected.pop(block_hash, None)

    def clear(self) -> None:
        """The engine went away: its cache and whatever was routed there are gone."""
        self.cached.clear()
        self.lora_of.clear()
        self.expected.clear()

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many of `hashes` (a prompt's leading blocks, in order) are held or expected, from the first."""
        for i, block_hash in enumerate(hashes):
            if block_hash not in self.cached and block_hash not in self.expected:
                return i
        return len(hashes)


@dataclass
class EngineLoad:
    """What the router knows of one engine."""

    in_flight: int = 0  # this frontend's requests there
    running: int = 0  # as the engine last reported (every frontend's)
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    block_size: int = 0  # 0: unknown (no prefix matching)
    prefix: PrefixIndex = field(default_factory=PrefixIndex)

    @property
    def load(self) -> int:
        return max(self.in_flight, self.running + self.waiting)


@dataclass(frozen=True)
class Decision:
    index: int  # into the candidates
    prefix_hashes: list[BlockHash]  # the prompt's block hashes at the chosen engine's block size
    matched_tokens: int  # prompt tokens the chosen engine holds (or is expected to), by the router's view


class Router:
    """Chooses one of the candidate engines for a prompt; `choose` is pure but for the round-robin turn."""

    def __init__(self, policy: RoutingPolicy = RoutingPolicy.PREFIX_AWARE, *, balance_abs: int = DEFAULT_BALANCE_ABS,
                 balance_rel: float = DEFAULT_BALANCE_REL, kv_usage_limit: float = DEFAULT_KV_USAGE_LIMIT) -> None:
        if balance_abs < 0 or balance_rel < 0:
            raise ValueError(f"balance thresholds must be >= 0, got abs={balance_abs} rel={balance_rel}")
        self.policy = policy
        self.balance_abs, self.balance_rel, self.kv_usage_limit = balance_abs, balance_rel, kv_usage_limit
        self._turn = itertools.count()

    def choose(self, engines: Sequence[EngineLoad], prompt_token_ids: Sequence[int],
               lora_name: str | None = None) -> Decision:
        """The engine for this prompt under the LoRA adapter `lora_name` (None: the base model; its blocks
        hash apart, engine_core/block_hash.py). engines: non-empty, in a stable order."""
        if not engines:
            raise ValueError("no engine to route to")
        turn = next(self._turn)
        if self.policy is RoutingPolicy.ROUND_ROBIN:
            return self._decision(engines, turn % len(engines), prompt_token_ids, lora_name)
        if self.policy is RoutingPolicy.LEAST_LOADED:
            return self._decision(engines, self._least_loaded(engines, range(len(engines)), turn), prompt_token_ids,
                                  lora_name)
        return self._prefix_aware(engines, prompt_token_ids, turn, lora_name)

    # ---- policies ---------------------------------------------------------------------
    def _prefix_aware(self, engines: Sequence[EngineLoad], prompt_token_ids: Sequence[int], turn: int,
                      lora_name: str | None) -> Decision:
        hashes_by_size: dict[int, list[BlockHash]] = {}
        matched = []
        for engine in engines:
            hashes = self._hashes(hashes_by_size, engine.block_size, prompt_token_ids, lora_name)
            matched.append(engine.prefix.match(hashes) * engine.block_size)
        eligible = self._eligible(engines)
        best = max(eligible, key=lambda i: (matched[i], -engines[i].load))
        if matched[best] == 0:
            best = self._least_loaded(engines, eligible, turn)
        hashes = hashes_by_size.get(engines[best].block_size, [])
        return Decision(best, hashes, matched[best])

    def _eligible(self, engines: Sequence[EngineLoad]) -> list[int]:
        """Engines whose load is not too far above the least loaded one's, and whose KV cache has room."""
        least = min(engine.load for engine in engines)
        slack = max(self.balance_abs, self.balance_rel * least)
        eligible = [i for i, e in enumerate(engines) if e.load <= least + slack]
        roomy = [i for i in eligible if engines[i].kv_usage < self.kv_usage_limit]
        return roomy or eligible

    @staticmethod
    def _least_loaded(engines: Sequence[EngineLoad], among: Iterable[int], turn: int) -> int:
        """The least loaded; ties: the smallest prefix cache, then in turn."""
        among = list(among)
        n = len(engines)
        return min(among, key=lambda i: (engines[i].load, len(engines[i].prefix), (i - turn) % n))

    def _decision(self, engines: Sequence[EngineLoad], index: int, prompt_token_ids: Sequence[int],
                  lora_name: str | None) -> Decision:
        """Round-robin and least-loaded still track what they send where (the index is what the engine reports)."""
        engine = engines[index]
        hashes = self._hashes({}, engine.block_size, prompt_token_ids, lora_name)
        return Decision(index, hashes, engine.prefix.match(hashes) * engine.block_size)

    @staticmethod
    def _hashes(cache: dict[int, list[BlockHash]], block_size: int, prompt_token_ids: Sequence[int],
                lora_name: str | None = None) -> list[BlockHash]:
        """The prompt's full-block hashes at `block_size`, but never its last token: an engine computes at
        least one prompt token, so a block ending at the prompt's end is only hit by longer prompts."""
        if block_size <= 0:
            return []
        if block_size not in cache:
            cache[block_size] = hash_prompt_blocks(prompt_token_ids, block_size,
                                                   limit=(len(prompt_token_ids) - 1) // block_size,
                                                   lora_name=lora_name)
        return cache[block_size]
