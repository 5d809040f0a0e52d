// Products of a few bfloat16 rows with packed bfloat16 weights: y[M, N] = x[M, K] . w for M <= kMaxRows, where
// oneDNN's brgemm reads the weights at about half the memory's bandwidth (9-12 GB/s against the ~20 of a plain
// stream here) and a decode step of a small model is that read. The weights are in oneDNN's BA16a64b2a layout
// (the packed layout onednn_matmul.cc checks for before calling this): blocks of 64 columns over all of K one
// after the other, inside a block K in pairs, each pair's 64 columns, each column's two values side by side,
// which is the operand order of avx512_bf16's dot instruction. Each thread streams whole blocks; float32
// accumulation, rounded to bfloat16 to nearest even at the end, as oneDNN does. The first pass over a block
// prefetches the bytes kPrefetchAhead further on: the dot instructions between loads leave the hardware's
// prefetchers too few requests in flight (SmolLM2's products at one row streamed 15-18 GB/s without it on an
// Intel Xeon VM and 18-23 with it, where a plain two-thread stream reads 21-30; benchmarks/RESULTS.md, "AMX's
// two speeds").
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "threads.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace jaxpage {

constexpr int64_t kMaxRows = 8;
// bfloat16 values (8 KiB; in a one-thread stream test 4 KiB was slower, 16 KiB level)
constexpr int64_t kPrefetchAhead = 4096;

#ifdef __AVX512BF16__
namespace {

// Rows [0, R) of x (row stride k) against one 64-column block wb of all of K: y's 64 columns of those rows;
// kPrefetch on the block's first pass (from memory), off on the next rows' passes (from L2).
template <int R, bool kPrefetch>
void Block(const uint16_t* x, const uint16_t* wb, uint16_t* y, int64_t k, int64_t n) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k / 2; ++p) {
    const uint16_t* wp = wb + p * 128;
    if (kPrefetch)
      for (int l = 0; l < 4; ++l)  // the pair's 4 cache lines; past the array's end a prefetch is a no-op
        _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchAhead + 32 * l), _MM_HINT_T0);
    __m512bh w[4];
    for (int j = 0; j < 4; ++j) w[j] = (__m512bh)_mm512_loadu_si512(wp + 32 * j);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * k + 2 * p, sizeof(pair));
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w[j], xr);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * n + 16 * j), (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
}

template <bool kPrefetch>
void Pass(const uint16_t* x, const uint16_t* wb, uint16_t* y, int64_t rows, int64_t k, int64_t n) {
  switch (rows) {
    case 1: return Block<1, kPrefetch>(x, wb, y, k, n);
    case 2: return Block<2, kPrefetch>(x, wb, y, k, n);
    case 3: return Block<3, kPrefetch>(x, wb, y, k, n);
    default: return Block<4, kPrefetch>(x, wb, y, k, n);
  }
}

void Rows(const uint16_t* x, const uint16_t* wb, uint16_t* y, int64_t rows, int64_t k, int64_t n) {
  Pass<true>(x, wb, y, std::min<int64_t>(rows, 4), k, n);
  for (int64_t r = 4; r < rows; r += 4)  // a block (64 x K) stays in L2 for the next 4 rows
    Pass<false>(x + r * k, wb, y + r * n, std::min<int64_t>(rows - r, 4), k, n);
}

}  // namespace

bool PackedGemvBf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t m, int64_t k, int64_t n) {
  if (m < 1 || m > kMaxRows || k % 16 != 0 || n % 64 != 0) return false;
  const int64_t blocks = n / 64;
#pragma omp parallel for schedule(dynamic) num_threads(KernelThreads(m))
  for (int64_t b = 0; b < blocks; ++b) Rows(x, w + b * 64 * k, y + b * 64, m, k, n);
  return true;
}
#else
bool PackedGemvBf16(const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, int64_t) { return false; }
#endif

}  // namespace jaxpage
