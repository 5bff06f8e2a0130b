// Group-wise int4 weight-only GEMM y = x W^T (+ b) for CPU: W[n, k] = (q[n, k] - z[n, g]) * s[n, g]
// with q in 0..15, g = k / G (G inputs per group), one float32 scale s and zero point z per output
// and group; x and y float32. Half the bytes of int8, an eighth of fp32: batch-1 decode streams
// every weight once per step, so fewer bytes is a faster step while the unpacking keeps up.
//
// Packed layout: panels of 16 outputs as in the fp32 kernel, two 4-bit values per byte:
// packed [N / 16, K, 8] uint8, byte j of panel p at step k holds output 16 p + j in its low
// nibble and 16 p + j + 8 in its high one (cpu_vec.h's load_u4 widens one vector of it).
// scale, zero: [N / 16, K / G, 16] float32, a panel's groups contiguous.
//
// Two paths:
// - Fewer than 16 rows (decode): the fused tile. Per group it sums x[m, k] * q[n, k] over the group's k in
//   registers (the weights are widened to floats as they are loaded, never stored), then folds
//   the group in: acc += s * (sum - z * sum_k x[m, k]) (the x sums per group are computed once
//   per call). Each packed byte is read once per row tile. The widening is the tile's main
//   work besides the FMAs, so it uses cpu_vec.h's load_u4_lanes, which leaves the 16 values of a
//   step in whatever lane order is cheapest for the ISA (AVX-512: a broadcast, a shift and a
//   16-entry table lookup, no int-to-float conversion); the group's scales and zeros are put in
//   that order (rows_to_u4) and the finished sums back in row order (u4_to_rows).
// - 16 rows and more (prefill, big batches): compute-bound, so the vector work of unpacking must not be
//   paid per row. Each thread dequantizes a group of 4 panels into a small fp32 buffer in the fp32
//   kernel's layout (exactly (q - z) * s) and runs the fp32 micro-kernel (cpu_gemm_common.h) on it
//   for all rows.
// Threads split the panels (at::parallel_for) in both paths. Op: packed_linear_int4.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu_gemm_common.h"
#include "cpu_kernels.h"

using namespace pagedllm_gemm;

namespace {

constexpr int64_t kBytesPerStep = kLanes / 2;  // one k step of a panel: 16 nibbles
// From this many rows the dequantize-then-fp32 path is used. Measured on the SmolLM2-shaped
// linears (benchmarks/int4_decode.py, AVX-512, one thread): at 8 rows it took 1.8x the fused
// tile's time at 7, and at 16 rows it was level with fp32; the fused tile's unpacking per row
// tile grows with the rows, the dequantization is paid once.
constexpr int64_t kDequantRows = 16;

struct Int4Problem {
  const float* x;  // [M, K], row stride ldx
  const uint8_t* p;  // [N / 16, K, 8]
  const float* scale;  // [N / 16, K / G, 16]
  const float* zero;  // [N / 16, K / G, 16]
  const float* xsum;  // [M, K / G]: x summed over each group
  const float* bias;  // [N] or nullptr
  float* y;  // [M, N], row stride ldy
  int64_t k, group, ldx, ldy;
};

// Vector registers of an MR x NR fused tile: two sets of accumulators (the group's and the
// total), the rows' broadcasts and one weight vector.
constexpr int int4_registers(int mr, int nr) { return 2 * mr * nr * kPanelVecs + mr + 1; }
constexpr int int4_panels(int mr) {
  int nr = kGroup;
  while (nr > 1 && int4_registers(mr, nr) > kRegisters) --nr;
  return nr;
}
constexpr int int4_rows() {
  int mr = 4;
  while (mr > 1 && int4_registers(mr, 1) > kRegisters) --mr;
  return mr;
}
constexpr int64_t kFusedRows = int4_rows();  // AVX-512 4 (x 3 panels), AVX2 3, NEON 3, portable 1

// MR rows at m0 times NR panels from p0, fused: see the top.
template <int MR, int NR>
void fused_tile(const Int4Problem& pr, int64_t m0, int64_t p0) {
  constexpr int V = NR * kPanelVecs;
  const int64_t groups = pr.k / pr.group, panel_bytes = pr.k * kBytesPerStep, panel_groups = groups * kLanes;
  const float* x = pr.x + m0 * pr.ldx;
  const uint8_t* w = pr.p + p0 * panel_bytes;
  Vec acc[MR][V];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) acc[i][v] = zero();
  for (int64_t g = 0; g < groups; ++g) {
    Vec part[MR][V];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
      for (int v = 0; v < V; ++v) part[i][v] = zero();
    for (int64_t k = g * pr.group; k < (g + 1) * pr.group; ++k) {
      Vec xv[MR];
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) xv[i] = broadcast(x[i * pr.ldx + k]);
#pragma GCC unroll 16
      for (int v = 0; v < V; ++v) {
        const Vec wv = load_u4_lanes(w + (v / kPanelVecs) * panel_bytes + k * kBytesPerStep, v % kPanelVecs);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) part[i][v] = fmadd(xv[i], wv, part[i][v]);
      }
    }
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) {
      const int64_t at = (p0 + v / kPanelVecs) * panel_groups + g * kLanes + (v % kPanelVecs) * kWidth;
      const Vec s = rows_to_u4(load(pr.scale + at)), z = rows_to_u4(load(pr.zero + at));
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const Vec t = fmadd(z, broadcast(-pr.xsum[(m0 + i) * groups + g]), part[i][v]);
        acc[i][v] = fmadd(s, t, acc[i][v]);
      }
    }
  }
