// How many OpenMP threads a kernel call over `rows` rows (tokens) takes: one up to JAXPAGE_CPU_SERIAL_ROWS rows,
// the whole team above (default 0: always the team). Such a call reads its weights or pages more than it computes.
// Where one thread reads memory about as fast as two, one thread saves the fork and the join that waits for the
// slower thread (a decode step makes ~150 such calls): on one AMX Xeon VM, 8 took 8% off the p99 ITL at 8
// streams. On another (one thread 7.5-8 GB/s, two 12-13 together) it cost 13-20% of tokens/s at 1 and 8 streams,
// so it is off unless a measurement on the host says otherwise (benchmarks/RESULTS.md, "One thread for few rows"
// and "A chunk cap of 32 on a CPU, and the thread cap on another host").
#pragma once

#include <omp.h>

#include <cstdint>
#include <cstdlib>

namespace jaxpage {

inline int KernelThreads(int64_t rows) {
  static const int64_t serial_rows = [] {
    const char* v = std::getenv("JAXPAGE_CPU_SERIAL_ROWS");
    return v != nullptr ? std::atoll(v) : int64_t{0};
  }();
  static const int all = omp_get_max_threads();
  return rows <= serial_rows ? 1 : all;
}

// The OpenMP threads an elementwise kernel's call over `rows` rows of `elements` in all takes: the whole team
// (KernelThreads) from kParallelElements, one below. A parallel region from XLA's calling thread (the second thread
// woken, then joined) cost more than it saved at 32 and 96 rows of SiluAndMul's 1,536 columns; a prompt's wave of
// 2,048 rows spent 94 ms a step in SiluAndMul and 34 in the norms on one thread (benchmarks/RESULTS.md, "The
// elementwise kernels of a wave's prefill on both cores").
inline int ElementwiseThreads(int64_t rows, int64_t elements) {
  constexpr int64_t kParallelElements = int64_t{1} << 19;
  return elements >= kParallelElements ? KernelThreads(rows) : 1;
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
