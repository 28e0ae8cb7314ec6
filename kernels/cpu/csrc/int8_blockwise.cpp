// W8A8 in blocks of 32 k, exact on GGUF Q4_0 / Q4_1 / Q8_0 weights (kernels/cpu/int8_blockwise.py):
//   w[n, k] = c[n, k] * d[n, b] + o[n, b] for k in block b (int8 codes, fp32 scale and offset)
//   xq, s = x rounded to int8 per row and block of 32 (scale absmax / 127), xsum its exact fp32 sum
//   out[m, n] = sum_b s[m, b] d[n, b] (xq[m, b] . c[n, b]) + sum_b o[n, b] xsum[m, b] (+ bias[n])
//
// The GEMM is int8_grouped.cpp's, run a block of 32 k at a time, with the operands the other way
// round: the weight is the unsigned byte (c + 128, packed in vpdpbusd's order) and the activations go
// in signed. The +128 then adds 128 * sum_k xq[m, k] per (row, block), one integer known when the
// row is rounded, so each block's int32 sums start at minus that (a broadcast instead of a clear)
// and come out exact. Per block and 16 columns: convert, multiply d by s, one fused multiply-add
// into the fp32 sums; where the weight has offsets (Q4_1) one more, o times xsum.
//
// Packed weight: [ceil(N / 16), K / 32, slots, 64] bytes; per 16 columns and block, 8 chunks of codes
// (chunk t: 4 k of each column), then the columns' fp32 scales d, then (slots 10) their offsets o.

#include "int8_quantize.h"
#include "ops.h"
#include "packed_tiles.h"

#include <vector>

