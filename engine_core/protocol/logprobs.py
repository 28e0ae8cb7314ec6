"""Logprobs at one position, as the engine samples them and the frontend decodes them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Index 0 is the chosen token, then the top-N."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # rank of the chosen token in the full distribution (1 = most likely)
    decoded: list[str] = field(default_factory=list)  # token texts, filled in by the frontend
