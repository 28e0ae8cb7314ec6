"""What a pooling (embedding) request asks for: torch-free, shared by the frontend and the engine.

A pooling request runs its prompt through the model like any prefill (chunked, batched with
generation) and, instead of sampling, returns one vector pooled from the final hidden states
(after the last norm); it then finishes and frees its KV blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PoolingType(enum.IntEnum):
    """Which hidden states make the vector (numbered like tandem.v1.PoolingType)."""

    LAST = 1  # the last prompt token's (decoder embedding models: Qwen3-Embedding, e5-mistral)
    MEAN = 2  # the mean over every prompt token
    CLS = 3  # the first prompt token's


@dataclass(frozen=True)
class PoolingParams:
    pooling_type: PoolingType = PoolingType.LAST
    normalize: bool = True  # scale the vector to unit L2 norm

    @property
    def needs_every_position(self) -> bool:
        """MEAN and CLS read hidden states a prefix-cache hit would skip, so they compute all."""
        return self.pooling_type != PoolingType.LAST
