// GEMMs for decode-sized batches over a weight packed once for an AVX-512 dot-product
// instruction: vpdpbusd (int8, int8_vnni.cpp) or vdpbf16ps (bf16, bf16_packed.cpp).
//
// Both instructions add, per 32-bit lane, the products of a few consecutive k of one activation
// row (broadcast to every lane) and of one output column: 4 int8 or 2 bf16 values. The weight is
// packed as [ceil(N / 16), K / per_lane, 16, per_lane], so one 64-byte load holds those k for 16
// output columns. A register tile of up to 8 rows x 3 blocks (48 columns) keeps its 24 sums in
// registers while the tile's weight streams by once; the rows are taken in blocks of 128 (their
// activations stay in L2) and each thread claims (row block, 3-block group) units.
#pragma once

#include "cpu_common.h"

#include <atomic>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// What the compiler targets: each kernel exists only where its instruction does.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TANDEM_HAS_VNNI 1
#else
#define TANDEM_HAS_VNNI 0
#endif
#if defined(__AVX512BF16__)
#define TANDEM_HAS_BF16_DOT 1
#else
#define TANDEM_HAS_BF16_DOT 0
#endif

namespace tandem::packed {

constexpr int kCols = 16;              // output columns per packed block (one zmm of sums)
constexpr int kTileRows = 8;           // rows per register tile
constexpr int kTileBlocks = 3;         // blocks per tile: 8 x 3 sums + 3 weights + 1 broadcast
constexpr int64_t kRowBlock = 128;     // rows whose activations stay in L2 while the weight streams by
constexpr int64_t kTaskOps = 1 << 20;  // multiply-adds per parallel task at least

#if defined(__AVX512F__)
// A Dot names the instruction: `Acc` (its sum type), `zero()` and `dot(acc, x lanes, w lanes)`.
// The instructions go in as inline assembly: with the intrinsics GCC 12 spills the 24 sums to
// the stack on every k step, a several-fold slowdown (docs/cpu-kernels.md#int8_vnni).
template <class Dot>
using Tile = typename Dot::Acc[kTileRows][kTileBlocks];

#if TANDEM_HAS_VNNI
struct Int8Dot {  // int32 lanes += 4 u8 x s8 products each
  using Acc = __m512i;
  static constexpr int kFullTile = 0;  // full_tile's instruction (below)
  static Acc zero() { return _mm512_setzero_si512(); }
  static Acc dot(Acc acc, __m512i a, __m512i w) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(w));
    return acc;
  }
};

// The operands the other way round: signed activation bytes x unsigned weight bytes (int8_gemv.cpp
// stores its int8 weight as q + 128, so that its activations, 16-bit integers split into two signed
// bytes, can go in signed).
struct Int8WeightDot : Int8Dot {
  static constexpr int kFullTile = 1;
  static Acc dot(Acc acc, __m512i a, __m512i w) { return Int8Dot::dot(acc, w, a); }
};
#endif

#if TANDEM_HAS_BF16_DOT
struct Bf16Dot {  // fp32 lanes += 2 bf16 x bf16 products each
  using Acc = __m512;
  static constexpr int kFullTile = 2;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc dot(Acc acc, __m512i a, __m512i w) {
    asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(w));
    return acc;
  }
};
#endif

// acc[r][c] = the dot products of x's rows r (row_bytes apart) with block c (block_bytes apart)
// over `steps` 4-byte groups of k, for R rows and C blocks. `next`: the weight of the tile that
// comes after this one's group (or null), prefetched line by line as this one streams: weights
// come from memory once per step, and the hardware prefetchers alone leave the first row tile
// of each group waiting on it.
template <class Dot, int R, int C>
void tile_sums(const uint8_t* x, int64_t row_bytes, const uint8_t* w, int64_t block_bytes, int64_t steps,
               const uint8_t* next, Tile<Dot>& acc) {
  typename Dot::Acc sums[R][C];  // locals, so they stay in registers (`acc` may alias the inputs)
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r][c] = Dot::zero();
  for (int64_t s = 0; s < steps; ++s) {
    __m512i wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(w + c * block_bytes + s * 64);
    if (next != nullptr)
      for (int c = 0; c < kTileBlocks; ++c) __builtin_prefetch(next + c * block_bytes + s * 64, 0, 2);
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, x + r * row_bytes + s * 4, sizeof four);
      const __m512i a = _mm512_set1_epi32(four);
      for (int c = 0; c < C; ++c) sums[r][c] = Dot::dot(sums[r][c], a, wv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = sums[r][c];
}

