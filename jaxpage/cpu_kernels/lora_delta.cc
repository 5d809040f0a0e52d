// A step's LoRA deltas on the CPU, each token against its own adapter only (vLLM's punica shrink and expand):
// out[t] = (x[t] . a[s]) . b[s] with s = slots[t], x [T, K], a [S, K, R], b [S, R, N]; slot 0 (no adapter) or a
// slot out of range gives zeros. XLA's form multiplies every token by every slot of the step under a one-hot
// mask, so its work grows with the number of adapters; here the tokens are grouped by slot and each group reads
// its adapter's A and B once. float32 or bfloat16 tokens and weights, float32 accumulation, out in x's dtype.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define JAXPAGE_LORA_AVX512 1
#include <immintrin.h>
#endif

#include "threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kColumns = 256;  // an expand job's output columns
constexpr int64_t kTile = 16;      // a job's tokens, all of one adapter

inline float ToFloat(float v) { return v; }
inline float ToFloat(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline void Store(float v, float* out) { *out = v; }
inline void Store(float v, uint16_t* out) {  // round to nearest even, as XLA's convert
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  *out = std::isnan(v) ? 0x7fc0 : static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

struct Tile {
  int64_t slot, begin, end;  // up to kTile tokens of one adapter: order[begin:end]
};

// The tokens' order grouped by slot (the unadapted first: order[0:*none]) and the adapted ones in tiles.
std::vector<Tile> Tiles(const int32_t* slots, int64_t T, int64_t S, std::vector<int64_t>& order, int64_t* none) {
  std::vector<int64_t> count(S, 0), next(S, 0);
  auto slot = [&](int64_t t) -> int64_t { return (slots[t] > 0 && slots[t] < S) ? slots[t] : 0; };
  for (int64_t t = 0; t < T; ++t) ++count[slot(t)];
  for (int64_t s = 1; s < S; ++s) next[s] = next[s - 1] + count[s - 1];
  for (int64_t t = 0; t < T; ++t) order[next[slot(t)]++] = t;
  std::vector<Tile> tiles;
  for (int64_t s = 1, begin = count[0]; s < S; begin += count[s++])
    for (int64_t b = begin; b < begin + count[s]; b += kTile) tiles.push_back({s, b, std::min(b + kTile, begin + count[s])});
  *none = count[0];
  return tiles;
}

// out_i[n0:n0 + width] = a_i . w[:, n0:n0 + width] for each row i of a tile: a_i (K values of A) and out_i (of O)
// given by pointers, w [K, N] row-major; float accumulation.
#ifdef JAXPAGE_LORA_AVX512
inline __m512 Load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 Load(const uint16_t* p, __mmask16 m) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void Put(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void Put(uint16_t* p, __m512 v, __mmask16 m) {  // round to nearest even; NaN stays NaN
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i high = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  high = _mm512_mask_mov_epi32(high, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(high));
}

template <int Rows, int Vecs, typename A, typename W, typename O>
void Block(const A* const* a, const W* w, O* const* out, int64_t K, int64_t N, int64_t n0, int64_t width) {
  __mmask16 mask[Vecs];
  for (int j = 0; j < Vecs; ++j) {
    const int64_t left = width - 16 * j;
    mask[j] = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
  }
  __m512 acc[Rows][Vecs];
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Vecs; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[Vecs];
    for (int j = 0; j < Vecs; ++j) wv[j] = Load(w + k * N + n0 + 16 * j, mask[j]);
    for (int r = 0; r < Rows; ++r) {
      const __m512 av = _mm512_set1_ps(ToFloat(a[r][k]));
      for (int j = 0; j < Vecs; ++j) acc[r][j] = _mm512_fmadd_ps(av, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Vecs; ++j) Put(out[r] + n0 + 16 * j, acc[r][j], mask[j]);
}

template <int Rows, typename A, typename W, typename O>
void Columns(const A* const* a, const W* w, O* const* out, int64_t K, int64_t N, int64_t n0, int64_t width) {
  for (int64_t n = n0; n < n0 + width; n += 64) {
    const int64_t cols = std::min<int64_t>(64, n0 + width - n);
    switch ((cols + 15) / 16) {
      case 1: Block<Rows, 1>(a, w, out, K, N, n, cols); break;
      case 2: Block<Rows, 2>(a, w, out, K, N, n, cols); break;
      case 3: Block<Rows, 3>(a, w, out, K, N, n, cols); break;
      default: Block<Rows, 4>(a, w, out, K, N, n, cols); break;
    }
  }
}

template <typename A, typename W, typename O>
void Product(const A* const* a, const W* w, O* const* out, int64_t rows, int64_t K, int64_t N, int64_t n0,
             int64_t width) {
  for (int64_t r = 0; r < rows; r += 4) {
    switch (std::min<int64_t>(4, rows - r)) {
      case 1: Columns<1>(a + r, w, out + r, K, N, n0, width); break;
      case 2: Columns<2>(a + r, w, out + r, K, N, n0, width); break;
      case 3: Columns<3>(a + r, w, out + r, K, N, n0, width); break;
      default: Columns<4>(a + r, w, out + r, K, N, n0, width); break;
    }
  }
}
#else
template <typename A, typename W, typename O>
void Product(const A* const* a, const W* w, O* const* out, int64_t rows, int64_t K, int64_t N, int64_t n0,
             int64_t width) {
  std::vector<float> acc(width);
  for (int64_t r = 0; r < rows; ++r) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const float v = ToFloat(a[r][k]);
      for (int64_t n = 0; n < width; ++n) acc[n] += v * ToFloat(w[k * N + n0 + n]);
    }
    for (int64_t n = 0; n < width; ++n) Store(acc[n], out[r] + n0 + n);
  }
}
#endif

template <typename X, typename W>
void Delta(const X* x, const W* a, const W* b, const int32_t* slots, X* out, int64_t T, int64_t K, int64_t R,
           int64_t N, int64_t S) {
  std::vector<int64_t> order(T);
  int64_t none = 0;
  const std::vector<Tile> tiles = Tiles(slots, T, S, order, &none);
  for (int64_t i = 0; i < none; ++i) std::memset(out + order[i] * N, 0, N * sizeof(X));  // 0.0 in either dtype
  std::vector<float> xa(T * R);  // shrink: each adapted token's x . a[s], at its place in order
  std::vector<const X*> x_rows(T);
  std::vector<float*> xa_rows(T);
  std::vector<X*> out_rows(T);
  for (int64_t i = 0; i < T; ++i) {
    x_rows[i] = x + order[i] * K;
    xa_rows[i] = xa.data() + i * R;
    out_rows[i] = out + order[i] * N;
  }
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
#pragma omp parallel for schedule(dynamic) num_threads(jaxpage::KernelThreads(T))
  for (int64_t j = 0; j < num_tiles; ++j) {
    const Tile& t = tiles[j];
    Product(x_rows.data() + t.begin, a + t.slot * K * R, xa_rows.data() + t.begin, t.end - t.begin, K, R, 0, R);
  }
  const int64_t chunks = (N + kColumns - 1) / kColumns;  // expand: a tile against a column chunk of b[s]
#pragma omp parallel for schedule(dynamic) num_threads(jaxpage::KernelThreads(T))
  for (int64_t job = 0; job < num_tiles * chunks; ++job) {
    const Tile& t = tiles[job / chunks];
    const int64_t n0 = (job % chunks) * kColumns;
    Product<float>(xa_rows.data() + t.begin, b + t.slot * R * N, out_rows.data() + t.begin, t.end - t.begin, R,
                   N, n0, std::min(kColumns, N - n0));
  }
}

template <typename X>
ffi::Error Dispatch(ffi::AnyBuffer x, ffi::AnyBuffer a, ffi::AnyBuffer b, const int32_t* slots, void* out,
                    int64_t T, int64_t K, int64_t R, int64_t N, int64_t S) {
  const X* xs = static_cast<const X*>(x.untyped_data());
  if (a.element_type() == ffi::DataType::F32)
    Delta(xs, static_cast<const float*>(a.untyped_data()), static_cast<const float*>(b.untyped_data()), slots,
          static_cast<X*>(out), T, K, R, N, S);
  else
    Delta(xs, static_cast<const uint16_t*>(a.untyped_data()), static_cast<const uint16_t*>(b.untyped_data()),
          slots, static_cast<X*>(out), T, K, R, N, S);
  return ffi::Error::Success();
}

ffi::Error LoraDelta(ffi::AnyBuffer x, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::S32> slots,
                     ffi::Result<ffi::AnyBuffer> out) {
  auto xd = x.dimensions(), ad = a.dimensions(), bd = b.dimensions();
  const auto f32 = ffi::DataType::F32, bf16 = ffi::DataType::BF16;
  if (xd.size() != 2 || ad.size() != 3 || bd.size() != 3 || ad[1] != xd[1] || bd[0] != ad[0] || bd[1] != ad[2] ||
      slots.element_count() != xd[0] || out->element_type() != x.element_type() ||
      out->element_count() != xd[0] * bd[2])
    return ffi::Error::InvalidArgument("lora_delta: x [T, K], a [S, K, R], b [S, R, N], slots [T], out [T, N]");
  if ((x.element_type() != f32 && x.element_type() != bf16) || a.element_type() != b.element_type() ||
      (a.element_type() != f32 && a.element_type() != bf16))
    return ffi::Error::InvalidArgument("lora_delta: float32 or bfloat16 x, and a and b of one of those");
  const int64_t T = xd[0], K = xd[1], R = ad[2], N = bd[2], S = ad[0];
  if (x.element_type() == f32)
    return Dispatch<float>(x, a, b, slots.typed_data(), out->untyped_data(), T, K, R, N, S);
  return Dispatch<uint16_t>(x, a, b, slots.typed_data(), out->untyped_data(), T, K, R, N, S);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageLoraDelta, LoraDelta,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());
