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
// the stack on every k step (measured on a Zen 4 core: 0.85 vs 3.5 G vpdpbusd/s).
template <class Dot>
using Tile = typename Dot::Acc[kTileRows][kTileBlocks];

#if TANDEM_HAS_VNNI
struct Int8Dot {  // int32 lanes += 4 u8 x s8 products each
  using Acc = __m512i;
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
  static Acc dot(Acc acc, __m512i a, __m512i w) { return Int8Dot::dot(acc, w, a); }
};
#endif

#if TANDEM_HAS_BF16_DOT
struct Bf16Dot {  // fp32 lanes += 2 bf16 x bf16 products each
  using Acc = __m512;
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

template <class Dot, int C>
void tile_rows(int64_t rows, const uint8_t* x, int64_t row_bytes, const uint8_t* w, int64_t block_bytes, int64_t steps,
               const uint8_t* next, Tile<Dot>& acc) {  // R as a template argument, chosen at run time
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

// the first `count` lanes of y to out
template <typename T>
inline void store_columns(T* out, f32x16 y, int64_t count) {
  if (count == kCols) return store(out, y);
  for (int64_t i = 0; i < count; ++i) store(out + i, y[i]);
}

}  // namespace tandem::packed
