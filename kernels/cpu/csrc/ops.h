// The registered ops that other kernels call directly, without a trip through the dispatcher
// (decode_layer.cpp chains a whole decoder layer of them). Each is defined beside its kernel.

#pragma once

#include "cpu_common.h"

namespace tandem {

// fused_ops.cpp
void rms_norm(Tensor out, Tensor x, Tensor weight, double eps);
void fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, double eps);
void rotary_embedding(Tensor x, Tensor cos, Tensor sin);
void silu_and_mul(Tensor out, Tensor x);
// int8_gemv.cpp
void int8_gemv(Tensor out, Tensor x, Tensor packed, Tensor scale);
// int4_gemv.cpp
void int4_gemv(Tensor out, Tensor x, Tensor packed);
// int8_vnni.cpp
void int8_vnni_gemm(Tensor out, Tensor x, Tensor packed, Tensor w_scale, Tensor offsets, Tensor bias);
// int8_grouped.cpp
void int8_grouped_gemm(Tensor out, Tensor x, Tensor packed, Tensor w_scale, Tensor offsets, Tensor bias);
// int8_blockwise.cpp
void int8_blockwise_gemm(Tensor out, Tensor x, Tensor packed, Tensor bias);
// bf16_packed.cpp
void bf16_packed_gemm(Tensor out, Tensor x, Tensor packed, Tensor bias);
// lora.cpp
void lora_add(Tensor y, Tensor x, Tensor a, Tensor b, Tensor row_slots, Tensor pieces);
// paged_attention.cpp
void paged_attention(Tensor out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables,
                     Tensor seq_lens, Tensor query_start_loc, double scale, int64_t window, double softcap,
                     bool batch_invariant);
void write_kv_cache(Tensor key, Tensor value, Tensor key_cache, Tensor value_cache, Tensor slot_mapping);

}  // namespace tandem
