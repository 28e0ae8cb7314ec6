"""What a proposer is: given requests and their tokens so far, up to k draft tokens each.

A proposer only guesses; the verification (engine_core/spec_decode/verification.py) makes the output exact
whatever it guesses, so a bad proposer costs speed, never correctness. Its drafts are taken as certain (a point
mass): the n-gram proposer's are, and a draft model or an EAGLE-style head that proposes its argmax are too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DraftInput:
    """One request to propose for: its tokens (prompt and output, the newest included) and the most drafts wanted."""

    request_id: str
    token_ids: Sequence[int]
    num_drafts: int


class Proposer(ABC):
    """Proposes draft tokens; called once a step, after sampling, for the requests that may speculate."""

    @abstractmethod
    def propose(self, inputs: Sequence[DraftInput]) -> list[list[int]]:
        """Per input, at most `num_drafts` tokens that likely follow its `token_ids` (empty: no guess)."""

    def forget(self, request_ids: Iterable[str]) -> None:  # noqa: B027 - stateless proposers keep nothing
        """Drop the state kept for these finished requests (a draft model's KV cache)."""
