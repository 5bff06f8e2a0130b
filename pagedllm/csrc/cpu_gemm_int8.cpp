// Weight-only int8 GEMM y = (x (Q^T)) * scale (+ b) for CPU decode: W ~ Q * scale[n] with Q int8
// (symmetric, one float32 scale per output channel) and x, y float32.
//
// Batch-1 decode streams every weight once per step, so it is bound by memory bandwidth; int8
// weights are a quarter of the fp32 bytes. The kernel widens 16 int8 weights to 16 floats in
// registers (vpmovsxbd + vcvtdq2ps), FMAs them with a broadcast x in float32, and applies the
// channel scale once per output at the end (the scale is constant along k, so it factors out).
//
// Packed layout: like the fp32 kernel's panels of 16 outputs (cpu_gemm.cpp), but 4 panels are
// interleaved along k: Q [N, K] is cut into groups of 64 output rows (the last may have 16, 32
// or 48), each stored transposed, [K, 64]: one k step of a group is one 64-byte cache line, so a
// tile reads one sequential stream (4 streams of 16 bytes per k step, the fp32 layout in int8,
// streamed 1.45x slower on one Zen 4 core: 13 vs 19 GB/s). The tensor keeps the shape
// [N / 16, K, 16] (same bytes) so shapes check as for fp32; threads split whole groups.
// The widening costs two extra vector ops per 16 weights and tile: at one row the kernel is close
// to compute-bound (~24 GB/s per core from L2), and from ~16 rows on, where fp32 is compute-bound
// too, int8 is no faster than fp32 (level at 256 rows): it buys memory, not prefill speed.
//
// Ops: packed_linear_int8 (AVX-512 when compiled for it, else the portable code) and
// packed_linear_int8_portable (always the portable code, so its tests run on any machine).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_gemm_common.h"

#include "cpu_vec.h"

namespace {

using namespace pagedllm_gemm;

struct Problem {
  const float* x;  // [M, K], row stride ldx
  const int8_t* p;  // [N / 16, K, 16]
  const float* scale;  // [N]
  const float* bias;  // [N] or nullptr
  float* y;  // [M, N], row stride ldy
  int64_t k, ldx, ldy;
};

// Portable tile: MR rows x NR panels with plain arrays, vectorised by the compiler.
template <int MR, int NR>
inline void tile_portable(const Problem& pr, int64_t m0, int64_t p0, const int8_t* w, int64_t ks) {
  const float* x = pr.x + m0 * pr.ldx;
  float acc[MR][NR][kLanes] = {};
  for (int64_t k = 0; k < pr.k; ++k)
    for (int i = 0; i < MR; ++i) {
      const float xv = x[i * pr.ldx + k];
      for (int j = 0; j < NR; ++j)
        for (int64_t l = 0; l < kLanes; ++l)
          acc[i][j][l] += xv * static_cast<float>(w[k * ks + j * kLanes + l]);
    }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      for (int64_t l = 0; l < kLanes; ++l) {
        const int64_t n = (p0 + j) * kLanes + l;
        pr.y[(m0 + i) * pr.ldy + n] = acc[i][j][l] * pr.scale[n] + (pr.bias ? pr.bias[n] : 0.f);
      }
}

#if defined(PAGEDLLM_VEC_AVX512)
constexpr bool kHaveAvx512 = true;

// 16 int8 weights at w -> 16 floats (exact: |q| <= 127).
inline __m512 widen(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}

// AVX-512 tile: MR * NR accumulators in registers; each k step widens NR weight vectors once and
// reuses them for all MR rows.
template <int MR, int NR>
inline void tile_avx512(const Problem& pr, int64_t m0, int64_t p0, const int8_t* w, int64_t ks) {
  const float* x = pr.x + m0 * pr.ldx;
  __m512 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < pr.k; ++k) {
    __m512 wv[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) wv[j] = widen(w + k * ks + j * kLanes);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * pr.ldx + k]);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) {
    const int64_t n = (p0 + j) * kLanes;
    const __m512 s = _mm512_loadu_ps(pr.scale + n);
    const __m512 b = pr.bias ? _mm512_loadu_ps(pr.bias + n) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) _mm512_storeu_ps(pr.y + (m0 + i) * pr.ldy + n, _mm512_fmadd_ps(acc[i][j], s, b));
  }
}
#else
constexpr bool kHaveAvx512 = false;
#endif

