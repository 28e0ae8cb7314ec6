// A whole Llama decoder layer as one op, for decode batches whose linears run Tandem's own kernels.
//
// At one decode row a SmolLM2 layer is ten small kernels (two norms, four GEMVs, rotary, the
// KV write, attention, SiLU * mul), and calling each from Python through the dispatcher costs
// about as much as the kernels themselves (docs/cpu-kernels.md#decoder-layers-as-one-c-op). Here the same kernels run back to back from
// C++ (ops.h), in the order and with the arithmetic of the module path, so one call replaces
// ten. The caller (kernels/cpu/decode_layers.py) makes the step's scratch tensors and
// their views once per forward; every layer reuses them.
//
// Each linear comes as a kernel kind and up to four tensors, the state its Python kernel holds
// (kernels/cpu/int8_linear.py, kernels/cpu/bf16_linear.py):
//   kInt8Gemv    packed, scale                      int8 weight-only GEMV (a few rows)
//   kInt8Vnni    packed, w_scale, offsets, bias     W8A8 over a VNNI-packed weight
//   kBf16Packed  packed, bias                       bf16 over a vdpbf16ps-packed weight
//   kInt4Gemv    packed                             int4 weight-only GEMV (a few rows)
//   kInt8Grouped packed, w_scale, offsets, bias     W8A8 with an activation scale per group of k
// (unused slots: empty tensors).
//
// With LoRA (engine_core/lora), each linear also comes with its adapter slots A [S, R, in] and
// B [S, R, out] and the outputs each slot's blocks of ranks reach (lora.cpp), and the step its rows' slots (`lora_row_slots` [T], -1 for base rows): lora.cpp adds
// every adapter row's product right after its linear, as the module path's LoraLinear does, so a
// decode step with adapter rows is still one op per layer. Without: empty tensors.

#include "ops.h"

