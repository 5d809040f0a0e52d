// How a product's column blocks are shared among the threads of a team, from each thread's measured speed. On the
// shared AMX VM measured, each core's AMX unit slows down (up to 3x) at its own times (benchmarks/RESULTS.md,
// "Timed choice of the few-row product kernel"), and oneDNN's static split of a product then waits for the slower
// core. Here each thread runs one-thread oneDNN calls over its own contiguous stretch of blocks, and after each call
// a thread's share moves halfway towards its share of the team's speed (blocks per ns), so a fast core takes more
// (benchmarks/RESULTS.md, "A product's columns shared by the cores' speeds"). A stretch starts and ends on a grain
// of blocks (at most 32 grains a product): each distinct stretch is a oneDNN primitive built once.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

namespace jaxpage {

class BalancedSplit {
 public:
  using Key = std::tuple<int64_t, int64_t, int64_t, int>;  // rows, K, N, threads

  // Thread t's blocks are [bounds[t], bounds[t + 1]) of `blocks`; each thread has at least one grain.
  std::vector<int64_t> Bounds(const Key& key, int64_t blocks, int threads) {
    std::vector<double> share = Shares(key, threads);
    const int64_t grain = std::max<int64_t>(1, blocks / kMaxGrains), grains = blocks / grain;
    std::vector<int64_t> bounds(threads + 1, 0);
    double before = 0;
    for (int t = 1; t < threads; ++t) {
      before += share[t - 1];
      const int64_t g = std::llround(before * grains);
      bounds[t] = std::clamp<int64_t>(g, bounds[t - 1] / grain + 1, grains - (threads - t)) * grain;
    }
    bounds[threads] = blocks;
    return bounds;
  }

  // Records the ns each thread took for its blocks [bounds[t], bounds[t + 1]) in one call of `key`.
  void Record(const Key& key, const std::vector<int64_t>& bounds, const std::vector<double>& ns) {
    const int threads = int(ns.size());
    std::vector<double> speed(threads);
    double total = 0;
    for (int t = 0; t < threads; ++t) total += speed[t] = double(bounds[t + 1] - bounds[t]) / std::max(ns[t], 1.0);
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<double>& share = shares_[key];
    if (int(share.size()) != threads) return;
    for (int t = 0; t < threads; ++t) share[t] += kStep * (speed[t] / total - share[t]);
  }

 private:
  static constexpr int64_t kMaxGrains = 32;
  static constexpr double kStep = 0.5;

  std::vector<double> Shares(const Key& key, int threads) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<double>& share = shares_[key];
    if (share.empty()) share.assign(threads, 1.0 / threads);
    return share;
  }

  std::mutex mu_;
  std::map<Key, std::vector<double>> shares_;
};

}  // namespace jaxpage
