// A whole Llama decoder layer as one op, for decode batches whose four linears run the int8 GEMV.
//
// At one decode row a SmolLM2 layer is ten small kernels (two norms, four GEMVs, rotary, the
// KV write, attention, SiLU * mul), and calling each from Python through the dispatcher costs
// 4-8 us, about as much as the kernels themselves. Here the same kernels run back to back from
// C++ (ops.h), in the order and with the arithmetic of the module path, so one call replaces
// ten. The caller (kernels/cpu_decode_layers.py) makes the step's scratch tensors and their
// views once per forward; every layer reuses them.

#include "ops.h"

namespace tandem {
namespace {

// (hidden, residual) -> (hidden, residual) for one layer; shapes as the module path has them:
//   hidden, residual [T, E]; qkv [T, (H + 2 Hkv) D] with views qk [T, H + Hkv, D], q [T, H, D],
//   k, v [T, Hkv, D]; attn [T, H, D] with attn_rows its [T, H D] view; o [T, E];
//   gate_up [T, 2 I]; act [T, I]. cos, sin [T, D / 2].
void llama_decode_layer(
    Tensor hidden, Tensor residual,
    Tensor input_norm, Tensor post_norm, double eps,
    Tensor qkv_packed, Tensor qkv_scale, Tensor o_packed, Tensor o_scale,
    Tensor gate_up_packed, Tensor gate_up_scale, Tensor down_packed, Tensor down_scale,
    Tensor key_cache, Tensor value_cache, double scale, int64_t window, double softcap,
    Tensor cos, Tensor sin, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc,
    Tensor qkv, Tensor qk, Tensor q, Tensor k, Tensor v, Tensor attn, Tensor attn_rows,
    Tensor o, Tensor gate_up, Tensor act) {
  // attention: hidden <- norm(hidden + residual), residual <- the sum
  fused_add_rms_norm(hidden, residual, input_norm, eps);
  int8_gemv(qkv, hidden, qkv_packed, qkv_scale);
  rotary_embedding(qk, cos, sin);
  write_kv_cache(k, v, key_cache, value_cache, slot_mapping);
  paged_attention(attn, q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, window,
                  softcap);
  int8_gemv(o, attn_rows, o_packed, o_scale);
  // MLP: o <- norm(o + residual); its output goes to hidden, the next layer's input
  fused_add_rms_norm(o, residual, post_norm, eps);
  int8_gemv(gate_up, o, gate_up_packed, gate_up_scale);
  silu_and_mul(act, gate_up);
  int8_gemv(hidden, act, down_packed, down_scale);
}

}  // namespace
}  // namespace tandem

STABLE_TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def(
      "llama_decode_layer(Tensor(a!) hidden, Tensor(b!) residual, Tensor input_norm, Tensor post_norm, "
      "float eps, Tensor qkv_packed, Tensor qkv_scale, Tensor o_packed, Tensor o_scale, "
      "Tensor gate_up_packed, Tensor gate_up_scale, Tensor down_packed, Tensor down_scale, "
      "Tensor(c!) key_cache, Tensor(d!) value_cache, float scale, int window, float softcap, "
      "Tensor cos, Tensor sin, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, Tensor(e!) qkv, Tensor(f!) qk, Tensor q, Tensor k, Tensor v, "
      "Tensor(g!) attn, Tensor attn_rows, Tensor(h!) o, Tensor(i!) gate_up, Tensor(j!) act) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("llama_decode_layer", TORCH_BOX(&tandem::llama_decode_layer));
}
