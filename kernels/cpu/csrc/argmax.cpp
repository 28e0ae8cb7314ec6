// Greedy sampling's argmax over each row of fp32 logits, on 16-lane vectors.
//
// torch.argmax walks a vocabulary row element by element (docs/cpu-kernels.md#the-kernels);
// this is a plain vectorized scan, memory bound. Same answer as torch.argmax: the first
// index of the maximum, a NaN counting as the maximum.

#include "cpu_common.h"

namespace tandem {
namespace {

constexpr int64_t kParallelElems = 1 << 16;  // rows per thread: at least this many logits

inline bool beats(float v, int64_t i, float best, int64_t best_index) {
  if (v != v) return best == best || i < best_index;  // NaN wins, the first NaN first
  return v > best || (v == best && i < best_index);
}

int64_t argmax_row(const float* row, int64_t n) {
  f32x16 best = load<f32x16>(row);  // callers guarantee n >= 16
  i32x16 index = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, at = index;
  int64_t i = 16;
  for (; i + 16 <= n; i += 16) {
    at += 16;
    const f32x16 v = load<f32x16>(row + i);
    const auto take = (v > best) | ((v != v) & (best == best));  // strictly better: earlier lanes keep ties
    best = take ? v : best;
    index = take ? at : index;
  }
  float top = best[0];
  int64_t top_index = index[0];
  for (int lane = 1; lane < 16; ++lane) {
    if (beats(best[lane], index[lane], top, top_index)) top = best[lane], top_index = index[lane];
  }
  for (; i < n; ++i) {
    if (beats(row[i], i, top, top_index)) top = row[i], top_index = i;
  }
  return top_index;
}

// out[N] (int64) = argmax of each row of logits[N, V] (fp32, V >= 16)
void argmax_rows(Tensor out, Tensor logits) {
  check_rows(logits, 2, "logits");
  check_cpu_dtype(logits, ScalarType::Float, "logits");
  check_cpu_dtype(out, ScalarType::Long, "out");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  TANDEM_CHECK(n >= 16 && out.numel() == rows && out.is_contiguous(), "argmax_rows wants [N, V >= 16] -> [N]");
  const float* src = ptr<float>(logits);
  int64_t* dst = ptr<int64_t>(out);
  torch::stable::parallel_for(0, rows, std::max<int64_t>(1, kParallelElems / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dst[r] = argmax_row(src + r * stride, n);
  });
}

}  // namespace
}  // namespace tandem

STABLE_TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("argmax_rows(Tensor(a!) out, Tensor logits) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("argmax_rows", TORCH_BOX(&tandem::argmax_rows));
}
