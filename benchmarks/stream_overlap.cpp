// Does this CPU overlap a weight stream's memory reads with the arithmetic on it? Built and run by
// benchmarks/stream_overlap.py with the kernels' flags for an ISA level, over pagedllm's cpu_vec.h.
//
// Each thread reads its half of a buffer much bigger than the caches as int8, widened to floats and
// multiplied into accumulators (1 + W FMAs per vector: W = 0 is the int8 LM head's tile at one
// row, larger W a heavier tile), as S sequential streams read side by side (the thread's half cut
// into S parts, a line of each per iteration), prefetching D lines ahead in each stream (0: the
// hardware prefetchers alone). Printed: GB/s of the arithmetic alone (1 MiB a thread, in L2), and
// of each (S, D) from memory. Where memory and arithmetic overlap, a run reaches the slower of the
// two; where they do not, about 1 / (1 / memory + 1 / arithmetic).
//
//   stream_overlap MIB THREADS W[,W...] S[,S...] D[,D...]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../pagedllm/csrc/cpu_vec.h"

using namespace pagedllm_vec;

namespace {

std::vector<int> ints(const char* text) {
  std::vector<int> out;
  for (const char* p = text; *p;) {
    out.push_back(std::atoi(p));
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return out;
}

// Lines [0, lines) of each of the S parts of p (part bytes apart), widened and multiplied.
__attribute__((noinline)) float run(const int8_t* p, int64_t bytes, int streams, int ahead, int work) {
  constexpr int kVecs = 64 / kWidth;  // vectors per 64-byte line of int8
  Vec acc[kVecs];
  for (Vec& a : acc) a = zero();
  const Vec x = broadcast(0.5f);
  const int64_t part = bytes / streams, lines = part / 64;
  for (int64_t l = 0; l < lines; ++l) {
    for (int s = 0; s < streams; ++s) {
      const int8_t* line = p + s * part + l * 64;
      if (ahead) prefetch_l2(line + ahead * 64);
      for (int v = 0; v < kVecs; ++v) {
        const Vec w = load_i8(line + v * kWidth);
        acc[v] = fmadd(x, w, acc[v]);
        for (int e = 0; e < work; ++e) acc[v] = fmadd(x, w, acc[v]);
      }
    }
  }
  Vec total = zero();
  for (const Vec& a : acc) total = total + a;
  return reduce_add(total);
}

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s MIB THREADS W[,W...] S[,S...] D[,D...]\n", argv[0]);
    return 2;
  }
  const int64_t bytes = std::atoll(argv[1]) << 20;
  const int threads = std::atoi(argv[2]);
  const std::vector<int> works = ints(argv[3]), streams = ints(argv[4]), aheads = ints(argv[5]);
  std::vector<int8_t> buffer(static_cast<size_t>(bytes), 1);
  const int64_t cached = 1 << 20;  // per thread: in L2
  std::vector<int8_t> small(static_cast<size_t>(threads * cached + 4096), 1);
  float sink = 0.f;
  const int64_t share = bytes / threads;
  for (int work : works) {
    double best = 1e30;
    for (int r = 0; r < 5; ++r) {
      const double t0 = seconds_now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
      {
        const int t = omp_get_thread_num();
        for (int i = 0; i < 50; ++i) sink += run(small.data() + t * cached + (i & 1) * 64, cached - 64, 1, 0, work);
      }
      best = std::min(best, seconds_now() - t0);
    }
    std::printf("arithmetic W=%d %.1f\n", work, threads * 50.0 * (cached - 64) / best / 1e9);
    for (int s : streams) {
      for (int d : aheads) {
        best = 1e30;
        for (int r = 0; r < 3; ++r) {
          const double t0 = seconds_now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
          sink += run(buffer.data() + omp_get_thread_num() * share, share, s, d, work);
          best = std::min(best, seconds_now() - t0);
        }
        std::printf("memory W=%d S=%d D=%d %.1f\n", work, s, d, bytes / best / 1e9);
      }
    }
  }
  std::fprintf(stderr, "checksum %g\n", static_cast<double>(sink));
  return 0;
}
