// vLLM's SiluAndMul on the CPU: silu(gate) * up from the gate/up matmul's fused output, in float32 and rounded once
// to the output's dtype (as jaxpage.models.layers.gated_activation). XLA:CPU's fusion of the same ops took ~0.1 ms
// a layer at 32 rows of SmolLM2's 1,536 columns, ~6% of a decode step (benchmarks/profile.py).
//
// x [T, 2, I] float32 or bfloat16 (gate, then up) -> out [T, I] in x's dtype; I a multiple of 16.
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "simd16.h"
#include "threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxpage;  // simd16.h, threads.h

// 1 / d for d in [1, 2]: the 14-bit reciprocal estimate and one Newton step where AVX-512 has it (a division's
// throughput is a quarter of this), else a division
inline F16 Reciprocal(F16 d) {
#if defined(__AVX512F__)
  const F16 r = (F16)_mm512_rcp14_ps((__m512)d);
  return r * (2.0f - d * r);
#else
  return 1.0f / d;
#endif
}

// silu(g) * u: g * sigmoid(g), with exp taken of -|g| only (Exp16's domain) so neither side overflows
inline F16 SiluTimes(F16 g, F16 u) {
  const F16 e = Exp16(Select(g < 0, g, -g)), one = F16{} + 1.0f;
  const F16 sigmoid = Select(g < 0, e, one) * Reciprocal(one + e);
  return g * sigmoid * u;
}

template <bool kBf16>
void Row(const void* x, void* out, int64_t width) {
  for (int64_t i = 0; i < width; i += 16) {
    if constexpr (kBf16) {
      const uint16_t* h = static_cast<const uint16_t*>(x);
      StoreBf16(static_cast<uint16_t*>(out) + i, SiluTimes(LoadBf16(h + i), LoadBf16(h + width + i)));
    } else {
      const float* f = static_cast<const float*>(x);
      Store16(static_cast<float*>(out) + i, SiluTimes(Load16(f + i), Load16(f + width + i)));
    }
  }
}

ffi::Error SiluAndMul(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  const auto dims = x.dimensions();
  const auto type = x.element_type();
  if (dims.size() != 3 || dims[1] != 2 || dims[2] % 16 != 0 || out->element_type() != type ||
      (type != ffi::DataType::F32 && type != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("silu_and_mul: x [T, 2, I] float32 or bfloat16 with I a multiple of 16");
  const int64_t rows = dims[0], width = dims[2], bytes = ffi::ByteWidth(type);
  const char* in = static_cast<const char*>(x.untyped_data());
  char* result = static_cast<char*>(out->untyped_data());
  const bool bf16 = type == ffi::DataType::BF16;
  const int threads = ElementwiseThreads(rows, rows * width);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    if (bf16)
      Row<true>(in + r * 2 * width * bytes, result + r * width * bytes, width);
    else
      Row<false>(in + r * 2 * width * bytes, result + r * width * bytes, width);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageSiluAndMul, SiluAndMul,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
