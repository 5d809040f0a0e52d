// In-place K/V write into the paged pool on the CPU: pool [L, NB, 2, KVH, BS, D] (any element type; aliased to the
// output), k and v [T, KVH, D] of the pool's element type, slots [T] (block * BS + offset), layer [] int32. Each
// token's K and V rows are copied into their slot of ``layer``. XLA:CPU has no bfloat16 or float8 scatter: it
// converted or copied the whole pool around one (jaxpage/cpu_kernels/onednn.py builds this file with the matmul). K and V
// come as two arrays: stacked first, XLA's fusion of the stack with K's rotary embedding took 42 ms of a 2,048-row
// step (benchmarks/RESULTS.md, "The elementwise kernels of a wave's prefill on both cores").
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error WriteKv(ffi::AnyBuffer pool, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slots,
                   ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> out) {
  auto p = pool.dimensions();
  if (p.size() != 6 || k.dimensions().size() != 3 || k.element_type() != pool.element_type() ||
      v.element_type() != pool.element_type() || k.element_count() != v.element_count() ||
      k.element_count() != int64_t(slots.element_count()) * p[3] * p[5])
    return ffi::Error::InvalidArgument("write_kv: pool [L, NB, 2, KVH, BS, D], k and v [T, KVH, D] of its dtype");
  const int64_t num_layers = p[0], num_blocks = p[1], kv_heads = p[3], block_size = p[4], head_dim = p[5];
  const int64_t num_tokens = k.dimensions()[0];
  const size_t row = head_dim * ffi::ByteWidth(pool.element_type());
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != pool.untyped_data())  // not aliased in place: start from the pool's contents
    std::memcpy(dst, pool.untyped_data(), pool.size_bytes());
  const char* src[2] = {static_cast<const char*>(k.untyped_data()), static_cast<const char*>(v.untyped_data())};
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= num_layers) return ffi::Error::InvalidArgument("write_kv: layer out of range");
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots.typed_data()[t], block = slot / block_size, offset = slot % block_size;
    if (slot < 0 || block >= num_blocks) continue;  // never written, as a dropped scatter update
    for (int64_t which = 0; which < 2; ++which)
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t to = ((((l * num_blocks + block) * 2 + which) * kv_heads + h) * block_size + offset);
        std::memcpy(dst + to * row, src[which] + (t * kv_heads + h) * row, row);
      }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageWriteKv, WriteKv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());