namespace tandem {
namespace {

constexpr int64_t kBlock = 32;                   // k per scale
constexpr int64_t kBlockSteps = kBlock / 4;      // vpdpbusd steps per block
constexpr int64_t kCodeBytes = kBlockSteps * 64;  // a block's codes for 16 columns

// One row's block of activations: what the GEMM reads beside its int8 codes.
struct RowBlock {
  float scale;    // s: absmax / 127
  int32_t start;  // -128 * sum xq: the int32 sums' starting value, undoing the weight's +128
  float sum;      // xsum: the block's exact sum of x
  float unused;   // 16 bytes: a row's blocks are one stride apart in the assembly's addressing
};
static_assert(sizeof(RowBlock) == 16, "the assembly reads RowBlock's fields at 0, 4 and 8");

template <typename T>
void quantize_blocks(int8_t* q, RowBlock* blocks, const T* x, int64_t count) {
  for (int64_t b = 0; b < count; ++b) {
    const T* xb = x + b * kBlock;
    const f32x16 lo = load<f32x16>(xb), hi = load<f32x16>(xb + 16);
    const f32x16 peak_lanes = abs_lanes(lo) > abs_lanes(hi) ? abs_lanes(lo) : abs_lanes(hi);
    const float s = std::max(reduce_max(peak_lanes) / 127.0f, 1e-12f);  // as quantize_row
    const i32x16 qlo = __builtin_convertvector(round_even(lo / s), i32x16);
    const i32x16 qhi = __builtin_convertvector(round_even(hi / s), i32x16);
    const i8x16 blo = __builtin_convertvector(qlo, i8x16), bhi = __builtin_convertvector(qhi, i8x16);
    std::memcpy(q + b * kBlock, &blo, sizeof blo);
    std::memcpy(q + b * kBlock + 16, &bhi, sizeof bhi);
    const i32x16 qsum = qlo + qhi;
    int32_t total = 0;
    for (int j = 0; j < 16; ++j) total += qsum[j];
    blocks[b] = {s, -128 * total, reduce_add(lo + hi), 0.0f};
  }
}

#if TANDEM_HAS_VNNI
constexpr int kRows = 4;  // rows per register tile: 4 x 3 int32 sums + 4 x 3 fp32 sums + operands
using Sums = f32x16[kRows][packed::kTileBlocks];

// sums[r][c] for R rows of x (row_bytes apart; their RowBlocks `groups` apart) and C column blocks
// (block_bytes apart), over `groups` blocks of k of `slot_bytes` each. The edge tiles; the full one,
// below, is the same loop in assembly.
template <int R, int C, bool kOffsets>
void blockwise_tile(const int8_t* x, int64_t row_bytes, const uint8_t* w, int64_t block_bytes, int64_t groups,
                    int64_t slot_bytes, const RowBlock* rb, Sums& out) {
  __m512 sums[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * slot_bytes;
    __m512i dots[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) dots[r][c] = _mm512_set1_epi32(rb[r * groups + g].start);
    for (int64_t s = 0; s < kBlockSteps; ++s) {
      __m512i wv[C];
      for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(wg + c * block_bytes + s * 64);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, x + r * row_bytes + g * kBlock + s * 4, sizeof four);
        const __m512i a = _mm512_set1_epi32(four);
        for (int c = 0; c < C; ++c) dots[r][c] = packed::Int8WeightDot::dot(dots[r][c], a, wv[c]);
      }
    }
    for (int c = 0; c < C; ++c) {
      const __m512 d = _mm512_loadu_ps(wg + c * block_bytes + kCodeBytes);
      for (int r = 0; r < R; ++r) {
        const RowBlock& row = rb[r * groups + g];
        sums[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r][c]), _mm512_mul_ps(d, _mm512_set1_ps(row.scale)),
                                     sums[r][c]);
        if constexpr (kOffsets) {
          const __m512 o = _mm512_loadu_ps(wg + c * block_bytes + kCodeBytes + 64);
          sums[r][c] = _mm512_fmadd_ps(o, _mm512_set1_ps(row.sum), sums[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r][c] = bit_cast<f32x16>(sums[r][c]);
}

// The full tile (4 rows x 3 blocks) in assembly, for the reason packed_tiles.h's full_tile gives.
// Registers: zmm0-11 a block's int32 sums (row r, column block c in zmm{3r + c}), zmm12-23 the fp32
// sums, zmm24-26 the weights, zmm27-28 the broadcast activations, zmm29 a column block's scales d,
// zmm30 its offsets o, zmm31 d times a row's s. The fp32 work (2 or 3 operations per block and 16
// columns beside 8 vpdpbusd) shares vpdpbusd's ports: it is what this kernel pays over int8_vnni.
// vpdpbusd with the activations as its broadcast memory operand ran slower (docs/cpu-kernels.md).
#define TANDEM_BW_DOTS(ADDR, A, S0, S1, S2)                                                          \
  "vpbroadcastd " ADDR ", %%zmm" #A "\n\t"                                                          \
  "vpdpbusd %%zmm" #A ", %%zmm24, %%zmm" #S0 "\n\tvpdpbusd %%zmm" #A ", %%zmm25, %%zmm" #S1 "\n\t"  \
  "vpdpbusd %%zmm" #A ", %%zmm26, %%zmm" #S2 "\n\t"
#define TANDEM_BW_START(ADDR, S0, S1, S2)                                                            \
  "vpbroadcastd " ADDR ", %%zmm" #S0 "\n\tvmovdqa64 %%zmm" #S0 ", %%zmm" #S1 "\n\t"                 \
  "vmovdqa64 %%zmm" #S0 ", %%zmm" #S2 "\n\t"
#define TANDEM_BW_SCALE(ROW, I, F)                                                                   \
  "vmulps " ROW "%{1to16%}, %%zmm29, %%zmm31\n\tvcvtdq2ps %%zmm" #I ", %%zmm" #I "\n\t"              \
  "vfmadd231ps %%zmm31, %%zmm" #I ", %%zmm" #F "\n\t"
#define TANDEM_BW_OFFSET(SUM, F) "vfmadd231ps " SUM "%{1to16%}, %%zmm30, %%zmm" #F "\n\t"
#define TANDEM_BW_COLUMN(WADDR, OADDR, I0, I1, I2, I3, F0, F1, F2, F3, OFFSETS)                     \
  "vmovups " WADDR ", %%zmm29\n\t" OFFSETS("vmovups " OADDR ", %%zmm30\n\t")                        \
  TANDEM_BW_SCALE("(%[ap])", I0, F0) OFFSETS(TANDEM_BW_OFFSET("8(%[ap])", F0))                       \
  TANDEM_BW_SCALE("(%[ap],%[as],1)", I1, F1) OFFSETS(TANDEM_BW_OFFSET("8(%[ap],%[as],1)", F1))       \
  TANDEM_BW_SCALE("(%[ap],%[as],2)", I2, F2) OFFSETS(TANDEM_BW_OFFSET("8(%[ap],%[as],2)", F2))       \
  TANDEM_BW_SCALE("(%[ap3])", I3, F3) OFFSETS(TANDEM_BW_OFFSET("8(%[ap3])", F3))
#define TANDEM_BW_KEEP(X) X
#define TANDEM_BW_DROP(X)
#define TANDEM_BW_TILE_ASM(OFFSETS, SLOT_REST)                                                       \
  asm volatile(                                                                                     \
      TANDEM_ZERO(12) TANDEM_ZERO(13) TANDEM_ZERO(14) TANDEM_ZERO(15) TANDEM_ZERO(16) TANDEM_ZERO(17) \
      TANDEM_ZERO(18) TANDEM_ZERO(19) TANDEM_ZERO(20) TANDEM_ZERO(21) TANDEM_ZERO(22) TANDEM_ZERO(23) \
      "2:\n\t"                                                                                      \
      TANDEM_BW_START("4(%[ap])", 0, 1, 2) TANDEM_BW_START("4(%[ap],%[as],1)", 3, 4, 5)               \
      TANDEM_BW_START("4(%[ap],%[as],2)", 6, 7, 8) TANDEM_BW_START("4(%[ap3])", 9, 10, 11)            \
      "mov $8, %[count]\n\t"                                                                        \
      "1:\n\t"                                                                                      \
      "vmovdqu64 (%[w]), %%zmm24\n\tvmovdqu64 (%[w],%[bb],1), %%zmm25\n\tvmovdqu64 (%[w],%[bb],2), %%zmm26\n\t" \
      TANDEM_BW_DOTS("(%[x0])", 27, 0, 1, 2) TANDEM_BW_DOTS("(%[x0],%[rb],1)", 28, 3, 4, 5)             \
      TANDEM_BW_DOTS("(%[x0],%[rb],2)", 27, 6, 7, 8) TANDEM_BW_DOTS("(%[x3])", 28, 9, 10, 11)           \
      "add $4, %[x0]\n\tadd $4, %[x3]\n\tadd $64, %[w]\n\t"                                         \
      "dec %[count]\n\tjnz 1b\n\t"                                                                  \
      TANDEM_BW_COLUMN("(%[w])", "64(%[w])", 0, 3, 6, 9, 12, 15, 18, 21, OFFSETS)                   \
      TANDEM_BW_COLUMN("(%[w],%[bb],1)", "64(%[w],%[bb],1)", 1, 4, 7, 10, 13, 16, 19, 22, OFFSETS)  \
      TANDEM_BW_COLUMN("(%[w],%[bb],2)", "64(%[w],%[bb],2)", 2, 5, 8, 11, 14, 17, 20, 23, OFFSETS)  \
      "add $" #SLOT_REST ", %[w]\n\tadd $16, %[ap]\n\tadd $16, %[ap3]\n\t"                          \
      "dec %[left]\n\tjnz 2b\n\t"                                                                   \
      "mov %[out], %[x0]\n\t" /* x0 is spent: it takes the address of `out` */                      \
      TANDEM_STORE(12, 0, "%[x0]") TANDEM_STORE(13, 64, "%[x0]") TANDEM_STORE(14, 128, "%[x0]")       \
      TANDEM_STORE(15, 192, "%[x0]") TANDEM_STORE(16, 256, "%[x0]") TANDEM_STORE(17, 320, "%[x0]")    \
      TANDEM_STORE(18, 384, "%[x0]") TANDEM_STORE(19, 448, "%[x0]") TANDEM_STORE(20, 512, "%[x0]")    \
      TANDEM_STORE(21, 576, "%[x0]") TANDEM_STORE(22, 640, "%[x0]") TANDEM_STORE(23, 704, "%[x0]")    \
      : [x0] "+r"(x0), [x3] "+r"(x3), [w] "+r"(wp), [ap] "+r"(ap), [ap3] "+r"(ap3), [count] "=&r"(count), \
        [left] "+r"(left)                                                                           \
      : [rb] "r"(row_bytes), [bb] "r"(block_bytes), [as] "r"(row_block_bytes), [out] "m"(out_ptr)   \
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",   \
        "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", \
        "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31")

template <bool kOffsets>
void blockwise_full_tile(const int8_t* x, int64_t row_bytes, const uint8_t* w, int64_t block_bytes, int64_t groups,
                         int64_t, const RowBlock* rb, Sums& out) {
  static_assert(kRows == 4 && packed::kTileBlocks == 3 && sizeof(Sums) == 12 * 64, "the registers are 4 x 3");
  const int8_t *x0 = x, *x3 = x + 3 * row_bytes;
  const uint8_t* wp = w;
  const RowBlock *ap = rb, *ap3 = rb + 3 * groups;
  const int64_t row_block_bytes = groups * int64_t(sizeof(RowBlock));
  f32x16* out_ptr = &out[0][0];
  int64_t count, left = groups;
  if constexpr (kOffsets) TANDEM_BW_TILE_ASM(TANDEM_BW_KEEP, 128);
  else TANDEM_BW_TILE_ASM(TANDEM_BW_DROP, 64);
}

using TileFn = void (*)(const int8_t*, int64_t, const uint8_t*, int64_t, int64_t, int64_t, const RowBlock*, Sums&);

template <int C, bool kOffsets>
constexpr TileFn kTiles[kRows] = {
    blockwise_tile<1, C, kOffsets>, blockwise_tile<2, C, kOffsets>, blockwise_tile<3, C, kOffsets>,
    C == packed::kTileBlocks ? blockwise_full_tile<kOffsets> : blockwise_tile<4, C, kOffsets>};

template <bool kOffsets>
TileFn tile_for(int64_t count, int64_t rows) {
  return count == 1 ? kTiles<1, kOffsets>[rows - 1] : count == 2 ? kTiles<2, kOffsets>[rows - 1]
                                                                 : kTiles<3, kOffsets>[rows - 1];
}
#endif

}  // namespace

void int8_blockwise_gemm(Tensor out, Tensor x, Tensor packed, Tensor bias) {
  using packed::kCols;
  using packed::kTileBlocks;
  TANDEM_CHECK(TANDEM_HAS_VNNI, "int8_blockwise_gemm needs a build for a CPU with AVX512-VNNI");
  check_rows(out, 2, "out");
  check_rows(x, 2, "x");
  check_cpu_dtype(out, x.scalar_type(), "out");
  check_cpu_dtype(packed, ScalarType::Byte, "packed");
  const int64_t rows = x.size(0), k_len = x.size(1), n = out.size(1);
  const int64_t blocks = (n + kCols - 1) / kCols, groups = k_len / kBlock;
  TANDEM_CHECK(k_len % kBlock == 0, "x must be [M, K] with K a multiple of 32");
  TANDEM_CHECK(out.size(0) == rows, "out must be [M, N]");
  TANDEM_CHECK(packed.is_contiguous() && packed.dim() == 4 && packed.size(0) == blocks && packed.size(1) == groups &&
                   (packed.size(2) == kBlockSteps + 1 || packed.size(2) == kBlockSteps + 2) && packed.size(3) == 64,
               "packed must be [ceil(N / 16), K / 32, 9 or 10, 64], contiguous");
  const bool has_offsets = packed.size(2) == kBlockSteps + 2, has_bias = bias.numel() > 0;
  if (has_bias) {
    check_cpu_dtype(bias, ScalarType::Float, "bias");
    TANDEM_CHECK(bias.is_contiguous() && bias.numel() == n, "bias must be [N] fp32, contiguous, or empty");
  }
#if TANDEM_HAS_VNNI
  std::vector<int8_t> xq(rows * k_len);
  std::vector<RowBlock> row_blocks(rows * groups);
  dispatch_float_bf16(x, [&](auto tag) {
    using T = decltype(tag);
    const T* src = ptr<T>(x);
    torch::stable::parallel_for(0, rows, row_grain(k_len), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        quantize_blocks(xq.data() + r * k_len, row_blocks.data() + r * groups, src + r * x.stride(0), groups);
    });
  });
  const float* b = has_bias ? ptr<float>(bias) : nullptr;
  const int64_t out_stride = out.stride(0), slot_bytes = packed.size(2) * 64, block_bytes = groups * slot_bytes;
  dispatch_float_bf16(out, [&](auto tag) {
    using T = decltype(tag);
    T* dst = ptr<T>(out);
    packed::for_each_tile(rows, blocks, block_bytes, k_len / 4, ptr<uint8_t>(packed), [&](int64_t r0, int64_t tile,
                                                                                          int64_t first, int64_t count,
                                                                                          const uint8_t* wg,
                                                                                          const uint8_t*) {
      for (int64_t r1 = r0; r1 < r0 + tile; r1 += kRows) {
        const int64_t part = std::min<int64_t>(kRows, r0 + tile - r1);
        Sums sums;
        const TileFn fn = has_offsets ? tile_for<true>(count, part) : tile_for<false>(count, part);
        fn(xq.data() + r1 * k_len, k_len, wg, block_bytes, groups, slot_bytes, row_blocks.data() + r1 * groups, sums);
        for (int64_t c = 0; c < count; ++c) {
          const int64_t col = (first + c) * kCols, valid = std::min<int64_t>(kCols, n - col);
          f32x16 col_bias = {};
          if (has_bias) std::memcpy(&col_bias, b + col, valid * sizeof(float));
          for (int64_t r = 0; r < part; ++r)
            packed::store_columns(dst + (r1 + r) * out_stride + col, has_bias ? sums[r][c] + col_bias : sums[r][c],
                                  valid);
        }
      }
    });
  });
#endif
}

}  // namespace tandem

STABLE_TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("int8_blockwise_gemm(Tensor(a!) out, Tensor x, Tensor packed, Tensor bias) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("int8_blockwise_gemm", TORCH_BOX(&tandem::int8_blockwise_gemm));
}
