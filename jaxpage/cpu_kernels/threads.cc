// The OpenMP threads a kernel call over `rows` rows takes (threads.h), exported for the tests.
#include <cstdint>

#include "threads.h"

extern "C" int jaxpage_kernel_threads(int64_t rows) { return jaxpage::KernelThreads(rows); }
