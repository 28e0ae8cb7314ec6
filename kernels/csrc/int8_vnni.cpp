// W8A8 GEMM for decode-sized batches on AVX512-VNNI, with the activations' quantization and the
// rescale fused into the one op:
//   xq[M, K], x_scale[M] = per-token int8 of x (int8_quantize.h)
//   out[M, N] = (xq . q[N, K]^T) * (x_scale[M] * w_scale[N]) (+ bias[N])
//
// torch._int_mm (oneDNN) takes the int8 weight as a plain matrix and reaches ~400 GOP/s at 32
// rows and ~150 at 8 on a 2-core Zen 4, against ~650 at 128 rows. Here the weight is packed
// once at load in VNNI order, [ceil(N / 16), K / 4, 16, 4]: one 64-byte load holds 4 k-values of
// 16 output columns, the operand layout of vpdpbusd (16 int32 lanes += 4 u8 x s8 products each).
// A tile of up to 8 rows x 3 blocks (48 columns) keeps its 24 int32 sums in registers while the
// weight streams once per tile; each row's 4 activations are one broadcast.
//
// vpdpbusd multiplies unsigned by signed bytes, so the activations go in as xq + 128 (a flipped
// sign bit) and the sums drop 128 * sum_k q[n, k] (`offsets`, made with the packing). Integer
// sums are exact, so the int32 results are torch._int_mm's; the quantization is quantize_rows_int8's
// and the rescale scale_int32_rows's arithmetic in the same order: the same bits as the unfused
// int8_dynamic path, in one call instead of three (at 32 rows the two extra dispatches and
// temporaries cost ~20 us a layer, a fifth of the GEMM).

#include "int8_quantize.h"

#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TANDEM_HAS_VNNI 1
#else
#define TANDEM_HAS_VNNI 0
#endif

namespace tandem {
namespace {

constexpr int kCols = 16;        // output columns per packed block (one zmm of int32 sums)
constexpr int kTileRows = 8;     // rows per register tile
constexpr int kTileBlocks = 3;   // blocks per register tile: 8 x 3 sums + 3 weights + 1 broadcast
constexpr int64_t kRowBlock = 128;     // rows whose activations stay in L2 while the weight streams by
constexpr int64_t kTaskOps = 1 << 20;  // multiply-adds per parallel task at least

#if TANDEM_HAS_VNNI
// acc + the 4-byte dot products of a (u8) and w (s8) per int32 lane. Inline assembly rather than
// _mm512_dpbusd_epi32: with the intrinsic, GCC 12 spills the accumulators to the stack on every
// iteration (measured: 0.85 vs 3.5 G instructions/s on a Zen 4 core).
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(w));
  return acc;
}

// acc[r][c] = sum over k of u8 x[r, k] * s8 w[block c][k, lanes], for R rows and C blocks
template <int R, int C>
inline void tile_sums(const uint8_t* x, int64_t k_len, const int8_t* w, int64_t block_bytes, __m512i (&acc)[kTileRows][kTileBlocks]) {
  __m512i sums[R][C];  // locals, so they stay in registers (`acc` may alias the inputs)
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r][c] = _mm512_setzero_si512();
  for (int64_t k = 0; k < k_len; k += 4) {
    __m512i wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(w + c * block_bytes + k * kCols);
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, x + r * k_len + k, sizeof four);
      const __m512i a = _mm512_set1_epi32(four);
      for (int c = 0; c < C; ++c) sums[r][c] = dpbusd(sums[r][c], a, wv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = sums[r][c];
}

using TileFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, __m512i (&)[kTileRows][kTileBlocks]);

template <int C>
TileFn tile_for_rows(int64_t rows) {  // R as a template argument, chosen at run time
  static constexpr TileFn table[kTileRows] = {tile_sums<1, C>, tile_sums<2, C>, tile_sums<3, C>, tile_sums<4, C>,
                                          tile_sums<5, C>, tile_sums<6, C>, tile_sums<7, C>, tile_sums<8, C>};
  return table[rows - 1];
}
#endif

template <typename T>
inline void store_columns(T* out, f32x16 y, int64_t count) {  // the first `count` lanes
  if (count == kCols) return store(out, y);
  for (int64_t i = 0; i < count; ++i) store(out + i, y[i]);
}

}  // namespace

// Whether this build has the kernel (the compiler targeted AVX512-VNNI).
bool int8_vnni_available() { return TANDEM_HAS_VNNI; }

