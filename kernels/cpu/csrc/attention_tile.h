// One work item of paged attention: a tile of query rows against one request's context.
//
// The rows (tokens of the tile x the query heads sharing one kv head) walk the context in
// chunks of kChunk keys, reading each K and V row where it lies in its block: scores for the
// chunk, one online-softmax update per row, then the weighted values. The next chunk is
// prefetched while this one computes (blocks lie anywhere in the cache, so the hardware
// prefetchers alone leave the loads waiting on memory): its keys before this chunk's scores, its
// values after them, since issuing both at once stalled on the core's miss buffers
// (docs/cpu-kernels.md#building-the-c-kernels).
//
// The math of one chunk is in attention_chunk.h; an int8 cache's (codes in blocks, a scale per token) in
// attention_int8.h.
#pragma once

#include "attention_chunk.h"
#include "attention_int8.h"

#include <limits>
#include <vector>

namespace tandem {

struct Layout {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size;
  int64_t row_stride;  // a float cache's elements per row (head_dim); an int8 cache's slabs: attention_int8.h
  int64_t key_align;   // items start at a multiple of this many keys: 16 in an int8 cache, else 1
  int64_t q_stride_t, q_stride_h, o_stride_t, o_stride_h;
  int64_t cache_stride_block, cache_stride_head;
  const int32_t* block_tables;
  int64_t block_table_stride;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  float scale;
  int64_t window;  // keys a query sees, its own included (sliding window; huge: none)
  float softcap;   // scores s -> softcap * tanh(s / softcap) when > 0
};

struct WorkItem {
  int32_t req, kv_head, token_begin, token_end;  // tokens [begin, end) of the flattened batch
  int64_t key_begin, keys;  // keys [key_begin, keys): all the tile's last token sees, or one split of them
  int64_t cost;             // rows x keys, for ordering
  int64_t partial;          // -1: write the output; else where this split's partial results go
};

// What one split of a decode's context leaves for the merge: per row, the unnormalized
// accumulator (vector lane order), the running max and the sum of weights.
inline int64_t partial_floats(const Layout& L) { return L.group * (L.head_dim + 2); }

struct Scratch {  // per thread, reused by its items
  std::vector<float> q, acc, scores, max, sum, correction;
  std::vector<int64_t> last_pos, visible, first;
  std::vector<const void*> query_rows, key_rows, value_rows;
  // int8 caches (attention_int8.h): the portable path's dequantized rows; with VNNI the rows' query and
  // weights as bytes with their biases and scales, the chunk's value scales and runs, the scores' sums
  std::vector<float> key_rows_f32, value_rows_f32, value_scales, q_scales, w_scales;
  std::vector<int8_t> q_hi, q_lo, w_hi, w_lo;
  std::vector<int32_t> q_bias, w_bias, sums;
  std::vector<const int8_t*> value_quads;
};

// ---- where the chunk's rows lie ---------------------------------------------------------
// calls f(offset of the first row, number of rows) for each block's run of positions [begin, end)
template <typename F>
inline void for_block_runs(const Layout& L, const WorkItem& w, int64_t begin, int64_t end, F&& f) {
  const int32_t* table = L.block_tables + w.req * L.block_table_stride;
  for (int64_t p = begin; p < end;) {
    const int64_t block = p / L.block_size, offset = p % L.block_size;
    const int64_t run = std::min(end - p, L.block_size - offset);
    f(table[block] * L.cache_stride_block + w.kv_head * L.cache_stride_head + offset * L.row_stride, run);
    p += run;
  }
}

// one cache's rows (K or V) of the chunk at `begin`, into L2
template <typename T>
inline void prefetch_chunk(const Layout& L, const T* cache, const WorkItem& w, int64_t begin) {
  for_block_runs(L, w, begin, std::min(w.keys, begin + kChunk), [&](int64_t offset, int64_t run) {
    const int64_t bytes = run * L.row_stride * int64_t(sizeof(T));
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(reinterpret_cast<const char*>(cache + offset) + i, 0, 2);
  });
}

// ---- an int8 cache's slabs -----------------------------------------------------------------
// calls f(slab, first token in it, tokens) for each block's run of positions [begin, end)
template <typename F>
inline void for_slab_runs(const Layout& L, const WorkItem& w, const int8_t* cache, int64_t begin, int64_t end, F&& f) {
  const int32_t* table = L.block_tables + w.req * L.block_table_stride;
  for (int64_t p = begin; p < end;) {
    const int64_t block = p / L.block_size, offset = p % L.block_size;
    const int64_t run = std::min(end - p, L.block_size - offset);
    f(cache + table[block] * L.cache_stride_block + w.kv_head * L.cache_stride_head, offset, run);
    p += run;
  }
}

// `bytes` from `from`, into L2 (GCC deleted these loops as __builtin_prefetch, even with -fno-finite-loops)
inline void prefetch_lines(const int8_t* from, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) {
#if defined(__x86_64__)
    asm volatile("prefetcht1 %0" : : "m"(from[i]));
#else
    __builtin_prefetch(from + i, 0, 2);
#endif
  }
}

