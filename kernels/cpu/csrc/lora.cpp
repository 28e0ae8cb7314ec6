// LoRA's shrink and expand for a batch whose rows each read their own adapter's slot (BGMV, as
// Punica's and vLLM's decode kernels do it): y[t] += (x[t] A_s^T) B_s for s = row_slots[t] >= 0;
// base-model rows (slot -1) are untouched.
//
// A [S, R, in] and B [S, R, out] are fp32 (the CPU keeps the slots in fp32: docs/lora.md); x and y
// are fp32 or bf16. A row's R shrunk values are fp32 dot products; the expand adds them times B's
// rows to y's row in fp32 and rounds once. Up to four consecutive rows of one adapter go through
// together, so each vector of A and B loaded serves all of them (the products are bound by loads,
// not arithmetic, one row at a time). Ranks an adapter leaves empty (a piece it does not train, a
// rank below the slot's) shrink to exactly 0 and are skipped in the expand. A fused module's slot
// (qkv: q, k and v side by side) may say which outputs each block of ranks reaches (`pieces`), and
// each block's expand then covers those outputs only.
//
// decode_layer.cpp calls it after each linear of a decoder layer, so a decode step with adapter
// rows stays one op per layer; registered alone it is kernels/cpu/lora.py's "cpp" kernel.

#include "cpu_common.h"
#include "ops.h"

#include <type_traits>
#include <vector>

namespace tandem {
namespace {

constexpr int64_t kTileRows = 4;  // rows of one adapter per pass: each A and B vector loaded once for them

// shrunk[j * rank + r] = x_j . a[r] for the tile's N rows (fp32, [N, in]) and r < rank, two ranks a pass
template <int N>
void shrink_tile(float* shrunk, const float* x, const float* a, int64_t rank, int64_t in) {
  int64_t r = 0;
  for (; r + 2 <= rank; r += 2) {
    const float* a0 = a + r * in;
    const float* a1 = a0 + in;
    f32x16 acc0[N] = {}, acc1[N] = {};
    float tail0[N] = {}, tail1[N] = {};
    for_lanes(in, [&](auto lanes, int64_t i) {
      using V = decltype(lanes);
      const V w0 = load<V>(a0 + i), w1 = load<V>(a1 + i);
      for (int j = 0; j < N; ++j) {
        const V xv = load<V>(x + j * in + i);
        if constexpr (is_vector<V>) {
          acc0[j] += xv * w0;
          acc1[j] += xv * w1;
        } else {
          tail0[j] += xv * w0;
          tail1[j] += xv * w1;
        }
      }
    });
    for (int j = 0; j < N; ++j) {
      shrunk[j * rank + r] = reduce_add(acc0[j]) + tail0[j];
      shrunk[j * rank + r + 1] = reduce_add(acc1[j]) + tail1[j];
    }
  }
  for (; r < rank; ++r) {
    f32x16 acc[N] = {};
    float tail[N] = {};
    for_lanes(in, [&](auto lanes, int64_t i) {
      using V = decltype(lanes);
      const V w = load<V>(a + r * in + i);
      for (int j = 0; j < N; ++j) {
        if constexpr (is_vector<V>) acc[j] += load<V>(x + j * in + i) * w;
        else tail[j] += load<V>(x + j * in + i) * w;
      }
    });
    for (int j = 0; j < N; ++j) shrunk[j * rank + r] = reduce_add(acc[j]) + tail[j];
  }
}

// y_j[begin:end] += sum over the used ranks of shrunk[j, r] * b[r, begin:end] for the tile's N rows, 32
// outputs at a time in registers (b's rows are `out` long)
template <int N, typename T>
void expand_tile(T* y, int64_t y_stride, const float* shrunk, int64_t rank, const int64_t* used, int64_t num_used,
                 const float* b, int64_t out, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + 32 <= end; i += 32) {
    f32x16 acc0[N], acc1[N];
    for (int j = 0; j < N; ++j) {
      acc0[j] = load<f32x16>(y + j * y_stride + i);
      acc1[j] = load<f32x16>(y + j * y_stride + i + 16);
    }
    for (int64_t u = 0; u < num_used; ++u) {
      const float* row = b + used[u] * out + i;
      const f32x16 b0 = load<f32x16>(row), b1 = load<f32x16>(row + 16);
      for (int j = 0; j < N; ++j) {
        const float s = shrunk[j * rank + used[u]];
        acc0[j] += s * b0;
        acc1[j] += s * b1;
      }
    }
    for (int j = 0; j < N; ++j) {
      store(y + j * y_stride + i, acc0[j]);
      store(y + j * y_stride + i + 16, acc1[j]);
    }
  }
  for (; i < end; ++i) {
    for (int j = 0; j < N; ++j) {
      float acc = load<float>(y + j * y_stride + i);
      for (int64_t u = 0; u < num_used; ++u) acc += shrunk[j * rank + used[u]] * b[used[u] * out + i];
      store(y + j * y_stride + i, acc);
    }
  }
}

// one tile: N consecutive rows of one slot. `pieces` (num_pieces > 0): the slot's blocks of rank
// rows, each as the (begin, end) of the outputs its B rows reach (the q, k and v of a fused qkv); else
// every rank reaches every output.
template <int N, typename T>
void add_tile(T* y, int64_t y_stride, const T* x, int64_t x_stride, const float* a, const float* b, int64_t rank,
              int64_t in, int64_t out, const int64_t* pieces, int64_t num_pieces, float* x_rows, float* shrunk,
              int64_t* used) {
  for (int j = 0; j < N; ++j) {
    const T* xr = x + j * x_stride;
    for_lanes(in, [&](auto lanes, int64_t i) { store(x_rows + j * in + i, load<decltype(lanes)>(xr + i)); });
  }
  shrink_tile<N>(shrunk, x_rows, a, rank, in);
  int64_t num_used = 0;  // ranks some row of the tile uses (an empty rank shrinks to 0 for every row)
  for (int64_t r = 0; r < rank; ++r) {
    bool nonzero = false;
    for (int j = 0; j < N; ++j) nonzero |= shrunk[j * rank + r] != 0.0f;
    if (nonzero) used[num_used++] = r;
  }
  if (num_used == 0) return;
  if (num_pieces == 0) return expand_tile<N>(y, y_stride, shrunk, rank, used, num_used, b, out, 0, out);
  const int64_t block = rank / num_pieces;
  int64_t u = 0;
  for (int64_t p = 0; p < num_pieces; ++p) {  // used[] is ascending: each block's ranks are a run of it
    const int64_t first = u;
    while (u < num_used && used[u] < (p + 1) * block) ++u;
    const int64_t begin = pieces[2 * p], end = pieces[2 * p + 1];
    if (u > first && end > begin) expand_tile<N>(y, y_stride, shrunk, rank, used + first, u - first, b, out, begin, end);
  }
}

}  // namespace

