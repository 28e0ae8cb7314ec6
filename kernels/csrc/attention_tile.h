// One work item of paged attention: a tile of query rows against one request's context.
//
// The rows (tokens of the tile x the query heads sharing one kv head) walk the context in
// chunks of kChunk keys, reading each K and V row where it lies in its block: scores for the
// chunk, one online-softmax update per row, then the weighted values. The next chunk is
// prefetched while this one computes (blocks lie anywhere in the cache, so the hardware
// prefetchers alone leave the loads waiting on memory).
//
// Vector path (head_dim a multiple of 32): a row of K or V is head_dim / 16 fp32 vectors.
// bf16 rows are widened in "split" lane order, each 32 elements as their 16 even then their
// 16 odd ones (one shift or one mask each, no shuffles); queries are loaded the same way so
// the dot products match, and the accumulators are put back in order when stored. Scores
// of 16 keys come from 16 vectors of per-lane partial dot products folded together (fold16),
// not 16 horizontal sums. Values accumulate for several rows at once, so each V row is
// widened once per group of rows and the multiply-adds have independent chains.
#pragma once

#include "cpu_common.h"

#include <limits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace tandem {

constexpr int64_t kChunk = 64;  // keys per online-softmax step

struct Layout {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size;
  int64_t q_stride_t, q_stride_h, o_stride_t, o_stride_h;
  int64_t cache_stride_block, cache_stride_head;
  const int32_t* block_tables;
  int64_t block_table_stride;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  float scale;
};

struct WorkItem {
  int32_t req, kv_head, token_begin, token_end;  // tokens [begin, end) of the flattened batch
  int64_t keys;                                  // context the tile's last token sees
  int64_t cost;                                  // rows x keys, for ordering
};

struct Scratch {  // per thread, reused by its items
  std::vector<float> q, acc, scores, max, sum, correction;
  std::vector<int64_t> last_pos, visible;
  std::vector<const void*> query_rows, key_rows, value_rows;
};

constexpr bool vectorized(int64_t kD) { return kD != 0 && kD % 32 == 0; }

// ---- rows as vectors ------------------------------------------------------------------
template <int64_t V>
inline void widen_row(const float* row, f32x16 (&out)[V]) {
  for (int64_t v = 0; v < V; ++v) out[v] = load<f32x16>(row + 16 * v);
}
template <int64_t V>
inline void widen_row(const bf16* row, f32x16 (&out)[V]) {  // split lane order
  for (int64_t u = 0; u < V / 2; ++u) {
    u32x16 w;
    std::memcpy(&w, row + 32 * u, sizeof w);
    out[2 * u] = bit_cast<f32x16>(w << 16);
    out[2 * u + 1] = bit_cast<f32x16>(w & 0xffff0000u);
  }
}
template <int64_t V>
inline void store_row(float* row, const f32x16 (&x)[V]) {
  for (int64_t v = 0; v < V; ++v) store(row + 16 * v, x[v]);
}
template <int64_t V>
inline void store_row(bf16* row, const f32x16 (&x)[V]) {  // from split lane order
  for (int64_t u = 0; u < V / 2; ++u) {
    const u32x16 w = bf16_bits(x[2 * u + 1]) | (bf16_bits(x[2 * u]) >> 16);
    std::memcpy(row + 32 * u, &w, sizeof w);
  }
}

