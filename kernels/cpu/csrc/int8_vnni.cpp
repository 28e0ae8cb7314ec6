// W8A8 GEMM for decode-sized batches on AVX512-VNNI, with the activations' quantization and the
// rescale fused into the one op:
//   xq[M, K], x_scale[M] = per-token int8 of x (int8_quantize.h)
//   out[M, N] = (xq . q[N, K]^T) * (x_scale[M] * w_scale[N]) (+ bias[N])
//
// torch._int_mm (oneDNN) takes the int8 weight as a plain matrix and runs well below its large-batch
// speed at decode batch sizes (docs/cpu-kernels.md#int8_vnni). Here the weight is packed
// once at load in VNNI order, [ceil(N / 16), K / 4, 16, 4], the operand layout of vpdpbusd
// (16 int32 lanes += 4 u8 x s8 products each), and multiplied in register tiles (packed_tiles.h).
//
// vpdpbusd multiplies unsigned by signed bytes, so the activations go in as xq + 128 (a flipped
// sign bit) and the sums drop 128 * sum_k q[n, k] (`offsets`, made with the packing). Integer
// sums are exact, so the int32 results are torch._int_mm's; the quantization is quantize_rows_int8's
// and the rescale scale_int32_rows's arithmetic in the same order: the same bits as the unfused
// int8_dynamic path, in one call instead of three (at 32 rows the two extra dispatches and
// temporaries cost a good part of the GEMM's time: docs/cpu-kernels.md#int8_vnni).

#include "int8_quantize.h"
#include "packed_tiles.h"

#include <vector>

namespace tandem {

// Whether this build has the kernel (the compiler targeted AVX512-VNNI).
bool int8_vnni_available() { return TANDEM_HAS_VNNI; }

void int8_vnni_gemm(Tensor out, Tensor x, Tensor packed, Tensor w_scale, Tensor offsets, Tensor bias) {
  using packed::kCols;
  const packed::W8A8Shape shape = packed::check_w8a8_args("int8_vnni_gemm", out, x, packed, w_scale, offsets, bias);
  const int64_t rows = shape.rows, k_len = shape.k_len, n = shape.n, blocks = shape.blocks;
  const bool has_bias = shape.has_bias;
  TANDEM_CHECK(offsets.is_contiguous() && offsets.numel() == blocks * kCols, "offsets must be [ceil(N / 16) * 16]");
#if TANDEM_HAS_VNNI
  std::vector<uint8_t> xu(rows * k_len);  // xq + 128, vpdpbusd's unsigned operand
  std::vector<float> row_scales(rows);
  dispatch_float_bf16(x, [&](auto tag) {
    using T = decltype(tag);
    const T* src = ptr<T>(x);
    torch::stable::parallel_for(0, rows, row_grain(k_len), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        int8_t* q = reinterpret_cast<int8_t*>(xu.data() + r * k_len);
        quantize_row(q, &row_scales[r], src + r * x.stride(0), k_len, /*flip=*/0x80);
      }
    });
  });
  const float* cs = ptr<float>(w_scale);
  const int32_t* off = ptr<int32_t>(offsets);
  const float* b = has_bias ? ptr<float>(bias) : nullptr;
  const int64_t out_stride = out.stride(0);
  dispatch_float_bf16(out, [&](auto tag) {
    using T = decltype(tag);
    T* dst = ptr<T>(out);
    auto epilogue = [&](const packed::Tile<packed::Int8Dot>& acc, int64_t r0, int64_t tile_rows, int64_t first, int64_t count) {
      for (int64_t c = 0; c < count; ++c) {
        const int64_t col = (first + c) * kCols, valid = std::min<int64_t>(kCols, n - col);
        i32x16 offset;
        std::memcpy(&offset, off + col, sizeof offset);
        f32x16 col_scale = {}, col_bias = {};
        std::memcpy(&col_scale, cs + col, valid * sizeof(float));
        if (has_bias) std::memcpy(&col_bias, b + col, valid * sizeof(float));
        for (int64_t r = 0; r < tile_rows; ++r) {
          const f32x16 value = __builtin_convertvector(bit_cast<i32x16>(acc[r][c]) - offset, f32x16);
          f32x16 y = value * (row_scales[r0 + r] * col_scale);  // as scale_int32_rows
          if (has_bias) y = y + col_bias;
          packed::store_columns(dst + (r0 + r) * out_stride + col, y, valid);
        }
      }
    };
    packed::gemm<packed::Int8Dot>(rows, blocks, k_len / 4, xu.data(), k_len, ptr<uint8_t>(packed), epilogue);
  });
#endif
}

}  // namespace tandem

STABLE_TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("int8_vnni_available() -> bool");
  m.def("int8_vnni_gemm(Tensor(a!) out, Tensor x, Tensor packed, Tensor w_scale, Tensor offsets, Tensor bias) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(tandem, CompositeExplicitAutograd, m) {  // no tensor to dispatch on
  m.impl("int8_vnni_available", TORCH_BOX(&tandem::int8_vnni_available));
}

STABLE_TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("int8_vnni_gemm", TORCH_BOX(&tandem::int8_vnni_gemm));
}
