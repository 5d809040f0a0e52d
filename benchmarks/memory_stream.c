// memory_stream MB PASSES: two threads, pinned to CPUs 0 and 1, each read their half of an MB buffer PASSES
// times (AVX-512 loads, nothing else between them); prints each pass's GB/s (both threads together) as a JSON
// list. A buffer read again every pass, as a model's weights are every step. benchmarks/product_speeds.py
// builds and runs it beside the kernels, to tell the memory's speed from theirs.
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static float* buffer;
static long bytes;
static int passes;
static pthread_barrier_t barrier;
static double pass_seconds[64];
static volatile float sink;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void* reader(void* arg) {
  long id = (long)arg;
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  CPU_SET(id, &cpus);
  pthread_setaffinity_np(pthread_self(), sizeof cpus, &cpus);
  const float* half = buffer + id * (bytes / 2) / 4;
  long n = (bytes / 2) / 4;
  for (int p = 0; p < passes; ++p) {
    pthread_barrier_wait(&barrier);
    double start = now();
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (long i = 0; i < n; i += 64) {
      s0 = _mm512_add_ps(s0, _mm512_load_ps(half + i));
      s1 = _mm512_add_ps(s1, _mm512_load_ps(half + i + 16));
      s2 = _mm512_add_ps(s2, _mm512_load_ps(half + i + 32));
      s3 = _mm512_add_ps(s3, _mm512_load_ps(half + i + 48));
    }
    sink += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
    pthread_barrier_wait(&barrier);
    if (id == 0) pass_seconds[p] = now() - start;
  }
  return NULL;
}

int main(int argc, char** argv) {
  if (argc != 3) return fprintf(stderr, "usage: memory_stream MB PASSES\n"), 2;
  bytes = atol(argv[1]) << 20;
  passes = atoi(argv[2]);
  if (passes < 1 || passes > 64 || bytes < (1 << 20)) return fprintf(stderr, "1-64 passes of at least 1 MB\n"), 2;
  buffer = aligned_alloc(64, bytes);
  memset(buffer, 1, bytes);
  pthread_barrier_init(&barrier, NULL, 2);
  pthread_t threads[2];
  for (long i = 0; i < 2; ++i) pthread_create(&threads[i], NULL, reader, (void*)i);
  for (int i = 0; i < 2; ++i) pthread_join(threads[i], NULL);
  printf("[");
  for (int p = 0; p < passes; ++p) printf("%s%.2f", p ? ", " : "", bytes / pass_seconds[p] / 1e9);
  printf("]\n");
  return 0;
}
