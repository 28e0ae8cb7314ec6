// Shared helpers of Tandem's CPU kernels: element types (fp32, bf16), 16-lane vectors, a
// vectorizable exp, dtype dispatch and argument checks. Header-only; kernels compute in fp32.
//
// Vectors use the GCC / Clang vector extensions: an f32x16 is one zmm register with AVX-512,
// two ymm with AVX2, four xmm elsewhere, so one source serves every x86 CPU with no
// ISA-specific intrinsics. Kernels written over a lane type V (float or f32x16) run the same
// code on whole vectors and on the scalar tail (see for_lanes).
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace tandem {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// ---- element and lane types ---------------------------------------------------------
struct bf16 {  // bfloat16 as its raw bits
  uint16_t bits;
};

typedef float f32x16 __attribute__((vector_size(64), aligned(4)));
typedef float f32x8 __attribute__((vector_size(32), aligned(4)));
typedef float f32x4 __attribute__((vector_size(16), aligned(4)));
typedef int32_t i32x16 __attribute__((vector_size(64), aligned(4)));
typedef uint32_t u32x16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef int8_t i8x16 __attribute__((vector_size(16), aligned(1)));

template <typename V>
constexpr bool is_vector = std::is_same_v<V, f32x16>;

template <typename To, typename From>
inline To bit_cast(const From& from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}

// ---- loads and stores: fp32 lanes from and to fp32 or bf16 memory ---------------------
template <typename V>
inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename V>
inline V load(const bf16* p) {
  if constexpr (is_vector<V>) {
    u16x16 h;
    std::memcpy(&h, p, sizeof h);
    return bit_cast<f32x16>(__builtin_convertvector(h, u32x16) << 16);
  } else {
    return bit_cast<float>(uint32_t(p->bits) << 16);
  }
}

template <typename V>
inline V load(const int8_t* p) {  // an int8 KV cache's codes, exactly
  if constexpr (is_vector<V>) {
    i8x16 c;
    std::memcpy(&c, p, sizeof c);
    return __builtin_convertvector(c, f32x16);
  } else {
    return float(*p);
  }
}

// fp32 -> the nearest bf16 (ties to even), kept as an fp32 bit pattern; NaN stays NaN
template <typename V>
inline auto bf16_bits(V x) {
  using U = std::conditional_t<is_vector<V>, u32x16, uint32_t>;
  const U u = bit_cast<U>(x);
  const U rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const U nan = (u & 0xffff0000u) | 0x400000u;
  if constexpr (is_vector<V>) return (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
  else return (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
}

inline void store(float* p, float x) { *p = x; }
inline void store(float* p, f32x16 x) { std::memcpy(p, &x, sizeof x); }
inline void store(bf16* p, float x) { p->bits = uint16_t(bf16_bits(x) >> 16); }
inline void store(bf16* p, f32x16 x) {
  const u16x16 h = __builtin_convertvector(bf16_bits(x) >> 16, u16x16);
  std::memcpy(p, &h, sizeof h);
}

// x rounded to T's precision, as torch's x.to(T) then back to fp32 would give
template <typename T, typename V>
inline V round_to(V x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return bit_cast<V>(bf16_bits(x));
}

// f(V{}, i) over [0, n): 16 lanes at a time, then one lane at a time for the tail
template <typename F>
inline void for_lanes(int64_t n, F&& f) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) f(f32x16{}, i);
  for (; i < n; ++i) f(0.0f, i);
}

inline float reduce_add(float x) { return x; }
inline float reduce_add(f32x16 v) {
  const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
inline float reduce_max(f32x16 v) {
  const f32x8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const f32x8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x8 a = lo > hi ? lo : hi;
  float m = a[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, a[i]);
  return m;
}

// ---- exp ------------------------------------------------------------------------------
inline float exp2_whole(float n) { return bit_cast<float>((int32_t(n) + 127) << 23); }  // 2^n, n whole
inline f32x16 exp2_whole(f32x16 n) { return bit_cast<f32x16>((__builtin_convertvector(n, i32x16) + 127) << 23); }

// exp(x) for x <= 0 up to ~2 ulp, branch-free so it vectorizes (std::exp does not without
// -ffast-math). Below -87, and at -inf, it gives 0, which the online softmax relies on.
template <typename V>
inline V exp_nonpositive(V x) {
  const auto small = x < -87.0f;
  x = small ? V{} - 87.0f : x;
  const V t = x * 1.44269504088896341f;         // x / ln 2 = n + f, |f| <= 1/2
  const V n = (t + 12582912.0f) - 12582912.0f;  // round to nearest: the 1.5 * 2^23 trick
  const V r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;  // x - n ln 2, in two parts
  // exp(r) on [-ln2/2, ln2/2]: the degree-6 polynomial of Cephes' expf
  V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return small ? V{} : p * exp2_whole(n);
}

// ---- parallel grain -------------------------------------------------------------------
constexpr int64_t kGrainElems = 1 << 15;  // elements per thread at least (ATen's grain size)

// rows per parallel_for task for rows of `row_elems` elements
inline int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems)); }

// ---- dispatch and checks ------------------------------------------------------------
#define TANDEM_CHECK(cond, ...) STD_TORCH_CHECK(cond, "tandem CPU kernel: ", __VA_ARGS__)

// Calls f(float{}) or f(bf16{}) by t's dtype; f reads its element type from the tag:
//   dispatch_float_bf16(x, [&](auto tag) { using scalar_t = decltype(tag); ... });
template <typename F>
void dispatch_float_bf16(const Tensor& t, F&& f) {
  switch (t.scalar_type()) {
    case ScalarType::Float:
      return f(float{});
    case ScalarType::BFloat16:
      return f(bf16{});
    default:
      TANDEM_CHECK(false, "expected a float32 or bfloat16 tensor");
  }
}

inline void check_cpu_dtype(const Tensor& t, ScalarType dtype, const char* name) {
  TANDEM_CHECK(t.is_cpu(), name, " must be on the CPU");
  TANDEM_CHECK(t.scalar_type() == dtype, name, " has the wrong dtype");
}

inline void check_rows(const Tensor& t, int64_t dim, const char* name) {  // last dim unit-stride
  TANDEM_CHECK(t.dim() == dim && t.stride(dim - 1) == 1, name, " must be ", dim,
               "-D with a unit-stride last dimension");
}

template <typename T>
inline T* ptr(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

}  // namespace tandem
