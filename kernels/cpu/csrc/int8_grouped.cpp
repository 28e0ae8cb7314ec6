// W8A8 GEMM with one activation scale per token *and group of k*, for inputs with outlier channels
// (an MLP's down projection: the SiLU·mul product has a few channels tens of times larger than
// the rest, and one int8 scale per token rounds every other channel of that token to a few levels):
//   xq[M, K], x_scale[M, K / G] = int8 of each group of G consecutive k of each row (int8_quantize.h)
//   out[M, N] = w_scale[N] * sum_g x_scale[M, g] * (xq[:, g] . q[N, g]^T) (+ bias[N])
//
// An outlier now coarsens only its own group of G. The GEMM is int8_vnni's (the weight packed in
// vpdpbusd's order, [ceil(N / 16), K / 4, 16, 4], register tiles from packed_tiles.h), run one
// group of k at a time: each group's exact int32 sums are turned to fp32 and added into the
// tile's fp32 sums with that group's activation scale. With G = 128 that is 4 extra operations a
// sum (subtract the offsets, convert, multiply-add, clear) per 32 vpdpbusd.
//
// vpdpbusd multiplies unsigned by signed bytes, so the activations go in as xq + 128 and each
// group's sums drop 128 * sum_{k in g} q[n, k] (`offsets`, [K / G, ceil(N / 16) * 16], made with
// the packing).

#include "int8_quantize.h"
#include "ops.h"
#include "packed_tiles.h"

#include <vector>

