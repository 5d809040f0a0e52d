// Paged attention on the CPU, reading the pool in place through the block tables (vLLM's CPU backend has its
// own kernel for the same reason): XLA's path gathers every page it reads into a new buffer and runs small
// batched dots on one thread at a time.
//
// q [T, H, D] (float32 or bfloat16), pool [L, NB, 2, KVH, BS, D] (float32, bfloat16, float8_e4m3fn, or int8 with
// scales [L, NB, 2, KVH, BS] float32; otherwise scales is empty), layer [] int32, token_seq [T] int32 (the
// block-table row of each token), positions [T] int32, block_tables [S, W] int32, window [] int32 (0: full
// attention). Token t sees the keys at positions p with window_start <= p <= positions[t] of its own sequence,
// window_start = max(positions[t] - window + 1, 0) when window > 0, else 0. Attributes: scale (on q) and soft_cap
// (0: none; else scores become soft_cap * tanh(scores / soft_cap)). out [T, H, D] in q's dtype; a row that sees no
// key gets zeros.
//
// The work is cut into tiles: up to kTile consecutive tokens of one sequence, which read each page once for all
// of their rows (a prompt chunk), times KV heads; the tiles run on OpenMP threads (the same libgomp team as
// oneDNN's). Each page's V rows (and K rows, unless bfloat16 keys meet bfloat16 queries on a CPU with the bfloat16
// dot: then they are read in place) are converted to float32 once per tile, and each token's query heads of the
// tile's KV head (its group, up to four at a time) fold the page into their running softmaxes together. On an AMX
// CPU, the leading pages that many rows see in full (a prompt chunk's earlier pages, decodes' shared prefix) are
// taken first as tile products (prefix_tiles.h, Stretch below), and the fold goes on from their state.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <utility>
#include <vector>

#include "prefix_tiles.h"
#include "simd16.h"
#include "threads.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxpage;  // simd16.h

constexpr int64_t kTile = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Fp8Table {  // float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; S.1111.111 is NaN, no infinity
  float value[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) {
      const int sign = i >> 7, exponent = (i >> 3) & 15, mantissa = i & 7;
      float v = exponent == 0 ? std::ldexp(mantissa / 8.0f, -6) : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
      if (exponent == 15 && mantissa == 7) v = std::numeric_limits<float>::quiet_NaN();
      value[i] = sign ? -v : v;
    }
  }
};
const Fp8Table kFp8;

struct Pool {
  const char* data;
  const float* scales;  // int8 only
  ffi::DataType type;
  int64_t num_blocks, kv_heads, block_size, head_dim;

  int64_t FirstRow(int64_t layer, int64_t block, int64_t which, int64_t head) const {
    return (((layer * num_blocks + block) * 2 + which) * kv_heads + head) * block_size;
  }

  const char* Rows(int64_t layer, int64_t block, int64_t which, int64_t head) const {
    return data + FirstRow(layer, block, which, head) * head_dim * ffi::ByteWidth(type);
  }

  // asks for the K and V rows of (layer, block, head) in cache: pages are scattered, so the hardware prefetcher
  // starts cold on each, and the tile waits on memory
  void Prefetch(int64_t layer, int64_t block, int64_t head) const {
    const int64_t bytes = block_size * head_dim * ffi::ByteWidth(type);
    for (int64_t which = 0; which < 2; ++which) {
      const char* first = data + FirstRow(layer, block, which, head) * head_dim * ffi::ByteWidth(type);
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(first + b);
    }
  }

