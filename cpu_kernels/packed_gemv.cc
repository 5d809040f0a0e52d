// Products of a few bfloat16 rows with packed bfloat16 weights: y[M, N] = x[M, K] . w for M <= kMaxRows, where
// oneDNN's brgemm reads the weights at about half the memory's bandwidth (9-12 GB/s against the ~20 of a plain
// stream on an AMD EPYC) and a decode step of a small model is that read. The weights are in oneDNN's BA16a64b2a
// layout (the packed layout onednn_matmul.cc checks for before calling this): blocks of 64 columns over all of K
// one after the other, inside a block K in pairs, each pair's 64 columns, each column's two values side by side,
// which is the operand order of avx512_bf16's dot instruction. Each thread streams whole blocks; float32
// accumulation, rounded to bfloat16 to nearest even at the end, as oneDNN does. The first pass over a block
// prefetches the bytes kPrefetchAhead further on: the arithmetic between loads leaves the hardware's prefetchers
// too few requests in flight (SmolLM2's products at one row streamed 15-18 GB/s without it on an Intel Xeon VM
// and 19-21 with it, where a plain two-thread stream reads 22-25; benchmarks/RESULTS.md, "AMX's two speeds").
//
// Two forms of the arithmetic, chosen by the CPU the library is built for. On Intel's AMX cores (Sapphire Rapids
// on) the bfloat16 dot (vdpbf16ps) issues once every two cycles, 16 products a cycle, where float32 FMAs issue
// twice a cycle, 32: there each weight pair is widened to two float32 vectors (a shift, a mask) and multiplied
// with float32 FMAs. Elsewhere (AMD EPYC: measured with the dot) the bfloat16 dot.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "threads.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace jaxpage {

constexpr int64_t kMaxRows = 8;
constexpr int64_t kPrefetchAhead = 4096;  // bfloat16 values (8 KiB; in a one-thread stream 4 KiB was slower, 16 KiB level)

#ifdef __AVX512BF16__
namespace {

#ifdef __AMX_BF16__
using XValue = float;  // x widened to float32 once a call

// acc[r][j] += the pair's 64 columns (4 vectors of 16 columns x 2 values of K) times row r's two values of x
template <int R>
inline void MultiplyPair(const float* x, int64_t k, int64_t p, const uint16_t* wp, __m512 (&acc)[R][4]) {
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  __m512 even[4], odd[4];
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(wp + 32 * j);
    even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd[j] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
  }
  for (int r = 0; r < R; ++r) {
    const __m512 x0 = _mm512_set1_ps(x[r * k + 2 * p]), x1 = _mm512_set1_ps(x[r * k + 2 * p + 1]);
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(odd[j], x1, _mm512_fmadd_ps(even[j], x0, acc[r][j]));
  }
}

const float* RowsInForm(const uint16_t* x, int64_t count) {
  thread_local std::vector<float> widened;  // this thread's: grown, never shared
  widened.resize(count);
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t bits = uint32_t(x[i]) << 16;
    std::memcpy(&widened[i], &bits, sizeof(float));
  }
  return widened.data();
}
#else
using XValue = uint16_t;

template <int R>
inline void MultiplyPair(const uint16_t* x, int64_t k, int64_t p, const uint16_t* wp, __m512 (&acc)[R][4]) {
  __m512bh w[4];
  for (int j = 0; j < 4; ++j) w[j] = (__m512bh)_mm512_loadu_si512(wp + 32 * j);
  for (int r = 0; r < R; ++r) {
    int32_t pair;
    std::memcpy(&pair, x + r * k + 2 * p, sizeof(pair));
    const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w[j], xr);
  }
}

const uint16_t* RowsInForm(const uint16_t* x, int64_t) { return x; }
#endif

// Rows [0, R) of x (row stride k) against one 64-column block wb of all of K: y's 64 columns of those rows;
// kPrefetch on the block's first pass (from memory), off on the next rows' passes (from L2).
template <int R, bool kPrefetch>
void Block(const XValue* x, const uint16_t* wb, uint16_t* y, int64_t k, int64_t n) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k / 2; ++p) {
    const uint16_t* wp = wb + p * 128;
    if (kPrefetch)
      for (int l = 0; l < 4; ++l)  // the pair's 4 cache lines; past the array's end a prefetch is a no-op
        _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchAhead + 32 * l), _MM_HINT_T0);
    MultiplyPair<R>(x, k, p, wp, acc);
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * n + 16 * j), (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
}

template <bool kPrefetch>
void Pass(const XValue* x, const uint16_t* wb, uint16_t* y, int64_t rows, int64_t k, int64_t n) {
  switch (rows) {
    case 1: return Block<1, kPrefetch>(x, wb, y, k, n);
    case 2: return Block<2, kPrefetch>(x, wb, y, k, n);
    case 3: return Block<3, kPrefetch>(x, wb, y, k, n);
    default: return Block<4, kPrefetch>(x, wb, y, k, n);
  }
}

void Rows(const XValue* x, const uint16_t* wb, uint16_t* y, int64_t rows, int64_t k, int64_t n) {
  Pass<true>(x, wb, y, std::min<int64_t>(rows, 4), k, n);
  for (int64_t r = 4; r < rows; r += 4)  // a block (64 x K) stays in L2 for the next 4 rows
    Pass<false>(x + r * k, wb, y + r * n, std::min<int64_t>(rows - r, 4), k, n);
}

}  // namespace

bool PackedGemvBf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t m, int64_t k, int64_t n) {
  if (m < 1 || m > kMaxRows || k % 16 != 0 || n % 64 != 0) return false;
  const int64_t blocks = n / 64;
  const XValue* xs = RowsInForm(x, m * k);
#pragma omp parallel for schedule(dynamic) num_threads(KernelThreads(m))
  for (int64_t b = 0; b < blocks; ++b) Rows(xs, w + b * 64 * k, y + b * 64, m, k, n);
  return true;
}
#else
bool PackedGemvBf16(const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, int64_t) { return false; }
#endif

}  // namespace jaxpage
