// The two passes around W8A8's int8 GEMM (kernels/cpu/int8_linear.py), each one pass over the rows:
//
//   quantize_rows_int8: x [M, K] (fp32 / bf16) -> q [M, K] int8 and scales [M] fp32,
//       scale = max(absmax(row) / 127, 1e-12), q = round_half_even(x / scale)
//   scale_int32_rows:   out [M, N] = acc [M, N] int32 * (row_scales[M] * col_scales[N]) (+ bias[N]),
//       rounded once to out's dtype
//
// In torch these are ten ops and as many temporaries; at decode batch sizes they cost more than
// torch._int_mm itself (docs/cpu-kernels.md#w8a8-around-torch_int_mm). The arithmetic is the torch path's, in the same order: the same
// bits, except that a bias add may fuse into the rescale's multiply (-ffp-contract=fast).

#include "int8_quantize.h"

namespace tandem {
namespace {

// q[M, K] int8, scales[M] fp32 from x[M, K] fp32 / bf16
void quantize_rows_int8(Tensor q, Tensor scales, Tensor x) {
  check_rows(x, 2, "x");
  check_cpu_dtype(q, ScalarType::Char, "q");
  check_cpu_dtype(scales, ScalarType::Float, "scales");
  const int64_t rows = x.size(0), n = x.size(1), x_stride = x.stride(0);
  TANDEM_CHECK(q.is_contiguous() && q.dim() == 2 && q.size(0) == rows && q.size(1) == n, "q must be [M, K], contiguous");
  TANDEM_CHECK(scales.is_contiguous() && scales.numel() == rows, "scales must be [M], contiguous");
  dispatch_float_bf16(x, [&](auto tag) {
    using T = decltype(tag);
    const T* src = ptr<T>(x);
    int8_t* dst = ptr<int8_t>(q);
    float* s = ptr<float>(scales);
    torch::stable::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) quantize_row(dst + r * n, s + r, src + r * x_stride, n);
    });
  });
}

// out[M, N] = acc[M, N] * (row_scales[M] * col_scales[N]) (+ bias[N] when bias has N elements)
void scale_int32_rows(Tensor out, Tensor acc, Tensor row_scales, Tensor col_scales, Tensor bias) {
  check_rows(out, 2, "out");
  check_rows(acc, 2, "acc");
  check_cpu_dtype(acc, ScalarType::Int, "acc");
  check_cpu_dtype(row_scales, ScalarType::Float, "row_scales");
  check_cpu_dtype(col_scales, ScalarType::Float, "col_scales");
  const int64_t rows = acc.size(0), n = acc.size(1);
  TANDEM_CHECK(out.size(0) == rows && out.size(1) == n, "out must be shaped as acc");
  TANDEM_CHECK(row_scales.is_contiguous() && row_scales.numel() == rows, "row_scales must be [M], contiguous");
  TANDEM_CHECK(col_scales.is_contiguous() && col_scales.numel() == n, "col_scales must be [N], contiguous");
  const bool has_bias = bias.numel() > 0;
  if (has_bias) {
    check_cpu_dtype(bias, ScalarType::Float, "bias");
    TANDEM_CHECK(bias.is_contiguous() && bias.numel() == n, "bias must be [N] fp32, contiguous, or empty");
  }
  const int32_t* a = ptr<int32_t>(acc);
  const float* rs = ptr<float>(row_scales);
  const float* cs = ptr<float>(col_scales);
  const float* b = has_bias ? ptr<float>(bias) : nullptr;
  const int64_t acc_stride = acc.stride(0), out_stride = out.stride(0);
  dispatch_float_bf16(out, [&](auto tag) {
    using T = decltype(tag);
    T* dst = ptr<T>(out);
    torch::stable::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int32_t* src = a + r * acc_stride;
        T* row = dst + r * out_stride;
        const float s = rs[r];
        for_lanes(n, [&](auto lanes, int64_t i) {
          using V = decltype(lanes);
          V value;
          if constexpr (is_vector<V>) {
            i32x16 v;
            std::memcpy(&v, src + i, sizeof v);
            value = __builtin_convertvector(v, f32x16);
          } else {
            value = float(src[i]);
          }
          V y = value * (s * load<V>(cs + i));
          if (has_bias) y = y + load<V>(b + i);
          store(row + i, y);
        });
      }
    });
  });
}

}  // namespace
}  // namespace tandem

STABLE_TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("quantize_rows_int8(Tensor(a!) q, Tensor(b!) scales, Tensor x) -> ()");
  m.def("scale_int32_rows(Tensor(a!) out, Tensor acc, Tensor row_scales, Tensor col_scales, Tensor bias) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("quantize_rows_int8", TORCH_BOX(&tandem::quantize_rows_int8));
  m.impl("scale_int32_rows", TORCH_BOX(&tandem::scale_int32_rows));
}
