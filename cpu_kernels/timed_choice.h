// A choice among kernels for one call shape, made from their measured times. On the shared AMX VM measured,
// oneDNN's AMX kernel runs at one of two speeds that switch within a second and last seconds to minutes: SmolLM2's
// 8-row products took 15.9 ms against packed_gemv.cc's 23.7 in fast spells and 33.1 against 27.5 in slow ones
// (benchmarks/RESULTS.md, "AMX's two speeds"). A fixed choice loses in one of the two. Each shape keeps a moving
// average of the running kernel's time and the others' latest tries; a call runs the fastest, and every
// kExploreEvery-th call of the shape, or its first call explore_after (250 ms) after the last try, one of the others
// in turn. A change of spell is seen within about one decode step for a layer's products (a call per layer) and
// within 250 ms for the LM head (a call per step). The first call of each kernel warms it (oneDNN builds its
// primitive) and is not counted. The spells turned out to be each core's own (benchmarks/RESULTS.md, "Timed choice
// of the few-row product kernel"), so one of the kernels raced is oneDNN's work shared by the cores' speeds
// (balanced_split.h), which costs its buffers' copy where the cores run alike.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

namespace jaxpage {

class TimedChoice {
 public:
  using Key = std::tuple<int64_t, int64_t, int64_t>;  // rows, K, N

  explicit TimedChoice(int kernels = 2, std::chrono::milliseconds explore_after = std::chrono::milliseconds(250))
      : kernels_(kernels), explore_after_(explore_after) {}

  // The kernel (0 to kernels - 1) this call of `key` runs.
  int Pick(const Key& key) {
    std::lock_guard<std::mutex> lock(mu_);
    Times& t = Get(key);
    const uint64_t call = t.calls++;
    if (call < uint64_t(2 * kernels_)) return int(call % kernels_);  // each twice: its first call warms it
    const int fastest = Fastest(t);
    const auto now = std::chrono::steady_clock::now();
    if (call % kExploreEvery != 0 && now - t.last_try < explore_after_) return fastest;
    t.last_try = now;
    t.tried = (t.tried + 1) % kernels_;  // the others in turn
    if (t.tried == fastest) t.tried = (t.tried + 1) % kernels_;
    return t.tried;
  }

  // Records that kernel `kernel` took `ns` for a call of `key` that Pick chose.
  void Record(const Key& key, int kernel, double ns) {
    std::lock_guard<std::mutex> lock(mu_);
    Times& t = Get(key);
    if (++t.samples[kernel] == 1) return;  // a warming call
    double& avg = t.ns[kernel];
    // The kernel running now: a moving average of its calls. The others, seen only on their tries: the latest
    // try (one slow try changes nothing; a fast one is checked by the calls that follow).
    avg = t.samples[kernel] == 2 || kernel != Fastest(t) ? ns : avg + 0.25 * (ns - avg);
  }

 private:
  static constexpr uint64_t kExploreEvery = 32;
  struct Times {
    uint64_t calls = 0;
    std::vector<uint64_t> samples;
    std::vector<double> ns;
    int tried = 0;
    std::chrono::steady_clock::time_point last_try;
  };

  Times& Get(const Key& key) {
    Times& t = times_[key];
    if (t.ns.empty()) t.samples.assign(kernels_, 0), t.ns.assign(kernels_, 0.0);
    return t;
  }
  static int Fastest(const Times& t) {
    return int(std::min_element(t.ns.begin(), t.ns.end()) - t.ns.begin());
  }

  const int kernels_;
  const std::chrono::milliseconds explore_after_;
  std::mutex mu_;
  std::map<Key, Times> times_;
};

inline double ElapsedNs(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - since).count();
}

}  // namespace jaxpage
