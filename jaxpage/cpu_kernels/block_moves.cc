// Whole-block moves on a paged pool leaf [L, NB, ...] on the CPU (any element type): take_blocks gathers blocks
// [n] of every layer into [L, n, ...]; put_blocks writes data [L, n, ...] into blocks [n] of every layer, the pool
// aliased to the output (in place when donated). XLA:CPU converted a whole bfloat16 or float8 pool to float32
// around each such gather or scatter (~0.75 s for SmolLM2's 1 GiB pool).
#include <algorithm>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Bytes of one layer's block, or 0 if the shapes do not match ([L, NB, ...] and [L, n, ...] of one dtype).
size_t BlockBytes(ffi::AnyBuffer pool, int64_t n, ffi::AnyBuffer other) {
  auto p = pool.dimensions(), o = other.dimensions();
  if (p.size() < 2 || o.size() != p.size() || o[0] != p[0] || o[1] != n || p[1] == 0 ||
      other.element_type() != pool.element_type())
    return 0;
  for (size_t i = 2; i < p.size(); ++i)
    if (o[i] != p[i]) return 0;
  return pool.size_bytes() / (p[0] * p[1]);
}

ffi::Error TakeBlocks(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> blocks, ffi::Result<ffi::AnyBuffer> out) {
  const int64_t n = blocks.element_count();
  const size_t block = BlockBytes(pool, n, *out);
  if (!block) return ffi::Error::InvalidArgument("take_blocks: pool [L, NB, ...] and out [L, n, ...] of its dtype");
  const int64_t layers = pool.dimensions()[0], num_blocks = pool.dimensions()[1];
  const char* src = static_cast<const char*>(pool.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = std::clamp<int64_t>(blocks.typed_data()[i], 0, num_blocks - 1);
      std::memcpy(dst + (l * n + i) * block, src + (l * num_blocks + b) * block, block);
    }
  return ffi::Error::Success();
}

ffi::Error PutBlocks(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> blocks, ffi::AnyBuffer data,
                     ffi::Result<ffi::AnyBuffer> out) {
  const int64_t n = blocks.element_count();
  const size_t block = BlockBytes(pool, n, data);
  if (!block) return ffi::Error::InvalidArgument("put_blocks: pool [L, NB, ...] and data [L, n, ...] of its dtype");
  const int64_t layers = pool.dimensions()[0], num_blocks = pool.dimensions()[1];
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != pool.untyped_data())  // not aliased in place: start from the pool's contents
    std::memcpy(dst, pool.untyped_data(), pool.size_bytes());
  const char* src = static_cast<const char*>(data.untyped_data());
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = blocks.typed_data()[i];
      if (b < 0 || b >= num_blocks) continue;  // dropped, as an out-of-range scatter update
      std::memcpy(dst + (l * num_blocks + b) * block, src + (l * n + i) * block, block);
    }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageTakeBlocks, TakeBlocks,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagePutBlocks, PutBlocks,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
