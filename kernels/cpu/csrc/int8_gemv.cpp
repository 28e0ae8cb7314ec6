// Weight-only int8 for a few rows: y[M, N] = (x[M, K] . q[N, K]^T) * scale[N].
//
// At decode's one row the product is a matrix-vector one and reading the weight is the whole
// cost, which torch._weight_int8pack_mm and oneDNN's bf16 pay slowly (docs/cpu-kernels.md#int8_gemv). Two paths, chosen by the packing (kernels/cpu/int8_linear.py):
//
// - AVX512-VNNI, weight [ceil(N/16), K/4, 16, 4] uint8 holding q + 128 (packed_tiles.h's order).
//   Each row of x is rounded to 16-bit integers with its own scale (|xq| <= 32512 = 127 * 256)
//   and split into two signed bytes, xq = 256 * hi + lo, each multiplied by the weight with
//   vpdpbusd (64 weight bytes per instruction, exact int32 sums). 16 bits keep the activations
//   finer than bf16 does (2^-15 of the row's largest value against 2^-8 of each value), so this
//   is still a weight-only product; it reads the weight faster per core than widening it to fp32,
//   fast enough to stream from memory (docs/cpu-kernels.md#int8_gemv).
// - Elsewhere, weight [ceil(N/16), K, 16] int8 in blocks of 16 output columns: each k of a block
//   is one 16-byte load, widened to 16 fp32 lanes and multiplied by the broadcast x[k] (fp32 sums).
//   Each thread streams its blocks front to back, each weight byte read once per 4 rows of x.
//
// The scale applies once per output, after the sum.

#include "cpu_common.h"
#include "int8_quantize.h"
#include "ops.h"
#include "packed_tiles.h"

#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tandem {
namespace {

using packed::kCols;  // output columns per block (one fp32 vector)
using packed::store_columns;
constexpr int kRows = 4;     // rows of x sharing one read of the weight
constexpr int kUnroll = 4;   // independent partial sums per row (FMA latency)
constexpr int64_t kBlocksPerTask = 8;

// 16 int8 weights as fp32 lanes. GCC widens int8 vectors a lane at a time, so the x86 sign
// extensions are named where the target has them (the f32x16 is one zmm, or two ymm halves).
inline f32x16 widen(const int8_t* p) {
#if defined(__AVX512F__)
  const __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return bit_cast<f32x16>(_mm512_cvtepi32_ps(wide));
#elif defined(__AVX2__)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256 low = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
  const __m256 high = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(raw, raw)));
  struct { __m256 a, b; } halves = {low, high};
  return bit_cast<f32x16>(halves);
#else
  f32x16 v;
  for (int i = 0; i < 16; ++i) v[i] = float(p[i]);
  return v;
#endif
}

template <int R>
inline void block_dot(const int8_t* w, int64_t k_len, const float* x, int64_t x_stride, f32x16* result) {
  f32x16 acc[R][kUnroll] = {};
  int64_t k = 0;
  for (; k + kUnroll <= k_len; k += kUnroll) {
    for (int u = 0; u < kUnroll; ++u) {
      const f32x16 wv = widen(w + (k + u) * kCols);
      for (int r = 0; r < R; ++r) acc[r][u] += wv * x[r * x_stride + k + u];
    }
  }
  for (; k < k_len; ++k) {
    const f32x16 wv = widen(w + k * kCols);
    for (int r = 0; r < R; ++r) acc[r][0] += wv * x[r * x_stride + k];
  }
  for (int r = 0; r < R; ++r) result[r] = (acc[r][0] + acc[r][1]) + (acc[r][2] + acc[r][3]);
}

#if TANDEM_HAS_VNNI
// out[M, N] = (x . (packed - 128)^T) * scale, packed as [ceil(N / 16), K / 4, 16, 4] uint8
void int8_gemv_vnni(Tensor& out, const Tensor& x, const Tensor& packed, const float* w_scale) {
  const int64_t rows = x.size(0), k_len = x.size(1), n = out.size(1);
  const int64_t blocks = (n + kCols - 1) / kCols;
  // byte rows for vpdpbusd: 2r holds the low bytes of x's row r, 2r + 1 the high ones
  std::vector<int8_t> bytes(2 * rows * k_len);
  std::vector<float> row_scales(rows);
  std::vector<int32_t> sums(2 * rows);
  dispatch_float_bf16(x, [&](auto tag) {
    using T = decltype(tag);
    const T* src = ptr<T>(x);
    for (int64_t r = 0; r < rows; ++r)  // a few rows: cheaper than waking the other threads
      split_row(&bytes[2 * r * k_len], &bytes[(2 * r + 1) * k_len], &row_scales[r], &sums[2 * r],
                src + r * x.stride(0), k_len);
  });
  const int64_t out_stride = out.stride(0);
  dispatch_float_bf16(out, [&](auto tag) {
    using T = decltype(tag);
    T* dst = ptr<T>(out);
    auto epilogue = [&](const packed::Tile<packed::Int8WeightDot>& acc, int64_t r0, int64_t tile_rows,
                        int64_t first, int64_t count) {
      for (int64_t c = 0; c < count; ++c) {
        const int64_t col = (first + c) * kCols, valid = std::min<int64_t>(kCols, n - col);
        f32x16 col_scale = {};
        std::memcpy(&col_scale, w_scale + col, valid * sizeof(float));
        for (int64_t t = 0; t < tile_rows; t += 2) {  // tiles start on even byte rows
          const int64_t r = (r0 + t) / 2;
          const i32x16 low = bit_cast<i32x16>(acc[t][c]) - 128 * sums[2 * r];
          const i32x16 high = bit_cast<i32x16>(acc[t + 1][c]) - 128 * sums[2 * r + 1];
          // 256 * high may pass 2^31: combined in fp32 (one rounding, 2^-24 of the sum)
          const f32x16 value = __builtin_convertvector(high, f32x16) * 256.0f + __builtin_convertvector(low, f32x16);
          store_columns(dst + r * out_stride + col, value * (row_scales[r] * col_scale), valid);
        }
      }
    };
    packed::gemm<packed::Int8WeightDot>(2 * rows, blocks, k_len / 4, reinterpret_cast<const uint8_t*>(bytes.data()),
                                        k_len, ptr<uint8_t>(packed), epilogue, /*task_ops=*/1);
  });
}
#endif

}  // namespace

