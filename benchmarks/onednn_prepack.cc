// oneDNN's bfloat16 matmul at SmolLM2's decode shapes: weights in plain layout (what cpu_kernels/onednn_matmul.cc
// passes today) against weights reordered once into the primitive's own blocked layout (format_tag::any).
//
//   g++ -O2 -std=c++17 benchmarks/onednn_prepack.cc -I$VENV/include -L$VENV/lib -ldnnl -Wl,-rpath,$VENV/lib \
//       -o /tmp/onednn_prepack && /tmp/onednn_prepack
//
// (VENV: the environment holding the PyPI onednn-cpu-gomp and onednn-devel-cpu-gomp wheels.) Per shape and M,
// the forms alternate call by call; medians of 200 calls after 20 warm-up calls, milliseconds.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"

using dnnl::memory;
using tag = memory::format_tag;

struct Form {
  dnnl::matmul primitive;
  memory x, w, y;
  std::vector<double> ms;
};

Form Make(dnnl::engine& engine, dnnl::stream& stream, int64_t m, int64_t k, int64_t n, tag w_tag, bool packed) {
  memory::desc xd({m, k}, memory::data_type::bf16, tag::ab), yd({m, n}, memory::data_type::bf16, tag::ab);
  memory::desc plain({k, n}, memory::data_type::bf16, w_tag);
  memory::desc wd = packed ? memory::desc({k, n}, memory::data_type::bf16, tag::any) : plain;
  dnnl::matmul::primitive_desc pd(engine, xd, wd, yd);
  memory w_plain(plain, engine);
  std::fill_n(static_cast<uint16_t*>(w_plain.get_data_handle()), k * n, 0x3c00);
  memory w = w_plain;
  if (packed) {
    w = memory(pd.weights_desc(), engine);
    dnnl::reorder(w_plain, w).execute(stream, w_plain, w);
    stream.wait();
  }
  memory x(xd, engine), y(yd, engine);
  std::fill_n(static_cast<uint16_t*>(x.get_data_handle()), m * k, 0x3c00);
  return {dnnl::matmul(pd), x, w, y, {}};
}

double Run(Form& f, dnnl::stream& stream) {
  auto start = std::chrono::steady_clock::now();
  f.primitive.execute(stream, {{DNNL_ARG_SRC, f.x}, {DNNL_ARG_WEIGHTS, f.w}, {DNNL_ARG_DST, f.y}});
  stream.wait();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

double Median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

int main() {
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  struct Shape { const char* name; int64_t k, n; tag w_tag; };
  const Shape shapes[] = {{"q/k/v 576x960", 576, 960, tag::ab}, {"o 576x576", 576, 576, tag::ab},
                          {"gate/up 576x3072", 576, 3072, tag::ab}, {"down 1536x576", 1536, 576, tag::ab},
                          {"LM head 576x49152 (ba)", 576, 49152, tag::ba}};
  std::printf("| weights | M | plain ms | pre-packed ms | plain / pre-packed |\n| --- | --- | --- | --- | --- |\n");
  for (const Shape& s : shapes) {
    for (int64_t m : {1, 8, 32}) {
      Form plain = Make(engine, stream, m, s.k, s.n, s.w_tag, false);
      Form packed = Make(engine, stream, m, s.k, s.n, s.w_tag, true);
      for (int i = 0; i < 220; ++i) {
        double a = Run(plain, stream), b = Run(packed, stream);
        if (i >= 20) plain.ms.push_back(a), packed.ms.push_back(b);
      }
      double a = Median(plain.ms), b = Median(packed.ms);
      std::printf("| %s | %ld | %.4f | %.4f | %.2fx |\n", s.name, long(m), a, b, a / b);
    }
  }
}
