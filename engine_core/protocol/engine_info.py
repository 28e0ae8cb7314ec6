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
    # CPU linear kernels in use past their layer's accuracy budget, "LAYER: KERNEL" (asked for with
    # --quantization int8/int4 or pinned; kernels/cpu/accuracy_budget.py); empty: every answer is within it
    lossy_linear_kernels: tuple[str, ...] = ()
    batch_invariant: bool = False  # --batch-invariant: answers independent of the batch (docs/batch-invariance.md)
    kv_cache_dtype: str = ""  # the KV cache's element type as --kv-cache-dtype names it: bf16, fp32, int8, fp8_e4m3
