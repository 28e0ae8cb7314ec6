"""The n-gram (prompt lookup) proposer: the longest suffix found earlier, the tokens after it."""

from __future__ import annotations

import pytest

from engine_core.config import SpeculativeConfig
from engine_core.spec_decode import DraftInput, NgramProposer


@pytest.mark.parametrize("tokens, k, drafts", [
    ([1, 2, 3, 4, 2, 3], 3, [4, 2, 3]),  # [2, 3] earlier: what followed it
    ([1, 2, 3, 4, 2, 3], 5, [4, 2, 3, 4, 2]),  # ... and on, into its own drafts
    ([1, 2, 3, 4, 5, 1, 2, 3], 2, [4, 5]),  # the longest suffix ([1, 2, 3]) wins
    ([1, 2, 3, 4, 5, 6], 3, []),  # no repeat
    ([1, 2, 3, 9, 3], 3, []),  # a one-token match is shorter than min_n
    ([7, 1, 2, 9, 1, 2, 8, 1, 2], 4, [8, 1, 2, 8]),  # the latest of equal matches
    ([1, 2, 1, 2, 1, 2], 5, [1, 2, 1, 2, 1]),  # periodic output continues its period
    ([5, 5, 5, 5], 3, [5, 5, 5]),
    ([1, 2], 3, []),  # too short to hold a match
])
def test_proposes_what_followed_the_longest_earlier_suffix(tokens, k, drafts):
    assert NgramProposer(min_n=2, max_n=3).propose_one(tokens, k) == drafts


def test_max_n_bounds_the_match_and_k_the_drafts():
    tokens = [1, 2, 3, 4, 10, 9, 2, 3, 4, 11, 1, 2, 3, 4]
    # [1, 2, 3, 4] (max_n 4) occurs at the start; with max_n 3, [2, 3, 4] occurs twice and the latest wins
    assert NgramProposer(2, 4).propose_one(tokens, 2) == [10, 9]
    assert NgramProposer(2, 3).propose_one(tokens, 2) == [11, 1]
    assert NgramProposer(2, 3).propose_one(tokens, 0) == []


def test_propose_batch_keeps_order():
    proposer = NgramProposer(2, 3)
    inputs = [DraftInput("a", [1, 2, 3, 1, 2], 2), DraftInput("b", [4, 5, 6], 2), DraftInput("c", [8, 9, 8, 9], 1)]
    assert proposer.propose(inputs) == [[3, 1], [], [8]]


def test_config_checks_its_ranges():
    assert not SpeculativeConfig().enabled and SpeculativeConfig(method="ngram").enabled
    for bad in (dict(method="medusa"), dict(method="ngram", num_speculative_tokens=0),
                dict(method="ngram", prompt_lookup_min=3, prompt_lookup_max=2), dict(method="draft"),
                dict(method="ngram", draft_model="x")):
        with pytest.raises(ValueError):
            SpeculativeConfig(**bad)
