// 16-lane float32 vectors (one AVX-512 register, two AVX ones) with GCC/Clang vector extensions, and the few
// operations on them that the CPU kernels share: loads, selects, lane reductions, exp; and bfloat16 to float32.
#pragma once

#include <cstdint>
#include <cstring>

namespace jaxpage {

inline float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

typedef float F16 __attribute__((vector_size(64)));  // 16 lanes: one AVX-512 register, two AVX ones
typedef int32_t I16 __attribute__((vector_size(64)));

inline F16 Load16(const float* p) {
  F16 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

inline void Store16(float* p, F16 x) { std::memcpy(p, &x, sizeof x); }

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
  I16 ni = __builtin_convertvector(t, I16);  // toward zero, then down where that rounded up
  F16 n = __builtin_convertvector(ni, F16);
  const I16 above = n > t;
  ni += above;
  n = __builtin_convertvector(ni, F16);
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
