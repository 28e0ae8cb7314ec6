// Weight-only int4 for a few rows: GGUF's 4-bit blocks (Q4_0 / Q4_1) kept as 4 bits.
//
//   w[n, k] = q[n, k] * scale[n, g] + min[n, g]   for k in group g (32 consecutive k), q in 0..15
//   y[m, n] = sum_g scale[n, g] * (sum_{k in g} q[n, k] x[m, k]) + min[n, g] * (sum_{k in g} x[m, k])
//
// At decode's one row reading the weight is the whole cost, and 4-bit codes with two fp16 values
// per group are 5 bits a weight against int8_gemv's 8: SmolLM2's decoder layers read 66 instead
// of 106 MB a step. The arithmetic is int8_gemv's VNNI path (where the CPU has AVX512-VNNI):
// each row of x rounded to 16-bit integers with its own scale and split into two signed bytes
// (int8_quantize.h's split_row), multiplied by the unsigned codes with vpdpbusd into exact int32
// sums, one group at a time; each group's sums then meet its scale and min in fp32.
//
// Layout (kernels/cpu/int4_linear.py packs it), [ceil(N / 16), K / 32, 320] uint8: per block of 16
// output columns and group, as GGUF keeps a block's scale beside its codes (one stream to read):
//   bytes 0-255, four 8-k chunks t of 64 bytes: column c's byte j holds q[c, 8t + j] in its low
//     nibble and q[c, 8t + 4 + j] in its high one, so one load, masked and shifted, is vpdpbusd's
//     weight operand for 4 k twice over;
//   bytes 256-319: the 16 columns' scales, then their mins, in fp16 (padding columns: zeros).

#include "int8_quantize.h"
#include "ops.h"
#include "packed_tiles.h"

#include <atomic>
#include <vector>

