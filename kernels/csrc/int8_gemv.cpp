// Weight-only int8 for a few rows: y[M, N] = (x[M, K] . q[N, K]^T) * scale[N], fp32 sums.
//
// At decode's one row the product is a matrix-vector one and reading the weight is the whole
// cost: torch._weight_int8pack_mm reads SmolLM2's int8 LM head at ~12 GB/s on a 2-core Zen 4,
// oneDNN's bf16 at ~22 GB/s. Here the weight is packed in blocks of 16 output columns
// ([N/16, K, 16]: each k of a block is one 16-byte load, widened to 16 fp32 lanes and
// multiplied by the broadcast x[k]), so each thread streams its blocks front to back and each
// weight byte is read once per 4 rows of x. The scale applies once per output, after the sum.

#include "cpu_common.h"
#include "ops.h"

#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tandem {
namespace {

constexpr int kCols = 16;    // output columns per block (one fp32 vector)
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

template <typename T>
void store_columns(T* out, f32x16 y, int64_t count) {  // the first `count` lanes
  if (count == kCols) return store(out, y);
  for (int64_t i = 0; i < count; ++i) store(out + i, y[i]);
}

}  // namespace

// out[M, N] = (x[M, K] . q^T) * scale, q packed as [ceil(N / 16), K, 16] int8 (zero-padded columns)
void int8_gemv(Tensor out, Tensor x, Tensor packed, Tensor scale) {
  check_rows(x, 2, "x");
  check_rows(out, 2, "out");
  check_cpu_dtype(packed, ScalarType::Char, "packed");
  check_cpu_dtype(scale, ScalarType::Float, "scale");
  const int64_t rows = x.size(0), k_len = x.size(1), n = out.size(1);
  const int64_t blocks = (n + kCols - 1) / kCols;
  TANDEM_CHECK(out.size(0) == rows && out.scalar_type() == x.scalar_type(), "out must be [M, N] in x's dtype");
  TANDEM_CHECK(packed.is_contiguous() && packed.dim() == 3 && packed.size(0) == blocks && packed.size(1) == k_len &&
                   packed.size(2) == kCols, "packed must be [ceil(N / 16), K, 16], contiguous");
  TANDEM_CHECK(scale.is_contiguous() && scale.numel() == n, "scale must be [N], contiguous");
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
