// bf16 GEMM for decode-sized batches on AVX512-BF16: out[M, N] = x[M, K] . w[N, K]^T (+ bias[N]).
//
// oneDNN's bf16 matmul reaches well under vdpbf16ps's peak at decode batch sizes
// (docs/cpu-kernels.md#linear_bf16_packed). Here the weight is packed once at load as
// [ceil(N / 16), K / 2, 16, 2], the operand layout of vdpbf16ps (16 fp32 lanes += 2 bf16 products
// each), and multiplied in register tiles (packed_tiles.h); each sum is rounded once to bf16.

#include "packed_tiles.h"

namespace tandem {

// Whether this build has the kernel (the compiler targeted AVX512-BF16).
bool bf16_packed_available() { return TANDEM_HAS_BF16_DOT; }

void bf16_packed_gemm(Tensor out, Tensor x, Tensor packed, Tensor bias) {
  using packed::kCols;
  TANDEM_CHECK(TANDEM_HAS_BF16_DOT, "bf16_packed_gemm needs a build for a CPU with AVX512-BF16");
  check_rows(out, 2, "out");
  check_rows(x, 2, "x");
  check_cpu_dtype(x, ScalarType::BFloat16, "x");
  check_cpu_dtype(out, ScalarType::BFloat16, "out");
  check_cpu_dtype(packed, ScalarType::BFloat16, "packed");
  const int64_t rows = x.size(0), k_len = x.size(1), n = out.size(1);
  const int64_t blocks = (n + kCols - 1) / kCols;
  TANDEM_CHECK(k_len % 2 == 0, "x must be [M, K] with K even");
  TANDEM_CHECK(out.size(0) == rows, "out must be [M, N]");
  TANDEM_CHECK(packed.is_contiguous() && packed.dim() == 4 && packed.size(0) == blocks && packed.size(1) == k_len / 2 &&
                   packed.size(2) == kCols && packed.size(3) == 2, "packed must be [ceil(N / 16), K / 2, 16, 2], contiguous");
  const bool has_bias = bias.numel() > 0;
  if (has_bias) {
    check_cpu_dtype(bias, ScalarType::Float, "bias");
    TANDEM_CHECK(bias.is_contiguous() && bias.numel() == n, "bias must be [N] fp32, contiguous, or empty");
  }
#if TANDEM_HAS_BF16_DOT
  const float* b = has_bias ? ptr<float>(bias) : nullptr;
  bf16* dst = ptr<bf16>(out);
  const int64_t out_stride = out.stride(0);
  auto epilogue = [&](const packed::Tile<packed::Bf16Dot>& acc, int64_t r0, int64_t tile_rows, int64_t first, int64_t count) {
    for (int64_t c = 0; c < count; ++c) {
      const int64_t col = (first + c) * kCols, valid = std::min<int64_t>(kCols, n - col);
      f32x16 col_bias = {};
      if (has_bias) std::memcpy(&col_bias, b + col, valid * sizeof(float));
      for (int64_t r = 0; r < tile_rows; ++r)
        packed::store_columns(dst + (r0 + r) * out_stride + col, bit_cast<f32x16>(acc[r][c]) + col_bias, valid);
    }
  };
  packed::gemm<packed::Bf16Dot>(rows, blocks, k_len / 2, ptr<uint8_t>(x), x.stride(0) * 2, ptr<uint8_t>(packed), epilogue);
#endif
}

}  // namespace tandem

STABLE_TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("bf16_packed_available() -> bool");
  m.def("bf16_packed_gemm(Tensor(a!) out, Tensor x, Tensor packed, Tensor bias) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(tandem, CompositeExplicitAutograd, m) {  // no tensor to dispatch on
  m.impl("bf16_packed_available", TORCH_BOX(&tandem::bf16_packed_available));
}

STABLE_TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("bf16_packed_gemm", TORCH_BOX(&tandem::bf16_packed_gemm));
}