namespace tandem {
namespace {

using packed::kCols;
constexpr int64_t kGroup = 32;        // k per scale: GGUF's block
constexpr int64_t kChunkBytes = 64;   // one load: 8 k of 16 columns
constexpr int64_t kGroupBytes = 320;  // a block's group: 4 chunks, then 16 fp16 scales and 16 mins

#if TANDEM_HAS_VNNI
constexpr int kMaxTileRows = 4;       // rows of x per pass over a block's codes
constexpr int64_t kUnitBlocks = 4;    // blocks a thread claims at a time

inline __m512i broadcast4(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof four);
  return _mm512_set1_epi32(four);
}

// y[r * C + c]: 16 columns of block c (block_bytes apart) for R rows of x, whose
// byte rows 2r (low) and 2r + 1 (high) are `k_len` apart; group_sums[r * groups + g]: the sum of
// row r's 16-bit integers over group g. R x C is chosen so the 2R x C int32 sums, the 2C weight
// operands and the R x C fp32 totals stay in registers, with enough independent sums to keep
// vpdpbusd's pipeline full at one row. `next`: the same C blocks of the thread's next unit (or
// null), prefetched a line per block per step: the codes come from memory once per step, and
// the hardware prefetchers alone left the int4 GEMV slower than int8_gemv (docs/cpu-kernels.md#int4_gemv).
template <int R, int C>
void tile_sums(const uint8_t* weight, int64_t block_bytes, int64_t groups, const int8_t* bytes, int64_t k_len,
               const float* group_sums, const uint8_t* next, f32x16* y) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 total[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) total[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i sums[2 * R][C];
    for (int b = 0; b < 2 * R; ++b)
      for (int c = 0; c < C; ++c) sums[b][c] = _mm512_setzero_si512();
    for (int64_t t = 0; t < kGroup / 8; ++t) {
      __m512i first[C], second[C];  // k 8t .. 8t + 3 and 8t + 4 .. 8t + 7
      const int64_t offset = g * kGroupBytes + t * kChunkBytes;
      if (next != nullptr) {
        for (int c = 0; c < C; ++c) __builtin_prefetch(next + c * block_bytes + offset, 0, 2);
        if (t == 0)  // the group's scales and mins: its fifth line
          for (int c = 0; c < C; ++c) __builtin_prefetch(next + c * block_bytes + g * kGroupBytes + 256, 0, 2);
      }
      for (int c = 0; c < C; ++c) {
        const __m512i raw = _mm512_loadu_si512(weight + c * block_bytes + offset);
        first[c] = _mm512_and_si512(raw, nibble);
        second[c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
      }
      const int64_t k = g * kGroup + t * 8;
      for (int b = 0; b < 2 * R; ++b) {
        const __m512i a0 = broadcast4(bytes + b * k_len + k), a1 = broadcast4(bytes + b * k_len + k + 4);
        for (int c = 0; c < C; ++c) {
          sums[b][c] = _mm512_dpbusd_epi32(sums[b][c], first[c], a0);
          sums[b][c] = _mm512_dpbusd_epi32(sums[b][c], second[c], a1);
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      const uint8_t* sc = weight + c * block_bytes + g * kGroupBytes + 256;
      const __m512 group_scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
      const __m512 group_min = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 2 * kCols)));
      for (int r = 0; r < R; ++r) {
        // 256 * high + low: at most 32 * 15 * 32512 < 2^24, exact in int32 and in fp32
        const __m512i q = _mm512_add_epi32(_mm512_slli_epi32(sums[2 * r + 1][c], 8), sums[2 * r][c]);
        total[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), group_scale, total[r][c]);
        total[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(group_sums[r * groups + g]), group_min, total[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * C + c] = bit_cast<f32x16>(total[r][c]);
}

void int4_gemv_vnni(Tensor& out, const Tensor& x, const uint8_t* weight) {
  const int64_t rows = x.size(0), k_len = x.size(1), n = out.size(1);
  const int64_t blocks = (n + kCols - 1) / kCols, groups = k_len / kGroup;
  std::vector<int8_t> bytes(2 * rows * k_len);  // byte rows: 2r the low bytes of row r, 2r + 1 the high
  std::vector<float> row_scales(rows), group_sums(rows * groups);
  std::vector<int32_t> unused(2 * rows);
  dispatch_float_bf16(x, [&](auto tag) {
    using T = decltype(tag);
    const T* src = ptr<T>(x);
    for (int64_t r = 0; r < rows; ++r) {  // a few rows: cheaper than waking the other threads
      int8_t* lo = &bytes[2 * r * k_len];
      int8_t* hi = lo + k_len;
      split_row(lo, hi, &row_scales[r], &unused[2 * r], src + r * x.stride(0), k_len);
      for (int64_t g = 0; g < groups; ++g) {
        int32_t sum = 0;  // |sum| <= 32 * 32512: exact in fp32
        for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) sum += 256 * hi[k] + lo[k];
        group_sums[r * groups + g] = float(sum);
      }
    }
  });
  const int64_t block_bytes = groups * kGroupBytes;
  const int64_t out_stride = out.stride(0), units = (blocks + kUnitBlocks - 1) / kUnitBlocks;
  dispatch_float_bf16(out, [&](auto tag) {
    using T = decltype(tag);
    T* dst = ptr<T>(out);
    // one tile: R rows from r0, C blocks from `first`, stored
    auto tile = [&](auto rows_tag, auto blocks_tag, int64_t r0, int64_t first, const uint8_t* next) {
      constexpr int R = decltype(rows_tag)::value, C = decltype(blocks_tag)::value;
      f32x16 y[R * C];
      tile_sums<R, C>(weight + first * block_bytes, block_bytes, groups, &bytes[2 * r0 * k_len], k_len, &group_sums[r0 * groups], next, y);
      for (int c = 0; c < C; ++c) {
        const int64_t col = (first + c) * kCols, count = std::min<int64_t>(kCols, n - col);
        for (int r = 0; r < R; ++r)
          packed::store_columns(dst + (r0 + r) * out_stride + col, y[r * C + c] * row_scales[r0 + r], count);
      }
    };
    using One = std::integral_constant<int, 1>;
    using Two = std::integral_constant<int, 2>;
    using Four = std::integral_constant<int, 4>;
    // units of 4 blocks, claimed one at a time as threads go (one claim ahead, whose codes are
    // prefetched): a thread that loses its core for a while leaves the rest to the others (as
    // packed_tiles.h's GEMM does)
    std::atomic<int64_t> claimed{0};
    auto run = [&](int64_t, int64_t) {
      int64_t unit = claimed.fetch_add(1);
      while (unit < units) {
        const int64_t following = claimed.fetch_add(1);
        const int64_t first = unit * kUnitBlocks, count = std::min(kUnitBlocks, blocks - first);
        // a whole next unit is prefetched block for block beside this one (a short last one is not)
        const bool prefetch = following < units && (following + 1) * kUnitBlocks <= blocks && count == kUnitBlocks;
        for (int64_t r0 = 0; r0 < rows; r0 += kMaxTileRows) {  // the unit's codes stay in L1/L2 meanwhile
          const int64_t tile_rows = std::min<int64_t>(kMaxTileRows, rows - r0);
          for (int64_t b = first; b < first + count;) {
            const uint8_t* next =
                prefetch && r0 == 0 ? weight + (following * kUnitBlocks + b - first) * block_bytes : nullptr;
            if (tile_rows == 1 && b + 4 <= first + count) { tile(One{}, Four{}, r0, b, next); b += 4; continue; }
            if (tile_rows <= 2 && b + 2 <= first + count) {
              tile_rows == 1 ? tile(One{}, Two{}, r0, b, next) : tile(Two{}, Two{}, r0, b, next);
              b += 2;
              continue;
            }
            switch (tile_rows) {
              case 1: tile(One{}, One{}, r0, b, next); break;
              case 2: tile(Two{}, One{}, r0, b, next); break;
              case 3: tile(std::integral_constant<int, 3>{}, One{}, r0, b, next); break;
              default: tile(Four{}, One{}, r0, b, next);
            }
            b += 1;
          }
        }
        unit = following;
      }
    };
    const int64_t tasks = std::min<int64_t>(torch::stable::get_num_threads(), units);
    if (tasks <= 1) run(0, 1);
    else torch::stable::parallel_for(0, tasks, 1, run);
  });
}
#endif

}  // namespace

// out[M, N] = x[M, K] . w^T with w in 4-bit groups of 32 (see the top of this file)
void int4_gemv(Tensor out, Tensor x, Tensor packed) {
  TANDEM_CHECK(TANDEM_HAS_VNNI, "int4_gemv needs a build for a CPU with AVX512-VNNI");
  check_rows(x, 2, "x");
  check_rows(out, 2, "out");
  check_cpu_dtype(packed, ScalarType::Byte, "packed");
  const int64_t rows = x.size(0), k_len = x.size(1), n = out.size(1);
  const int64_t blocks = (n + kCols - 1) / kCols;
  TANDEM_CHECK(out.size(0) == rows && out.scalar_type() == x.scalar_type(), "out must be [M, N] in x's dtype");
  TANDEM_CHECK(k_len % kGroup == 0, "x must be [M, K] with K a multiple of 32 (the int4 group)");
  TANDEM_CHECK(packed.is_contiguous() && packed.dim() == 3 && packed.size(0) == blocks &&
                   packed.size(1) == k_len / kGroup && packed.size(2) == kGroupBytes,
               "packed must be [ceil(N / 16), K / 32, 320] uint8, contiguous");
#if TANDEM_HAS_VNNI
  int4_gemv_vnni(out, x, ptr<uint8_t>(packed));
#endif
}

}  // namespace tandem

STABLE_TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("int4_gemv(Tensor(a!) out, Tensor x, Tensor packed) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("int4_gemv", TORCH_BOX(&tandem::int4_gemv));
}
