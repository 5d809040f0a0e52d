// 16-lane float32 vectors (one AVX-512 register, two AVX ones) with GCC/Clang vector extensions, and the few
// operations on them that the CPU kernels share: loads, selects, lane reductions, exp; bfloat16 to and from float32
// (AVX-512 instructions where the CPU has them).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace jaxpage {

inline float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

typedef float F16 __attribute__((vector_size(64)));  // 16 lanes: one AVX-512 register, two AVX ones
typedef int32_t I16 __attribute__((vector_size(64)));
typedef uint32_t U16 __attribute__((vector_size(64)));
typedef uint16_t H16 __attribute__((vector_size(32)));  // 16 bfloat16 values

inline F16 Load16(const float* p) {
  F16 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

inline void Store16(float* p, F16 x) { std::memcpy(p, &x, sizeof x); }

inline uint16_t FloatToBf16(float f) {  // round to nearest even, as XLA's convert
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN stays NaN
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

inline F16 LoadBf16(const uint16_t* p) {
#if defined(__AVX512F__)
  return (F16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
  H16 h;
  std::memcpy(&h, p, sizeof h);
  return (F16)(__builtin_convertvector(h, U16) << 16);
#endif
}

inline void StoreBf16(uint16_t* p, F16 x) {  // FloatToBf16 on 16 lanes
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh((__m512)x));
#else
  U16 bits = (U16)x;
  const U16 nan = (bits & 0x7fffffff) > 0x7f800000;
  bits = (nan & ((bits >> 16) | 0x40)) | (~nan & ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16));
  const H16 h = __builtin_convertvector(bits, H16);
  std::memcpy(p, &h, sizeof h);
#endif
}

// 16 lanes at element i of p, bfloat16 (kBf16) or float32, as float32; and back, rounded once
template <bool kBf16>
inline F16 Load(const void* p, int64_t i) {
  if constexpr (kBf16) return LoadBf16(static_cast<const uint16_t*>(p) + i);
  return Load16(static_cast<const float*>(p) + i);
}

template <bool kBf16>
inline void Store(void* p, int64_t i, F16 x) {
  if constexpr (kBf16)
    StoreBf16(static_cast<uint16_t*>(p) + i, x);
  else
    Store16(static_cast<float*>(p) + i, x);
}

inline float Sum16(F16 x) {
#if defined(__clang__)
  x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#else
  x += __builtin_shuffle(x, I16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  x += __builtin_shuffle(x, I16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  x += __builtin_shuffle(x, I16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  x += __builtin_shuffle(x, I16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#endif
  return x[0];
}

#if defined(__clang__)
#define SHUFFLE2(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
#define SHUFFLE2(x, y, ...) __builtin_shuffle(x, y, I16{__VA_ARGS__})
#endif

inline F16 Select(I16 mask, F16 a, F16 b) { return (F16)(((I16)a & mask) | ((I16)b & ~mask)); }

inline float Max16(F16 x) {
  float r = x[0];
  for (int i = 1; i < 16; ++i) r = std::max(r, x[i]);
  return r;
}

// exp(x) for x <= 0 on 16 lanes (Cephes' expf polynomial, ~1 ulp)
inline F16 Exp16(F16 x) {
  const F16 lowest = F16{} - 87.0f;
  x = Select(x < lowest, lowest, x);
  const F16 t = x * 1.44269504f + 0.5f;
#if defined(__AVX512F__)
  const F16 n = (F16)_mm512_roundscale_ps((__m512)t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const I16 ni = __builtin_convertvector(n, I16);
#else
  I16 ni = __builtin_convertvector(t, I16);  // toward zero, then down where that rounded up
  F16 n = __builtin_convertvector(ni, F16);
  const I16 above = n > t;
  ni += above;
  n = __builtin_convertvector(ni, F16);
#endif
  const F16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  F16 y = F16{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  return y * (F16)((ni + 127) << 23);
}

}  // namespace jaxpage