// ---- fold16: lane c of the result = sum of the lanes of p[c] ---------------------------
// Each step halves the lanes per key and doubles the keys per vector, keeping key order.
#define TANDEM_FOLD(x, y, ...) (__builtin_shufflevector(x, y, __VA_ARGS__))
inline f32x16 fold_step16(f32x16 x, f32x16 y) {  // 1 key x 16 lanes each -> 2 keys x 8
  return TANDEM_FOLD(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         TANDEM_FOLD(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
inline f32x16 fold_step8(f32x16 x, f32x16 y) {  // 2 keys x 8 -> 4 keys x 4
  return TANDEM_FOLD(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         TANDEM_FOLD(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
inline f32x16 fold_step4(f32x16 x, f32x16 y) {  // 4 keys x 4 -> 8 keys x 2
  return TANDEM_FOLD(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         TANDEM_FOLD(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
inline f32x16 fold_step2(f32x16 x, f32x16 y) {  // 8 keys x 2 -> 16 keys x 1
  return TANDEM_FOLD(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         TANDEM_FOLD(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#undef TANDEM_FOLD

inline f32x16 fold16(const f32x16 (&p)[16]) {
  f32x16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = fold_step16(p[2 * i], p[2 * i + 1]);
  for (int i = 0; i < 4; ++i) b[i] = fold_step8(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 2; ++i) c[i] = fold_step4(b[2 * i], b[2 * i + 1]);
  return fold_step2(c[0], c[1]);
}

// ---- where the chunk's rows lie ---------------------------------------------------------
// calls f(offset of the first row, number of rows) for each block's run of positions [begin, end)
template <typename F>
inline void for_block_runs(const Layout& L, const WorkItem& w, int64_t begin, int64_t end, F&& f) {
  const int32_t* table = L.block_tables + w.req * L.block_table_stride;
  for (int64_t p = begin; p < end;) {
    const int64_t block = p / L.block_size, offset = p % L.block_size;
    const int64_t run = std::min(end - p, L.block_size - offset);
    f(table[block] * L.cache_stride_block + w.kv_head * L.cache_stride_head + offset * L.head_dim, run);
    p += run;
  }
}

template <typename T>
inline void prefetch_chunk(const Layout& L, const T* key_cache, const T* value_cache, const WorkItem& w,
                           int64_t begin) {
  for_block_runs(L, w, begin, std::min(w.keys, begin + kChunk), [&](int64_t offset, int64_t run) {
    const int64_t bytes = run * L.head_dim * int64_t(sizeof(T));
    for (int64_t i = 0; i < bytes; i += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(key_cache + offset) + i, 0, 2);  // into L2
      __builtin_prefetch(reinterpret_cast<const char*>(value_cache + offset) + i, 0, 2);
    }
  });
}

// ---- the rows' work on one chunk of n keys ------------------------------------------------
#if defined(__AVX512BF16__)
constexpr bool kBf16DotProducts = true;  // vdpbf16ps: bf16 pairs multiplied exactly, summed in fp32

// out[c] = scale * (q . k_c) for c < n (whole groups of 16), straight from bf16 q and K rows
template <int64_t kD>
inline void score_row_bf16(const bf16* q, float scale, const bf16* const* keys, int64_t n, float* out) {
  constexpr int64_t W = kD / 32;  // bf16 pairs: 32 elements per register
  __m512bh qv[W];
  for (int64_t w = 0; w < W; ++w) qv[w] = (__m512bh)_mm512_loadu_si512(q + 32 * w);
  for (int64_t g = 0; g < n; g += 16) {
    f32x16 partial[16];
    for (int64_t c = 0; c < 16; ++c) {
      const bf16* k = keys[std::min(g + c, n - 1)];  // past n: any valid row, masked later
      __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(k));
      for (int64_t w = 1; w < W; ++w) a = _mm512_dpbf16_ps(a, qv[w], (__m512bh)_mm512_loadu_si512(k + 32 * w));
      partial[c] = (f32x16)a;
    }
    store(out + g, fold16(partial) * scale);
  }
}
#else
constexpr bool kBf16DotProducts = false;
#endif

// scores[r][c] = q_r . k_c for c < n_r (n_r: the row's visible keys; whole groups of 16).
// q: the rows scaled, fp32 (split order for bf16); q_rows: the same rows as they lie in the
// query tensor, unscaled, for the bf16 dot-product instructions.
template <typename T, int64_t kD>
inline void score_chunk(const float* q, const T* const* q_rows, float scale, int64_t rows, const int64_t* visible,
                        const T* const* keys, int64_t D, float* scores) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = visible[r];
    float* out = scores + r * kChunk;
    if constexpr (std::is_same_v<T, bf16> && vectorized(kD) && kBf16DotProducts) {
#if defined(__AVX512BF16__)
      score_row_bf16<kD>(q_rows[r], scale, keys, n, out);
#endif
    } else if constexpr (vectorized(kD)) {
      constexpr int64_t V = kD / 16;
      f32x16 qv[V];
      widen_row<V>(q + r * kD, qv);
      for (int64_t g = 0; g < n; g += 16) {
        f32x16 partial[16];
        for (int64_t c = 0; c < 16; ++c) {
          f32x16 k[V];
          widen_row<V>(keys[std::min(g + c, n - 1)], k);  // past n: any valid row, masked later
          f32x16 a = qv[0] * k[0];
          for (int64_t v = 1; v < V; ++v) a += qv[v] * k[v];
          partial[c] = a;
        }
        store(out + g, fold16(partial));
      }
    } else {
      for (int64_t c = 0; c < n; ++c) {
        float a = 0.0f;
        for (int64_t d = 0; d < D; ++d) a += q[r * D + d] * load<float>(keys[c] + d);
        out[c] = a;
      }
    }
  }
}

// One online-softmax step of a row whose chunk of n keys shows it `visible` of them
// (0 <= visible <= n): updates max and sum, turns the scores into weights, zero from
// `visible` up to n's next multiple of 16, and returns the old accumulator's rescale.
inline float softmax_step(float* scores, int64_t visible, int64_t n, float& max, float& sum) {
  const int64_t padded = (visible + 15) / 16 * 16, chunk = (n + 15) / 16 * 16;
  std::fill(scores + padded, scores + chunk, 0.0f);
  if (visible == 0) {
    std::fill(scores, scores + padded, 0.0f);
    return 1.0f;
  }
  std::fill(scores + visible, scores + padded, -std::numeric_limits<float>::infinity());
  f32x16 top = load<f32x16>(scores);
  for (int64_t c = 16; c < padded; c += 16) {
    const f32x16 s = load<f32x16>(scores + c);
    top = top > s ? top : s;
  }
  const float new_max = std::max(max, reduce_max(top));
  const float correction = exp_nonpositive(max - new_max);
  f32x16 total = {};
  for (int64_t c = 0; c < padded; c += 16) {
    const f32x16 e = exp_nonpositive(load<f32x16>(scores + c) - new_max);
    store(scores + c, e);
    total += e;
  }
  sum = sum * correction + reduce_add(total);
  max = new_max;
  return correction;
}

// acc[r] = acc[r] * correction[r] + sum_c weights[r][c] v_c for R rows at once, accumulators
// in registers: each V row is widened once for the R rows, and R x V independent chains
template <typename T, int64_t kD, int64_t R>
inline void accumulate_rows(float* acc, const float* weights, const float* correction, const T* const* values,
                            int64_t keys) {
  constexpr int64_t V = kD / 16;
  f32x16 a[R][V];
  for (int64_t i = 0; i < R; ++i) {
    for (int64_t v = 0; v < V; ++v) a[i][v] = load<f32x16>(acc + i * kD + 16 * v) * correction[i];
  }
  for (int64_t c = 0; c < keys; ++c) {
    f32x16 x[V];
    widen_row<V>(values[c], x);
    for (int64_t i = 0; i < R; ++i) {
      const float p = weights[i * kChunk + c];
      for (int64_t v = 0; v < V; ++v) a[i][v] += p * x[v];
    }
  }
  for (int64_t i = 0; i < R; ++i) {
    for (int64_t v = 0; v < V; ++v) store(acc + i * kD + 16 * v, a[i][v]);
  }
}

// every row's acc += its weights (zero past its visible keys) times the chunk's n values
template <typename T, int64_t kD>
inline void accumulate_chunk(float* acc, int64_t rows, const int64_t* visible, const float* weights,
                             const float* correction, const T* const* values, int64_t n, int64_t D) {
  if constexpr (vectorized(kD)) {
    constexpr int64_t kMaxRows = kD <= 64 ? 4 : 2;  // R x V accumulators stay within the registers
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
      const int64_t group = std::min(kMaxRows, rows - r0);
      int64_t keys = 0;  // run to the group's widest row
      for (int64_t i = 0; i < group; ++i) keys = std::max(keys, visible[r0 + i]);
      float* a = acc + r0 * kD;
      const float* p = weights + r0 * kChunk;
      const float* f = correction + r0;
      switch (group) {
        case 1: accumulate_rows<T, kD, 1>(a, p, f, values, keys); break;
        case 2: accumulate_rows<T, kD, 2>(a, p, f, values, keys); break;
        case 3: if constexpr (kMaxRows >= 3) accumulate_rows<T, kD, 3>(a, p, f, values, keys); break;
        default: if constexpr (kMaxRows >= 4) accumulate_rows<T, kD, 4>(a, p, f, values, keys); break;
      }
    }
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      float* a = acc + r * D;
      for (int64_t d = 0; d < D; ++d) a[d] *= correction[r];
      for (int64_t c = 0; c < std::min(n, visible[r]); ++c) {
        const float p = weights[r * kChunk + c];
        for (int64_t d = 0; d < D; ++d) a[d] += p * load<float>(values[c] + d);
      }
    }
  }
}

// ---- one work item --------------------------------------------------------------------
// kD: head_dim known at compile time (a multiple of 32 runs on 16-lane vectors), or 0 for any.
// `next`: the item this thread runs after this one (its first chunk is prefetched), or null.
template <typename T, int64_t kD>
void attend(const Layout& L, const WorkItem& w, const WorkItem* next, const T* query, const T* key_cache,
            const T* value_cache, T* out, Scratch& s) {
  constexpr int64_t V = kD / 16;
  const int64_t D = kD ? kD : L.head_dim, G = L.group;
  const int64_t num_tokens = w.token_end - w.token_begin, rows = num_tokens * G;
  const int64_t q_begin = L.query_start_loc[w.req], q_len = L.query_start_loc[w.req + 1] - q_begin;
  const int64_t seq_len = L.seq_lens[w.req];
  s.q.resize(rows * D);
  s.acc.assign(rows * D, 0.0f);
  s.scores.resize(rows * kChunk);
  s.max.assign(rows, -std::numeric_limits<float>::infinity());
  s.sum.assign(rows, 0.0f);
  s.correction.resize(rows);
  s.last_pos.resize(rows);
  s.visible.resize(rows);
  s.query_rows.resize(rows);
  s.key_rows.resize(kChunk);
  s.value_rows.resize(kChunk);
  int64_t* visible = s.visible.data();
  float* correction = s.correction.data();

  // the tile's query rows, scaled, in fp32 (split lane order for bf16 vectors):
  // row r = (token r / G, head kv_head * G + r % G)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t token = w.token_begin + t;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = t * G + g;
      const T* src = query + token * L.q_stride_t + (w.kv_head * G + g) * L.q_stride_h;
      s.query_rows[r] = src;
      if constexpr (vectorized(kD)) {
        f32x16 x[V];
        widen_row<V>(src, x);
        for (int64_t v = 0; v < V; ++v) store(s.q.data() + r * D + 16 * v, x[v] * L.scale);
      } else {
        for (int64_t d = 0; d < D; ++d) s.q[r * D + d] = load<float>(src + d) * L.scale;
      }
      s.last_pos[r] = seq_len - q_len + (token - q_begin);  // sees keys 0..last_pos
    }
  }

  const T** keys = reinterpret_cast<const T**>(s.key_rows.data());
  const T** values = reinterpret_cast<const T**>(s.value_rows.data());
  for (int64_t begin = 0; begin < w.keys; begin += kChunk) {
    const int64_t n = std::min(kChunk, w.keys - begin);
    if (begin + kChunk < w.keys) {
      prefetch_chunk(L, key_cache, value_cache, w, begin + kChunk);
    } else if (next != nullptr) {
      prefetch_chunk(L, key_cache, value_cache, *next, 0);
    }
    int64_t c = 0;
    for_block_runs(L, w, begin, begin + n, [&](int64_t offset, int64_t run) {
      for (int64_t i = 0; i < run; ++i, ++c) {
        keys[c] = key_cache + offset + i * D;
        values[c] = value_cache + offset + i * D;
      }
    });
    for (int64_t r = 0; r < rows; ++r) visible[r] = std::max<int64_t>(0, std::min(n, s.last_pos[r] + 1 - begin));
    score_chunk<T, kD>(s.q.data(), reinterpret_cast<const T* const*>(s.query_rows.data()), L.scale, rows, visible,
                       keys, D, s.scores.data());
    for (int64_t r = 0; r < rows; ++r) {
      correction[r] = softmax_step(s.scores.data() + r * kChunk, visible[r], n, s.max[r], s.sum[r]);
    }
    accumulate_chunk<T, kD>(s.acc.data(), rows, visible, s.scores.data(), correction, values, n, D);
  }

  for (int64_t r = 0; r < rows; ++r) {  // normalize into the output rows
    const int64_t token = w.token_begin + r / G, head = w.kv_head * G + r % G;
    T* dst = out + token * L.o_stride_t + head * L.o_stride_h;
    const float inv = 1.0f / s.sum[r];
    if constexpr (vectorized(kD)) {
      f32x16 x[V];
      for (int64_t v = 0; v < V; ++v) x[v] = load<f32x16>(s.acc.data() + r * D + 16 * v) * inv;
      store_row<V>(dst, x);
    } else {
      for (int64_t d = 0; d < D; ++d) store(dst + d, s.acc[r * D + d] * inv);
    }
  }
}

}  // namespace tandem
