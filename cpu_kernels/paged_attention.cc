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
// tile's KV head (its group, up to four at a time) fold the page into their running softmaxes together.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "simd16.h"
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
  Scratch(int64_t bs, int64_t dim, int64_t vectors) : k(bs * dim), v(bs * dim), m(vectors), l(vectors) {}
};

// One tile's rows on one KV head: q [rows * group, D] (float32 and scaled, or bfloat16 where p.bf16_dot) ->
// acc [rows * group, D], normalised.
void AttendTile(const Problem& p, const Tile& tile, int64_t kv_head, const void* q, float* acc, Scratch& x) {
  const Pool& pool = *p.pool;
  const int64_t bs = pool.block_size, dim = pool.head_dim, vectors = tile.count * p.group;
  const int64_t q_bytes = p.bf16_dot ? 2 : 4;
  const KeyForm form = p.bf16_dot ? kBfloatKeys : kFloatKeys;
  FoldFn folds[kMaxVectors];
  for (int64_t n = 1; n <= kMaxVectors; ++n) folds[n - 1] = FoldFor(dim, n, form);
  float *m = x.m.data(), *l = x.l.data();
  std::fill(m, m + vectors, kNegInf);
  std::fill(l, l + vectors, 0.0f);
  std::fill(acc, acc + vectors * dim, 0.0f);
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = -1;
  for (int64_t r = 0; r < tile.count; ++r) {
    const int64_t pos = p.positions[tile.first + r];
    lo = std::min(lo, WindowStart(pos, p.window));
    hi = std::max(hi, pos);
  }
  const int32_t* row = p.tables + tile.seq * p.width;
  const int64_t last = std::min(hi / bs, p.width - 1);
  auto block_of = [&](int64_t page) { return std::clamp<int64_t>(row[page], 0, pool.num_blocks - 1); };
  for (int64_t page = lo / bs; page <= last; ++page) {
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

std::vector<Tile> Tiles(const int32_t* token_seq, int64_t num_tokens) {
  std::vector<Tile> tiles;
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (tiles.empty() || tiles.back().seq != token_seq[t] || tiles.back().count == kTile)
      tiles.push_back({t, 0, token_seq[t]});
    ++tiles.back().count;
  }
  return tiles;
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
  const int64_t work = static_cast<int64_t>(tiles.size()) * kv_heads;
  const void* q_data = q.untyped_data();
  void* out_data = out->untyped_data();
#pragma omp parallel
  {
    Scratch scratch(pages.block_size, dim, kTile * p.group);
    std::vector<float> qf(kTile * p.group * dim), acc(kTile * p.group * dim);
    std::vector<uint16_t> qb(p.bf16_dot ? kTile * p.group * dim : 0);
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < work; ++item) {
      const Tile& tile = tiles[item / kv_heads];
      const int64_t kv_head = item % kv_heads;
      for (int64_t r = 0; r < tile.count; ++r)
        for (int64_t g = 0; g < p.group; ++g) {
          const int64_t from = ((tile.first + r) * heads + kv_head * p.group + g) * dim;
          if (p.bf16_dot) {
            std::memcpy(qb.data() + (r * p.group + g) * dim, static_cast<const uint16_t*>(q_data) + from, dim * 2);
            continue;
          }
          float* dst = qf.data() + (r * p.group + g) * dim;
          for (int64_t d = 0; d < dim; ++d)
            dst[d] = scale * (bf16 ? Bf16ToFloat(static_cast<const uint16_t*>(q_data)[from + d])
                                   : static_cast<const float*>(q_data)[from + d]);
        }
      AttendTile(p, tile, kv_head, p.bf16_dot ? static_cast<const void*>(qb.data()) : qf.data(), acc.data(),
                 scratch);
      for (int64_t r = 0; r < tile.count; ++r)
        for (int64_t g = 0; g < p.group; ++g) {
          const int64_t to = ((tile.first + r) * heads + kv_head * p.group + g) * dim;
          const float* src = acc.data() + (r * p.group + g) * dim;
          for (int64_t d = 0; d < dim; ++d) {
            if (bf16)
              static_cast<uint16_t*>(out_data)[to + d] = FloatToBf16(src[d]);
            else
              static_cast<float*>(out_data)[to + d] = src[d];
          }
        }
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