namespace tandem {
namespace {

enum LinearKind : int64_t { kInt8Gemv = 0, kInt8Vnni = 1, kBf16Packed = 2, kInt4Gemv = 3, kInt8Grouped = 4 };

void adapters(Tensor out, Tensor x, const Tensor& lora_a, const Tensor& lora_b, const Tensor& lora_pieces,
              const Tensor& row_slots) {
  if (row_slots.numel() > 0 && lora_a.numel() > 0) lora_add(out, x, lora_a, lora_b, row_slots, lora_pieces);
}

void linear(int64_t kind, Tensor out, Tensor x, const Tensor& a, const Tensor& b, const Tensor& c, const Tensor& d) {
  switch (kind) {
    case kInt8Gemv: return int8_gemv(out, x, a, b);
    case kInt8Vnni: return int8_vnni_gemm(out, x, a, b, c, d);
    case kBf16Packed: return bf16_packed_gemm(out, x, a, b);
    case kInt4Gemv: return int4_gemv(out, x, a);
    case kInt8Grouped: return int8_grouped_gemm(out, x, a, b, c, d);
    default: TANDEM_CHECK(false, "unknown linear kind ", kind);
  }
}

// (hidden, residual) -> (hidden, residual) for one layer; shapes as the module path has them:
//   hidden, residual [T, E]; qkv [T, (H + 2 Hkv) D] with views qk [T, H + Hkv, D], q [T, H, D],
//   k, v [T, Hkv, D]; attn [T, H, D] with attn_rows its [T, H D] view; o [T, E];
//   gate_up [T, 2 I]; act [T, I]. cos, sin [T, D / 2].
void llama_decode_layer(
    Tensor hidden, Tensor residual,
    Tensor input_norm, Tensor post_norm, double eps,
    int64_t qkv_kind, Tensor qkv_a, Tensor qkv_b, Tensor qkv_c, Tensor qkv_d,
    int64_t o_kind, Tensor o_a, Tensor o_b, Tensor o_c, Tensor o_d,
    int64_t gate_up_kind, Tensor gate_up_a, Tensor gate_up_b, Tensor gate_up_c, Tensor gate_up_d,
    int64_t down_kind, Tensor down_a, Tensor down_b, Tensor down_c, Tensor down_d,
    Tensor key_cache, Tensor value_cache, double scale, int64_t window, double softcap, bool batch_invariant,
    Tensor cos, Tensor sin, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc,
    Tensor qkv, Tensor qk, Tensor q, Tensor k, Tensor v, Tensor attn, Tensor attn_rows,
    Tensor o, Tensor gate_up, Tensor act,
    Tensor lora_row_slots, Tensor qkv_lora_a, Tensor qkv_lora_b, Tensor qkv_lora_pieces, Tensor o_lora_a,
    Tensor o_lora_b, Tensor o_lora_pieces, Tensor gate_up_lora_a, Tensor gate_up_lora_b, Tensor gate_up_lora_pieces,
    Tensor down_lora_a, Tensor down_lora_b, Tensor down_lora_pieces) {
  // attention: hidden <- norm(hidden + residual), residual <- the sum
  fused_add_rms_norm(hidden, residual, input_norm, eps);
  linear(qkv_kind, qkv, hidden, qkv_a, qkv_b, qkv_c, qkv_d);
  adapters(qkv, hidden, qkv_lora_a, qkv_lora_b, qkv_lora_pieces, lora_row_slots);
  rotary_embedding(qk, cos, sin);
  write_kv_cache(k, v, key_cache, value_cache, slot_mapping);
  paged_attention(attn, q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, window,
                  softcap, batch_invariant);
  linear(o_kind, o, attn_rows, o_a, o_b, o_c, o_d);
  adapters(o, attn_rows, o_lora_a, o_lora_b, o_lora_pieces, lora_row_slots);
  // MLP: o <- norm(o + residual); its output goes to hidden, the next layer's input
  fused_add_rms_norm(o, residual, post_norm, eps);
  linear(gate_up_kind, gate_up, o, gate_up_a, gate_up_b, gate_up_c, gate_up_d);
  adapters(gate_up, o, gate_up_lora_a, gate_up_lora_b, gate_up_lora_pieces, lora_row_slots);
  silu_and_mul(act, gate_up);
  linear(down_kind, hidden, act, down_a, down_b, down_c, down_d);
  adapters(hidden, act, down_lora_a, down_lora_b, down_lora_pieces, lora_row_slots);
}

}  // namespace
}  // namespace tandem

STABLE_TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def(
      "llama_decode_layer(Tensor(a!) hidden, Tensor(b!) residual, Tensor input_norm, Tensor post_norm, "
      "float eps, int qkv_kind, Tensor qkv_a, Tensor qkv_b, Tensor qkv_c, Tensor qkv_d, "
      "int o_kind, Tensor o_a, Tensor o_b, Tensor o_c, Tensor o_d, "
      "int gate_up_kind, Tensor gate_up_a, Tensor gate_up_b, Tensor gate_up_c, Tensor gate_up_d, "
      "int down_kind, Tensor down_a, Tensor down_b, Tensor down_c, Tensor down_d, "
      "Tensor(c!) key_cache, Tensor(d!) value_cache, float scale, int window, float softcap, bool batch_invariant, "
      "Tensor cos, Tensor sin, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, Tensor(e!) qkv, Tensor(f!) qk, Tensor q, Tensor k, Tensor v, "
      "Tensor(g!) attn, Tensor attn_rows, Tensor(h!) o, Tensor(i!) gate_up, Tensor(j!) act, "
      "Tensor lora_row_slots, Tensor qkv_lora_a, Tensor qkv_lora_b, Tensor qkv_lora_pieces, Tensor o_lora_a, "
      "Tensor o_lora_b, Tensor o_lora_pieces, Tensor gate_up_lora_a, Tensor gate_up_lora_b, "
      "Tensor gate_up_lora_pieces, Tensor down_lora_a, Tensor down_lora_b, Tensor down_lora_pieces) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("llama_decode_layer", TORCH_BOX(&tandem::llama_decode_layer));
}
