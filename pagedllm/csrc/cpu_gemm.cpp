// fp32 GEMM y = x W^T (+ b) for CPU on a weight packed once into column panels, tuned for
// decode: at a few rows the step is bound by streaming the weight, so the kernel reads every
// weight byte exactly once per call, in long sequential runs, and keeps all sums in registers.
//
// Packed layout: W [N, K] -> P [N / 16, K, 16], P[p, k, j] = W[16 p + j, k]. One k step of a
// panel is one 64-byte vector (16 outputs), so the inner loop is a broadcast of x[m, k] times a
// vector load: no horizontal sums, and the same layout serves 1 row and a prefill's thousands.
// Threads split the panels (at::parallel_for), so each weight byte is read by one core.
//
// Ops: packed_linear (AVX-512 when compiled for it, else the portable code) and
// packed_linear_portable (always the portable code, so its tests run on any machine).
// Only light ATen headers (no torch/extension.h, no pybind): the first-use build takes seconds.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_gemm_common.h"

#include "cpu_vec.h"

namespace {

using namespace pagedllm_gemm;

struct Problem {
  const float* x;  // [M, K], row stride ldx
  const float* p;  // [N / 16, K, 16]
  const float* bias;  // [N] or nullptr
  float* y;  // [M, N], row stride ldy
  int64_t k, ldx, ldy;
};

// Portable tile: MR rows x NR panels with plain arrays, vectorised by the compiler.
template <int MR, int NR>
inline void tile_portable(const Problem& pr, int64_t m0, int64_t p0) {
  const int64_t panel = pr.k * kLanes;
  const float* w = pr.p + p0 * panel;
  const float* x = pr.x + m0 * pr.ldx;
  float acc[MR][NR][kLanes] = {};
  for (int64_t k = 0; k < pr.k; ++k)
    for (int i = 0; i < MR; ++i) {
      const float xv = x[i * pr.ldx + k];
      for (int j = 0; j < NR; ++j)
        for (int64_t l = 0; l < kLanes; ++l) acc[i][j][l] += xv * w[j * panel + k * kLanes + l];
    }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      for (int64_t l = 0; l < kLanes; ++l) {
        const int64_t n = (p0 + j) * kLanes + l;
        pr.y[(m0 + i) * pr.ldy + n] = acc[i][j][l] + (pr.bias ? pr.bias[n] : 0.f);
      }
}

#if defined(PAGEDLLM_VEC_AVX512)
constexpr bool kHaveAvx512 = true;

// AVX-512 tile: the MR * NR accumulators live in registers; each k step loads NR weight vectors
// once and reuses them for all MR rows. With Prefetch, each k step also prefetches its line of the
// panels at pf and pf2 into L2 (see for_each_tile; pf2 == pf for one panel): a k step's MR * NR
// FMAs leave the load ports room for it.
template <int MR, int NR, bool Prefetch>
inline void tile_avx512(const Problem& pr, int64_t m0, int64_t p0, const float* pf, const float* pf2) {
  const int64_t panel = pr.k * kLanes;
  const float* w = pr.p + p0 * panel;
  const float* x = pr.x + m0 * pr.ldx;
  __m512 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < pr.k; ++k) {
    if constexpr (Prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + k * kLanes), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(pf2 + k * kLanes), _MM_HINT_T1);
    }
    __m512 wv[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_ps(w + j * panel + k * kLanes);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * pr.ldx + k]);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) {
    const __m512 b = pr.bias ? _mm512_loadu_ps(pr.bias + (p0 + j) * kLanes) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
      _mm512_storeu_ps(pr.y + (m0 + i) * pr.ldy + (p0 + j) * kLanes, _mm512_add_ps(acc[i][j], b));
  }
}
#else
constexpr bool kHaveAvx512 = false;
#endif

// MR rows at m0 times the NR panels from p0, prefetching the panels [f0, f1) (0-2).
template <bool Simd, int MR, int NR>
inline void tile(const Problem& pr, int64_t m0, int64_t p0, int64_t f0, int64_t f1) {
#if defined(PAGEDLLM_VEC_AVX512)
  if constexpr (Simd) {
    const float* pf = pr.p + f0 * pr.k * kLanes;
    if (f1 == f0) return tile_avx512<MR, NR, false>(pr, m0, p0, pf, pf);
    return tile_avx512<MR, NR, true>(pr, m0, p0, pf, pf + (f1 - f0 - 1) * pr.k * kLanes);
  }
#endif
  tile_portable<MR, NR>(pr, m0, p0);
}

// The group of panels [g, ge) (1-4 panels) for MR rows at m0, in one tile: a thread's last 1-3
// panels in a narrower tile, which still loads each weight vector once for all MR rows.
template <bool Simd, int MR>
void row_tiles(const Problem& pr, int64_t m0, int64_t g, int64_t ge, int64_t f0, int64_t f1) {
  switch (ge - g) {
    case 1: return tile<Simd, MR, 1>(pr, m0, g, f0, f1);
    case 2: return tile<Simd, MR, 2>(pr, m0, g, f0, f1);
    case 3: return tile<Simd, MR, 3>(pr, m0, g, f0, f1);
    default: return tile<Simd, MR, kGroup>(pr, m0, g, f0, f1);
  }
}

// One thread's panels [p0, p1) for all M rows (see for_each_tile).
template <bool Simd>
void run_panels(const Problem& pr, int64_t m, int64_t p0, int64_t p1) {
  for_each_tile(m, pr.k, p0, p1, [&](int64_t m0, int64_t mr, int64_t g, int64_t ge, int64_t f0, int64_t f1) {
    dispatch_rows(mr, [&](auto rows) { row_tiles<Simd, decltype(rows)::value>(pr, m0, g, ge, f0, f1); });
  });
}

// x: [..., K] fp32; packed: [N / 16, K, 16] fp32 (see the top); bias: [N] or None -> [..., N].
template <bool Simd>
at::Tensor run(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kFloat, "packed weight must be float32");
  const int64_t k = packed.size(1), panels = packed.size(0), n = panels * kLanes;
  const GemmIo io = gemm_io(x, packed, n);
  const int64_t m = io.x2.size(0);
  if (m == 0) return io.y;
  const Problem pr{io.x2.data_ptr<float>(), packed.data_ptr<float>(), checked_vector(bias, n, "bias"),
                   io.y.data_ptr<float>(), k, io.x2.stride(0), n};
  // Tiny weights (test models) stay on one thread: a parallel region costs more than they do.
  const int64_t grain = std::max<int64_t>(1, kMinThreadBytes / (k * kLanes * 4));
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) { run_panels<Simd>(pr, m, p0, p1); });
  return io.y;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  return run<kHaveAvx512>(x, packed, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_OPS, m) {
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_OPS, CPU, m) {
  m.impl("packed_linear", &packed_linear);
}