// the key (kKey) or value codes and scales of the chunk at `begin`, into L2
template <bool kKey>
inline void prefetch_chunk_int8(const Layout& L, const int8_t* cache, const WorkItem& w, int64_t begin) {
  const int64_t D = L.head_dim, bs = L.block_size;
  for_slab_runs(L, w, cache, begin, std::min(w.keys, begin + kChunk), [&](const int8_t* slab, int64_t t, int64_t run) {
    if constexpr (kKey) {
      for (int64_t j = 0; j < D / 4; ++j) prefetch_lines(slab + (j * bs + t) * 4, run * 4);
    } else {
      prefetch_lines(slab + t / 4 * D * 4, (run + 3) / 4 * D * 4);
    }
    prefetch_lines(slab + bs * D + kKvScaleBytes * t, kKvScaleBytes * run);
  });
}

// each row's visible keys of the chunk at `begin` (n keys), and the first one inside its window
inline void visible_keys(const Layout& L, int64_t rows, int64_t begin, int64_t n, Scratch& s) {
  for (int64_t r = 0; r < rows; ++r) {
    s.visible[r] = std::max<int64_t>(0, std::min(n, s.last_pos[r] + 1 - begin));
    s.first[r] = std::max<int64_t>(0, s.last_pos[r] + 1 - L.window - begin);  // keys before it: out of window
  }
}

// one online-softmax step for every row over the chunk's scores (soft-capped first where the layer caps)
inline void softmax_rows(const Layout& L, int64_t rows, int64_t n, Scratch& s) {
  for (int64_t r = 0; r < rows; ++r) {
    float* scores = s.scores.data() + r * kChunk;
    if (L.softcap > 0.0f) {
      for (int64_t c = 0; c < s.visible[r]; ++c) scores[c] = L.softcap * std::tanh(scores[c] / L.softcap);
    }
    s.correction[r] = softmax_step(scores, s.first[r], s.visible[r], n, s.max[r], s.sum[r]);
  }
}

