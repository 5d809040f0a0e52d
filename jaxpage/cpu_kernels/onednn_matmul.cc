// y[M, N] = x[M, K] . w, w stored [K, N] ("ab") or [N, K] ("ba", transposed=1), or packed: reordered once into
// the layout oneDNN's matmul picks for itself (format_tag::any), which saves the kernel reordering plain weights
// inside every call (2-2.6x on one row here). oneDNN's matmul primitive (avx512_bf16 / AMX brgemm kernels where
// the CPU has them), bfloat16 or float32, float32 accumulation. An XLA FFI handler, registered from
// jaxpage/cpu_kernels/onednn.py, and two C functions for packing on the host (called through ctypes); primitives are
// cached per shape and dtype.
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "threads.h"
#include "timed_choice.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using dnnl::memory;

namespace jaxpage {
// packed_gemv.cc: a few rows against BA16a64b2a-packed bfloat16 weights; false where it does not apply
bool PackedGemvBf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t m, int64_t k, int64_t n);
}

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

memory::desc PlainWeights(int64_t k, int64_t n, memory::data_type t, bool transposed) {
  return {{k, n}, t, transposed ? memory::format_tag::ba : memory::format_tag::ab};
}

// The layout the matmul picks for [k, n] weights. It was the same for every M from 1 to 512 at SmolLM2's shapes
// (avx512_core_bf16), and a primitive for any M takes it, so one packed copy serves every token bucket.
memory::desc PackedWeights(int64_t k, int64_t n, memory::data_type t) {
  using Key = std::tuple<int64_t, int64_t, int>;
  static std::mutex mu;
  static std::map<Key, memory::desc> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(Key{k, n, int(t)});
  if (it == cache.end()) {
    memory::desc x({1, k}, t, memory::format_tag::ab), y({1, n}, t, memory::format_tag::ab);
    memory::desc any({k, n}, t, memory::format_tag::any);
    it = cache.emplace(Key{k, n, int(t)}, dnnl::matmul::primitive_desc(CpuEngine(), x, any, y).weights_desc()).first;
  }
  return it->second;
}

// Whether bfloat16 weights [k, n] packed are in the layout packed_gemv.cc reads.
bool PackedForGemv(int64_t k, int64_t n) {
  const memory::data_type t = memory::data_type::bf16;
  return PackedWeights(k, n, t) == memory::desc({k, n}, t, memory::format_tag::BA16a64b2a);
}

struct Shape {
  int64_t m, k, n;
  memory::data_type x, w, y;
  bool transposed, packed;
  memory::desc XDesc() const { return {{m, k}, x, memory::format_tag::ab}; }
  memory::desc WDesc() const { return packed ? PackedWeights(k, n, w) : PlainWeights(k, n, w, transposed); }
  memory::desc YDesc() const { return {{m, n}, y, memory::format_tag::ab}; }
};

// A primitive and its scratchpad's bytes. The caller passes the scratchpad (scratchpad_mode::user): with the
// library's own, two XLA threads running matmuls of one shape at once (independent ops of one program) share it
// and crash in oneDNN's kernels.
struct Matmuls {
  dnnl::matmul primitive;
  size_t scratchpad_bytes;
};

Matmuls Primitive(const Shape& s) {
  // oneDNN sizes a primitive's work for the calling thread's team (ThreadCap)
  using Key = std::tuple<int64_t, int64_t, int64_t, int, int, int, bool, bool, int>;
  static std::mutex mu;
  static std::map<Key, Matmuls> cache;
  Key key{s.m, s.k, s.n, int(s.x), int(s.w), int(s.y), s.transposed, s.packed, omp_get_max_threads()};
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it == cache.end()) {
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    dnnl::matmul::primitive_desc pd(CpuEngine(), s.XDesc(), s.WDesc(), s.YDesc(), attr);
    it = cache.emplace(key, Matmuls{dnnl::matmul(pd), pd.scratchpad_desc().get_size()}).first;
  }
  return it->second;
}

ffi::Error OnednnMatmul(const Shape& s, void* x, void* w, void* y) {
  try {
    Matmuls matmul = Primitive(s);
    dnnl::engine& engine = CpuEngine();
    memory xm(s.XDesc(), engine, x);
    memory wm(s.WDesc(), engine, w);
    memory ym(s.YDesc(), engine, y);
    thread_local std::vector<char> scratch;  // this XLA thread's: grown, never shared
    if (scratch.size() < matmul.scratchpad_bytes) scratch.resize(matmul.scratchpad_bytes);
    memory sm({{int64_t(matmul.scratchpad_bytes)}, memory::data_type::u8, memory::format_tag::a}, engine,
              scratch.data());
    dnnl::stream stream(engine);
    matmul.primitive.execute(stream, {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, ym},
                                      {DNNL_ARG_SCRATCHPAD, sm}});
    stream.wait();
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("onednn_matmul: ") + e.what());
  }
  return ffi::Error::Success();
}

bool Gemv(const Shape& s, const void* x, const void* w, void* y) {
  return jaxpage::PackedGemvBf16(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w),
                                 static_cast<uint16_t*>(y), s.m, s.k, s.n);
}

