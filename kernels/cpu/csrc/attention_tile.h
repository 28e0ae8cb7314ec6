// One work item of paged attention: a tile of query rows against one request's context.
//
// The rows (tokens of the tile x the query heads sharing one kv head) walk the context in
// chunks of kChunk keys, reading each K and V row where it lies in its block: scores for the
// chunk, one online-softmax update per row, then the weighted values. The next chunk is
// prefetched while this one computes (blocks lie anywhere in the cache, so the hardware
// prefetchers alone leave the loads waiting on memory): its keys before this chunk's scores, its
// values after them, since issuing both at once stalled on the core's miss buffers (perf: ~20% of
// the kernel's samples on the prefetches; split, batch-32 decodes ran 10-20% faster on a Zen 4).
//
// The math of one chunk is in attention_chunk.h.
#pragma once

#include "attention_chunk.h"

#include <limits>
#include <vector>

namespace tandem {

struct Layout {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size;
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
};

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

// one cache's rows (K or V) of the chunk at `begin`, into L2
template <typename T>
inline void prefetch_chunk(const Layout& L, const T* cache, const WorkItem& w, int64_t begin) {
  for_block_runs(L, w, begin, std::min(w.keys, begin + kChunk), [&](int64_t offset, int64_t run) {
    const int64_t bytes = run * L.head_dim * int64_t(sizeof(T));
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(reinterpret_cast<const char*>(cache + offset) + i, 0, 2);
  });
}

// ---- one work item --------------------------------------------------------------------
// kD: head_dim known at compile time (a multiple of 32 runs on 16-lane vectors), or 0 for any.
// `next`: the item this thread runs after this one (its first chunk is prefetched), or null.
template <typename T, int64_t kD>
void attend(const Layout& L, const WorkItem& w, const WorkItem* next, const T* query, const T* key_cache,
            const T* value_cache, T* out, float* partials, Scratch& s) {
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
  s.first.resize(rows);
  s.query_rows.resize(rows);
  s.key_rows.resize(kChunk);
  s.value_rows.resize(kChunk);
  int64_t* visible = s.visible.data();
  int64_t* first = s.first.data();
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
        keys[c] = key_cache + offset + i * D;
        values[c] = value_cache + offset + i * D;
      }
    });
    for (int64_t r = 0; r < rows; ++r) {
      visible[r] = std::max<int64_t>(0, std::min(n, s.last_pos[r] + 1 - begin));
      first[r] = std::max<int64_t>(0, s.last_pos[r] + 1 - L.window - begin);  // keys before it: out of window
    }
    score_chunk<T, kD>(s.q.data(), reinterpret_cast<const T* const*>(s.query_rows.data()), L.scale, rows, visible,
                       keys, D, s.scores.data());
    if (ahead != nullptr) prefetch_chunk(L, value_cache, *ahead, ahead_begin);
    for (int64_t r = 0; r < rows; ++r) {
      float* scores = s.scores.data() + r * kChunk;
      if (L.softcap > 0.0f) {
        for (int64_t c = 0; c < visible[r]; ++c) scores[c] = L.softcap * std::tanh(scores[c] / L.softcap);
      }
      correction[r] = softmax_step(scores, first[r], visible[r], n, s.max[r], s.sum[r]);
    }
    accumulate_chunk<T, kD>(s.acc.data(), rows, visible, s.scores.data(), correction, values, n, D);
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
      store_row<V>(dst, x);
    } else {
      for (int64_t d = 0; d < D; ++d) store(dst + d, s.acc[r * D + d] * inv);
    }
  }
}

// The output rows of a decode whose context ran as `splits` items (partials one after
// another from `first`): each split's accumulator rescaled to the common max, summed, normalized.
template <typename T, int64_t kD>
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
      store_row<V>(dst, x);
    } else {
      for (int64_t d = 0; d < D; ++d) store(dst + d, acc[d] / sum);
    }
  }
}

}  // namespace tandem
