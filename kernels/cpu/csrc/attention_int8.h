// An int8 KV cache (--kv-cache-dtype int8): each (block, kv head) slab holds the block's codes in vpdpbusd's
// order, then one fp16 scale per token (kernels/kv_cache_layout.py): keys as [head_dim / 4][block_size][4],
// values as [block_size / 4][head_dim][4]; value = code * scale, of the token's row rotated by a Hadamard
// transform (H x). Attention rotates each query row the same way (H q / n: the scores do not change) and
// its output rows back (H acc / n).
//
// With AVX-512 VNNI the codes never become floats. vpdpbusd multiplies unsigned by signed bytes, four per
// 32-bit lane: the codes are made unsigned (code + 128, one xor per vector) and meet signed bytes:
//   scores  Each query row is rounded to 16-bit integers with one scale per row (q ~ q16 * scale, max |q16|
//           32639: finer than the bf16 query itself) and split into two signed bytes, q16 = 256 hi + lo. One
//           key vector is dims 4j..4j+3 of 16 tokens, so a broadcast of the row's four hi (lo) bytes gives 16
//           tokens' partial sums at once, lanes in token order: head_dim / 2 instructions per 16 scores, no
//           horizontal sums. score = (256 sum_hi + sum_lo - 128 sum q16) * q's scale * the token's scale.
//   values  Each row's weights of a chunk (probabilities times the tokens' value scales) are rounded the
//           same way (one scale per row and chunk) and split into bytes; a value vector is 16 dims of 4
//           tokens, so a broadcast of the row's four weights' hi (lo) bytes adds 4 tokens into 16 dims.
//           acc = acc * correction + (256 sum_hi + sum_lo - 128 sum w16) * the weights' scale.
// Every sum is exact in int32: at most 128 * 255 * 127 * 256 (head_dim <= 128) for a score, 64 * 255 * 127 *
// 256 for a chunk of values. Per token that is fewer instructions than the bf16 path's, on half its bytes.
//
// Elsewhere (no VNNI, or a head_dim the vector path does not take) each chunk's codes are dequantized into
// fp32 rows and the float path runs on them (attention_tile.h), exactly as the reference computes.
#pragma once

#include "attention_chunk.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace tandem {

constexpr int64_t kKvScaleBytes = 2;  // kernels/kv_cache_layout.py's SCALE_BYTES: fp16 scales after the codes
constexpr int64_t kKeyGroup = 16;     // tokens per key vector: an int8 cache's block_size is a multiple of it
constexpr float kInt8CodeMax = 127.0f;
constexpr float kInt16Max = 32639.0f;  // 127 * 256 + 127: q16 = 256 hi + lo with hi, lo signed bytes
constexpr int64_t kMaxHeadDim = 512;  // an int8 cache's largest head_dim

// where token t's code of dim d lies in a slab (kernels.kv_cache_layout.slab_offsets)
inline int64_t key_code_offset(int64_t t, int64_t d, int64_t block_size) { return (d / 4 * block_size + t) * 4 + d % 4; }
inline int64_t value_code_offset(int64_t t, int64_t d, int64_t head_dim) { return (t / 4 * head_dim + d) * 4 + t % 4; }

inline float slab_scale(const int8_t* slab, int64_t t, int64_t block_size, int64_t head_dim) {
  _Float16 scale;
  std::memcpy(&scale, slab + block_size * head_dim + kKvScaleBytes * t, sizeof scale);
  return float(scale);
}

// ---- the rotation (kernels/kv_cache_layout.py): Sylvester's Hadamard matrix on each of head_dim's powers of
// two, largest first; +-1 entries, so the butterflies below are its product exactly (in double: exact sums)
template <typename V>
inline void hadamard(V* x, int64_t head_dim) {
  for (int64_t start = 0, rest = head_dim; rest > 0;) {
    int64_t n = 1;
    while (n * 2 <= rest) n *= 2;
    for (int64_t h = 1; h < n; h *= 2) {
      for (int64_t i = start; i < start + n; i += 2 * h) {
        for (int64_t j = i; j < i + h; ++j) {
          const V a = x[j], b = x[j + h];
          x[j] = a + b;
          x[j + h] = a - b;
        }
      }
    }
    start += n;
    rest -= n;
  }
}