void lora_add(Tensor y, Tensor x, Tensor a, Tensor b, Tensor row_slots, Tensor pieces) {
  check_rows(x, 2, "x");
  check_rows(y, 2, "y");
  check_cpu_dtype(y, x.scalar_type(), "y");
  check_cpu_dtype(a, ScalarType::Float, "lora A");
  check_cpu_dtype(b, ScalarType::Float, "lora B");
  check_cpu_dtype(row_slots, ScalarType::Long, "row_slots");
  TANDEM_CHECK(a.is_contiguous() && b.is_contiguous() && row_slots.is_contiguous(),
               "lora A, B and row_slots must be contiguous");
  const int64_t rows = x.size(0), in = x.size(1), out = y.size(1);
  const int64_t slots = a.size(0), rank = a.size(1);
  TANDEM_CHECK(a.dim() == 3 && a.size(2) == in, "lora A must be [S, R, in]");
  TANDEM_CHECK(b.dim() == 3 && b.size(0) == slots && b.size(1) == rank && b.size(2) == out,
               "lora B must be [S, R, out]");
  TANDEM_CHECK(y.size(0) == rows && row_slots.numel() == rows, "y and row_slots need a row per row of x");
  const int64_t num_pieces = pieces.numel() == 0 ? 0 : pieces.size(1);
  if (num_pieces > 0) {
    check_cpu_dtype(pieces, ScalarType::Long, "pieces");
    TANDEM_CHECK(pieces.is_contiguous() && pieces.dim() == 3 && pieces.size(0) == slots && pieces.size(2) == 2 &&
                     rank % num_pieces == 0,
                 "pieces must be [S, P, 2] (the outputs of each block of R / P ranks)");
  }
  const int64_t* piece_data = num_pieces > 0 ? ptr<int64_t>(pieces) : nullptr;
  const int64_t* slot_of = ptr<int64_t>(row_slots);
  const float* a_data = ptr<float>(a);
  const float* b_data = ptr<float>(b);
  for (int64_t t = 0; t < rows; ++t) {  // here, not in the parallel loop: a throw there ends the process
    TANDEM_CHECK(slot_of[t] < slots, "row ", t, " reads slot ", slot_of[t], " of ", slots);
  }
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0);
  // tiles: runs of up to kTileRows consecutive rows of one slot (the runner orders rows by adapter)
  std::vector<int64_t> tiles;  // first row of each tile, then the end
  for (int64_t t = 0; t < rows;) {
    if (slot_of[t] < 0) {
      ++t;
      continue;
    }
    int64_t end = t + 1;
    while (end < rows && end - t < kTileRows && slot_of[end] == slot_of[t]) ++end;
    tiles.push_back(t);
    tiles.push_back(end);
    t = end;
  }
  const int64_t num_tiles = int64_t(tiles.size()) / 2;
  dispatch_float_bf16(x, [&](auto tag) {
    using T = decltype(tag);
    const T* xs = ptr<T>(x);
    T* ys = ptr<T>(y);
    // a tile's work is rows x R (in + out) multiply-adds: one tile per task already fills a core
    torch::stable::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> x_rows(kTileRows * in), shrunk(kTileRows * rank);
      std::vector<int64_t> used(rank);
      for (int64_t tile = begin; tile < end; ++tile) {
        const int64_t first = tiles[2 * tile], n = tiles[2 * tile + 1] - first, s = slot_of[first];
        const float* a_s = a_data + s * rank * in;
        const float* b_s = b_data + s * rank * out;
        T* yt = ys + first * y_stride;
        const T* xt = xs + first * x_stride;
        auto run = [&](auto rows_tag) {
          constexpr int N = decltype(rows_tag)::value;
          add_tile<N>(yt, y_stride, xt, x_stride, a_s, b_s, rank, in, out,
                      num_pieces > 0 ? piece_data + s * num_pieces * 2 : nullptr, num_pieces, x_rows.data(),
                      shrunk.data(), used.data());
        };
        switch (n) {
          case 1: run(std::integral_constant<int, 1>{}); break;
          case 2: run(std::integral_constant<int, 2>{}); break;
          case 3: run(std::integral_constant<int, 3>{}); break;
          default: run(std::integral_constant<int, 4>{}); break;
        }
      }
    });
  });
}

}  // namespace tandem

STABLE_TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor row_slots, Tensor pieces) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("lora_add", TORCH_BOX(&tandem::lora_add));
}