// Rows in (gemv_rows, timed_rows]: packed_gemv.cc or oneDNN, whichever timed_choice.h finds the faster now.
ffi::Error TimedMatmul(const Shape& s, void* x, void* w, void* y) {
  static jaxpage::TimedChoice choice;
  const jaxpage::TimedChoice::Key key{s.m, s.k, s.n};
  const int kernel = choice.Pick(key);
  const auto start = std::chrono::steady_clock::now();
  if (kernel == 0 && Gemv(s, x, w, y)) {
    choice.Record(key, 0, jaxpage::ElapsedNs(start));
    return ffi::Error::Success();
  }
  ffi::Error error = OnednnMatmul(s, x, w, y);
  if (kernel == 1) choice.Record(key, 1, jaxpage::ElapsedNs(start));
  return error;
}

// gemv_rows: the most rows packed_gemv.cc takes; timed_rows: the most for which it races oneDNN's kernel
// (packed bfloat16 only; jaxpage/cpu_kernels/onednn.py chooses both per CPU)
ffi::Error Matmul(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y, int64_t transposed,
                  int64_t packed, int64_t gemv_rows, int64_t timed_rows) {
  auto dims = w.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("onednn_matmul: weights must be 2-D");
  Shape s;
  s.transposed = transposed != 0;
  s.packed = packed != 0;
  s.k = s.transposed ? dims[1] : dims[0];
  s.n = s.transposed ? dims[0] : dims[1];
  s.m = s.k ? int64_t(x.element_count()) / s.k : 0;
  s.x = DnnlType(x.element_type());
  s.w = DnnlType(w.element_type());
  s.y = DnnlType(y->element_type());
  if (s.x == memory::data_type::undef || s.w == memory::data_type::undef || s.y == memory::data_type::undef)
    return ffi::Error::InvalidArgument("onednn_matmul: dtypes must be bfloat16 or float32");
  if (s.m * s.k != int64_t(x.element_count()) || int64_t(y->element_count()) != s.m * s.n)
    return ffi::Error::InvalidArgument("onednn_matmul: x, w and y shapes do not match");
  if (s.m == 0) return ffi::Error::Success();
  const auto bf16 = memory::data_type::bf16;
  jaxpage::ThreadCap cap(jaxpage::KernelThreads(s.m));
  void *xp = x.untyped_data(), *wp = w.untyped_data(), *yp = y->untyped_data();
  const bool gemv_applies = s.packed && s.x == bf16 && s.w == bf16 && s.y == bf16 && PackedForGemv(s.k, s.n);
  if (gemv_applies && s.m <= gemv_rows && Gemv(s, xp, wp, yp)) return ffi::Error::Success();
  if (gemv_applies && s.m <= timed_rows) return TimedMatmul(s, xp, wp, yp);
  return OnednnMatmul(s, xp, wp, yp);
}

}  // namespace

// A TimedChoice of its own for the tests (tries at least every `explore_after_ms`): a call's pick (0 or 1) for one
// shape after recording `ns` for the previous pick (ns < 0: none).
extern "C" int jaxpage_timed_choice_step(void* choice, double ns, int previous) {
  auto* c = static_cast<jaxpage::TimedChoice*>(choice);
  const jaxpage::TimedChoice::Key key{1, 1, 1};
  if (ns >= 0) c->Record(key, previous, ns);
  return c->Pick(key);
}
extern "C" void* jaxpage_timed_choice_new(int64_t explore_after_ms) {
  return new jaxpage::TimedChoice(std::chrono::milliseconds(explore_after_ms));
}
extern "C" void jaxpage_timed_choice_free(void* choice) { delete static_cast<jaxpage::TimedChoice*>(choice); }

// Bytes of bfloat16 [k, n] weights packed (the plain layout's when the packed one pads nothing), or -1 on an
// error.
extern "C" int64_t jaxpage_onednn_packed_bytes(int64_t k, int64_t n) {
  try {
    return int64_t(PackedWeights(k, n, memory::data_type::bf16).get_size());
  } catch (const dnnl::error&) {
    return -1;
  }
}

// Reorders plain bfloat16 weights (w [k, n], or [n, k] with transposed) into the packed layout at out; 0 on
// success.
extern "C" int jaxpage_onednn_pack(const void* w, void* out, int64_t k, int64_t n, int transposed) {
  try {
    memory::data_type t = memory::data_type::bf16;
    dnnl::engine& engine = CpuEngine();
    memory plain(PlainWeights(k, n, t, transposed != 0), engine, const_cast<void*>(w));
    memory packed(PackedWeights(k, n, t), engine, out);
    dnnl::stream stream(engine);
    dnnl::reorder(plain, packed).execute(stream, plain, packed);
    stream.wait();
    return 0;
  } catch (const dnnl::error&) {
    return 1;
  }
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageOnednnMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("transposed")
                                  .Attr<int64_t>("packed")
                                  .Attr<int64_t>("gemv_rows")
                                  .Attr<int64_t>("timed_rows"));