#pragma GCC unroll 16
  for (int v = 0; v < V; ++v) {
    const int64_t n = p0 * kLanes + v * kWidth;
    const Vec b = pr.bias ? load(pr.bias + n) : zero();
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) store(pr.y + (m0 + i) * pr.ldy + n, u4_to_rows(acc[i][v]) + b);
  }
}

// Panels [p0, p1) for all m rows through the fused tile.
void fused_panels(const Int4Problem& pr, int64_t m, int64_t p0, int64_t p1) {
  for (int64_t m0 = 0; m0 < m; m0 += kFusedRows) {
    dispatch<static_cast<int>(kFusedRows)>(std::min(kFusedRows, m - m0), [&](auto rows) {
      constexpr int MR = decltype(rows)::value, kNr = int4_panels(MR);
      for (int64_t p = p0; p < p1; p += kNr)
        dispatch<kNr>(std::min<int64_t>(kNr, p1 - p), [&](auto cols) { fused_tile<MR, decltype(cols)::value>(pr, m0, p); });
    });
  }
}

// Panels [p0, p1) as fp32 panels [p1 - p0, K, 16] in out: exactly (q - z) * s.
void dequantize_panels(const Int4Problem& pr, int64_t p0, int64_t p1, float* out) {
  const int64_t groups = pr.k / pr.group;
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* w = pr.p + p * pr.k * kBytesPerStep;
    for (int64_t k = 0; k < pr.k; ++k, out += kLanes) {
      const int64_t at = (p * groups + k / pr.group) * kLanes;
#pragma GCC unroll 4
      for (int v = 0; v < kPanelVecs; ++v) {
        const Vec q = load_u4(w + k * kBytesPerStep, v);
        store(out + v * kWidth, (q - load(pr.zero + at + v * kWidth)) * load(pr.scale + at + v * kWidth));
      }
    }
  }
}

// Panels [p0, p1) for all m rows: groups of 4 panels dequantized, then the fp32 micro-kernel.
void dequant_panels(const Int4Problem& pr, int64_t m, int64_t p0, int64_t p1) {
  std::vector<float> buffer(static_cast<size_t>(kGroup * pr.k * kLanes));
  for (int64_t g = p0; g < p1; g += kGroup) {
    const int64_t ge = std::min(p1, g + kGroup);
    dequantize_panels(pr, g, ge, buffer.data());
    const Problem<float> fp{pr.x, buffer.data(), nullptr, pr.bias ? pr.bias + g * kLanes : nullptr,
                            pr.y + g * kLanes, pr.k, pr.ldx, pr.ldy, false};
    run_panels(fp, m, 0, ge - g);
  }
}

// x [M, K] -> its sums over each group of G inputs, [M, K / G].
std::vector<float> group_sums(const float* x, int64_t m, int64_t k, int64_t ldx, int64_t group) {
  std::vector<float> sums(static_cast<size_t>(m * (k / group)));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t g = 0; g < k / group; ++g) {
      float s = 0.f;
      for (int64_t j = g * group; j < (g + 1) * group; ++j) s += x[i * ldx + j];
      sums[i * (k / group) + g] = s;
    }
  return sums;
}

const float* checked_groups(const at::Tensor& t, int64_t panels, int64_t groups, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 3 && t.size(0) == panels &&
                  t.size(1) == groups && t.size(2) == kLanes,
              what, " must be a contiguous float32 [", panels, ", ", groups, ", 16] tensor");
  return t.data_ptr<float>();
}

}  // namespace

// x: [..., K] fp32; packed: [N / 16, K, 8] uint8; scale, zero: [N / 16, K / G, 16] fp32;
// bias: [N] or None -> [..., N].
at::Tensor packed_linear_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                              const at::Tensor& zero, const std::optional<at::Tensor>& bias, int64_t group_size) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == kBytesPerStep &&
                  packed.is_contiguous(),
              "packed weight must be a contiguous uint8 [N/16, K, 8] tensor");
  const int64_t panels = packed.size(0), k = packed.size(1), n = panels * kLanes;
  TORCH_CHECK(group_size > 0 && k % group_size == 0, "group_size ", group_size, " must divide K = ", k);
  const float* s = checked_groups(scale, panels, k / group_size, "scale");
  const float* z = checked_groups(zero, panels, k / group_size, "zero");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == k, "x must be float32 [..., ", k, "]");
  at::Tensor x2 = x.reshape({-1, k});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor y = at::empty(out_shape, x.options());
  const int64_t m = x2.size(0);
  if (m == 0) return y;
  const float* xp = x2.data_ptr<float>();
  const std::vector<float> xsum = group_sums(xp, m, k, x2.stride(0), group_size);
  const Int4Problem pr{xp, packed.data_ptr<uint8_t>(), s, z, xsum.data(), checked_vector(bias, n, "bias"),
                       y.data_ptr<float>(), k, group_size, x2.stride(0), n};
  // Tiny weights (test models) stay on one thread; threads split whole groups of 4 panels.
  const int64_t grain = std::max<int64_t>(1, kMinThreadBytes / (k * kBytesPerStep * kGroup));
  at::parallel_for(0, (panels + kGroup - 1) / kGroup, grain, [&](int64_t g0, int64_t g1) {
    const int64_t p0 = g0 * kGroup, p1 = std::min(panels, g1 * kGroup);
    if (m < kDequantRows)
      fused_panels(pr, m, p0, p1);
    else
      dequant_panels(pr, m, p0, p1);
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_OPS, m) {
  m.def("packed_linear_int4(Tensor x, Tensor packed, Tensor scale, Tensor zero, Tensor? bias, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_OPS, CPU, m) {
  m.impl("packed_linear_int4", &packed_linear_int4);
}
