// The rows' work on one chunk of keys: scores, an online-softmax step, weighted values.
//
// Vector path (head_dim a multiple of 32, row_vectors.h): scores of 16 keys come from 16
// vectors of per-lane partial dot products folded together, not 16 horizontal sums; with
// AVX-512 BF16, bf16 rows go straight into vdpbf16ps. Values accumulate for several rows at
// once, so each V row is read once per group of rows and the multiply-adds have independent
// chains: with AVX-512 BF16, bf16 V rows two keys per vdpbf16ps (probabilities rounded to
// bf16), else widened to fp32 (int8 codes too; attention_int8.h has their integer path).
// Other head_dims take plain loops.
#pragma once

#include "row_vectors.h"

#include <limits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace tandem {

constexpr int64_t kChunk = 64;  // keys per online-softmax step (a multiple of 16)

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
// q: the rows scaled, fp32 (in the keys' lane order: split for bf16); q_rows: the same rows as they
// lie in the query tensor (TQ), unscaled, for the bf16 dot-product instructions. Keys of an int8
// cache give the dot products with their codes (the caller scales them).
template <typename T, typename TQ, int64_t kD>
inline void score_chunk(const float* q, const TQ* const* q_rows, float scale, int64_t rows, const int64_t* visible,
                        const T* const* keys, int64_t D, float* scores) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = visible[r];
    float* out = scores + r * kChunk;
    if constexpr (std::is_same_v<T, bf16> && std::is_same_v<TQ, bf16> && vectorized(kD) && kBf16DotProducts) {
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

// One online-softmax step of a row whose chunk of n keys shows it keys [first, visible)
// (0 <= visible <= n; keys before `first` lie outside a sliding window): updates max and
// sum, turns the scores into weights, zero outside [first, visible) up to n's next multiple
// of 16, and returns the old accumulator's rescale.
inline float softmax_step(float* scores, int64_t first, int64_t visible, int64_t n, float& max, float& sum) {
  const int64_t padded = (visible + 15) / 16 * 16, chunk = (n + 15) / 16 * 16;
  std::fill(scores + padded, scores + chunk, 0.0f);
  if (visible <= first) {
    std::fill(scores, scores + padded, 0.0f);
    return 1.0f;
  }
  std::fill(scores, scores + first, -std::numeric_limits<float>::infinity());
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

#if defined(__AVX512BF16__)
// ---- weighted values with vdpbf16ps: two keys per instruction -----------------------------
// Two V rows interleaved element by element (unpacklo/hi) hold, per 32-bit lane, one dim of two
// keys; their two weights, rounded to bf16 as the Hugging Face modules round probabilities
// before multiplying by V, form one 32-bit lane broadcast to all. vdpbf16ps then adds both
// products into the fp32 accumulator: half the instructions of widening V and one FMA per key.
// The interleave puts dims in "pair" lane order (per 128-bit lane j: dims 8j..8j+3, then
// 8j+4..8j+7 in the second vector); the accumulators are kept in split order in memory, so
// they are permuted on the way in and out.
struct PairOrder {  // vpermt2ps indices between split and pair order for one 32-dim block
  int32_t to_pair[2][16], to_split[2][16];
  constexpr PairOrder() : to_pair{}, to_split{} {
    for (int32_t m = 0; m < 32; ++m) {  // m: lane of the pair-order block (second vector: 16..31)
      const int32_t v = m / 16, lane = m % 16, dim = 8 * (lane / 4) + 4 * v + lane % 4;
      to_pair[v][lane] = dim % 2 == 0 ? dim / 2 : 16 + dim / 2;  // split order: even dims, then odd
    }
    for (int32_t m = 0; m < 32; ++m) {  // m: lane of the split-order block
      const int32_t v = m / 16, lane = m % 16, dim = 2 * lane + v, r = dim % 8;
      to_split[v][lane] = (r < 4 ? 0 : 16) + 4 * (dim / 8) + r % 4;
    }
  }
};
inline constexpr PairOrder kPairOrder{};

template <int64_t kD, int64_t R>
inline void accumulate_rows_bf16(float* acc, const float* weights, const float* correction,
                                 const bf16* const* values, int64_t keys) {
  constexpr int64_t V = kD / 16;  // vectors per row, in pairs of 32 dims
  const __m512i to_pair0 = _mm512_loadu_si512(kPairOrder.to_pair[0]);
  const __m512i to_pair1 = _mm512_loadu_si512(kPairOrder.to_pair[1]);
  __m512 a[R][V];
  for (int64_t i = 0; i < R; ++i) {
    const __m512 f = _mm512_set1_ps(correction[i]);
    for (int64_t v = 0; v < V; v += 2) {
      const __m512 s0 = _mm512_loadu_ps(acc + i * kD + 16 * v), s1 = _mm512_loadu_ps(acc + i * kD + 16 * v + 16);
      a[i][v] = _mm512_mul_ps(_mm512_permutex2var_ps(s0, to_pair0, s1), f);
      a[i][v + 1] = _mm512_mul_ps(_mm512_permutex2var_ps(s0, to_pair1, s1), f);
    }
  }
  // each row's weights as bf16 pairs: 32-bit word c / 2 = (w[c], w[c + 1])
  alignas(64) uint32_t pairs[R][kChunk / 2];
  for (int64_t i = 0; i < R; ++i) {
    for (int64_t c = 0; c < keys; c += 32) {
      const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(weights + i * kChunk + c + 16),
                                             _mm512_loadu_ps(weights + i * kChunk + c));
      _mm512_store_si512(pairs[i] + c / 2, (__m512i)w);
    }
  }
  for (int64_t c = 0; c < keys; c += 2) {
    const bf16* v0 = values[c];
    const bf16* v1 = c + 1 < keys ? values[c + 1] : v0;  // its weight is zero
    __m512i x[V];
    for (int64_t u = 0; u < V / 2; ++u) {
      const __m512i r0 = _mm512_loadu_si512(v0 + 32 * u), r1 = _mm512_loadu_si512(v1 + 32 * u);
      x[2 * u] = _mm512_unpacklo_epi16(r0, r1);
      x[2 * u + 1] = _mm512_unpackhi_epi16(r0, r1);
    }
    for (int64_t i = 0; i < R; ++i) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(int32_t(pairs[i][c / 2]));
      for (int64_t v = 0; v < V; ++v) a[i][v] = _mm512_dpbf16_ps(a[i][v], (__m512bh)x[v], w);
    }
  }
  const __m512i to_split0 = _mm512_loadu_si512(kPairOrder.to_split[0]);
  const __m512i to_split1 = _mm512_loadu_si512(kPairOrder.to_split[1]);
  for (int64_t i = 0; i < R; ++i) {
    for (int64_t v = 0; v < V; v += 2) {
      _mm512_storeu_ps(acc + i * kD + 16 * v, _mm512_permutex2var_ps(a[i][v], to_split0, a[i][v + 1]));
      _mm512_storeu_ps(acc + i * kD + 16 * v + 16, _mm512_permutex2var_ps(a[i][v], to_split1, a[i][v + 1]));
    }
  }
}
#endif

// acc[r] = acc[r] * correction[r] + sum_c weights[r][c] v_c for R rows at once, accumulators
// in registers: each V row is widened once for the R rows, and R x V independent chains
template <typename T, int64_t kD, int64_t R>
inline void accumulate_rows(float* acc, const float* weights, const float* correction, const T* const* values,
                            int64_t keys) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) {
    accumulate_rows_bf16<kD, R>(acc, weights, correction, values, keys);
    return;
  }
#endif
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

}  // namespace tandem