// The full tile (8 rows x 3 blocks, all but the edges of a product) as one loop in assembly. The
// intrinsics loop above keeps the sums in registers, but GCC 12 adds ~10 instructions a k step
// (moves among the 32 vector registers, scalars parked in vector registers, the prefetch test);
// this loop runs at the instruction's peak on data in L1 (docs/cpu-kernels.md#int8_vnni).
// Registers: zmm0-23 the sums (row r, block c in zmm{3r + c}), zmm24-26 the weights, zmm27-28 the
// broadcast activations (alternating, so one row's broadcast need not wait for the last's dots).
#define TANDEM_DOT_AW(OP, W, A, S) OP " %%zmm" #W ", %%zmm" #A ", %%zmm" #S "\n\t"  // a: src1, w: src2
#define TANDEM_DOT_WA(OP, W, A, S) OP " %%zmm" #A ", %%zmm" #W ", %%zmm" #S "\n\t"  // w: src1, a: src2
#define TANDEM_FULL_ROW(DOT, OP, ADDR, A, S0, S1, S2) \
  "vpbroadcastd " ADDR ", %%zmm" #A "\n\t" DOT(OP, 24, A, S0) DOT(OP, 25, A, S1) DOT(OP, 26, A, S2)
#define TANDEM_FULL_TILE_LOOP(DOT, OP, PREFETCH)                                                       \
  "1:\n\t"                                                                                          \
  "vmovdqu64 (%[w]), %%zmm24\n\t"                                                                   \
  "vmovdqu64 (%[w],%[bb],1), %%zmm25\n\t"                                                           \
  "vmovdqu64 (%[w],%[bb],2), %%zmm26\n\t"                                                           \
  PREFETCH                                                                                           \
  TANDEM_FULL_ROW(DOT, OP, "(%[x0])", 27, 0, 1, 2)                                                   \
  TANDEM_FULL_ROW(DOT, OP, "(%[x0],%[rb],1)", 28, 3, 4, 5)                                           \
  TANDEM_FULL_ROW(DOT, OP, "(%[x0],%[rb],2)", 27, 6, 7, 8)                                           \
  TANDEM_FULL_ROW(DOT, OP, "(%[x3])", 28, 9, 10, 11)                                                 \
  TANDEM_FULL_ROW(DOT, OP, "(%[x3],%[rb],1)", 27, 12, 13, 14)                                        \
  TANDEM_FULL_ROW(DOT, OP, "(%[x3],%[rb],2)", 28, 15, 16, 17)                                        \
  TANDEM_FULL_ROW(DOT, OP, "(%[x6])", 27, 18, 19, 20)                                                \
  TANDEM_FULL_ROW(DOT, OP, "(%[x6],%[rb],1)", 28, 21, 22, 23)                                        \
  "add $4, %[x0]\n\tadd $4, %[x3]\n\tadd $4, %[x6]\n\tadd $64, %[w]\n\tadd $64, %[n]\n\t"               \
  "dec %[steps]\n\tjnz 1b\n\t"