// The item's context, chunk by chunk, from a float cache: into s.acc, s.max, s.sum.
template <typename T, typename C, int64_t kD>
void walk(const Layout& L, const WorkItem& w, const WorkItem* next, const C* key_cache, const C* value_cache,
          int64_t rows, Scratch& s) {
  const int64_t D = kD ? kD : L.head_dim;
  const C** keys = reinterpret_cast<const C**>(s.key_rows.data());
  const C** values = reinterpret_cast<const C**>(s.value_rows.data());
  for (int64_t begin = w.key_begin; begin < w.keys; begin += kChunk) {
    const int64_t n = std::min(kChunk, w.keys - begin);
    // the next chunk's keys now and its values after this chunk's scores: half as many loads in
    // flight at once, so the prefetches do not stall waiting for miss buffers
    const bool more = begin + kChunk < w.keys;  // else the next item's first chunk
    const WorkItem* ahead = more ? &w : next;
    const int64_t ahead_begin = more ? begin + kChunk : ahead != nullptr ? ahead->key_begin : 0;
    if (ahead != nullptr) prefetch_chunk(L, key_cache, *ahead, ahead_begin);
    int64_t c = 0;
    for_block_runs(L, w, begin, begin + n, [&](int64_t offset, int64_t run) {
      for (int64_t i = 0; i < run; ++i, ++c) {
        keys[c] = key_cache + offset + i * L.row_stride;
        values[c] = value_cache + offset + i * L.row_stride;
      }
    });
    visible_keys(L, rows, begin, n, s);
    score_chunk<C, T, kD>(s.q.data(), reinterpret_cast<const T* const*>(s.query_rows.data()), L.scale, rows,
                          s.visible.data(), keys, D, s.scores.data());
    if (ahead != nullptr) prefetch_chunk(L, value_cache, *ahead, ahead_begin);
    softmax_rows(L, rows, n, s);
    accumulate_chunk<C, kD>(s.acc.data(), rows, s.visible.data(), s.scores.data(), s.correction.data(), values, n, D);
  }
}

// The same from an int8 cache (attention_int8.h): chunks start at multiples of 16 (the plan aligns the items),
// so each 16 keys lie in one block. With VNNI on the codes, else on each chunk dequantized into fp32 rows.
template <typename T, int64_t kD>
void walk_int8(const Layout& L, const WorkItem& w, const WorkItem* next, const int8_t* key_cache,
               const int8_t* value_cache, int64_t rows, Scratch& s) {
  const int64_t D = kD ? kD : L.head_dim, bs = L.block_size;
  const int32_t* table = L.block_tables + w.req * L.block_table_stride;
  auto slab = [&](const int8_t* cache, int64_t pos) {
    return cache + table[pos / bs] * L.cache_stride_block + w.kv_head * L.cache_stride_head;
  };
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  constexpr bool vnni = int8_dot_products(kD);
  Int8Rows q8{};
  if constexpr (vnni) {
    s.q_hi.resize(rows * kD);
    s.q_lo.resize(rows * kD);
    s.q_bias.resize(rows);
    s.q_scales.resize(rows);
    s.w_hi.resize(rows * kChunk);
    s.w_lo.resize(rows * kChunk);
    s.w_bias.resize(rows);
    s.w_scales.resize(rows);
    s.value_scales.resize(kChunk);
    s.value_quads.resize(kChunk / 4);
    s.sums.resize(rows * 32);  // two vectors of int32 sums a row
    split_rows_int16(s.q.data(), rows, kD, kD, kD, s.q_hi.data(), s.q_lo.data(), s.q_bias.data(), s.q_scales.data());
    q8 = {s.q_hi.data(), s.q_lo.data(), s.q_bias.data(), s.q_scales.data(),
          s.w_hi.data(), s.w_lo.data(), s.w_bias.data(), s.w_scales.data()};
  }
#else
  constexpr bool vnni = false;
#endif
  if constexpr (!vnni) {
    s.key_rows_f32.resize(kChunk * D);
    s.value_rows_f32.resize(kChunk * D);
  }
  const float** keys = reinterpret_cast<const float**>(s.key_rows.data());
  const float** values = reinterpret_cast<const float**>(s.value_rows.data());
  for (int64_t begin = w.key_begin; begin < w.keys; begin += kChunk) {
    const int64_t n = std::min(kChunk, w.keys - begin), padded = (n + 15) / 16 * 16;
    const bool more = begin + kChunk < w.keys;  // else the next item's first chunk
    const WorkItem* ahead = more ? &w : next;
    const int64_t ahead_begin = more ? begin + kChunk : ahead != nullptr ? ahead->key_begin : 0;
    if (ahead != nullptr) prefetch_chunk_int8<true>(L, key_cache, *ahead, ahead_begin);
    visible_keys(L, rows, begin, n, s);
    if constexpr (vnni) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      for (int64_t g = 0; g < n; g += kKeyGroup) {
        const int64_t pos = begin + g, t = pos % bs;
        const __m512 key_scales = group_scales(slab(key_cache, pos), t, bs, D);
        const __m512 value_scales = group_scales(slab(value_cache, pos), t, bs, D);  // zero past the context
        _mm512_storeu_ps(s.value_scales.data() + g,
                         _mm512_maskz_mov_ps(__mmask16((1u << std::min<int64_t>(16, n - g)) - 1), value_scales));
        score_group_int8<kD>(slab(key_cache, pos), t, bs, q8, rows, s.visible.data(), g, key_scales,
                             s.scores.data(), s.sums.data());
      }
#endif
    } else {
      for (int64_t c = 0; c < n;) {  // each block's run of the chunk, dequantized
        const int64_t pos = begin + c, t = pos % bs, run = std::min(n - c, bs - t);
        dequantize_tokens<true>(slab(key_cache, pos), t, run, bs, D, s.key_rows_f32.data() + c * D);
        dequantize_tokens<false>(slab(value_cache, pos), t, run, bs, D, s.value_rows_f32.data() + c * D);
        c += run;
      }
      for (int64_t c = 0; c < n; ++c) {
        keys[c] = s.key_rows_f32.data() + c * D;
        values[c] = s.value_rows_f32.data() + c * D;
      }
      score_chunk<float, T, kD>(s.q.data(), reinterpret_cast<const T* const*>(s.query_rows.data()), L.scale, rows,
                                s.visible.data(), keys, D, s.scores.data());
    }
    if (ahead != nullptr) prefetch_chunk_int8<false>(L, value_cache, *ahead, ahead_begin);
    softmax_rows(L, rows, n, s);
    if constexpr (vnni) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      for (int64_t r = 0; r < rows; ++r) {  // the weights times the tokens' value scales
        float* weights = s.scores.data() + r * kChunk;
        for (int64_t c = 0; c < padded; c += 16) {
          _mm512_storeu_ps(weights + c, _mm512_mul_ps(_mm512_loadu_ps(weights + c),
                                                      _mm512_loadu_ps(s.value_scales.data() + c)));
        }
      }
      split_rows_int16(s.scores.data(), rows, padded, kChunk, kChunk, s.w_hi.data(), s.w_lo.data(), s.w_bias.data(),
                       s.w_scales.data());
      for (int64_t k = 0; k < (n + 3) / 4; ++k) {
        const int64_t pos = begin + 4 * k, t = pos % bs;
        s.value_quads[k] = slab(value_cache, pos) + t / 4 * D * 4;
      }
      accumulate_chunk_int8<kD>(s.acc.data(), q8, rows, s.visible.data(), s.correction.data(), s.value_quads.data());
#endif
    } else {
      accumulate_chunk<float, kD>(s.acc.data(), rows, s.visible.data(), s.scores.data(), s.correction.data(), values,
                                  n, D);
    }
  }
}

