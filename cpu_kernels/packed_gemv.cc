// Products of a few bfloat16 rows with packed bfloat16 weights: y[M, N] = x[M, K] . w for M <= kMaxRows, where
// oneDNN's brgemm reads the weights at about half the memory's bandwidth (9-12 GB/s against the ~20 of a plain
// stream here) and a decode step of a small model is that read. The weights are in oneDNN's BA16a64b2a layout
// (the packed layout onednn_matmul.cc checks for before calling this): blocks of 64 columns over all of K one
// after the other, inside a block K in pairs, each pair's 64 columns, each column's two values side by side,
// which is the operand order of avx512_bf16's dot instruction. Each thread streams whole blocks; float32
// accumulation, rounded to bfloat16 to nearest even at the end, as oneDNN does.
#include <cstdint>
#include <cstring>

#include "threads.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace jaxpage {

constexpr int64_t kMaxRows = 8;

#ifdef __AVX512BF16__
namespace {

// Rows [0, R) of x (row stride k) against one 64-column block wb of all of K: y's 64 columns of those rows.
template <int R>
void Block(const uint16_t* x, const uint16_t* wb, uint16_t* y, int64_t k, int64_t n) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k / 2; ++p) {
    const uint16_t* wp = wb + p * 128;
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

void Rows(const uint16_t* x, const uint16_t* wb, uint16_t* y, int64_t rows, int64_t k, int64_t n) {
  for (int64_t r = 0; r < rows; r += 4) {  // a block (64 x K) stays in L2 for the next 4 rows
    switch (rows - r < 4 ? rows - r : 4) {
      case 1: Block<1>(x + r * k, wb, y + r * n, k, n); break;
      case 2: Block<2>(x + r * k, wb, y + r * n, k, n); break;
      case 3: Block<3>(x + r * k, wb, y + r * n, k, n); break;
      default: Block<4>(x + r * k, wb, y + r * n, k, n); break;
    }
  }
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