#define TANDEM_FULL_TILE_PREFETCH "prefetcht1 (%[n])\n\tprefetcht1 (%[n],%[bb],1)\n\tprefetcht1 (%[n],%[bb],2)\n\t"
// zmm0-23 to zero; zmm{I} to OFFSET bytes past the address in BASE (an operand, e.g. "%[acc]")
#define TANDEM_ZERO(I) "vpxord %%zmm" #I ", %%zmm" #I ", %%zmm" #I "\n\t"
#define TANDEM_ZERO_0_TO_23                                                                        \
  TANDEM_ZERO(0) TANDEM_ZERO(1) TANDEM_ZERO(2) TANDEM_ZERO(3) TANDEM_ZERO(4) TANDEM_ZERO(5)        \
  TANDEM_ZERO(6) TANDEM_ZERO(7) TANDEM_ZERO(8) TANDEM_ZERO(9) TANDEM_ZERO(10) TANDEM_ZERO(11)      \
  TANDEM_ZERO(12) TANDEM_ZERO(13) TANDEM_ZERO(14) TANDEM_ZERO(15) TANDEM_ZERO(16) TANDEM_ZERO(17)  \
  TANDEM_ZERO(18) TANDEM_ZERO(19) TANDEM_ZERO(20) TANDEM_ZERO(21) TANDEM_ZERO(22) TANDEM_ZERO(23)