// The same butterflies on whole vectors for a head_dim of 16 * V (a power of two): within a vector lane j meets
// lane j ^ h by one shuffle and one multiply-add, across vectors v meets v + h / 16 by an add and a subtract
template <int64_t V>
inline void hadamard_vectors(f32x16 (&x)[V]) {
  const f32x16 sign1 = {1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1};
  const f32x16 sign2 = {1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1};
  const f32x16 sign4 = {1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1};
  const f32x16 sign8 = {1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1};
  for (int64_t v = 0; v < V; ++v) {
    f32x16 y = x[v];
    y = y * sign1 + __builtin_shufflevector(y, y, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    y = y * sign2 + __builtin_shufflevector(y, y, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    y = y * sign4 + __builtin_shufflevector(y, y, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    y = y * sign8 + __builtin_shufflevector(y, y, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x[v] = y;
  }
  for (int64_t h = 1; h < V; h *= 2) {
    for (int64_t i = 0; i < V; i += 2 * h) {
      for (int64_t j = i; j < i + h; ++j) {
        const f32x16 a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
}

// x <- H x / n on each block: a rotated query meets rotated keys as the query meets the keys; a sum of rotated
// values comes back to the values' space (H H = n I)
template <int64_t kD>
inline void rotate_scaled(float* x, int64_t head_dim) {
  if constexpr (kD == 64 || kD == 128) {  // one block, on vectors
    constexpr int64_t V = kD / 16;
    f32x16 v[V];
    for (int64_t i = 0; i < V; ++i) v[i] = load<f32x16>(x + 16 * i);
    hadamard_vectors<V>(v);
    for (int64_t i = 0; i < V; ++i) store(x + 16 * i, v[i] * (1.0f / float(kD)));
    return;
  }
  hadamard(x, head_dim);
  for (int64_t start = 0, rest = head_dim; rest > 0;) {
    int64_t n = 1;
    while (n * 2 <= rest) n *= 2;
    for (int64_t d = start; d < start + n; ++d) x[d] /= float(n);
    start += n;
    rest -= n;
  }
}

// One token's head_dim values into its codes and scale in a key (kKey) or value slab, as
// kernels.reference.quantize_kv_rows does: x <- H x (in double, rounded once to fp32), then scale = max |x| /
// 127 rounded to fp16 (held below fp16's largest), code = x / scale in fp32 rounded half to even.
template <bool kKey, typename T>
inline void quantize_kv_token(const T* x, int64_t head_dim, int8_t* slab, int64_t t, int64_t block_size) {
  double rotated[kMaxHeadDim];
  for (int64_t d = 0; d < head_dim; ++d) rotated[d] = double(load<float>(x + d));
  hadamard(rotated, head_dim);
  float y[kMaxHeadDim], absmax = 0.0f;
  for (int64_t d = 0; d < head_dim; ++d) {
    y[d] = float(rotated[d]);
    absmax = std::max(absmax, std::fabs(y[d]));
  }
  const _Float16 scale = _Float16(std::min(absmax / kInt8CodeMax, 65504.0f));
  const float divisor = float(scale) > 0.0f ? float(scale) : 1.0f;
  for (int64_t d = 0; d < head_dim; ++d) {
    const float code = std::clamp(std::nearbyint(y[d] / divisor), -kInt8CodeMax, kInt8CodeMax);
    slab[kKey ? key_code_offset(t, d, block_size) : value_code_offset(t, d, head_dim)] = int8_t(code);
  }
  std::memcpy(slab + block_size * head_dim + kKvScaleBytes * t, &scale, sizeof scale);
}

// the portable path: `count` tokens from `t` of a slab into fp32 rows (row i at rows + i * head_dim)
template <bool kKey>
inline void dequantize_tokens(const int8_t* slab, int64_t t, int64_t count, int64_t block_size, int64_t head_dim,
                              float* rows) {
  for (int64_t i = 0; i < count; ++i) {
    const float scale = slab_scale(slab, t + i, block_size, head_dim);
    for (int64_t d = 0; d < head_dim; ++d) {
      const int64_t at = kKey ? key_code_offset(t + i, d, block_size) : value_code_offset(t + i, d, head_dim);
      rows[i * head_dim + d] = float(slab[at]) * scale;
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kInt8DotProducts = true;

// acc += 4 u8 x s8 products per int32 lane; inline assembly as in packed_tiles.h: with the intrinsic GCC 12
// copies every sum through another register (or the stack) on each step (docs/kv-cache-dtype.md#the-c-kernel)
inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}
// the same with four signed bytes from memory broadcast to every lane
inline __m512i dpbusd(__m512i acc, __m512i u8, const int8_t* s8x4) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u8), "m"(*reinterpret_cast<const int32_t*>(s8x4)));
  return acc;
}

// the head_dims the integer path takes: whole 16-dim value vectors, sums within int32 (see above)
constexpr bool int8_dot_products(int64_t kD) { return kD == 64 || kD == 128; }

// 16 tokens' fp16 scales from `t` of a slab
inline __m512 group_scales(const int8_t* slab, int64_t t, int64_t block_size, int64_t head_dim) {
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(slab + block_size * head_dim +
                                                                              kKvScaleBytes * t));
  return _mm512_cvtph_ps(halves);
}

// a vector of codes made unsigned: code + 128
inline __m512i load_biased(const int8_t* codes) {
  return _mm512_xor_si512(_mm512_loadu_si512(codes), _mm512_set1_epi8(char(0x80)));
}

// Rows of fp32 values (n of each, a multiple of 16, from x + r * x_stride) -> 16-bit integers with one scale
// per row, split into signed bytes: hi and lo at out_stride bytes a row, word k of a row = elements 4k..4k+3;
// `bias` = 128 * sum q16 per row (what vpdpbusd's unsigned codes add), `scales` the rows' scales.
inline void split_rows_int16(const float* x, int64_t rows, int64_t n, int64_t x_stride, int64_t out_stride,
                             int8_t* hi, int8_t* lo, int32_t* bias, float* scales) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * x_stride;
    __m512 top = _mm512_setzero_ps();
    for (int64_t c = 0; c < n; c += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(row + c)));
    const float largest = _mm512_reduce_max_ps(top);
    scales[r] = largest / kInt16Max;
    const __m512 inv = _mm512_set1_ps(largest > 0.0f ? kInt16Max / largest : 0.0f);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t c = 0; c < n; c += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + c), inv));  // half to even
      const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(128)), 8);
      const __m512i l = _mm512_sub_epi32(q, _mm512_slli_epi32(h, 8));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + r * out_stride + c), _mm512_cvtepi32_epi8(h));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + r * out_stride + c), _mm512_cvtepi32_epi8(l));
      sum = _mm512_add_epi32(sum, q);
    }
    bias[r] = 128 * _mm512_reduce_add_epi32(sum);
  }
}