namespace tandem {
namespace {

#if TANDEM_HAS_VNNI
constexpr int kGroupedRows = 4;  // rows per register tile: 4 x 3 int32 sums + 4 x 3 fp32 sums + 4 operands

// sums[r][c] = sum_g x_scale[r, g] * (the int32 dot products of row r and block c over group g,
// less the group's offsets), for R rows of x (row_bytes apart) and C blocks (block_bytes apart).
// packed_tiles.h's tile_sums gives each group's int32 sums (this path serves the edge tiles; the
// full one, below, keeps both sets in registers). `next`: the weight of the tile after this one,
// prefetched as this one streams.
template <int R, int C>
void grouped_tile(const uint8_t* x, int64_t row_bytes, const uint8_t* w, int64_t block_bytes, int64_t groups,
                  int64_t group_steps, const int32_t* offsets, int64_t offsets_stride, const float* x_scales,
                  const uint8_t* next, f32x16 (&out)[kGroupedRows][packed::kTileBlocks]) {
  __m512 sums[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    packed::Tile<packed::Int8Dot> dots;  // the group's int32 sums
    const int64_t k_step = g * group_steps;
    packed::tile_sums<packed::Int8Dot, R, C>(x + k_step * 4, row_bytes, w + k_step * 64, block_bytes, group_steps,
                                             next != nullptr ? next + k_step * 64 : nullptr, dots);
    for (int c = 0; c < C; ++c) {
      const __m512i offset = _mm512_loadu_si512(offsets + g * offsets_stride + c * packed::kCols);
      for (int r = 0; r < R; ++r)
        sums[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dots[r][c], offset)),
                                     _mm512_set1_ps(x_scales[r * groups + g]), sums[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r][c] = bit_cast<f32x16>(sums[r][c]);
}

// The full tile (4 rows x 3 blocks) as one loop in assembly, for the reason packed_tiles.h's
// full_tile gives. Registers: zmm0-11 a group's int32 sums (row r, block c in zmm{3r + c}),
// zmm12-23 the fp32 sums, zmm24-26 the weights, zmm27-28 the broadcast activations, zmm29 a block's
// offsets. No prefetch of `next`: the hardware prefetchers keep up with 4-row tiles.
#define TANDEM_GROUPED_DOTS(ADDR, A, S0, S1, S2)                                                     \
  "vpbroadcastd " ADDR ", %%zmm" #A "\n\t"                                                          \
  "vpdpbusd %%zmm24, %%zmm" #A ", %%zmm" #S0 "\n\tvpdpbusd %%zmm25, %%zmm" #A ", %%zmm" #S1 "\n\t"    \
  "vpdpbusd %%zmm26, %%zmm" #A ", %%zmm" #S2 "\n\t"
#define TANDEM_GROUPED_ADD(I, F, SCALE)                                                              \
  "vpsubd %%zmm29, %%zmm" #I ", %%zmm" #I "\n\tvcvtdq2ps %%zmm" #I ", %%zmm" #I "\n\t"              \
  "vfmadd231ps " SCALE "%{1to16%}, %%zmm" #I ", %%zmm" #F "\n\tvpxord %%zmm" #I ", %%zmm" #I ", %%zmm" #I "\n\t"
#define TANDEM_GROUPED_BLOCK(C, OFFSET, I0, I1, I2, I3, F0, F1, F2, F3)                              \
  "vmovdqu64 " #OFFSET "(%[op]), %%zmm29\n\t"                                                       \
  TANDEM_GROUPED_ADD(I0, F0, "(%[sp])") TANDEM_GROUPED_ADD(I1, F1, "(%[sp],%[ss],1)")                  \
  TANDEM_GROUPED_ADD(I2, F2, "(%[sp],%[ss],2)") TANDEM_GROUPED_ADD(I3, F3, "(%[sp3])")

void grouped_full_tile(const uint8_t* x, int64_t row_bytes, const uint8_t* w, int64_t block_bytes, int64_t groups,
                       int64_t group_steps, const int32_t* offsets, int64_t offsets_stride, const float* x_scales,
                       const uint8_t*, f32x16 (&out)[kGroupedRows][packed::kTileBlocks]) {
  static_assert(kGroupedRows == 4 && packed::kTileBlocks == 3 && sizeof(out) == 12 * 64, "the registers are 4 x 3");
  const uint8_t *x0 = x, *x3 = x + 3 * row_bytes, *wp = w;
  const float *sp = x_scales, *sp3 = x_scales + 3 * groups;
  const int32_t* op = offsets;
  const int64_t scale_stride = groups * 4, offsets_bytes = offsets_stride * 4;
  f32x16* out_ptr = &out[0][0];
  int64_t count, left = groups;
  asm volatile(
      TANDEM_ZERO_0_TO_23
      "2:\n\t"
      "mov %[gs], %[count]\n\t"
      "1:\n\t"
      "vmovdqu64 (%[w]), %%zmm24\n\tvmovdqu64 (%[w],%[bb],1), %%zmm25\n\tvmovdqu64 (%[w],%[bb],2), %%zmm26\n\t"
      TANDEM_GROUPED_DOTS("(%[x0])", 27, 0, 1, 2)
      TANDEM_GROUPED_DOTS("(%[x0],%[rb],1)", 28, 3, 4, 5)
      TANDEM_GROUPED_DOTS("(%[x0],%[rb],2)", 27, 6, 7, 8)
      TANDEM_GROUPED_DOTS("(%[x3])", 28, 9, 10, 11)
      "add $4, %[x0]\n\tadd $4, %[x3]\n\tadd $64, %[w]\n\t"
      "dec %[count]\n\tjnz 1b\n\t"
      TANDEM_GROUPED_BLOCK(0, 0, 0, 3, 6, 9, 12, 15, 18, 21)
      TANDEM_GROUPED_BLOCK(1, 64, 1, 4, 7, 10, 13, 16, 19, 22)
      TANDEM_GROUPED_BLOCK(2, 128, 2, 5, 8, 11, 14, 17, 20, 23)
      "add $4, %[sp]\n\tadd $4, %[sp3]\n\tadd %[ob], %[op]\n\t"
      "dec %[left]\n\tjnz 2b\n\t"
      "mov %[out], %[x0]\n\t"  // x0 is spent: it takes the address of `out`
      TANDEM_STORE(12, 0, "%[x0]") TANDEM_STORE(13, 64, "%[x0]") TANDEM_STORE(14, 128, "%[x0]")
      TANDEM_STORE(15, 192, "%[x0]") TANDEM_STORE(16, 256, "%[x0]") TANDEM_STORE(17, 320, "%[x0]")
      TANDEM_STORE(18, 384, "%[x0]") TANDEM_STORE(19, 448, "%[x0]") TANDEM_STORE(20, 512, "%[x0]")
      TANDEM_STORE(21, 576, "%[x0]") TANDEM_STORE(22, 640, "%[x0]") TANDEM_STORE(23, 704, "%[x0]")
      : [x0] "+r"(x0), [x3] "+r"(x3), [w] "+r"(wp), [sp] "+r"(sp), [sp3] "+r"(sp3), [op] "+r"(op),
        [count] "=&r"(count), [left] "+r"(left)
      : [rb] "r"(row_bytes), [bb] "r"(block_bytes), [ss] "r"(scale_stride), [gs] "m"(group_steps),
        [ob] "m"(offsets_bytes), [out] "m"(out_ptr)
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
        "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22",
        "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29");
}

using GroupedTileFn = void (*)(const uint8_t*, int64_t, const uint8_t*, int64_t, int64_t, int64_t, const int32_t*,
                               int64_t, const float*, const uint8_t*, f32x16 (&)[kGroupedRows][packed::kTileBlocks]);

template <int C>
constexpr GroupedTileFn kGroupedTiles[kGroupedRows] = {grouped_tile<1, C>, grouped_tile<2, C>, grouped_tile<3, C>,
                                                       C == packed::kTileBlocks ? grouped_full_tile : grouped_tile<4, C>};
#endif

}  // namespace

// The group size is K / offsets.size(0).
void int8_grouped_gemm(Tensor out, Tensor x, Tensor packed, Tensor w_scale, Tensor offsets, Tensor bias) {
  using packed::kCols;
  using packed::kTileBlocks;
  const packed::W8A8Shape shape = packed::check_w8a8_args("int8_grouped_gemm", out, x, packed, w_scale, offsets, bias);
  const int64_t rows = shape.rows, k_len = shape.k_len, n = shape.n, blocks = shape.blocks;
  const bool has_bias = shape.has_bias;
  TANDEM_CHECK(offsets.is_contiguous() && offsets.dim() == 2 && offsets.size(0) > 0 && k_len % offsets.size(0) == 0 &&
                   offsets.size(1) == blocks * kCols,
               "offsets must be [K / group, ceil(N / 16) * 16], contiguous");
  const int64_t groups = offsets.size(0), group = k_len / groups;
  TANDEM_CHECK(group % 4 == 0, "the group (K / offsets.size(0)) must be a multiple of 4");
#if TANDEM_HAS_VNNI
  std::vector<uint8_t> xu(rows * k_len);  // xq + 128, vpdpbusd's unsigned operand
  std::vector<float> x_scales(rows * groups);
  dispatch_float_bf16(x, [&](auto tag) {
    using T = decltype(tag);
    const T* src = ptr<T>(x);
    torch::stable::parallel_for(0, rows, row_grain(k_len), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t g = 0; g < groups; ++g)
          quantize_row(reinterpret_cast<int8_t*>(xu.data() + r * k_len + g * group), &x_scales[r * groups + g],
                       src + r * x.stride(0) + g * group, group, /*flip=*/0x80);
    });
  });
  const float* cs = ptr<float>(w_scale);
  const int32_t* off = ptr<int32_t>(offsets);
  const float* b = has_bias ? ptr<float>(bias) : nullptr;
  const int64_t out_stride = out.stride(0), padded = blocks * kCols;
  const int64_t steps = k_len / 4, group_steps = group / 4, block_bytes = steps * 64;
  dispatch_float_bf16(out, [&](auto tag) {
    using T = decltype(tag);
    T* dst = ptr<T>(out);
    packed::for_each_tile(rows, blocks, block_bytes, steps, ptr<uint8_t>(packed), [&](int64_t r0, int64_t tile, int64_t first,
                                                                                     int64_t count, const uint8_t* wg,
                                                                                     const uint8_t* next) {
      for (int64_t r1 = r0; r1 < r0 + tile; r1 += kGroupedRows) {
        const int64_t part = std::min<int64_t>(kGroupedRows, r0 + tile - r1);
        f32x16 sums[kGroupedRows][kTileBlocks];
        const GroupedTileFn fn = count == 1   ? kGroupedTiles<1>[part - 1]
                                 : count == 2 ? kGroupedTiles<2>[part - 1]
                                              : kGroupedTiles<3>[part - 1];
        fn(xu.data() + r1 * k_len, k_len, wg, block_bytes, groups, group_steps, off + first * kCols, padded,
           x_scales.data() + r1 * groups, r1 == r0 ? next : nullptr, sums);
        for (int64_t c = 0; c < count; ++c) {
          const int64_t col = (first + c) * kCols, valid = std::min<int64_t>(kCols, n - col);
          f32x16 col_scale = {}, col_bias = {};
          std::memcpy(&col_scale, cs + col, valid * sizeof(float));
          if (has_bias) std::memcpy(&col_bias, b + col, valid * sizeof(float));
          for (int64_t r = 0; r < part; ++r) {
            f32x16 y = sums[r][c] * col_scale;
            if (has_bias) y = y + col_bias;
            packed::store_columns(dst + (r1 + r) * out_stride + col, y, valid);
          }
        }
      }
    });
  });
#endif
}

}  // namespace tandem

STABLE_TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("int8_grouped_gemm(Tensor(a!) out, Tensor x, Tensor packed, Tensor w_scale, Tensor offsets, Tensor bias) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("int8_grouped_gemm", TORCH_BOX(&tandem::int8_grouped_gemm));
}
