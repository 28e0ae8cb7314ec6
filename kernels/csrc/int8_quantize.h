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

}  // namespace tandem