inline int32_t word(const int8_t* bytes, int64_t k) {
  int32_t w;
  std::memcpy(&w, bytes + 4 * k, sizeof w);
  return w;
}

struct Int8Rows {  // a tile's rows split into bytes (split_rows_int16), and per chunk their weights
  const int8_t *q_hi, *q_lo;
  const int32_t* q_bias;
  const float* q_scales;
  int8_t *w_hi, *w_lo;
  int32_t* w_bias;
  float* w_scales;
};

// scores[r][g..g+16) of each row that sees past g, for the 16 tokens from `t` of a key slab: the rows' q16
// against the codes, times q's and the tokens' scales (`scales`: the 16 tokens'). sums: per row 32 int32 of
// scratch, where a head_dim of 128 keeps its first half's sums.
template <int64_t kD>
inline void score_group_int8(const int8_t* slab, int64_t t, int64_t block_size, const Int8Rows& q, int64_t rows,
                             const int64_t* visible, int64_t g, __m512 scales, float* scores, int32_t* sums) {
  constexpr int64_t kQuads = kD / 4, kHeld = 16;  // key vectors held in registers at once
  for (int64_t h0 = 0; h0 < kQuads; h0 += kHeld) {
    __m512i k[kHeld];
    for (int64_t j = 0; j < kHeld; ++j) k[j] = load_biased(slab + ((h0 + j) * block_size + t) * 4);
    for (int64_t r = 0; r < rows; ++r) {
      if (visible[r] <= g) continue;
      __m512i hi = h0 ? _mm512_loadu_si512(sums + 32 * r) : _mm512_setzero_si512();
      __m512i lo = h0 ? _mm512_loadu_si512(sums + 32 * r + 16) : _mm512_setzero_si512();
      const int8_t* qh = q.q_hi + r * kD + 4 * h0;
      const int8_t* ql = q.q_lo + r * kD + 4 * h0;
      for (int64_t j = 0; j < kHeld; ++j) {
        hi = dpbusd(hi, k[j], qh + 4 * j);
        lo = dpbusd(lo, k[j], ql + 4 * j);
      }
      if (h0 + kHeld < kQuads) {
        _mm512_storeu_si512(sums + 32 * r, hi);
        _mm512_storeu_si512(sums + 32 * r + 16, lo);
        continue;
      }
      const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo), _mm512_set1_epi32(q.q_bias[r]));
      _mm512_storeu_ps(scores + r * kChunk + g,
                       _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(q.q_scales[r])), scales));
    }
  }
}

