// y[M, N] = x[M, K] . w, w stored [K, N] ("ab") or [N, K] ("ba", transposed=1): oneDNN's matmul primitive
// (avx512_bf16 / AMX brgemm kernels where the CPU has them), bfloat16 or float32, float32 accumulation.
// An XLA FFI handler, registered from cpu_kernels/onednn.py; primitives are cached per shape and dtype.
#include <map>
#include <mutex>
#include <tuple>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using dnnl::memory;

namespace {

dnnl::engine& CpuEngine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

memory::data_type DnnlType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16: return memory::data_type::bf16;
    case ffi::DataType::F32: return memory::data_type::f32;
    default: return memory::data_type::undef;
  }
}

struct Shape {
  int64_t m, k, n;
  memory::data_type x, w, y;
  bool transposed;
  memory::desc XDesc() const { return {{m, k}, x, memory::format_tag::ab}; }
  memory::desc WDesc() const { return {{k, n}, w, transposed ? memory::format_tag::ba : memory::format_tag::ab}; }
  memory::desc YDesc() const { return {{m, n}, y, memory::format_tag::ab}; }
};

dnnl::matmul Primitive(const Shape& s) {
  using Key = std::tuple<int64_t, int64_t, int64_t, int, int, int, bool>;
  static std::mutex mu;
  static std::map<Key, dnnl::matmul> cache;
  Key key{s.m, s.k, s.n, int(s.x), int(s.w), int(s.y), s.transposed};
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it == cache.end()) {
    dnnl::matmul::primitive_desc pd(CpuEngine(), s.XDesc(), s.WDesc(), s.YDesc());
    it = cache.emplace(key, dnnl::matmul(pd)).first;
  }
  return it->second;
}

ffi::Error Matmul(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y, int64_t transposed) {
  auto wd = w.dimensions();
  if (wd.size() != 2) return ffi::Error::InvalidArgument("onednn_matmul: weights must be 2-D");
  Shape s;
  s.transposed = transposed != 0;
  s.k = s.transposed ? wd[1] : wd[0];
  s.n = s.transposed ? wd[0] : wd[1];
  s.m = s.k ? int64_t(x.element_count()) / s.k : 0;
  s.x = DnnlType(x.element_type());
  s.w = DnnlType(w.element_type());
  s.y = DnnlType(y->element_type());
  if (s.x == memory::data_type::undef || s.w == memory::data_type::undef || s.y == memory::data_type::undef)
    return ffi::Error::InvalidArgument("onednn_matmul: dtypes must be bfloat16 or float32");
  if (s.m * s.k != int64_t(x.element_count()) || int64_t(y->element_count()) != s.m * s.n)
    return ffi::Error::InvalidArgument("onednn_matmul: x, w and y shapes do not match");
  if (s.m == 0) return ffi::Error::Success();
  try {
    dnnl::matmul primitive = Primitive(s);
    dnnl::engine& engine = CpuEngine();
    memory xm(s.XDesc(), engine, x.untyped_data());
    memory wm(s.WDesc(), engine, w.untyped_data());
    memory ym(s.YDesc(), engine, y->untyped_data());
    dnnl::stream stream(engine);
    primitive.execute(stream, {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, ym}});
    stream.wait();
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("onednn_matmul: ") + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageOnednnMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("transposed"));