// ---- one work item --------------------------------------------------------------------
// T: the query's and output's type; C: the cache's, T or int8_t (attention_int8.h).
// kD: head_dim known at compile time (a multiple of 32 runs on 16-lane vectors), or 0 for any.
// `next`: the item this thread runs after this one (its first chunk is prefetched), or null.
// Rows in registers follow the cache's lane order: split for bf16 (row_vectors.h), else natural.
template <typename T, typename C, int64_t kD>
void attend(const Layout& L, const WorkItem& w, const WorkItem* next, const T* query, const C* key_cache,
            const C* value_cache, T* out, float* partials, Scratch& s) {
  constexpr int64_t V = kD / 16;
  constexpr bool int8_cache = std::is_same_v<C, int8_t>;
  constexpr bool split = std::is_same_v<C, bf16>;
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
  s.first.resize(rows);
  s.query_rows.resize(rows);
  s.key_rows.resize(kChunk);
  s.value_rows.resize(kChunk);

  // the tile's query rows, scaled, in fp32 (the cache's lane order):
  // row r = (token r / G, head kv_head * G + r % G)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t token = w.token_begin + t;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = t * G + g;
      const T* src = query + token * L.q_stride_t + (w.kv_head * G + g) * L.q_stride_h;
      s.query_rows[r] = src;
      if constexpr (vectorized(kD)) {
        f32x16 x[V];
        if constexpr (split) widen_row<V>(src, x);
        else widen_row_natural<V>(src, x);
        for (int64_t v = 0; v < V; ++v) store(s.q.data() + r * D + 16 * v, x[v] * L.scale);
      } else {
        for (int64_t d = 0; d < D; ++d) s.q[r * D + d] = load<float>(src + d) * L.scale;
      }
      s.last_pos[r] = seq_len - q_len + (token - q_begin);  // sees keys 0..last_pos
    }
  }

  if constexpr (int8_cache) {  // the keys and values were rotated when written: the query meets them rotated
    for (int64_t r = 0; r < rows; ++r) rotate_scaled<kD>(s.q.data() + r * D, D);
    walk_int8<T, kD>(L, w, next, key_cache, value_cache, rows, s);
    for (int64_t r = 0; r < rows; ++r) rotate_scaled<kD>(s.acc.data() + r * D, D);  // the values' sums back
  } else {
    walk<T, C, kD>(L, w, next, key_cache, value_cache, rows, s);
  }

  if (w.partial >= 0) {  // one split of a decode's context: leave it for merge_splits
    float* part = partials + w.partial;
    for (int64_t r = 0; r < rows; ++r, part += D + 2) {
      std::copy(s.acc.data() + r * D, s.acc.data() + (r + 1) * D, part);
      part[D] = s.max[r];
      part[D + 1] = s.sum[r];
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {  // normalize into the output rows
    const int64_t token = w.token_begin + r / G, head = w.kv_head * G + r % G;
    T* dst = out + token * L.o_stride_t + head * L.o_stride_h;
    const float inv = 1.0f / s.sum[r];
    if constexpr (vectorized(kD)) {
      f32x16 x[V];
      for (int64_t v = 0; v < V; ++v) x[v] = load<f32x16>(s.acc.data() + r * D + 16 * v) * inv;
      if constexpr (split) store_row<V>(dst, x);
      else store_row_natural<V>(dst, x);
    } else {
      for (int64_t d = 0; d < D; ++d) store(dst + d, s.acc[r * D + d] * inv);
    }
  }
}

// The output rows of a decode whose context ran as `splits` items (partials one after
// another from `first`): each split's accumulator rescaled to the common max, summed, normalized.
// C: the cache's type, which sets the accumulators' lane order.
template <typename T, typename C, int64_t kD>
void merge_splits(const Layout& L, const WorkItem& w, const float* first, int64_t splits, T* out) {
  const int64_t D = kD ? kD : L.head_dim, stride = partial_floats(L);
  std::vector<float> acc(D);
  for (int64_t r = 0; r < L.group; ++r) {
    float max = -std::numeric_limits<float>::infinity(), sum = 0.0f;
    for (int64_t i = 0; i < splits; ++i) max = std::max(max, first[i * stride + r * (D + 2) + D]);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t i = 0; i < splits; ++i) {
      const float* part = first + i * stride + r * (D + 2);
      const float scale = exp_nonpositive(part[D] - max);
      sum += part[D + 1] * scale;
      for (int64_t d = 0; d < D; ++d) acc[d] += part[d] * scale;
    }
    T* dst = out + int64_t(w.token_begin) * L.o_stride_t + (w.kv_head * L.group + r) * L.o_stride_h;
    if constexpr (vectorized(kD)) {
      constexpr int64_t V = kD / 16;
      f32x16 x[V];
      for (int64_t v = 0; v < V; ++v) x[v] = load<f32x16>(acc.data() + 16 * v) / sum;
      if constexpr (std::is_same_v<C, bf16>) store_row<V>(dst, x);
      else store_row_natural<V>(dst, x);
    } else {
      for (int64_t d = 0; d < D; ++d) store(dst + d, acc[d] / sum);
    }
  }
}

}  // namespace tandem
