// Attention rows (head_dim elements of q, K, V or an accumulator) as 16-lane fp32 vectors,
// and fold16, which sums 16 vectors' lanes at once.
//
// bf16 rows are widened in "split" lane order: each 32 elements become their 16 even then
// their 16 odd ones, one shift or one mask each and no shuffles. Dot products do not care
// about the order as long as both sides share it, and store_row puts it back. int8 rows (the
// codes of an int8 KV cache) are widened in natural order, and so are the rows they meet
// (store_row_natural writes such a row back to fp32 or bf16).
#pragma once

#include "cpu_common.h"

namespace tandem {

// head_dims whose rows run on vectors (others take the scalar loops)
constexpr bool vectorized(int64_t kD) { return kD != 0 && kD % 32 == 0; }

template <int64_t V>
inline void widen_row(const float* row, f32x16 (&out)[V]) {
  for (int64_t v = 0; v < V; ++v) out[v] = load<f32x16>(row + 16 * v);
}
template <int64_t V>
inline void widen_row(const bf16* row, f32x16 (&out)[V]) {  // split lane order
  for (int64_t u = 0; u < V / 2; ++u) {
    u32x16 w;
    std::memcpy(&w, row + 32 * u, sizeof w);
    out[2 * u] = bit_cast<f32x16>(w << 16);
    out[2 * u + 1] = bit_cast<f32x16>(w & 0xffff0000u);
  }
}
template <int64_t V>
inline void widen_row(const int8_t* row, f32x16 (&out)[V]) {  // natural lane order
  for (int64_t v = 0; v < V; ++v) out[v] = load<f32x16>(row + 16 * v);
}
template <int64_t V, typename T>
inline void widen_row_natural(const T* row, f32x16 (&out)[V]) {
  for (int64_t v = 0; v < V; ++v) out[v] = load<f32x16>(row + 16 * v);
}
template <int64_t V, typename T>
inline void store_row_natural(T* row, const f32x16 (&x)[V]) {
  for (int64_t v = 0; v < V; ++v) store(row + 16 * v, x[v]);
}
template <int64_t V>
inline void store_row(float* row, const f32x16 (&x)[V]) {
  for (int64_t v = 0; v < V; ++v) store(row + 16 * v, x[v]);
}
template <int64_t V>
inline void store_row(bf16* row, const f32x16 (&x)[V]) {  // from split lane order
  for (int64_t u = 0; u < V / 2; ++u) {
    const u32x16 w = bf16_bits(x[2 * u + 1]) | (bf16_bits(x[2 * u]) >> 16);
    std::memcpy(row + 32 * u, &w, sizeof w);
  }
}

// ---- fold16: lane c of the result = sum of the lanes of p[c] ---------------------------
// Each step halves the lanes per key and doubles the keys per vector, keeping key order.
#define TANDEM_FOLD(x, y, ...) (__builtin_shufflevector(x, y, __VA_ARGS__))
template <typename V>
inline V fold_step16(V x, V y) {  // 1 key x 16 lanes each -> 2 keys x 8
  return TANDEM_FOLD(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         TANDEM_FOLD(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
template <typename V>
inline V fold_step8(V x, V y) {  // 2 keys x 8 -> 4 keys x 4
  return TANDEM_FOLD(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         TANDEM_FOLD(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
template <typename V>
inline V fold_step4(V x, V y) {  // 4 keys x 4 -> 8 keys x 2
  return TANDEM_FOLD(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         TANDEM_FOLD(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
template <typename V>
inline V fold_step2(V x, V y) {  // 8 keys x 2 -> 16 keys x 1
  return TANDEM_FOLD(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         TANDEM_FOLD(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#undef TANDEM_FOLD

template <typename V>  // f32x16, or i32x16 for exact integer sums
inline V fold16(const V (&p)[16]) {
  V a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = fold_step16(p[2 * i], p[2 * i + 1]);
  for (int i = 0; i < 4; ++i) b[i] = fold_step8(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 2; ++i) c[i] = fold_step4(b[2 * i], b[2 * i + 1]);
  return fold_step2(c[0], c[1]);
}

}  // namespace tandem