  // rows [BS, D] of (layer, block, which, head) as float32 into dst
  void Load(int64_t layer, int64_t block, int64_t which, int64_t head, float* dst) const {
    const int64_t first = FirstRow(layer, block, which, head);
    const int64_t n = block_size * head_dim;
    switch (type) {
      case ffi::DataType::F32:
        std::memcpy(dst, reinterpret_cast<const float*>(data) + first * head_dim, n * 4);
        break;
      case ffi::DataType::BF16: {
        const uint16_t* src = reinterpret_cast<const uint16_t*>(data) + first * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
          std::memcpy(dst + i, &bits, 4);
        }
        break;
      }
      case ffi::DataType::F8E4M3FN: {
        const uint8_t* src = reinterpret_cast<const uint8_t*>(data) + first * head_dim;
        for (int64_t i = 0; i < n; ++i) dst[i] = kFp8.value[src[i]];
        break;
      }
      default: {  // S8 with one scale per row
        const int8_t* src = reinterpret_cast<const int8_t*>(data) + first * head_dim;
        for (int64_t r = 0; r < block_size; ++r) {
          const float s = scales[first + r];
          for (int64_t d = 0; d < head_dim; ++d) dst[r * head_dim + d] = src[r * head_dim + d] * s;
        }
      }
    }
  }
};

struct Tile {
  int64_t first, count, seq;
};

struct Problem {
  const Pool* pool;
  const int32_t* positions;
  const int32_t* tables;
  int64_t layer, width, heads, group, window;
  float scale, soft_cap;
  bool bf16_dot;  // bfloat16 queries against bfloat16 keys (BfloatScores)
};

int64_t WindowStart(int64_t pos, int64_t window) { return window > 0 ? std::max<int64_t>(pos - window + 1, 0) : 0; }


constexpr int64_t kMaxChunks = 16;  // head_dim up to 256, in chunks of 16



