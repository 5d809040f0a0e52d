// How many OpenMP threads a kernel call over `rows` rows (tokens) takes. Up to JAXPAGE_CPU_SERIAL_ROWS rows
// (default 8) one: such a call reads its weights or pages more than it computes, and one thread read them about
// as fast as two here, without the fork and the join that waits for the slower thread each call (a decode step
// makes ~150 such calls). The other core is then free for the host, the server and its clients
// (benchmarks/RESULTS.md, "One thread for few rows").
#pragma once

#include <omp.h>

#include <cstdint>
#include <cstdlib>

namespace jaxpage {

inline int KernelThreads(int64_t rows) {
  static const int64_t serial_rows = [] {
    const char* v = std::getenv("JAXPAGE_CPU_SERIAL_ROWS");
    return v != nullptr ? std::atoll(v) : int64_t{8};
  }();
  static const int all = omp_get_max_threads();
  return rows <= serial_rows ? 1 : all;
}

// Caps the calling thread's OpenMP team for a library that forks its own (oneDNN), restored on leaving the scope.
class ThreadCap {
 public:
  explicit ThreadCap(int threads) : before_(omp_get_max_threads()) { omp_set_num_threads(threads); }
  ~ThreadCap() { omp_set_num_threads(before_); }
  ThreadCap(const ThreadCap&) = delete;
  ThreadCap& operator=(const ThreadCap&) = delete;

 private:
  int before_;
};

}  // namespace jaxpage
