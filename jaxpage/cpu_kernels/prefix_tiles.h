// Attention of up to 16 query rows over pages they all see in full, as AMX tile products (bfloat16 in, float32
// accumulators): the shared prefix of vLLM's cascade attention (decodes over one cached prompt prefix), or a prompt
// chunk's earlier pages. paged_attention.cc folds the rest of each row's keys into the state this leaves.
//
// Two passes, so no running output needs rescaling inside the tiles: the scores S = Q·Kᵀ of every page, one softmax
// per row over all of them, then P·V. A page's K and V are first packed into the pairs the tile products read
// (PackPage), once for all the row blocks of a stretch (paged_attention.cc's work item).
#pragma once

#include <cstdint>
#include <cstring>

#include "simd16.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define JAXPAGE_AMX 1
#endif

namespace jaxpage {

constexpr int64_t kTileRows = 16;  // query rows of one tile product, and keys of a page
constexpr int64_t kOutputTiles = 4;  // P·V accumulators: 64 of head_dim at a time

// Linux hands a process the tile registers' state only on request.
inline bool TileProductsUsable() {
#if defined(JAXPAGE_AMX)
  static const bool usable = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return usable;
#else
  return false;
#endif
}

// One page (16 keys) of one KV head, k and v [16, D] bfloat16, into packed [2 * 16 * D] bfloat16: the keys as
// [D/2][16][2] (Kᵀ's operand: each dimension pair of the 16 keys) and the values as [8][D][2] (V's: each key
// pair's dimensions interleaved).
inline void PackPage(const uint16_t* k, const uint16_t* v, int64_t dim, uint16_t* packed) {
  uint32_t* keys = reinterpret_cast<uint32_t*>(packed);
  for (int64_t pair = 0; pair < dim / 2; ++pair)
    for (int64_t key = 0; key < kTileRows; ++key) std::memcpy(keys + pair * kTileRows + key, k + key * dim + 2 * pair, 4);
  uint16_t* values = packed + kTileRows * dim;
  for (int64_t pair = 0; pair < kTileRows / 2; ++pair)
    for (int64_t d = 0; d < dim; ++d) {
      values[(pair * dim + d) * 2] = v[2 * pair * dim + d];
      values[(pair * dim + d) * 2 + 1] = v[(2 * pair + 1) * dim + d];
    }
}

struct PrefixScratch {  // one row block's scores and weights over every page: [16][pages * 16]
  float* scores;
  uint16_t* weights;
};

#if defined(JAXPAGE_AMX)
struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

// tiles 0-2 and 5 are 16 x 64 bytes (Q, packed K, S; then the four P·V accumulators), 3 is P (16 rows of one
// page's 16 weights), 4 a page's packed V for 16 dimensions (8 key pairs)
inline TileConfig PrefixTileConfig() {
  TileConfig c{};
  c.palette = 1;
  for (int t : {0, 1, 2, 5}) c.bytes_per_row[t] = 64, c.rows[t] = 16;
  c.bytes_per_row[3] = 32, c.rows[3] = 16;
  c.bytes_per_row[4] = 64, c.rows[4] = 8;
  return c;
}

// exp(x) for x <= 0 as the bfloat16 weights need it: 2^(x log2 e) = 2^n 2^f, n the nearest integer, |f| <= 1/2, 2^f
// by a cubic (relative error 1e-4, against bfloat16's 4e-3), 2^n by vscalefps. Half of Exp16's instructions.
inline F16 WeightExp(F16 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps((__m512)x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(5.592212081e-2f), f, _mm512_set1_ps(2.426406890e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931210160e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999244213e-1f));
  return (F16)_mm512_scalef_ps(p, n);
}

// the scores of the 16 rows q [16, D] against every page into x.scores [16][pages * 16]
inline void PrefixScores(const uint16_t* q, const uint16_t* const* pages, int64_t num_pages, int64_t dim,
                         const PrefixScratch& x) {
  const int64_t keys = num_pages * kTileRows;
  for (int64_t page = 0; page < num_pages; ++page) {
    _tile_zero(2);
    for (int64_t c = 0; c < dim / 32; ++c) {
      _tile_loadd(0, q + 32 * c, dim * 2);
      _tile_loadd(1, pages[page] + 32 * kTileRows * c, 64);
      _tile_dpbf16ps(2, 0, 1);
    }
    _tile_stored(2, x.scores + page * kTileRows, keys * 4);
  }
}

// acc [16, D] += P·V for head_dim [d0, d0 + 16 * tiles)
template <int kTiles>
void PrefixValues(const uint16_t* const* pages, int64_t num_pages, int64_t dim, int64_t d0, const PrefixScratch& x,
                  float* acc) {
  const int64_t keys = num_pages * kTileRows;
  _tile_zero(0);
  if constexpr (kTiles > 1) _tile_zero(1);
  if constexpr (kTiles > 2) _tile_zero(2);
  if constexpr (kTiles > 3) _tile_zero(5);
  for (int64_t page = 0; page < num_pages; ++page) {
    const uint16_t* values = pages[page] + kTileRows * dim + 2 * d0;
    _tile_loadd(3, x.weights + page * kTileRows, keys * 2);
    _tile_loadd(4, values, dim * 4);
    _tile_dpbf16ps(0, 3, 4);
    if constexpr (kTiles > 1) {
      _tile_loadd(4, values + 32, dim * 4);
      _tile_dpbf16ps(1, 3, 4);
    }
    if constexpr (kTiles > 2) {
      _tile_loadd(4, values + 64, dim * 4);
      _tile_dpbf16ps(2, 3, 4);
    }
    if constexpr (kTiles > 3) {
      _tile_loadd(4, values + 96, dim * 4);
      _tile_dpbf16ps(5, 3, 4);
    }
  }
  _tile_stored(0, acc + d0, dim * 4);
  if constexpr (kTiles > 1) _tile_stored(1, acc + d0 + 16, dim * 4);
  if constexpr (kTiles > 2) _tile_stored(2, acc + d0 + 32, dim * 4);
  if constexpr (kTiles > 3) _tile_stored(5, acc + d0 + 48, dim * 4);
}
#endif

// Rows q [16, D] bfloat16 (unscaled; rows past the real ones zero) over the packed pages (every key seen) -> each
// row's softmax state: max m of its scaled scores, sum l of exp(score - m), acc [16, D] = sum of exp(score - m) v.
// D a multiple of 32. Only where TileProductsUsable().
inline void AttendPrefix(const uint16_t* q, const uint16_t* const* pages, int64_t num_pages, int64_t dim, float scale,
                         const PrefixScratch& x, float* m, float* l, float* acc) {
#if defined(JAXPAGE_AMX)
  const TileConfig config = PrefixTileConfig();
  _tile_loadconfig(&config);
  PrefixScores(q, pages, num_pages, dim, x);
  const int64_t keys = num_pages * kTileRows;
  for (int64_t r = 0; r < kTileRows; ++r) {
    const float* s = x.scores + r * keys;
    F16 top = Load16(s);
    for (int64_t j = 16; j < keys; j += 16) {
      const F16 next = Load16(s + j);
      top = Select(next > top, next, top);
    }
    m[r] = Max16(top) * scale;
    F16 sum{};
    for (int64_t j = 0; j < keys; j += 16) {
      const F16 w = WeightExp(Load16(s + j) * scale - m[r]);
      sum += w;
      StoreBf16(x.weights + r * keys + j, w);
    }
    l[r] = Sum16(sum);
  }
  for (int64_t d0 = 0; d0 < dim; d0 += 16 * kOutputTiles) {
    switch (std::min<int64_t>((dim - d0) / 16, kOutputTiles)) {
      case 1: PrefixValues<1>(pages, num_pages, dim, d0, x, acc); break;
      case 2: PrefixValues<2>(pages, num_pages, dim, d0, x, acc); break;
      case 3: PrefixValues<3>(pages, num_pages, dim, d0, x, acc); break;
      default: PrefixValues<4>(pages, num_pages, dim, d0, x, acc);
    }
  }
  _tile_release();
#endif
}

}  // namespace jaxpage