// The lane sums of 16 vectors as one vector (lane j: the sum of x[j]'s lanes): four rounds of pairwise
// shuffles and adds, 15 in all, where a reduction per vector would take 16 of four rounds each.
inline F16 TransposedSums(F16* x) {
  for (int i = 0; i < 8; ++i)
    x[i] = SHUFFLE2(x[2 * i], x[2 * i + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           SHUFFLE2(x[2 * i], x[2 * i + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  for (int i = 0; i < 4; ++i)
    x[i] = SHUFFLE2(x[2 * i], x[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           SHUFFLE2(x[2 * i], x[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  for (int i = 0; i < 2; ++i)
    x[i] = SHUFFLE2(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           SHUFFLE2(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  return SHUFFLE2(x[0], x[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         SHUFFLE2(x[0], x[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}

// s[n] lane j: query vector n against key j of a page (float32, q scaled); keys outside [from, to) are not read
// (a stale slot may hold a NaN) and score 0. A vector's 16 dot products stay in registers until their transposed
// sum.
template <int64_t kChunks, int64_t kN>
void FloatScores(const float* q, const float* k, int64_t from, int64_t to, F16* s) {
  constexpr int64_t dim = 16 * kChunks;
#pragma GCC unroll 4
  for (int64_t n = 0; n < kN; ++n) {
    F16 qv[kChunks], dots[16];
#pragma GCC unroll 16
    for (int64_t c = 0; c < kChunks; ++c) qv[c] = Load16(q + n * dim + 16 * c);
#pragma GCC unroll 16
    for (int64_t j = 0; j < 16; ++j) {
      dots[j] = F16{};
      if (j < from || j >= to) continue;
#pragma GCC unroll 16
      for (int64_t c = 0; c < kChunks; ++c) dots[j] += qv[c] * Load16(k + j * dim + 16 * c);
    }
    s[n] = TransposedSums(dots);
  }
}

// The same from bfloat16 queries (unscaled) and keys read in place: the CPU's bfloat16 dot (avx512_bf16) multiplies
// 32 pairs into 16 float32 lanes, half the instructions of the float32 form and no conversion of the page's keys.
template <int64_t kChunks, int64_t kN>
void BfloatScores(const uint16_t* q, const uint16_t* k, int64_t from, int64_t to, F16* s) {
#if defined(__AVX512BF16__)
  constexpr int64_t dim = 16 * kChunks, pairs = kChunks / 2;
#pragma GCC unroll 4
  for (int64_t n = 0; n < kN; ++n) {
    __m512bh qv[pairs];
    F16 dots[16];
#pragma GCC unroll 8
    for (int64_t c = 0; c < pairs; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + n * dim + 32 * c);
#pragma GCC unroll 16
    for (int64_t j = 0; j < 16; ++j) {
      dots[j] = F16{};
      if (j < from || j >= to) continue;
#pragma GCC unroll 8
      for (int64_t c = 0; c < pairs; ++c)
        dots[j] = (F16)_mm512_dpbf16_ps((__m512)dots[j], qv[c], (__m512bh)_mm512_loadu_si512(k + j * dim + 32 * c));
    }
    s[n] = TransposedSums(dots);
  }
#endif
}

enum KeyForm { kFloatKeys, kBfloatKeys };  // FloatScores, BfloatScores

// Folds keys [from, to) of one page (k as kForm says; v [BS, D] float32; BS <= 16) into
// the running softmaxes (max m, sum l, output out [D]) of kN query vectors q [kN, D] (float32 and scaled, or
// bfloat16 and scaled here) that see the same keys: the query heads of one KV head at one token. They share each
// key and value row's loads and give the core kN independent chains. A page's scores, weights and their sum are
// vectors of 16 lanes. kChunks: head_dim / 16.
template <int64_t kChunks, int64_t kN, int kForm>
void FoldPage(const void* q, const void* k, const float* v, int64_t from, int64_t to, float scale, float soft_cap,
              float* m, float* l, float* out) {
  constexpr int64_t dim = 16 * kChunks;
  F16 s[kN], w[kN];
  alignas(64) float weights[kN][16];
  if constexpr (kForm == kBfloatKeys)
    BfloatScores<kChunks, kN>(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k), from, to, s);
  else
    FloatScores<kChunks, kN>(static_cast<const float*>(q), static_cast<const float*>(k), from, to, s);
  const I16 lane{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const I16 in = (lane >= static_cast<int32_t>(from)) & (lane < static_cast<int32_t>(to));
  // The page's weights and weighted values are taken against its own max and merged into the running state at
  // the end: only that merge waits for the page before, so the core overlaps consecutive pages.
  float page_max[kN];
  for (int64_t n = 0; n < kN; ++n) {
    if constexpr (kForm != kFloatKeys) s[n] *= scale;
    if (soft_cap > 0)
      for (int64_t j = from; j < to; ++j) s[n][j] = soft_cap * std::tanh(s[n][j] / soft_cap);
    s[n] = Select(in, s[n], F16{} + kNegInf);
    page_max[n] = Max16(s[n]);
    w[n] = Select(in, Exp16(s[n] - page_max[n]), F16{});
    Store16(weights[n], w[n]);
  }
  F16 pv[kN][kChunks] = {};
  for (int64_t j = from; j < to; ++j) {
    const float* value = v + j * dim;
    for (int64_t c = 0; c < kChunks; ++c) {
      const F16 vc = Load16(value + 16 * c);
      for (int64_t n = 0; n < kN; ++n) pv[n][c] += weights[n][j] * vc;
    }
  }
  F16 shift{};  // lane n: the running max's shift to the new max; lane 8 + n: the page max's
  for (int64_t n = 0; n < kN; ++n) {
    const float new_max = std::max(m[n], page_max[n]);
    shift[n] = m[n] - new_max;
    shift[8 + n] = page_max[n] - new_max;
    m[n] = new_max;
  }
  const F16 scales = Exp16(shift);
  for (int64_t n = 0; n < kN; ++n) {
    const float old_scale = scales[n], page_scale = scales[8 + n];
    for (int64_t c = 0; c < kChunks; ++c)
      Store16(out + n * dim + 16 * c, Load16(out + n * dim + 16 * c) * old_scale + pv[n][c] * page_scale);
    l[n] = l[n] * old_scale + Sum16(w[n]) * page_scale;
  }
}

// Pages of more than 16 keys: the keys [from, to) in pages of 16.
template <int64_t kChunks, int64_t kN, int kForm>
void FoldKeys(const void* q, const void* k, const float* v, int64_t from, int64_t to, float scale, float soft_cap,
              float* m, float* l, float* out) {
  constexpr int64_t dim = 16 * kChunks, key_bytes = kForm == kFloatKeys ? 4 : 2;
  for (int64_t first = from - from % 16; first < to; first += 16)
    FoldPage<kChunks, kN, kForm>(q, static_cast<const char*>(k) + first * dim * key_bytes, v + first * dim,
                                 std::max(from - first, int64_t{0}), std::min(to - first, int64_t{16}), scale,
                                 soft_cap, m, l, out);
}

using FoldFn = void (*)(const void*, const void*, const float*, int64_t, int64_t, float, float, float*, float*,
                        float*);

constexpr int64_t kMaxVectors = 4;  // query vectors folded at once

#if defined(__AVX512BF16__)
constexpr bool kBfloatDot = true;
#else
constexpr bool kBfloatDot = false;
#endif

// [vectors - 1][form]; the bfloat16 form takes whole pairs of 16-lane chunks (elsewhere: the float32 form)
template <int64_t kChunks, size_t... kN>
constexpr std::array<std::array<FoldFn, 2>, kMaxVectors> FoldsOf(std::index_sequence<kN...>) {
  constexpr bool bf16 = kBfloatDot && kChunks % 2 == 0;
  return {std::array<FoldFn, 2>{FoldKeys<kChunks, kN + 1, kFloatKeys>,
                                FoldKeys<kChunks, kN + 1, bf16 ? kBfloatKeys : kFloatKeys>}...};
}

template <size_t... kChunks>
FoldFn FoldFor(int64_t dim, int64_t vectors, KeyForm form, std::index_sequence<kChunks...>) {
  static constexpr std::array<std::array<FoldFn, 2>, kMaxVectors> kFolds[] = {
      FoldsOf<kChunks + 1>(std::make_index_sequence<kMaxVectors>())...};  // head_dim = 16 * (kChunks + 1)
  return kFolds[dim / 16 - 1][vectors - 1][form];
}

// the fold of up to kMaxVectors query vectors at once
FoldFn FoldFor(int64_t dim, int64_t vectors, KeyForm form) {
  return FoldFor(dim, vectors, form, std::make_index_sequence<kMaxChunks>());
}

struct Scratch {  // one thread's: a page's K and V as float32; the tile's maxima and sums
  std::vector<float> k, v, m, l;
};

// Where a tile's vectors start: their softmax states (m, l, acc [vectors, D] as FoldPage keeps them) over the
// tile's first `pages` pages, which the tile products took; pages 0: from nothing.
struct Start {
  const float *m = nullptr, *l = nullptr, *acc = nullptr;
  int64_t pages = 0;
};

// One tile's rows on one KV head: q [rows * group, D] (float32 and scaled, or bfloat16 where p.bf16_dot) ->
// acc [rows * group, D], normalised.
void AttendTile(const Problem& p, const Tile& tile, int64_t kv_head, const Start& start, const void* q, float* acc,
                Scratch& x) {
  const Pool& pool = *p.pool;
  const int64_t bs = pool.block_size, dim = pool.head_dim, vectors = tile.count * p.group;
  const int64_t q_bytes = p.bf16_dot ? 2 : 4;
  const KeyForm form = p.bf16_dot ? kBfloatKeys : kFloatKeys;
  FoldFn folds[kMaxVectors];
  for (int64_t n = 1; n <= kMaxVectors; ++n) folds[n - 1] = FoldFor(dim, n, form);
  float *m = x.m.data(), *l = x.l.data();
  if (start.pages > 0) {
    std::copy_n(start.m, vectors, m);
    std::copy_n(start.l, vectors, l);
    std::copy_n(start.acc, vectors * dim, acc);
  } else {
    std::fill(m, m + vectors, kNegInf);
    std::fill(l, l + vectors, 0.0f);
    std::fill(acc, acc + vectors * dim, 0.0f);
  }
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = -1;
  for (int64_t r = 0; r < tile.count; ++r) {
    const int64_t pos = p.positions[tile.first + r];
    lo = std::min(lo, WindowStart(pos, p.window));
    hi = std::max(hi, pos);
  }
  const int32_t* row = p.tables + tile.seq * p.width;
  const int64_t last = std::min(hi / bs, p.width - 1);
  auto block_of = [&](int64_t page) { return std::clamp<int64_t>(row[page], 0, pool.num_blocks - 1); };
  for (int64_t page = std::max(lo / bs, start.pages); page <= last; ++page) {
    const int64_t block = block_of(page);
    if (page < last) pool.Prefetch(p.layer, block_of(page + 1), kv_head);
    const void* keys = x.k.data();
    if (form == kBfloatKeys)
      keys = pool.Rows(p.layer, block, 0, kv_head);  // read in place
    else
      pool.Load(p.layer, block, 0, kv_head, x.k.data());
    pool.Load(p.layer, block, 1, kv_head, x.v.data());
    for (int64_t r = 0; r < tile.count; ++r) {
      const int64_t pos = p.positions[tile.first + r], start = WindowStart(pos, p.window);
      const int64_t from = std::max(start - page * bs, int64_t{0}), to = std::min(pos - page * bs + 1, bs);
      if (from >= to) continue;
      for (int64_t g = 0; g < p.group; g += kMaxVectors) {
        const int64_t vec = r * p.group + g, n = std::min(kMaxVectors, p.group - g);
        folds[n - 1](static_cast<const char*>(q) + vec * dim * q_bytes, keys, x.v.data(), from, to, p.scale,
                     p.soft_cap, m + vec, l + vec, acc + vec * dim);
      }
    }
  }
  for (int64_t vec = 0; vec < vectors; ++vec) {
    const float inverse = l[vec] > 0 ? 1.0f / l[vec] : 0.0f;
    for (int64_t d = 0; d < dim; ++d) acc[vec * dim + d] *= inverse;
  }
}

template <typename T>
void Grow(std::vector<T>& v, size_t n) {  // never shrinks: a thread keeps its buffers between calls
  if (v.size() < n) v.resize(n);
}

struct Buffers {  // one thread's
  Scratch scratch;
  std::vector<float> qf, acc;  // the tile's query vectors (float32 and scaled) and outputs [vectors, D]
  std::vector<uint16_t> qb;  // or its queries in bfloat16
  // the tile products': a stretch's pages packed [pages, 2 * 16 * D], a row block's queries [16, D], scores and
  // weights [16, pages * 16], and the stretch's states (m, l [rows], acc [rows, D], rows rounded up to 16)
  std::vector<uint16_t> packed, rows, weights;
  std::vector<float> scores, m, l, states;
};

// One tile on one KV head from `start`, into out [T, H, D] (q's dtype).
void AttendTileInto(const Problem& p, const Tile& tile, int64_t kv_head, const Start& start, const void* q_data,
                    bool bf16, void* out_data, Buffers& b) {
  const int64_t dim = p.pool->head_dim, vectors = tile.count * p.group;
  Grow(b.acc, vectors * dim);
  if (p.bf16_dot)
    Grow(b.qb, vectors * dim);
  else
    Grow(b.qf, vectors * dim);
  Grow(b.scratch.m, vectors);
  Grow(b.scratch.l, vectors);
  for (int64_t r = 0; r < tile.count; ++r)
    for (int64_t g = 0; g < p.group; ++g) {
      const int64_t from = ((tile.first + r) * p.heads + kv_head * p.group + g) * dim;
      if (p.bf16_dot) {
        std::memcpy(b.qb.data() + (r * p.group + g) * dim, static_cast<const uint16_t*>(q_data) + from, dim * 2);
        continue;
      }
      float* dst = b.qf.data() + (r * p.group + g) * dim;
      for (int64_t d = 0; d < dim; ++d)
        dst[d] = p.scale * (bf16 ? Bf16ToFloat(static_cast<const uint16_t*>(q_data)[from + d])
                                 : static_cast<const float*>(q_data)[from + d]);
    }
  AttendTile(p, tile, kv_head, start, p.bf16_dot ? static_cast<const void*>(b.qb.data()) : b.qf.data(),
             b.acc.data(), b.scratch);
  for (int64_t r = 0; r < tile.count; ++r)
    for (int64_t g = 0; g < p.group; ++g) {
      const int64_t to = ((tile.first + r) * p.heads + kv_head * p.group + g) * dim;
      const float* src = b.acc.data() + (r * p.group + g) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        if (bf16)
          static_cast<uint16_t*>(out_data)[to + d] = FloatToBf16(src[d]);
        else
          static_cast<float*>(out_data)[to + d] = src[d];
      }
    }
}

std::vector<Tile> Tiles(const int32_t* token_seq, int64_t num_tokens) {
  std::vector<Tile> tiles;
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (tiles.empty() || tiles.back().seq != token_seq[t] || tiles.back().count == kTile)
      tiles.push_back({t, 0, token_seq[t]});
    ++tiles.back().count;
  }
  return tiles;
}

// Query rows that all see the same leading pages of one block-table row in full, taken by the tile products
// (prefix_tiles.h): a prompt chunk's earlier pages, or the cached prefix that decodes of several sequences share
// (vLLM's cascade attention).
struct Stretch {
  std::vector<int64_t> tiles;
  int64_t seq, pages;
};

constexpr int64_t kMinStretchRows = 8;  // below this, a tile product's 16 rows are mostly padding
constexpr int64_t kMaxSharedRows = 48;  // a shared prefix's decodes are cut into stretches of about this many rows,
                                        // so that both cores take a share of each KV head

int64_t FullPages(const Problem& p, const Tile& tile) {  // leading pages every row of the tile sees in full
  int64_t lowest = std::numeric_limits<int64_t>::max();
  for (int64_t r = 0; r < tile.count; ++r) lowest = std::min<int64_t>(lowest, p.positions[tile.first + r]);
  return std::min((lowest + 1) / p.pool->block_size, p.width);
}

// Tiles of few rows (decodes) that start from the same block: the prefix they share, taken at the length that
// covers the most rows times pages, in stretches of about kMaxSharedRows rows.
void AddSharedStretches(const Problem& p, const std::vector<Tile>& tiles, const std::vector<int64_t>& members,
                        std::vector<Stretch>& out) {
  const int32_t* first = p.tables + tiles[members[0]].seq * p.width;
  std::vector<std::pair<int64_t, int64_t>> shared;  // (pages, tile)
  for (int64_t t : members) {
    const int32_t* row = p.tables + tiles[t].seq * p.width;
    int64_t n = 0;
    for (const int64_t full = FullPages(p, tiles[t]); n < full && row[n] == first[n];) ++n;
    shared.push_back({n, t});
  }
  std::sort(shared.rbegin(), shared.rend());
  int64_t rows = 0, best = 0, count = 0, best_rows = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(shared.size()); ++i) {
    rows += tiles[shared[i].second].count * p.group;
    if (rows >= kMinStretchRows && shared[i].first * rows > best)
      best = shared[i].first * rows, count = i + 1, best_rows = rows;
  }
  if (count == 0) return;
  const int64_t parts = (best_rows + kMaxSharedRows - 1) / kMaxSharedRows, pages = shared[count - 1].first;
  int64_t taken = 0;
  for (int64_t part = 0, i = 0; part < parts; ++part) {
    Stretch stretch{{}, tiles[members[0]].seq, pages};
    for (; i < count && taken * parts < best_rows * (part + 1); ++i) {
      stretch.tiles.push_back(shared[i].second);
      taken += tiles[shared[i].second].count * p.group;
    }
    if (!stretch.tiles.empty()) out.push_back(std::move(stretch));
  }
}

// A tile of at least 16 rows takes its own full pages; smaller ones are grouped by their first block.
std::vector<Stretch> Stretches(const Problem& p, const std::vector<Tile>& tiles) {
  std::vector<Stretch> out;
  std::map<int32_t, std::vector<int64_t>> by_first_block;
  for (int64_t t = 0; t < static_cast<int64_t>(tiles.size()); ++t) {
    const int64_t full = FullPages(p, tiles[t]);
    if (full == 0) continue;
    if (tiles[t].count * p.group >= kTileRows)
      out.push_back({{t}, tiles[t].seq, full});
    else
      by_first_block[p.tables[tiles[t].seq * p.width]].push_back(t);
  }
  for (const auto& [block, members] : by_first_block) AddSharedStretches(p, tiles, members, out);
  return out;
}

// A stretch on one KV head: its pages packed, its rows' states over them as tile products, then each of its tiles
// from there. One work item, so no thread waits for another's part.
void AttendStretch(const Problem& p, const std::vector<Tile>& tiles, const Stretch& stretch, int64_t kv_head,
                   const void* q_data, void* out_data, Buffers& b) {
  const Pool& pool = *p.pool;
  const int64_t dim = pool.head_dim, page_size = 2 * kTileRows * dim;
  Grow(b.packed, stretch.pages * page_size);
  std::vector<const uint16_t*> pages(stretch.pages);
  for (int64_t i = 0; i < stretch.pages; ++i) {
    const int64_t block = std::clamp<int64_t>(p.tables[stretch.seq * p.width + i], 0, pool.num_blocks - 1);
    PackPage(reinterpret_cast<const uint16_t*>(pool.Rows(p.layer, block, 0, kv_head)),
             reinterpret_cast<const uint16_t*>(pool.Rows(p.layer, block, 1, kv_head)), dim,
             b.packed.data() + i * page_size);
    pages[i] = b.packed.data() + i * page_size;
  }
  std::vector<int64_t> targets;  // the stretch's rows in q [T * H, D]: its tiles' tokens by query head
  for (int64_t t : stretch.tiles)
    for (int64_t r = 0; r < tiles[t].count; ++r)
      for (int64_t g = 0; g < p.group; ++g) targets.push_back((tiles[t].first + r) * p.heads + kv_head * p.group + g);
  const int64_t rows = static_cast<int64_t>(targets.size()), padded = (rows + kTileRows - 1) / kTileRows * kTileRows;
  Grow(b.rows, kTileRows * dim);
  Grow(b.scores, kTileRows * stretch.pages * kTileRows);
  Grow(b.weights, kTileRows * stretch.pages * kTileRows);
  Grow(b.m, padded);
  Grow(b.l, padded);
  Grow(b.states, padded * dim);
  for (int64_t first = 0; first < rows; first += kTileRows) {
    std::fill_n(b.rows.begin(), kTileRows * dim, 0);
    for (int64_t i = first; i < std::min(rows, first + kTileRows); ++i)
      std::copy_n(static_cast<const uint16_t*>(q_data) + targets[i] * dim, dim, b.rows.data() + (i - first) * dim);
    AttendPrefix(b.rows.data(), pages.data(), stretch.pages, dim, p.scale, {b.scores.data(), b.weights.data()},
                 b.m.data() + first, b.l.data() + first, b.states.data() + first * dim);
  }
  int64_t offset = 0;
  for (int64_t t : stretch.tiles) {
    const Start start{b.m.data() + offset, b.l.data() + offset, b.states.data() + offset * dim, stretch.pages};
    AttendTileInto(p, tiles[t], kv_head, start, q_data, p.bf16_dot, out_data, b);
    offset += tiles[t].count * p.group;
  }
}

ffi::Error PagedAttention(ffi::AnyBuffer q, ffi::AnyBuffer pool, ffi::Buffer<ffi::F32> scales,
                          ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> token_seq,
                          ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> block_tables,
                          ffi::Buffer<ffi::S32> window, ffi::Result<ffi::AnyBuffer> out, float scale, float soft_cap) {
  auto qd = q.dimensions(), pd = pool.dimensions(), td = block_tables.dimensions();
  const auto qt = q.element_type(), pt = pool.element_type();
  if (qd.size() != 3 || pd.size() != 6 || td.size() != 2 || qd[2] != pd[5] || qd[1] % pd[3] != 0 ||
      out->element_type() != qt || (qt != ffi::DataType::F32 && qt != ffi::DataType::BF16) || qd[2] % 16 != 0 ||
      qd[2] > 16 * kMaxChunks)
    return ffi::Error::InvalidArgument(
        "paged_attention: q [T, H, D] float32/bfloat16 with D a multiple of 16 up to 256, pool [L, NB, 2, KVH, BS, "
        "D] with KVH dividing H");
  if (pt != ffi::DataType::F32 && pt != ffi::DataType::BF16 && pt != ffi::DataType::F8E4M3FN &&
      pt != ffi::DataType::S8)
    return ffi::Error::InvalidArgument("paged_attention: pool of float32, bfloat16, float8_e4m3fn or int8");
  if ((pt == ffi::DataType::S8) != (scales.element_count() * pd[5] == pool.element_count()))
    return ffi::Error::InvalidArgument("paged_attention: an int8 pool takes its scales [L, NB, 2, KVH, BS]");
  const int64_t num_tokens = qd[0], heads = qd[1], dim = qd[2], kv_heads = pd[3];
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= pd[0] || pd[1] == 0) return ffi::Error::InvalidArgument("paged_attention: layer out of range");
  const Pool pages{static_cast<const char*>(pool.untyped_data()), scales.typed_data(), pt, pd[1], kv_heads, pd[4],
                   dim};
  const bool bf16 = qt == ffi::DataType::BF16;
  const Problem p{&pages, positions.typed_data(), block_tables.typed_data(), l, td[1], heads, heads / kv_heads,
                  window.typed_data()[0], scale, soft_cap,
                  kBfloatDot && bf16 && pt == ffi::DataType::BF16 && dim % 32 == 0};
  std::vector<Tile> tiles = Tiles(token_seq.typed_data(), num_tokens);
  for (Tile& tile : tiles) tile.seq = std::clamp<int64_t>(tile.seq, 0, td[0] - 1);
  const bool tile_products = p.bf16_dot && p.window <= 0 && p.soft_cap <= 0 && pages.block_size == kTileRows &&
                             TileProductsUsable();
  const std::vector<Stretch> stretches = tile_products ? Stretches(p, tiles) : std::vector<Stretch>{};
  std::vector<bool> in_stretch(tiles.size());
  for (const Stretch& stretch : stretches)
    for (int64_t t : stretch.tiles) in_stretch[t] = true;
  std::vector<int64_t> items;  // a stretch s as -1 - s, else a tile, on each KV head (item * kv_heads + head)
  for (int64_t s = 0; s < static_cast<int64_t>(stretches.size()); ++s) items.push_back(-1 - s);
  for (int64_t t = 0; t < static_cast<int64_t>(tiles.size()); ++t)
    if (!in_stretch[t]) items.push_back(t);
  const int64_t work = static_cast<int64_t>(items.size()) * kv_heads;
  const void* q_data = q.untyped_data();
  void* out_data = out->untyped_data();
#pragma omp parallel num_threads(KernelThreads(num_tokens))
  {
    thread_local Buffers buffers;
    Grow(buffers.scratch.k, pages.block_size * dim);
    Grow(buffers.scratch.v, pages.block_size * dim);
#pragma omp for schedule(dynamic)
    for (int64_t i = 0; i < work; ++i) {
      const int64_t item = items[i / kv_heads], kv_head = i % kv_heads;
      if (item < 0)
        AttendStretch(p, tiles, stretches[-1 - item], kv_head, q_data, out_data, buffers);
      else
        AttendTileInto(p, tiles[item], kv_head, Start{}, q_data, bf16, out_data, buffers);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagePagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap"));
