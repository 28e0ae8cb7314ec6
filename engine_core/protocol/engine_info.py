"""What an engine says about itself and its model (tandem.v1 GetEngineInfo)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    block_size: int = 0  # tokens per KV block: the prefix hashes' granularity (0: unknown)
    num_blocks: int = 0
    bos_token_id: int | None = None
    dtype: str = ""
    device: str = ""
    attention_backend: str = ""