// acc[r] = acc[r] * correction[r] + sum of the row's weights times the chunk's values, for R rows from r0:
// `value_quads[k]`: where the chunk's k-th 4 tokens lie (a value slab's [head_dim][4] run); weights as bytes
template <int64_t kD, int64_t R>
inline void accumulate_rows_int8(float* acc, const Int8Rows& w, int64_t r0, const float* correction,
                                 const int8_t* const* value_quads, int64_t quads) {
  constexpr int64_t V = kD / 16;
  __m512i a[R][2 * V];  // per row: the hi bytes' sums of its V vectors, then the lo bytes'
  for (int64_t i = 0; i < R; ++i) {
    for (int64_t v = 0; v < 2 * V; ++v) a[i][v] = _mm512_setzero_si512();
  }
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  const int8_t* hi_bytes[R];
  const int8_t* lo_bytes[R];
  for (int64_t i = 0; i < R; ++i) {
    hi_bytes[i] = w.w_hi + (r0 + i) * kChunk;
    lo_bytes[i] = w.w_lo + (r0 + i) * kChunk;
  }
  for (int64_t k = 0; k < quads; ++k) {
    __m512i x[V];
    for (int64_t v = 0; v < V; ++v) x[v] = _mm512_xor_si512(_mm512_loadu_si512(value_quads[k] + 64 * v), flip);
    for (int64_t i = 0; i < R; ++i) {
      const __m512i h = _mm512_set1_epi32(word(hi_bytes[i], k)), l = _mm512_set1_epi32(word(lo_bytes[i], k));
      for (int64_t v = 0; v < V; ++v) {
        a[i][v] = dpbusd(a[i][v], x[v], h);
        a[i][V + v] = dpbusd(a[i][V + v], x[v], l);
      }
    }
  }
  for (int64_t i = 0; i < R; ++i) {
    const __m512 f = _mm512_set1_ps(correction[r0 + i]), s = _mm512_set1_ps(w.w_scales[r0 + i]);
    const __m512i bias = _mm512_set1_epi32(w.w_bias[r0 + i]);
    for (int64_t v = 0; v < V; ++v) {
      const __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(a[i][v], 8), a[i][V + v]), bias);
      float* dst = acc + (r0 + i) * kD + 16 * v;
      _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), s, _mm512_mul_ps(_mm512_loadu_ps(dst), f)));
    }
  }
}

// every row's acc += its weights (already split into bytes) times the chunk's values
template <int64_t kD>
inline void accumulate_chunk_int8(float* acc, const Int8Rows& w, int64_t rows, const int64_t* visible,
                                  const float* correction, const int8_t* const* value_quads) {
  constexpr int64_t kMaxRows = kD <= 64 ? 3 : 1;  // 2 x R x V sums and V value vectors within the 32 registers
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
    const int64_t group = std::min(kMaxRows, rows - r0);
    int64_t keys = 0;  // run to the group's widest row
    for (int64_t i = 0; i < group; ++i) keys = std::max(keys, visible[r0 + i]);
    const int64_t quads = (keys + 3) / 4;
    switch (group) {
      case 1: accumulate_rows_int8<kD, 1>(acc, w, r0, correction, value_quads, quads); break;
      case 2: if constexpr (kMaxRows >= 2) accumulate_rows_int8<kD, 2>(acc, w, r0, correction, value_quads, quads); break;
      default: if constexpr (kMaxRows >= 3) accumulate_rows_int8<kD, 3>(acc, w, r0, correction, value_quads, quads); break;
    }
  }
}
#else
constexpr bool kInt8DotProducts = false;
constexpr bool int8_dot_products(int64_t) { return false; }
#endif

}  // namespace tandem