// out[M, N] = (x[M, K] . q^T) * scale, q packed as [ceil(N / 16), K, 16] int8 (zero-padded columns)
void int8_gemv(Tensor out, Tensor x, Tensor packed, Tensor scale) {
  check_rows(x, 2, "x");
  check_rows(out, 2, "out");
  check_cpu_dtype(scale, ScalarType::Float, "scale");
  const int64_t rows = x.size(0), k_len = x.size(1), n = out.size(1);
  const int64_t blocks = (n + kCols - 1) / kCols;
  TANDEM_CHECK(out.size(0) == rows && out.scalar_type() == x.scalar_type(), "out must be [M, N] in x's dtype");
  TANDEM_CHECK(scale.is_contiguous() && scale.numel() == n, "scale must be [N], contiguous");
  if (packed.scalar_type() == ScalarType::Byte) {  // the VNNI packing
    TANDEM_CHECK(TANDEM_HAS_VNNI, "a uint8 (VNNI) packing needs a build for a CPU with AVX512-VNNI");
    TANDEM_CHECK(packed.is_contiguous() && packed.dim() == 4 && packed.size(0) == blocks &&
                     k_len % 4 == 0 && packed.size(1) == k_len / 4 && packed.size(2) == kCols && packed.size(3) == 4,
                 "a uint8 packed must be [ceil(N / 16), K / 4, 16, 4], contiguous");
#if TANDEM_HAS_VNNI
    int8_gemv_vnni(out, x, packed, ptr<float>(scale));
#endif
    return;
  }
  check_cpu_dtype(packed, ScalarType::Char, "packed");
  TANDEM_CHECK(packed.is_contiguous() && packed.dim() == 3 && packed.size(0) == blocks && packed.size(1) == k_len &&
                   packed.size(2) == kCols, "packed must be [ceil(N / 16), K, 16], contiguous");
  dispatch_float_bf16(x, [&](auto tag) {
    using T = decltype(tag);
    std::vector<float> xf(rows * k_len);  // x in fp32
    const T* src = ptr<T>(x);
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = src + r * x.stride(0);
      for_lanes(k_len, [&](auto lanes, int64_t i) { store(xf.data() + r * k_len + i, load<decltype(lanes)>(row + i)); });
    }
    const int8_t* w = ptr<int8_t>(packed);
    const float* s = ptr<float>(scale);
    T* dst = ptr<T>(out);
    const int64_t out_stride = out.stride(0);
    torch::stable::parallel_for(0, blocks, kBlocksPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int8_t* wb = w + b * k_len * kCols;
        const int64_t col = b * kCols, count = std::min<int64_t>(kCols, n - col);
        f32x16 scales = {};
        std::memcpy(&scales, s + col, count * sizeof(float));
        for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
          f32x16 y[kRows];
          const float* xr = xf.data() + r0 * k_len;
          switch (std::min<int64_t>(kRows, rows - r0)) {  // no FMAs on padding rows
            case 1: block_dot<1>(wb, k_len, xr, k_len, y); break;
            case 2: block_dot<2>(wb, k_len, xr, k_len, y); break;
            case 3: block_dot<3>(wb, k_len, xr, k_len, y); break;
            default: block_dot<4>(wb, k_len, xr, k_len, y);
          }
          for (int64_t r = r0; r < std::min(rows, r0 + kRows); ++r)
            store_columns(dst + r * out_stride + col, y[r - r0] * scales, count);
        }
      }
    });
  });
}

}  // namespace tandem

STABLE_TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("int8_gemv(Tensor(a!) out, Tensor x, Tensor packed, Tensor scale) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("int8_gemv", TORCH_BOX(&tandem::int8_gemv));
}