// w: panel p0 at k = 0; panel p0 + j at w + 16 j; one k step is ks bytes (the group's width).
template <bool Simd, int MR, int NR>
inline void tile(const Problem& pr, int64_t m0, int64_t p0, const int8_t* w, int64_t ks) {
#if defined(PAGEDLLM_VEC_AVX512)
  if constexpr (Simd) return tile_avx512<MR, NR>(pr, m0, p0, w, ks);
#endif
  tile_portable<MR, NR>(pr, m0, p0, w, ks);
}

// The group of panels [g, ge) (ge - g <= 4, g a multiple of 4) for MR rows at m0: all its
// panels in one tile, or (the 1-3 panels of a last, narrower group) one tile each.
template <bool Simd, int MR>
void row_tiles(const Problem& pr, int64_t m0, int64_t g, int64_t ge) {
  const int64_t width = ge - g, ks = width * kLanes;
  const int8_t* w = pr.p + g * pr.k * kLanes;  // every group before is full: 64 K bytes
  if (width == kGroup) return tile<Simd, MR, kGroup>(pr, m0, g, w, ks);
  for (int64_t j = 0; j < width; ++j) tile<Simd, MR, 1>(pr, m0, g + j, w + j * kLanes, ks);
}

// One thread's panels [p0, p1) for all M rows (see for_each_tile); a tile exactly as tall as
// the rows left, so each weight vector is read (and widened) once. The next group's panels that
// for_each_tile offers to prefetch go unused: not measured for this layout.
template <bool Simd>
void run_panels(const Problem& pr, int64_t m, int64_t p0, int64_t p1) {
  for_each_tile(m, pr.k, p0, p1, [&](int64_t m0, int64_t mr, int64_t g, int64_t ge, int64_t, int64_t) {
    dispatch_rows(mr, [&](auto rows) { row_tiles<Simd, decltype(rows)::value>(pr, m0, g, ge); });
  });
}

// x: [..., K] fp32; packed: [N / 16, K, 16] int8; scale: [N] fp32; bias: [N] or None -> [..., N].
template <bool Simd>
at::Tensor run(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
               const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kChar, "packed weight must be int8");
  const int64_t k = packed.size(1), panels = packed.size(0), n = panels * kLanes;
  const float* scale_ptr = checked_vector(scale, n, "scale");
  TORCH_CHECK(scale_ptr != nullptr, "scale is required");
  const GemmIo io = gemm_io(x, packed, n);
  const int64_t m = io.x2.size(0);
  if (m == 0) return io.y;
  const Problem pr{io.x2.data_ptr<float>(), packed.data_ptr<int8_t>(), scale_ptr, checked_vector(bias, n, "bias"),
                   io.y.data_ptr<float>(), k, io.x2.stride(0), n};
  // Tiny weights (test models) stay on one thread: a parallel region costs more than they do.
  const int64_t grain = std::max<int64_t>(1, kMinThreadBytes / (k * kLanes));
  // Threads split whole groups of 4 panels (the interleaved unit of the layout).
  const int64_t groups = (panels + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, std::max<int64_t>(1, grain / kGroup), [&](int64_t g0, int64_t g1) {
    run_panels<Simd>(pr, m, g0 * kGroup, std::min(panels, g1 * kGroup));
  });
  return io.y;
}

at::Tensor packed_linear_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                              const std::optional<at::Tensor>& bias) {
  return run<kHaveAvx512>(x, packed, scale, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_OPS, m) {
  m.def("packed_linear_int8(Tensor x, Tensor packed, Tensor scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_OPS, CPU, m) {
  m.impl("packed_linear_int8", &packed_linear_int8);
}
