// A choice between two kernels for one call shape, made from their measured times. On the shared AMX VM measured,
// oneDNN's AMX kernel runs at one of two speeds that switch within a second and last seconds to minutes: SmolLM2's
// 8-row products took 15.9 ms against packed_gemv.cc's 23.7 in fast spells and 33.1 against 27.5 in slow ones
// (benchmarks/RESULTS.md, "AMX's two speeds"). A fixed choice loses in one of the two. Each shape keeps a moving
// average of the running kernel's time and the other's latest try; a call runs the faster, and every
// kExploreEvery-th call of the shape, or its first call explore_after (250 ms) after the last try, the other. A change of
// spell is seen within about one decode step for a layer's products (a call per layer) and within 250 ms for the
// LM head (a call per step). The first call of each kernel warms it (oneDNN builds its primitive) and is not
// counted. The spells turned out to be each core's own (benchmarks/RESULTS.md, "Timed choice of the few-row
// product kernel"): oneDNN splits a product statically over the cores and waits for the slower one.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

namespace jaxpage {

class TimedChoice {
 public:
  using Key = std::tuple<int64_t, int64_t, int64_t>;  // rows, K, N

  explicit TimedChoice(std::chrono::milliseconds explore_after = std::chrono::milliseconds(250))
      : explore_after_(explore_after) {}

  // The kernel (0 or 1) this call of `key` runs.
  int Pick(const Key& key) {
    std::lock_guard<std::mutex> lock(mu_);
    Times& t = times_[key];
    const uint64_t call = t.calls++;
    if (call < kWarmCalls) return int(call % 2);
    const int faster = t.ns[1] < t.ns[0] ? 1 : 0;
    const auto now = std::chrono::steady_clock::now();
    if (call % kExploreEvery != 0 && now - t.last_try < explore_after_) return faster;
    t.last_try = now;
    return 1 - faster;
  }

  // Records that kernel `kernel` took `ns` for a call of `key` that Pick chose.
  void Record(const Key& key, int kernel, double ns) {
    std::lock_guard<std::mutex> lock(mu_);
    Times& t = times_[key];
    if (++t.samples[kernel] == 1) return;  // a warming call
    double& avg = t.ns[kernel];
    // The kernel running now: a moving average of its calls. The other, seen only on its tries: its
    // latest try (one slow try changes nothing; a fast one is checked by the calls that follow).
    const int faster = t.ns[1] < t.ns[0] ? 1 : 0;
    avg = t.samples[kernel] == 2 || kernel != faster ? ns : avg + 0.25 * (ns - avg);
  }

 private:
  static constexpr uint64_t kWarmCalls = 4;  // per shape: kernels 0, 1, 0, 1, the last two each one's first time
  static constexpr uint64_t kExploreEvery = 32;
  struct Times {
    uint64_t calls = 0;
    uint64_t samples[2] = {0, 0};
    double ns[2] = {0, 0};
    std::chrono::steady_clock::time_point last_try;
  };
  const std::chrono::milliseconds explore_after_;
  std::mutex mu_;
  std::map<Key, Times> times_;
};

inline double ElapsedNs(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - since).count();
}

}  // namespace jaxpage
