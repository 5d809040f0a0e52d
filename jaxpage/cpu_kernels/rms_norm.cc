// vLLM's rms_norm and fused_add_rms_norm on the CPU: one pass over each row instead of XLA:CPU's four thunks (a
// convert, YNNPACK's reduction, the rsqrt, the scale) for a norm and five for a residual add and its norm.
//
// rms_norm:            x [T, D] -> x / rms(x) * w
// fused_add_rms_norm:  x, h [T, D] -> (r = x + h rounded to the dtype, r / rms(r) * w)
// float32 or bfloat16 (w in the same dtype), computed in float32 and rounded once; D a multiple of 16.
#include <cmath>
#include <cstdint>

#include "simd16.h"
#include "threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxpage;  // simd16.h, threads.h

// One row: with h, r = x + h is stored to residual first; then out = r / rms(r) * w.
template <bool kBf16>
void Row(const void* x, const void* h, void* residual, const void* w, void* out, int64_t d, float eps) {
  F16 squares{};
  for (int64_t i = 0; i < d; i += 16) {
    F16 v = Load<kBf16>(x, i);
    if (h != nullptr) {  // the residual as stored: a bfloat16 one rounded, as x + h in the model's dtype
      Store<kBf16>(residual, i, v + Load<kBf16>(h, i));
      v = Load<kBf16>(residual, i);
    }
    squares += v * v;
  }
  const float scale = 1.0f / std::sqrt(Sum16(squares) / float(d) + eps);
  const void* r = h != nullptr ? residual : x;
  for (int64_t i = 0; i < d; i += 16) Store<kBf16>(out, i, Load<kBf16>(r, i) * scale * Load<kBf16>(w, i));
}

bool Supported(ffi::AnyBuffer x, ffi::AnyBuffer w) {
  const auto dims = x.dimensions();
  const auto type = x.element_type();
  return dims.size() == 2 && dims[1] % 16 == 0 && w.element_type() == type && w.element_count() == dims[1] &&
         (type == ffi::DataType::F32 || type == ffi::DataType::BF16);
}

void Rows(ffi::AnyBuffer x, const void* h, void* residual, ffi::AnyBuffer w, void* out, float eps) {
  const int64_t rows = x.dimensions()[0], d = x.dimensions()[1], bytes = ffi::ByteWidth(x.element_type());
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  const char* in = static_cast<const char*>(x.untyped_data());
  const int threads = ElementwiseThreads(rows, rows * d);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t at = r * d * bytes;
    const void* hr = h != nullptr ? static_cast<const char*>(h) + at : nullptr;
    void* rr = residual != nullptr ? static_cast<char*>(residual) + at : nullptr;
    if (bf16)
      Row<true>(in + at, hr, rr, w.untyped_data(), static_cast<char*>(out) + at, d, eps);
    else
      Row<false>(in + at, hr, rr, w.untyped_data(), static_cast<char*>(out) + at, d, eps);
  }
}

ffi::Error RmsNorm(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out, float eps) {
  if (!Supported(x, w) || out->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("rms_norm: x [T, D] and w [D], float32 or bfloat16, D a multiple of 16");
  Rows(x, nullptr, nullptr, w, out->untyped_data(), eps);
  return ffi::Error::Success();
}

ffi::Error FusedAddRmsNorm(ffi::AnyBuffer x, ffi::AnyBuffer h, ffi::AnyBuffer w,
                           ffi::Result<ffi::AnyBuffer> residual, ffi::Result<ffi::AnyBuffer> out, float eps) {
  if (!Supported(x, w) || h.element_type() != x.element_type() || h.element_count() != x.element_count())
    return ffi::Error::InvalidArgument(
        "fused_add_rms_norm: x and h [T, D], w [D], float32 or bfloat16, D a multiple of 16");
  Rows(x, h.untyped_data(), residual->untyped_data(), w, out->untyped_data(), eps);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageRmsNorm, RmsNorm,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageFusedAddRmsNorm, FusedAddRmsNorm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps"));
