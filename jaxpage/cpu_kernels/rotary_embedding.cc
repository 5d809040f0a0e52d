// vLLM's rotary_embedding on the CPU, on the fused q/k/v product's output: one pass that splits it into q, k and v
// and rotates q and k (rotate-half, as jaxpage.models.rope.apply_rope), in float32 and rounded once. XLA:CPU ran it
// as two fusions and a copy (q's RoPE, k's, v out of the product), 30 thread-ms of a 2,048-row step and ~1.5 of an
// 8-row decode step (benchmarks/RESULTS.md, "The elementwise kernels of a wave's prefill on both cores").
//
// y [T, KVH, G + 2, D] (per KV head: its G query heads, then k, then v; float32 or bfloat16), cos and sin [T, D / 2]
// float32 -> q [T, KVH * G, D], k and v [T, KVH, D] in y's dtype; D a multiple of 32.
#include <cstdint>
#include <cstring>

#include "simd16.h"
#include "threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxpage;  // simd16.h, threads.h

// One head's row x [D] rotated into out: [x1 * cos - x2 * sin, x2 * cos + x1 * sin] for its halves x1 and x2.
template <bool kBf16>
void Rotate(const void* x, void* out, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; i += 16) {
    const F16 x1 = Load<kBf16>(x, i), x2 = Load<kBf16>(x, half + i), c = Load16(cos + i), s = Load16(sin + i);
    Store<kBf16>(out, i, x1 * c - x2 * s);
    Store<kBf16>(out, half + i, x2 * c + x1 * s);
  }
}

struct Dims {
  int64_t kv_heads, group, head_dim, bytes;
};

template <bool kBf16>
void Token(const char* y, const float* cos, const float* sin, char* q, char* k, char* v, const Dims& d) {
  const int64_t row = d.head_dim * d.bytes;
  for (int64_t h = 0; h < d.kv_heads; ++h) {
    const char* slot = y + h * (d.group + 2) * row;
    for (int64_t g = 0; g < d.group; ++g)
      Rotate<kBf16>(slot + g * row, q + (h * d.group + g) * row, cos, sin, d.head_dim / 2);
    Rotate<kBf16>(slot + d.group * row, k + h * row, cos, sin, d.head_dim / 2);
    std::memcpy(v + h * row, slot + (d.group + 1) * row, row);
  }
}

ffi::Error RotaryEmbedding(ffi::AnyBuffer y, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                           ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> k,
                           ffi::Result<ffi::AnyBuffer> v) {
  const auto dims = y.dimensions();
  const auto type = y.element_type();
  if (dims.size() != 4 || dims[2] < 3 || dims[3] % 32 != 0 ||
      (type != ffi::DataType::F32 && type != ffi::DataType::BF16) ||
      cos.element_count() != size_t(dims[0] * dims[3] / 2) || sin.element_count() != cos.element_count())
    return ffi::Error::InvalidArgument(
        "rotary_embedding: y [T, KVH, G + 2, D] float32 or bfloat16 (D % 32 == 0), cos and sin [T, D / 2]");
  const int64_t tokens = dims[0];
  const Dims d{dims[1], dims[2] - 2, dims[3], int64_t(ffi::ByteWidth(type))};
  const int64_t in_row = d.kv_heads * (d.group + 2) * d.head_dim * d.bytes;
  const int64_t kv_row = d.kv_heads * d.head_dim * d.bytes;
  const char* in = static_cast<const char*>(y.untyped_data());
  char *qs = static_cast<char*>(q->untyped_data()), *ks = static_cast<char*>(k->untyped_data()),
       *vs = static_cast<char*>(v->untyped_data());
  const bool bf16 = type == ffi::DataType::BF16;
  const int64_t half = d.head_dim / 2;
  const int threads = ElementwiseThreads(tokens, y.element_count());
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    const float *c = cos.typed_data() + t * half, *s = sin.typed_data() + t * half;
    char *qt = qs + t * d.kv_heads * d.group * d.head_dim * d.bytes, *kt = ks + t * kv_row, *vt = vs + t * kv_row;
    if (bf16)
      Token<true>(in + t * in_row, c, s, qt, kt, vt, d);
    else
      Token<false>(in + t * in_row, c, s, qt, kt, vt, d);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageRotaryEmbedding, RotaryEmbedding,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