#define TANDEM_STORE(I, OFFSET, BASE) "vmovdqu64 %%zmm" #I ", " #OFFSET "(" BASE ")\n\t"
#define TANDEM_FULL_TILE_ASM(LOOP)                                                                          \
  asm volatile(                                                                                            \
      TANDEM_ZERO_0_TO_23                                                                                  \
      LOOP                                                                                                 \
      TANDEM_STORE(0, 0, "%[acc]") TANDEM_STORE(1, 64, "%[acc]") TANDEM_STORE(2, 128, "%[acc]")              \
      TANDEM_STORE(3, 192, "%[acc]") TANDEM_STORE(4, 256, "%[acc]") TANDEM_STORE(5, 320, "%[acc]")           \
      TANDEM_STORE(6, 384, "%[acc]") TANDEM_STORE(7, 448, "%[acc]") TANDEM_STORE(8, 512, "%[acc]")           \
      TANDEM_STORE(9, 576, "%[acc]") TANDEM_STORE(10, 640, "%[acc]") TANDEM_STORE(11, 704, "%[acc]")         \
      TANDEM_STORE(12, 768, "%[acc]") TANDEM_STORE(13, 832, "%[acc]") TANDEM_STORE(14, 896, "%[acc]")        \
      TANDEM_STORE(15, 960, "%[acc]") TANDEM_STORE(16, 1024, "%[acc]") TANDEM_STORE(17, 1088, "%[acc]")      \
      TANDEM_STORE(18, 1152, "%[acc]") TANDEM_STORE(19, 1216, "%[acc]") TANDEM_STORE(20, 1280, "%[acc]")     \
      TANDEM_STORE(21, 1344, "%[acc]") TANDEM_STORE(22, 1408, "%[acc]") TANDEM_STORE(23, 1472, "%[acc]")     \
      : [x0] "+r"(x0), [x3] "+r"(x3), [x6] "+r"(x6), [w] "+r"(wp), [n] "+r"(np), [steps] "+r"(steps)       \
      : [rb] "r"(row_bytes), [bb] "r"(block_bytes), [acc] "r"(&acc[0][0])                                  \
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",         \
        "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20",     \
        "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28")

template <class Dot>
void full_tile(const uint8_t* x, int64_t row_bytes, const uint8_t* w, int64_t block_bytes, int64_t steps,
               const uint8_t* next, Tile<Dot>& acc) {
  static_assert(kTileRows == 8 && kTileBlocks == 3 && sizeof(acc) == 24 * 64, "full_tile's registers are 8 x 3");
  const uint8_t *x0 = x, *x3 = x + 3 * row_bytes, *x6 = x + 6 * row_bytes, *wp = w, *np = next;
  if (next != nullptr) {
    if constexpr (Dot::kFullTile == 0) TANDEM_FULL_TILE_ASM(TANDEM_FULL_TILE_LOOP(TANDEM_DOT_AW, "vpdpbusd", TANDEM_FULL_TILE_PREFETCH));
    if constexpr (Dot::kFullTile == 1) TANDEM_FULL_TILE_ASM(TANDEM_FULL_TILE_LOOP(TANDEM_DOT_WA, "vpdpbusd", TANDEM_FULL_TILE_PREFETCH));
    if constexpr (Dot::kFullTile == 2) TANDEM_FULL_TILE_ASM(TANDEM_FULL_TILE_LOOP(TANDEM_DOT_AW, "vdpbf16ps", TANDEM_FULL_TILE_PREFETCH));
  } else {
    if constexpr (Dot::kFullTile == 0) TANDEM_FULL_TILE_ASM(TANDEM_FULL_TILE_LOOP(TANDEM_DOT_AW, "vpdpbusd", ""));
    if constexpr (Dot::kFullTile == 1) TANDEM_FULL_TILE_ASM(TANDEM_FULL_TILE_LOOP(TANDEM_DOT_WA, "vpdpbusd", ""));
    if constexpr (Dot::kFullTile == 2) TANDEM_FULL_TILE_ASM(TANDEM_FULL_TILE_LOOP(TANDEM_DOT_AW, "vdpbf16ps", ""));
  }
}

template <class Dot, int C>
void tile_rows(int64_t rows, const uint8_t* x, int64_t row_bytes, const uint8_t* w, int64_t block_bytes, int64_t steps,
               const uint8_t* next, Tile<Dot>& acc) {  // R as a template argument, chosen at run time
  if constexpr (C == kTileBlocks) {
    if (rows == kTileRows && steps > 0) return full_tile<Dot>(x, row_bytes, w, block_bytes, steps, next, acc);
  }
  using Fn = void (*)(const uint8_t*, int64_t, const uint8_t*, int64_t, int64_t, const uint8_t*, Tile<Dot>&);
  static constexpr Fn table[kTileRows] = {tile_sums<Dot, 1, C>, tile_sums<Dot, 2, C>, tile_sums<Dot, 3, C>,
                                          tile_sums<Dot, 4, C>, tile_sums<Dot, 5, C>, tile_sums<Dot, 6, C>,
                                          tile_sums<Dot, 7, C>, tile_sums<Dot, 8, C>};
  table[rows - 1](x, row_bytes, w, block_bytes, steps, next, acc);
}

// Walks the product's register tiles: `rows` rows, `blocks` packed blocks of `block_bytes` bytes
// of weight each, split among the threads. tile(first row, tile rows, first block, blocks, their
// weight, next) handles one tile; `next` is the weight of the group a thread takes next (or null),
// to prefetch while this one streams. task_ops: multiply-adds per parallel task at least (a
// memory-bound GEMV wants every thread streaming its share of the weight, however small the product).
template <class TileFn>
void for_each_tile(int64_t rows, int64_t blocks, int64_t block_bytes, int64_t steps, const uint8_t* w,
                   const TileFn& tile, int64_t task_ops = kTaskOps) {
  const int64_t groups = (blocks + kTileBlocks - 1) / kTileBlocks;
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t unit_ops = std::min(rows, kRowBlock) * steps * kTileBlocks * kCols;
  const int64_t grain = std::max<int64_t>(1, task_ops / std::max<int64_t>(1, unit_ops));
  // units: (row block, group of 3 blocks), the row block outer, so a thread's consecutive units
  // reuse one row block's activations from L2. Threads claim `grain` units at a time as they go
  // (not a fixed share each): a thread that loses its core to another process for a while leaves
  // its units to the others instead of holding the whole region at the barrier.
  const int64_t units = row_blocks * groups;
  std::atomic<int64_t> claimed{0};
  auto run = [&](int64_t, int64_t) {
    int64_t begin = claimed.fetch_add(grain);
    while (begin < units) {
      const int64_t end = std::min(units, begin + grain);
      const int64_t next_begin = claimed.fetch_add(grain);  // one claim ahead: its weight is prefetched
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t first = (unit % groups) * kTileBlocks, count = std::min<int64_t>(kTileBlocks, blocks - first);
        const int64_t row_end = std::min(rows, (unit / groups + 1) * kRowBlock);
        const uint8_t* wg = w + first * block_bytes;
        // the next unit's group, fetched during this unit's first row tile (its other tiles find
        // this group in L1/L2); the last group has fewer blocks than kTileBlocks: not prefetched
        const int64_t following = unit + 1 < end ? unit + 1 : next_begin;
        const bool prefetch = following < units && following % groups != 0 && following % groups + 1 < groups;
        const uint8_t* next_group = w + (following % groups) * kTileBlocks * block_bytes;
        for (int64_t r0 = (unit / groups) * kRowBlock; r0 < row_end; r0 += kTileRows) {
          const uint8_t* next = prefetch && r0 == (unit / groups) * kRowBlock ? next_group : nullptr;
          tile(r0, std::min<int64_t>(kTileRows, row_end - r0), first, count, wg, next);
        }
      }
      begin = next_begin;
    }
  };
  const int64_t tasks = std::min<int64_t>(torch::stable::get_num_threads(), (units + grain - 1) / grain);
  if (tasks <= 1) {
    run(0, 1);
  } else {
    torch::stable::parallel_for(0, tasks, 1, run);
  }
}

