// The elementwise chain of a Llama layer as single passes over each row, in fp32:
// RMSNorm, residual add + RMSNorm, rotary embedding (in place) and SiLU * mul.
//
// Rounding follows the Hugging Face modules they replace: RMSNorm rounds the normalized row
// to the activation dtype before the weight multiplies it, and a residual sum is rounded
// before it is normalized; everything else rounds once at the end.

#include "cpu_common.h"
#include "ops.h"

#include <algorithm>
#include <vector>

namespace tandem {
namespace {

// out = round(round(h / rms(h)) * weight): h is one fp32 row (already rounded to T)
template <typename T>
void normalize_row(T* out, const float* h, const T* weight, int64_t n, float eps) {
  f32x16 squares = {};
  float tail = 0.0f;
  for_lanes(n, [&](auto lanes, int64_t i) {
    using V = decltype(lanes);
    const V x = load<V>(h + i);
    if constexpr (is_vector<V>) squares += x * x;
    else tail += x * x;
  });
  const float inv = 1.0f / std::sqrt((reduce_add(squares) + tail) / float(n) + eps);
  for_lanes(n, [&](auto lanes, int64_t i) {
    using V = decltype(lanes);
    store(out + i, round_to<T>(load<V>(h + i) * inv) * load<V>(weight + i));  // as x.to(dtype) * weight
  });
}

}  // namespace

// out[N, H] = rms_norm(x[N, H]) * weight
void rms_norm(Tensor out, Tensor x, Tensor weight, double eps) {
  check_rows(x, 2, "x");
  check_rows(out, 2, "out");
  check_cpu_dtype(out, x.scalar_type(), "out");
  check_cpu_dtype(weight, x.scalar_type(), "weight");
  const int64_t rows = x.size(0), n = x.size(1), x_stride = x.stride(0), out_stride = out.stride(0);
  TANDEM_CHECK(weight.numel() == n && out.size(0) == rows && out.size(1) == n, "shapes do not match");
  dispatch_float_bf16(x, [&](auto tag) {
    using T = decltype(tag);
    const T* src = ptr<T>(x);
    const T* w = ptr<T>(weight);
    T* dst = ptr<T>(out);
    torch::stable::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
      std::vector<float> h(n);
      for (int64_t r = begin; r < end; ++r) {
        const T* row = src + r * x_stride;
        for_lanes(n, [&](auto lanes, int64_t i) { store(h.data() + i, load<decltype(lanes)>(row + i)); });
        normalize_row(dst + r * out_stride, h.data(), w, n, float(eps));
      }
    });
  });
}

// residual = x + residual; x = rms_norm(residual) * weight   (both [N, H], in place)
void fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, double eps) {
  check_rows(x, 2, "x");
  check_rows(residual, 2, "residual");
  check_cpu_dtype(residual, x.scalar_type(), "residual");
  check_cpu_dtype(weight, x.scalar_type(), "weight");
  const int64_t rows = x.size(0), n = x.size(1), x_stride = x.stride(0), res_stride = residual.stride(0);
  TANDEM_CHECK(weight.numel() == n && residual.size(0) == rows && residual.size(1) == n, "shapes do not match");
  dispatch_float_bf16(x, [&](auto tag) {
    using T = decltype(tag);
    T* xs = ptr<T>(x);
    T* res = ptr<T>(residual);
    const T* w = ptr<T>(weight);
    torch::stable::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
      std::vector<float> h(n);
      for (int64_t r = begin; r < end; ++r) {
        T* xr = xs + r * x_stride;
        T* rr = res + r * res_stride;
        for_lanes(n, [&](auto lanes, int64_t i) {
          using V = decltype(lanes);
          const V sum = round_to<T>(load<V>(xr + i) + load<V>(rr + i));  // the residual stream, in T
          store(rr + i, sum);
          store(h.data() + i, sum);
        });
        normalize_row(xr, h.data(), w, n, float(eps));
      }
    });
  });
}

// x[T, H, D] (rows may be strided) rotated in place by cos, sin [T, D/2] ("rotate_half" layout)
void rotary_embedding(Tensor x, Tensor cos, Tensor sin) {
  check_rows(x, 3, "x");
  check_rows(cos, 2, "cos");
  check_rows(sin, 2, "sin");
  check_cpu_dtype(cos, x.scalar_type(), "cos");
  check_cpu_dtype(sin, x.scalar_type(), "sin");
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  TANDEM_CHECK(x.size(2) % 2 == 0 && cos.size(0) == tokens && cos.size(1) == half && sin.size(0) == tokens &&
                   sin.size(1) == half,
               "cos / sin must be [T, head_dim / 2]");
  const int64_t st = x.stride(0), sh = x.stride(1), cs = cos.stride(0), ss = sin.stride(0);
  dispatch_float_bf16(x, [&](auto tag) {
    using T = decltype(tag);
    T* base = ptr<T>(x);
    const T* c = ptr<T>(cos);
    const T* s = ptr<T>(sin);
    torch::stable::parallel_for(0, tokens, row_grain(heads * half * 2), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
          T* x1 = base + t * st + h * sh;
          T* x2 = x1 + half;
          for_lanes(half, [&](auto lanes, int64_t i) {
            using V = decltype(lanes);
            const V a = load<V>(x1 + i), b = load<V>(x2 + i);
            const V ci = load<V>(c + t * cs + i), si = load<V>(s + t * ss + i);
            store(x1 + i, a * ci - b * si);
            store(x2 + i, b * ci + a * si);
          });
        }
      }
    });
  });
}

// out[N, I] = silu(x[:, :I]) * x[:, I:]
void silu_and_mul(Tensor out, Tensor x) {
  check_rows(x, 2, "x");
  check_rows(out, 2, "out");
  check_cpu_dtype(out, x.scalar_type(), "out");
  const int64_t rows = x.size(0), n = x.size(1) / 2, x_stride = x.stride(0), out_stride = out.stride(0);
  TANDEM_CHECK(x.size(1) % 2 == 0 && out.size(0) == rows && out.size(1) == n, "out must be [N, x.size(1) / 2]");
  dispatch_float_bf16(x, [&](auto tag) {
    using T = decltype(tag);
    const T* src = ptr<T>(x);
    T* dst = ptr<T>(out);
    torch::stable::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* gate = src + r * x_stride;
        const T* up = gate + n;
        T* o = dst + r * out_stride;
        for_lanes(n, [&](auto lanes, int64_t i) {
          using V = decltype(lanes);
          const V g = load<V>(gate + i);
          const V e = exp_nonpositive(g < 0.0f ? g : -g);  // exp(-|g|): sigmoid without overflow
          const V sigmoid = (g < 0.0f ? e : V{} + 1.0f) / (1.0f + e);
          store(o + i, round_to<T>(g * sigmoid) * load<V>(up + i));  // as F.silu(gate) * up in T
        });
      }
    });
  });
}

}  // namespace tandem

STABLE_TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("rms_norm", TORCH_BOX(&tandem::rms_norm));
  m.impl("fused_add_rms_norm", TORCH_BOX(&tandem::fused_add_rms_norm));
  m.impl("rotary_embedding", TORCH_BOX(&tandem::rotary_embedding));
  m.impl("silu_and_mul", TORCH_BOX(&tandem::silu_and_mul));
}