void int8_vnni_gemm(Tensor out, Tensor x, Tensor packed, Tensor w_scale, Tensor offsets, Tensor bias) {
  TANDEM_CHECK(TANDEM_HAS_VNNI, "int8_vnni_gemm needs a build for a CPU with AVX512-VNNI");
  check_rows(out, 2, "out");
  check_rows(x, 2, "x");
  check_cpu_dtype(out, x.scalar_type(), "out");
  check_cpu_dtype(packed, ScalarType::Char, "packed");
  check_cpu_dtype(w_scale, ScalarType::Float, "w_scale");
  check_cpu_dtype(offsets, ScalarType::Int, "offsets");
  const int64_t rows = x.size(0), k_len = x.size(1), n = out.size(1);
  const int64_t blocks = (n + kCols - 1) / kCols;
  TANDEM_CHECK(k_len % 4 == 0, "x must be [M, K] with K a multiple of 4");
  TANDEM_CHECK(out.size(0) == rows, "out must be [M, N]");
  TANDEM_CHECK(packed.is_contiguous() && packed.dim() == 4 && packed.size(0) == blocks && packed.size(1) == k_len / 4 &&
                   packed.size(2) == kCols && packed.size(3) == 4, "packed must be [ceil(N / 16), K / 4, 16, 4], contiguous");
  TANDEM_CHECK(w_scale.is_contiguous() && w_scale.numel() == n, "w_scale must be [N], contiguous");
  TANDEM_CHECK(offsets.is_contiguous() && offsets.numel() == blocks * kCols, "offsets must be [ceil(N / 16) * 16]");
  const bool has_bias = bias.numel() > 0;
  if (has_bias) {
    check_cpu_dtype(bias, ScalarType::Float, "bias");
    TANDEM_CHECK(bias.is_contiguous() && bias.numel() == n, "bias must be [N] fp32, contiguous, or empty");
  }
#if TANDEM_HAS_VNNI
  std::vector<uint8_t> xu(rows * k_len);  // xq + 128, vpdpbusd's unsigned operand
  std::vector<float> row_scales(rows);
  dispatch_float_bf16(x, [&](auto tag) {
    using T = decltype(tag);
    const T* src = ptr<T>(x);
    torch::stable::parallel_for(0, rows, row_grain(k_len), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        int8_t* q = reinterpret_cast<int8_t*>(xu.data() + r * k_len);
        quantize_row(q, &row_scales[r], src + r * x.stride(0), k_len);
        for (int64_t i = 0; i < k_len; ++i) xu[r * k_len + i] ^= 0x80u;
      }
    });
  });
  const int8_t* w = ptr<int8_t>(packed);
  const float* rs = row_scales.data();
  const float* cs = ptr<float>(w_scale);
  const int32_t* off = ptr<int32_t>(offsets);
  const float* b = has_bias ? ptr<float>(bias) : nullptr;
  const int64_t block_bytes = k_len * kCols, out_stride = out.stride(0);
  // work units: (block of up to 128 rows, group of 3 column blocks), the row block outer, so a
  // thread's consecutive units reuse one row block's activations from L2
  const int64_t groups = (blocks + kTileBlocks - 1) / kTileBlocks;
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t unit_ops = std::min(rows, kRowBlock) * k_len * kTileBlocks * kCols;
  const int64_t grain = std::max<int64_t>(1, kTaskOps / std::max<int64_t>(1, unit_ops));
  dispatch_float_bf16(out, [&](auto tag) {
    using T = decltype(tag);
    T* dst = ptr<T>(out);
    torch::stable::parallel_for(0, row_blocks * groups, grain, [&](int64_t begin, int64_t end) {
      __m512i acc[kTileRows][kTileBlocks];
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t g = unit % groups, row_end = std::min(rows, (unit / groups + 1) * kRowBlock);
        const int64_t first = g * kTileBlocks, count = std::min<int64_t>(kTileBlocks, blocks - first);
        for (int64_t r0 = (unit / groups) * kRowBlock; r0 < row_end; r0 += kTileRows) {
          const int64_t tile_rows = std::min<int64_t>(kTileRows, row_end - r0);
          const uint8_t* xr = xu.data() + r0 * k_len;
          const int8_t* wg = w + first * block_bytes;
          switch (count) {
            case 1: tile_for_rows<1>(tile_rows)(xr, k_len, wg, block_bytes, acc); break;
            case 2: tile_for_rows<2>(tile_rows)(xr, k_len, wg, block_bytes, acc); break;
            default: tile_for_rows<3>(tile_rows)(xr, k_len, wg, block_bytes, acc);
          }
          for (int64_t c = 0; c < count; ++c) {
            const int64_t col = (first + c) * kCols, valid = std::min<int64_t>(kCols, n - col);
            i32x16 offset;
            std::memcpy(&offset, off + col, sizeof offset);
            f32x16 col_scale = {}, col_bias = {};
            std::memcpy(&col_scale, cs + col, valid * sizeof(float));
            if (has_bias) std::memcpy(&col_bias, b + col, valid * sizeof(float));
            for (int64_t r = 0; r < tile_rows; ++r) {
              const f32x16 value = __builtin_convertvector(bit_cast<i32x16>(acc[r][c]) - offset, f32x16);
              f32x16 y = value * (rs[r0 + r] * col_scale);  // as scale_int32_rows
              if (has_bias) y = y + col_bias;
              store_columns(dst + (r0 + r) * out_stride + col, y, valid);
            }
          }
        }
      }
    });
  });
#endif
}

}  // namespace tandem

STABLE_TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("int8_vnni_available() -> bool");
  m.def("int8_vnni_gemm(Tensor(a!) out, Tensor x, Tensor packed, Tensor w_scale, Tensor offsets, Tensor bias) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(tandem, CompositeExplicitAutograd, m) {  // no tensor to dispatch on
  m.impl("int8_vnni_available", TORCH_BOX(&tandem::int8_vnni_available));
}

STABLE_TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("int8_vnni_gemm", TORCH_BOX(&tandem::int8_vnni_gemm));
}
