// oneDNN's bfloat16 matmul at SmolLM2's shapes: weights in plain layout against weights reordered once into the
// primitive's own blocked layout (format_tag::any), chosen for each M ("own") and chosen once for M=1 and used at
// every M ("M=1's", what jaxpage/models/weight_packing.py does: one packed copy for every token bucket).
//
//   g++ -O2 -std=c++17 benchmarks/onednn_prepack.cc -I$VENV/include -L$VENV/lib -ldnnl -Wl,-rpath,$VENV/lib \
//       -o /tmp/onednn_prepack && /tmp/onednn_prepack
//
// (VENV: the environment holding the PyPI onednn-cpu-gomp and onednn-devel-cpu-gomp wheels.) Per shape and M the
// three forms alternate call by call; medians of 50 calls after 10 warm-up calls, milliseconds. One weight buffer
// per form, reused: cache-warm for the small matrices.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"

using dnnl::memory;
using tag = memory::format_tag;
using dt = memory::data_type;

double Median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

memory Filled(const memory::desc& d, dnnl::engine& engine) {
  memory m(d, engine);
  std::fill_n(static_cast<uint16_t*>(m.get_data_handle()), d.get_size() / 2, 0x3c00);
  return m;
}

memory::desc Packed(dnnl::engine& engine, int64_t m, int64_t k, int64_t n) {
  memory::desc x({m, k}, dt::bf16, tag::ab), y({m, n}, dt::bf16, tag::ab), any({k, n}, dt::bf16, tag::any);
  return dnnl::matmul::primitive_desc(engine, x, any, y).weights_desc();
}

int main() {
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  struct Shape { const char* name; int64_t k, n; tag w_tag; };
  const Shape shapes[] = {{"q/k/v 576x960", 576, 960, tag::ab}, {"o 576x576", 576, 576, tag::ab},
                          {"gate/up 576x3072", 576, 3072, tag::ab}, {"down 1536x576", 1536, 576, tag::ab},
                          {"LM head 576x49152 (ba)", 576, 49152, tag::ba}};
  std::printf("| weights | M | plain ms | own packed ms | M=1's packed ms | plain / M=1's | same layout |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- |\n");
  for (const Shape& s : shapes) {
    memory::desc plain_d({s.k, s.n}, dt::bf16, s.w_tag);
    memory plain = Filled(plain_d, engine);
    memory::desc one_d = Packed(engine, 1, s.k, s.n);
    memory one(one_d, engine);
    dnnl::reorder(plain, one).execute(stream, plain, one);
    for (int64_t m : {1, 8, 32, 128, 512}) {
      memory::desc xd({m, s.k}, dt::bf16, tag::ab), yd({m, s.n}, dt::bf16, tag::ab);
      memory x = Filled(xd, engine), y(yd, engine);
      memory::desc own_d = Packed(engine, m, s.k, s.n);
      memory own(own_d, engine);
      dnnl::reorder(plain, own).execute(stream, plain, own);
      stream.wait();
      dnnl::matmul forms[] = {dnnl::matmul({engine, xd, plain_d, yd}), dnnl::matmul({engine, xd, own_d, yd}),
                              dnnl::matmul({engine, xd, one_d, yd})};
      memory weights[] = {plain, own, one};
      std::vector<double> ms[3];
      for (int i = 0; i < 60; ++i) {
        for (int f = 0; f < 3; ++f) {
          auto start = std::chrono::steady_clock::now();
          forms[f].execute(stream, {{DNNL_ARG_SRC, x}, {DNNL_ARG_WEIGHTS, weights[f]}, {DNNL_ARG_DST, y}});
          stream.wait();
          if (i >= 10) ms[f].push_back(std::chrono::duration<double, std::milli>(
              std::chrono::steady_clock::now() - start).count());
        }
      }
      double a = Median(ms[0]), b = Median(ms[1]), c = Median(ms[2]);
      std::printf("| %s | %ld | %.4f | %.4f | %.4f | %.2fx | %s |\n", s.name, long(m), a, b, c, a / c,
                  own_d == one_d ? "yes" : "no");
    }
  }
}
