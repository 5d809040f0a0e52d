// The plain greedy sampler's reductions over each row of logits in one kernel: the token (the first of the row's
// largest values, as jnp.argmax) and its log-probability, (x - max) - log(sum(exp(x - max))). XLA:CPU computes
// these as four passes over [rows, vocab] with a float32 copy and a broadcast of the max materialized (~6 ms a
// step at 32 rows of SmolLM2's 49,152 logits); here each row is converted once into a thread's float32 buffer
// (L2-sized) and read twice, the rows split over the OpenMP team.
//
// logits [S, V] float32 or bfloat16 -> tokens [S] int32, logprobs [S] float32. Attribute soft_cap (0: none; else
// x becomes soft_cap * tanh(x / soft_cap) first, as the model's logits). A row with a NaN gets a NaN
// log-probability.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "simd16.h"
#include "threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxpage;  // simd16.h

// Row ``x`` [V] as float32 (soft-capped) into ``row``; returns (max, first index of the max). NaNs are passed
// over here; the sum of exponentials then makes the log-probability NaN.
std::pair<float, int64_t> ConvertAndFindMax(const void* x, bool bf16, int64_t vocab, float soft_cap, float* row) {
  if (bf16) {
    const uint16_t* h = static_cast<const uint16_t*>(x);
#pragma omp simd
    for (int64_t i = 0; i < vocab; ++i) row[i] = Bf16ToFloat(h[i]);
  } else {
    std::memcpy(row, x, vocab * sizeof(float));
  }
  if (soft_cap > 0)
    for (int64_t i = 0; i < vocab; ++i) row[i] = soft_cap * std::tanh(row[i] / soft_cap);
  F16 top = F16{} - std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + 16 <= vocab; i += 16) {
    const F16 v = Load16(row + i);
    top = Select(v > top, v, top);
  }
  float best = Max16(top);
  for (; i < vocab; ++i) best = row[i] > best ? row[i] : best;
  int64_t first = 0;
  while (first < vocab - 1 && row[first] != best) ++first;  // an all -inf (or NaN) row: the first token
  return {best, first};
}

float SumExp(const float* row, int64_t vocab, float max) {
  F16 sum{};
  int64_t i = 0;
  for (; i + 16 <= vocab; i += 16) sum += Exp16(Load16(row + i) - max);
  float tail = 0.0f;
  for (; i < vocab; ++i) tail += std::exp(row[i] - max);
  return Sum16(sum) + tail;
}

ffi::Error GreedyPick(ffi::AnyBuffer logits, ffi::Result<ffi::Buffer<ffi::S32>> tokens,
                      ffi::Result<ffi::Buffer<ffi::F32>> logprobs, float soft_cap) {
  auto d = logits.dimensions();
  const auto t = logits.element_type();
  if (d.size() != 2 || (t != ffi::DataType::F32 && t != ffi::DataType::BF16) || d[1] == 0 ||
      tokens->element_count() != d[0] || logprobs->element_count() != d[0])
    return ffi::Error::InvalidArgument("greedy_pick: logits [S, V] float32 or bfloat16, V > 0; outputs [S]");
  const int64_t rows = d[0], vocab = d[1];
  const bool bf16 = t == ffi::DataType::BF16;
  const char* data = static_cast<const char*>(logits.untyped_data());
  const int64_t row_bytes = vocab * ffi::ByteWidth(t);
  int32_t* out_tokens = tokens->typed_data();
  float* out_logprobs = logprobs->typed_data();
#pragma omp parallel num_threads(KernelThreads(rows))
  {
    std::vector<float> row(vocab);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      auto [max, token] = ConvertAndFindMax(data + r * row_bytes, bf16, vocab, soft_cap, row.data());
      out_tokens[r] = static_cast<int32_t>(token);
      out_logprobs[r] = (row[token] - max) - std::log(SumExp(row.data(), vocab, max));
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageGreedyPick, GreedyPick,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("soft_cap"));