// acc = the sums of one tile: `tile` rows of x from xr (row_bytes apart) with `count` blocks from wg
template <class Dot>
void tile_blocks(int64_t count, int64_t tile, const uint8_t* xr, int64_t row_bytes, const uint8_t* wg,
                 int64_t block_bytes, int64_t steps, const uint8_t* next, Tile<Dot>& acc) {
  switch (count) {
    case 1: tile_rows<Dot, 1>(tile, xr, row_bytes, wg, block_bytes, steps, next, acc); break;
    case 2: tile_rows<Dot, 2>(tile, xr, row_bytes, wg, block_bytes, steps, next, acc); break;
    default: tile_rows<Dot, 3>(tile, xr, row_bytes, wg, block_bytes, steps, next, acc);
  }
}

// The whole product: `rows` rows of x (row_bytes apart), `blocks` packed blocks of `steps` k groups
// each. epilogue(acc, first row, tile rows, first block, blocks) stores one finished tile.
template <class Dot, class Epilogue>
void gemm(int64_t rows, int64_t blocks, int64_t steps, const uint8_t* x, int64_t row_bytes, const uint8_t* w,
          const Epilogue& epilogue, int64_t task_ops = kTaskOps) {
  const int64_t block_bytes = steps * 64;
  for_each_tile(rows, blocks, block_bytes, steps, w, [&](int64_t r0, int64_t tile, int64_t first, int64_t count,
                                                          const uint8_t* wg, const uint8_t* next) {
    Tile<Dot> acc;
    tile_blocks<Dot>(count, tile, x + r0 * row_bytes, row_bytes, wg, block_bytes, steps, next, acc);
    epilogue(acc, r0, tile, first, count);
  }, task_ops);
}
#endif

// The arguments the VNNI W8A8 GEMMs share (int8_vnni.cpp, int8_grouped.cpp; kernels/cpu/int8_linear.py
// makes them): out [M, N] and x [M, K] of one float dtype, packed [ceil(N / 16), K / 4, 16, 4] int8,
// w_scale [N] fp32, offsets int32 (each kernel checks its shape), bias [N] fp32 or empty.
struct W8A8Shape {
  int64_t rows, k_len, n, blocks;
  bool has_bias;
};

inline W8A8Shape check_w8a8_args(const char* op, const Tensor& out, const Tensor& x, const Tensor& packed,
                                 const Tensor& w_scale, const Tensor& offsets, const Tensor& bias) {
  TANDEM_CHECK(TANDEM_HAS_VNNI, op, " needs a build for a CPU with AVX512-VNNI");
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
  const bool has_bias = bias.numel() > 0;
  if (has_bias) {
    check_cpu_dtype(bias, ScalarType::Float, "bias");
    TANDEM_CHECK(bias.is_contiguous() && bias.numel() == n, "bias must be [N] fp32, contiguous, or empty");
  }
  return {rows, k_len, n, blocks, has_bias};
}

// the first `count` lanes of y to out
template <typename T>
inline void store_columns(T* out, f32x16 y, int64_t count) {
  if (count == kCols) return store(out, y);
  for (int64_t i = 0; i < count; ++i) store(out + i, y[i]);
}

}  // namespace tandem::packed
