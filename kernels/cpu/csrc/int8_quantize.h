// Per-token int8 quantization of one activation row, shared by W8A8's kernels (int8_rows.cpp's
// quantize pass, int8_vnni.cpp's fused one) so both round the same way:
//   scale = max(absmax(row) / 127, 1e-12), q = round_half_even(x / scale)
#pragma once

#include "cpu_common.h"

namespace tandem {

template <typename V>
inline V abs_lanes(V x) { return x < 0.0f ? -x : x; }

// round half to even for |x| < 2^22 (the 1.5 * 2^23 trick), as torch.round and nearbyint do
template <typename V>
inline V round_even(V x) { return (x + 12582912.0f) - 12582912.0f; }

// max |x[i]| over one row (also int8_gemv.cpp's 16-bit rows)
template <typename T>
float row_absmax(const T* x, int64_t n) {
  f32x16 peak = {};
  float tail = 0.0f;
  for_lanes(n, [&](auto lanes, int64_t i) {
    using V = decltype(lanes);
    const V a = abs_lanes(load<V>(x + i));
    if constexpr (is_vector<V>) peak = a > peak ? a : peak;
    else tail = std::max(tail, a);
  });
  return std::max(reduce_max(peak), tail);
}

// flip: XORed into each byte as it is stored (0x80 turns q into q + 128 as an unsigned byte,
// vpdpbusd's unsigned operand, in the same pass)
template <typename T>
void quantize_row(int8_t* q, float* scale, const T* x, int64_t n, uint8_t flip = 0) {
  const float s = std::max(row_absmax(x, n) / 127.0f, 1e-12f);
  *scale = s;
  for_lanes(n, [&](auto lanes, int64_t i) {
    using V = decltype(lanes);
    const V r = round_even(load<V>(x + i) / s);  // |r| <= 127: no clamp needed
    if constexpr (is_vector<V>) {
      const i8x16 b = __builtin_convertvector(__builtin_convertvector(r, i32x16), i8x16) ^ int8_t(flip);
      std::memcpy(q + i, &b, sizeof b);
    } else {
      q[i] = int8_t(int8_t(r) ^ int8_t(flip));
    }
  });
}

constexpr float kInt16Peak = 32512.0f;  // 127 * 256: the high byte of xq stays a signed byte

// One row of x as 16-bit integers split into bytes (the weight-only GEMVs, int8_gemv.cpp and
// int4_gemv.cpp): xq = round(x / scale) = 256 * hi + lo, with
// lo in [-128, 127] and hi in [-127, 127]; sums[0], sums[1]: the sums of lo and of hi, which undo
// the weight's +128 (sum_k (q + 128) * a = sum_k q * a + 128 * sum_k a).
template <typename T>
void split_row(int8_t* lo, int8_t* hi, float* scale, int32_t* sums, const T* x, int64_t n) {
  const float s = std::max(row_absmax(x, n) / kInt16Peak, 1e-30f);
  *scale = s;
  i32x16 lo_sums = {}, hi_sums = {};
  int32_t lo_tail = 0, hi_tail = 0;
  for_lanes(n, [&](auto lanes, int64_t i) {
    using V = decltype(lanes);
    const V r = round_even(load<V>(x + i) / s);  // |r| <= 32512
    if constexpr (is_vector<V>) {
      const i32x16 q = __builtin_convertvector(r, i32x16);
      const i32x16 l = ((q + 128) & 255) - 128;
      const i32x16 h = (q - l) >> 8;
      const i8x16 lb = __builtin_convertvector(l, i8x16), hb = __builtin_convertvector(h, i8x16);
      std::memcpy(lo + i, &lb, sizeof lb);
      std::memcpy(hi + i, &hb, sizeof hb);
      lo_sums += l;
      hi_sums += h;
    } else {
      const int32_t q = int32_t(r), l = ((q + 128) & 255) - 128, h = (q - l) >> 8;
      lo[i] = int8_t(l);
      hi[i] = int8_t(h);
      lo_tail += l;
      hi_tail += h;
    }
  });
  int32_t lo_total = lo_tail, hi_total = hi_tail;
  for (int j = 0; j < 16; ++j) lo_total += lo_sums[j], hi_total += hi_sums[j];
  sums[0] = lo_total;
  sums[1] = hi_total;
}

}  // namespace tandem
