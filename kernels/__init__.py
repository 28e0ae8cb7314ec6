"""The kernels' one front door: the engine imports `kernels` and nothing deeper (tests/test_layering.py).

What it offers: paged attention and the KV-cache write (`select_backend`), fused layer ops and argmax
(`select_fused_ops`, `argmax`), the float dtype measured fastest here (`fastest_float_dtype`), LoRA's
shrink/expand products (`select_lora_ops`: Triton on CUDA, the kernel measured fastest per row bucket on the
CPU; `LoraStepIndex` maps a step's rows to adapter slots), and the CPU plan in one call
(`plan_cpu_model`): every linear on the kernel measured fastest per batch bucket within its accuracy budget
(or pinned), and the decoder layers as one C++ op each where that measures faster; `watch_compiles` tells a
watcher of every Triton compile and CPU plan timing in the process (kernels/compile_watch.py). The model says
what each layer computes (its linears' `LinearRole`s, its layers as a `DecoderStack`); the kernels choose how,
and the engine never times a kernel itself. Every kernel's plain-torch reference is in `reference`
(kernels/reference/), which the torch paths call.

Paged attention behind one dispatch point:

`select_backend(device, name)` returns an `AttentionBackend` whose two functions
have the same signature on every backend:

    write_kv_cache(key, value, key_cache, value_cache, slot_mapping, metadata=None)
        key, value: [T, num_kv_heads, head_dim]
        key_cache, value_cache: [num_blocks, num_kv_heads, block_size, row]: row = head_dim values, or an 8-bit
            cache's head_dim codes and fp16 scale (kernels/kv_cache_layout.py: `kv_cache_shape`, the element
            types of --kv-cache-dtype; every backend reads int8, Triton fp8_e4m3 too)
        slot_mapping: [T] int64; slot -1 is skipped
        metadata: the step's AttentionMetadata, when the caller has it (lets a backend
            reuse per-step work across layers); optional

    paged_attention(query, key_cache, value_cache, metadata, scale) -> [T, num_heads, head_dim]

`batch_invariant=True` asks for a backend whose output rows do not depend on the rows beside them (the
engine's --batch-invariant): the C++ kernel and Triton's split no context by batch; the torch reference,
whose matmul shapes follow each request's length, cannot promise it.

"torch" is the pure-torch reference (any device, kernels/reference/attention.py); "cpp" is the
C++ CPU kernel that reads K/V blocks in place (kernels/cpu/attention.py, built on first use by
kernels/cpu/extension.py);
"triton" runs the Triton kernels (CUDA, or the CPU interpreter under TRITON_INTERPRET=1).

`supports_cuda_graphs` says a backend may be captured in a CUDA graph: it reads every
per-step value from the metadata's device tensors (never the host lists, beyond their
length) and never syncs with the host. The torch reference sizes its gathers from the
host lists, so it runs eagerly only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from kernels.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv_cache: Callable
    paged_attention: Callable
    supports_cuda_graphs: bool = False
    batch_invariant: bool = False


def select_backend(device: str, name: str = "auto", batch_invariant: bool = False) -> AttentionBackend:
    """Triton on CUDA; on the CPU the C++ kernel, or the torch reference when it cannot be
    built (no compiler); `name` overrides (tests, debugging). `batch_invariant`: see above."""
    if name == "auto":
        if device.startswith("cuda"):
            name = "triton"
        else:
            from kernels.cpu import extension as cpu_extension

            name = "cpp" if cpu_extension.load() else "torch"
    if name == "cpp":
        from kernels.cpu import attention as cpu_attention
        from kernels.cpu import extension as cpu_extension

        if not cpu_extension.load():
            raise ValueError("attention backend 'cpp' needs a C++ compiler (see the log); use 'torch' or 'auto'")
        attend = functools.partial(cpu_attention.paged_attention, batch_invariant=True) if batch_invariant else \
            cpu_attention.paged_attention
        return AttentionBackend("cpp", cpu_attention.write_kv_cache, attend, batch_invariant=batch_invariant)
    if batch_invariant and name == "torch":
        raise ValueError("batch-invariant mode needs the 'cpp' or 'triton' attention backend: the torch reference's "
                         "matmuls change shape with each request's length")
    if name == "torch":
        from kernels import reference

        return AttentionBackend("torch", reference.write_kv_cache, reference.paged_attention)
    if name == "triton":
        from kernels.triton import kv_write as triton_kv_write
        from kernels.triton import paged_attention as triton_paged_attention

        attend = functools.partial(triton_paged_attention.paged_attention, batch_invariant=True) \
            if batch_invariant else triton_paged_attention.paged_attention
        return AttentionBackend(
            "triton", triton_kv_write.write_kv_cache, attend, supports_cuda_graphs=True,
            batch_invariant=batch_invariant,
        )
    raise ValueError(f"attention backend must be 'auto', 'torch', 'cpp' or 'triton', got {name!r}")


# ---- the rest of the front door (imported after AttentionBackend: these modules import this package)
from kernels import reference  # noqa: E402
from kernels.compile_watch import unwatch_compiles, watch_compiles  # noqa: E402
from kernels.cpu.decode_layers import CpuDecodeLayers, DecoderLayerSpec, DecoderStack  # noqa: E402
from kernels.cpu.linear import LinearRole, Pins, batch_invariant_kernel, lossy_linear_kernels  # noqa: E402
from kernels.cpu.linear_timing import Timer, wall_timer  # noqa: E402
from kernels.cpu.plan import fastest_float_dtype, plan_cpu_model  # noqa: E402
from kernels.fused_ops import FusedOps, argmax, select_fused_ops  # noqa: E402
from kernels.kv_cache_layout import (  # noqa: E402
    KV_CACHE_DTYPES,
    is_quantized,
    kv_bytes_per_token,
    kv_cache_shape,
    resolve_kv_cache_dtype,
)
from kernels.lora_index import LoraStepIndex  # noqa: E402
from kernels.lora_ops import LORA_KERNELS, LoraOps, LoraPlan, select_lora_ops  # noqa: E402

__all__ = [
    "AttentionBackend", "AttentionMetadata", "CpuDecodeLayers", "DecoderLayerSpec", "DecoderStack", "FusedOps",
    "KV_CACHE_DTYPES", "LORA_KERNELS", "LinearRole", "LoraOps", "LoraPlan", "Pins", "LoraStepIndex", "Timer",
    "argmax", "batch_invariant_kernel", "fastest_float_dtype", "is_quantized", "kv_bytes_per_token",
    "kv_cache_shape", "lossy_linear_kernels", "plan_cpu_model", "reference", "resolve_kv_cache_dtype",
    "select_backend", "select_fused_ops", "select_lora_ops", "unwatch_compiles", "wall_timer", "watch_compiles",
]
