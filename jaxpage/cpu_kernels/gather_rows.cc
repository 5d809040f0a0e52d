// out[c] = table[clip(rows[c], 0, R - 1)] over the leading axis of table [R, ...] (any element type): the pool's
// page gather on the CPU. XLA:CPU normalizes a bfloat16 or float8 gather to float32, converting the whole pool.
#include <algorithm>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error GatherRows(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::AnyBuffer> out) {
  auto dims = table.dimensions();
  if (dims.size() == 0 || dims[0] == 0 || out->element_type() != table.element_type())
    return ffi::Error::InvalidArgument("gather_rows: table [R, ...] with R > 0, out of its dtype");
  const int64_t num_rows = dims[0], count = rows.element_count();
  const size_t row = table.size_bytes() / num_rows;
  if (out->size_bytes() != count * row) return ffi::Error::InvalidArgument("gather_rows: out must be [C, ...]");
  const char* src = static_cast<const char*>(table.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  for (int64_t c = 0; c < count; ++c) {
    const int64_t r = std::clamp<int64_t>(rows.typed_data()[c], 0, num_rows - 1);
    std::memcpy(dst + c * row, src + r * row, row);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageGatherRows, GatherRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());
