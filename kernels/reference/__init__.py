"""The plain-torch reference of every kernel Tandem has, in one place: what each kernel computes,
written the obvious way. Tests check each kernel against its reference (tests/kernels); where a
kernel falls back to torch with the same arithmetic (attention, the layer ops, argmax), the fallback
calls its reference. Nothing else defines a reference (tests/test_layering.py checks that no test
under tests/kernels writes its own); tests/kernels/paged_batch.py's dense attention, from the
definition on unpaged K/V, is the check of the attention reference itself.

One module per family, each kernel (module under kernels/) -> its reference:

- attention.py: paged attention and the KV-cache write, also the "torch" attention backend
  - cpu_attention (C++), triton_paged_attention -> `attention.paged_attention`
  - cpu_attention (C++), triton_kv_write -> `attention.write_kv_cache`
  - (both read a request's context as `attention.gather_context` lays it out; an 8-bit cache holds
    `attention.quantize_kv_rows`' codes and scales in kernels/kv_cache_layout.py's slabs, read back by
    `attention.read_kv_slabs` / `attention.dequantize_kv_cache`)
- layer_ops.py: the fused layer ops and argmax; the torch layers (engine_core/models/layers.py) call them
  - fused_ops.FusedOps (C++), triton_fused_ops.TritonFusedOps -> `layer_ops.rms_norm`,
    `layer_ops.fused_add_rms_norm`, `layer_ops.apply_rotary`, `layer_ops.silu_and_mul`
    (`layer_ops.gelu_and_mul`: Gemma's activation, no kernel yet)
  - fused_ops.argmax (C++) -> `layer_ops.argmax`
- linear.py: the CPU linears (kernels/cpu/linear.py's names)
  - linear, linear_colmajor (cpu_linear), onednn (onednn_linear) -> `linear.float_linear`
  - linear_bf16_packed (bf16_linear) -> `linear.bf16_linear`
  - int8, int8_gemv (int8_linear, weight-only) -> `linear.int8_weight_only`
  - int8_dynamic, int8_vnni (int8_linear, W8A8 per token) -> `linear.int8_per_token`;
    the C++ row pass that rounds W8A8's activations -> `linear.quantize_rows_int8`
  - int8_grouped (int8_linear, W8A8 per group of k) -> `linear.int8_grouped`
  - int4, int4_gemv (int4_linear) -> `linear.int4_weight_only`
- lora.py: cpu_lora's five kernels (the C++ one, csrc/lora.cpp, too), triton_lora -> `lora.add_lora`
- the one-op CPU decode layer (csrc/decode_layer.cpp, kernels/cpu/decode_layers.py) has
  no function here: its reference is the model's own module path (engine_core/models/llama.py's
  `LlamaDecoderLayer`, each op through the kernels above, so through these references on the torch
  path), and tests/engine_core/test_cpu_decode_layers.py checks the op against it.

The linear references take the float weight, apply the kernel's own quantization (the format, from
the kernel's module) and multiply in float64: the exact product of what the kernel holds, so a
test's tolerance is the kernel's rounding alone.
"""

from __future__ import annotations

from kernels.reference import attention, layer_ops, linear, lora
from kernels.reference.attention import (
    dequantize_kv_cache,
    dequantize_kv_rows,
    gather_context,
    paged_attention,
    quantize_kv_rows,
    read_kv_slabs,
    write_kv_cache,
)

__all__ = ["attention", "dequantize_kv_cache", "dequantize_kv_rows", "gather_context", "layer_ops", "linear", "lora",
           "paged_attention", "quantize_kv_rows", "read_kv_slabs", "write_kv_cache"]
