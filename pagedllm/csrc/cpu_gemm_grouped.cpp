// Group-wise weight-only GEMM y = x W^T (+ b) for CPU, two weight formats over one source:
// - int4: W[n, k] = (q[n, k] - z[n, g]) * s[n, g] with q in 0..15 (the int4 method, AWQ, GPTQ,
//   GGUF's Q4_0 / Q4_1 / Q4_K blocks); op packed_linear_int4.
// - int8: W[n, k] = q[n, k] * s[n, g] with q in -127..127 (GGUF's Q8_0 blocks; the LM head of the
//   quantized methods); op packed_linear_int8_grouped.
// g = k / G (G inputs per group), one float32 scale (and zero point) per output and group; x and y
// float32. Batch-1 decode streams every weight once per step, so fewer bytes is a faster step
// while the widening keeps up.
//
// Packed layouts (Format below says how to find a panel of 16 outputs):
// - int4 [N / 16, K, 8] uint8: panels of 16 outputs as in the fp32 kernel, byte j of panel p at
//   step k holds output 16 p + j in its low nibble and 16 p + j + 8 in its high one (cpu_vec.h's
//   load_u4 widens one vector of it).
// - int8 [N / 16, K, 16] int8: the per-channel int8 kernel's layout (cpu_gemm_int8.cpp): groups
//   of 4 panels interleaved along k, one 64-byte line per k step of a full group.
// scale, zero: [N / 16, K / G, 16] float32, a panel's groups contiguous.
//
// Two paths:
// - Fewer than 16 rows (decode): the fused tile. Per group it sums x[m, k] * q[n, k] over the group's k in
//   registers (the weights are widened to floats as they are loaded, never stored), then folds
//   the group in: acc += s * (sum - z * sum_k x[m, k]) (int8: acc += s * sum; the x sums per group
//   are computed once per call). Each weight byte is read once per row tile. The widening is the
//   tile's main work besides the FMAs; for int4 it uses cpu_vec.h's load_u4_lanes, which leaves the
//   16 values of a step in whatever lane order is cheapest for the ISA (AVX-512: a broadcast, a
//   shift and a 16-entry table lookup, no int-to-float conversion); the group's scales and zeros
//   are put in that order (rows_to_u4) and the finished sums back in row order (u4_to_rows).
// - 16 rows and more (prefill, big batches): compute-bound, so the vector work of widening must not be
//   paid per row. Each thread dequantizes a group of 4 panels into a small fp32 buffer in the fp32
//   kernel's layout (exactly (q - z) * s, or q * s) and runs the fp32 micro-kernel
//   (cpu_gemm_common.h) on it for all rows.
// Threads split whole groups of 4 panels (at::parallel_for) in both paths.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu_gemm_common.h"
#include "cpu_kernels.h"

using namespace pagedllm_gemm;

namespace {

// From this many rows the dequantize-then-fp32 path is used. Measured for int4 on the
// SmolLM2-shaped linears (benchmarks/int4_decode.py, AVX-512, one thread): at 8 rows it took 1.8x
// the fused tile's time at 7, and at 16 rows it was level with fp32; the fused tile's widening per
// row tile grows with the rows, the dequantization is paid once.
constexpr int64_t kDequantRows = 16;

// int4: 16 nibbles per k step of a panel, panels one after another.
struct Int4Format {
  using T = uint8_t;
  static constexpr bool kZero = true;
  static constexpr const char* kName = "uint8 [N/16, K, 8]";
  static constexpr int64_t kStepBytes = kLanes / 2;
  // Panel j of the group of `width` panels starting at panel g, and the step between its k steps.
  static const T* panel(const T* base, int64_t k, int64_t g, int64_t, int64_t j) {
    return base + (g + j) * k * kStepBytes;
  }
  static int64_t panel_stride(int64_t k, int64_t) { return k * kStepBytes; }
  static int64_t k_stride(int64_t) { return kStepBytes; }
  static Vec load_lanes(const T* p, int v) { return load_u4_lanes(p, v); }  // in the fused tile's lane order
  static Vec load_rows(const T* p, int v) { return load_u4(p, v); }  // in row order
  static Vec to_lanes(Vec a) { return rows_to_u4(a); }
  static Vec to_rows(Vec a) { return u4_to_rows(a); }
};

// int8: 16 bytes per k step of a panel, groups of 4 panels interleaved (cpu_gemm_int8.cpp).
struct Int8Format {
  using T = int8_t;
  static constexpr bool kZero = false;
  static constexpr const char* kName = "int8 [N/16, K, 16]";
  static constexpr int64_t kStepBytes = kLanes;
  static const T* panel(const T* base, int64_t k, int64_t g, int64_t, int64_t j) {
    return base + g * k * kLanes + j * kLanes;
  }
  static int64_t panel_stride(int64_t, int64_t) { return kLanes; }
  static int64_t k_stride(int64_t width) { return width * kLanes; }
  static Vec load_lanes(const T* p, int v) { return load_i8(p + v * kWidth); }
  static Vec load_rows(const T* p, int v) { return load_i8(p + v * kWidth); }
  static Vec to_lanes(Vec a) { return a; }
  static Vec to_rows(Vec a) { return a; }
};

template <class F>
struct GroupedProblem {
  const float* x;  // [M, K], row stride ldx
  const typename F::T* p;  // the format's packed weights
  const float* scale;  // [N / 16, K / G, 16]
  const float* zero;  // [N / 16, K / G, 16] (int4 only)
  const float* xsum;  // [M, K / G]: x summed over each group (int4 only)
  const float* bias;  // [N] or nullptr
  float* y;  // [M, N], row stride ldy
  int64_t k, group, ldx, ldy, panels;
};

// Vector registers of an MR x NR fused tile: two sets of accumulators (the group's and the
// total), the rows' broadcasts and one weight vector.
constexpr int fused_registers(int mr, int nr) { return 2 * mr * nr * kPanelVecs + mr + 1; }
constexpr int fused_panels_max(int mr) {
  int nr = kGroup;
  while (nr > 1 && fused_registers(mr, nr) > kRegisters) --nr;
  return nr;
}
constexpr int fused_rows() {
  int mr = 4;
  while (mr > 1 && fused_registers(mr, 1) > kRegisters) --mr;
  return mr;
}
constexpr int64_t kFusedRows = fused_rows();  // AVX-512 4 (x 3 panels), AVX2 3, NEON 3, portable 1

// MR rows at m0 times NR panels from panel p0 (its weights at w, panel j at w + j * panel_stride,
// k step k at + k * k_stride), fused: see the top.
template <class F, int MR, int NR>
void fused_tile(const GroupedProblem<F>& pr, int64_t m0, int64_t p0, const typename F::T* w, int64_t panel_stride,
                int64_t k_stride) {
  constexpr int V = NR * kPanelVecs;
  const int64_t groups = pr.k / pr.group, panel_groups = groups * kLanes;
  const float* x = pr.x + m0 * pr.ldx;
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
        const Vec wv = F::load_lanes(w + (v / kPanelVecs) * panel_stride + k * k_stride, v % kPanelVecs);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) part[i][v] = fmadd(xv[i], wv, part[i][v]);
      }
    }
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) {
      const int64_t at = (p0 + v / kPanelVecs) * panel_groups + g * kLanes + (v % kPanelVecs) * kWidth;
      const Vec s = F::to_lanes(load(pr.scale + at));
      if constexpr (F::kZero) {
        const Vec z = F::to_lanes(load(pr.zero + at));
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
          const Vec t = fmadd(z, broadcast(-pr.xsum[(m0 + i) * groups + g]), part[i][v]);
          acc[i][v] = fmadd(s, t, acc[i][v]);
        }
      } else {
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) acc[i][v] = fmadd(s, part[i][v], acc[i][v]);
      }
    }
  }
#pragma GCC unroll 16
  for (int v = 0; v < V; ++v) {
    const int64_t n = p0 * kLanes + v * kWidth;
    const Vec b = pr.bias ? load(pr.bias + n) : zero();
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) store(pr.y + (m0 + i) * pr.ldy + n, F::to_rows(acc[i][v]) + b);
  }
}

// The group of panels [g, g + 4) ∩ [g, p1) for all m rows through the fused tile.
template <class F>
void fused_group(const GroupedProblem<F>& pr, int64_t m, int64_t g, int64_t p1) {
  const int64_t width = std::min<int64_t>(kGroup, p1 - g);
  const int64_t panel_stride = F::panel_stride(pr.k, width), k_stride = F::k_stride(width);
  for (int64_t m0 = 0; m0 < m; m0 += kFusedRows) {
    dispatch<static_cast<int>(kFusedRows)>(std::min(kFusedRows, m - m0), [&](auto rows) {
      constexpr int MR = decltype(rows)::value, kNr = fused_panels_max(MR);
      const int64_t tiles = (width + kNr - 1) / kNr, nr = (width + tiles - 1) / tiles;  // even widths
      for (int64_t j = 0; j < width; j += nr)
        dispatch<kNr>(std::min<int64_t>(nr, width - j), [&](auto cols) {
          fused_tile<F, MR, decltype(cols)::value>(pr, m0, g + j, F::panel(pr.p, pr.k, g, width, j), panel_stride,
                                                   k_stride);
        });
    });
  }
}

// The group of panels from g (width of them) as fp32 panels [width, K, 16] in out: exactly
// (q - z) * s, or q * s.
template <class F>
void dequantize_group(const GroupedProblem<F>& pr, int64_t g, int64_t width, float* out) {
  const int64_t groups = pr.k / pr.group, k_stride = F::k_stride(width);
  for (int64_t j = 0; j < width; ++j) {
    const typename F::T* w = F::panel(pr.p, pr.k, g, width, j);
    for (int64_t k = 0; k < pr.k; ++k, out += kLanes) {
      const int64_t at = ((g + j) * groups + k / pr.group) * kLanes;
#pragma GCC unroll 4
      for (int v = 0; v < kPanelVecs; ++v) {
        Vec q = F::load_rows(w + k * k_stride, v);
        if constexpr (F::kZero) q = q - load(pr.zero + at + v * kWidth);
        store(out + v * kWidth, q * load(pr.scale + at + v * kWidth));
      }
    }
  }
}

// The group of panels from g for all m rows: dequantized, then the fp32 micro-kernel.
template <class F>
void dequant_group(const GroupedProblem<F>& pr, int64_t m, int64_t g, int64_t p1, std::vector<float>& buffer) {
  const int64_t width = std::min<int64_t>(kGroup, p1 - g);
  buffer.resize(static_cast<size_t>(kGroup * pr.k * kLanes));
  dequantize_group(pr, g, width, buffer.data());
  const Problem<float> fp{pr.x, buffer.data(), nullptr, pr.bias ? pr.bias + g * kLanes : nullptr,
                          pr.y + g * kLanes, pr.k, pr.ldx, pr.ldy, false};
  run_panels(fp, m, 0, width);
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

// x: [..., K] fp32; packed: the format's [N / 16, K, bytes per step]; scale (and zero for int4):
// [N / 16, K / G, 16] fp32; bias: [N] or None -> [..., N].
template <class F>
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                          const at::Tensor* zero, const std::optional<at::Tensor>& bias, int64_t group_size,
                          at::ScalarType type) {
  TORCH_CHECK(packed.scalar_type() == type && packed.dim() == 3 && packed.size(2) == F::kStepBytes &&
                  packed.is_contiguous(),
              "packed weight must be a contiguous ", F::kName, " tensor");
  const int64_t panels = packed.size(0), k = packed.size(1), n = panels * kLanes;
  TORCH_CHECK(group_size > 0 && k % group_size == 0, "group_size ", group_size, " must divide K = ", k);
  const float* s = checked_groups(scale, panels, k / group_size, "scale");
  const float* z = zero ? checked_groups(*zero, panels, k / group_size, "zero") : nullptr;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == k, "x must be float32 [..., ", k, "]");
  at::Tensor x2 = x.reshape({-1, k});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor y = at::empty(out_shape, x.options());
  const int64_t m = x2.size(0);
  if (m == 0) return y;
  const float* xp = x2.data_ptr<float>();
  const std::vector<float> xsum = F::kZero && m < kDequantRows ? group_sums(xp, m, k, x2.stride(0), group_size)
                                                                 : std::vector<float>();
  const GroupedProblem<F> pr{xp, packed.data_ptr<typename F::T>(), s, z, xsum.data(), checked_vector(bias, n, "bias"),
                             y.data_ptr<float>(), k, group_size, x2.stride(0), n, panels};
  // Tiny weights (test models) stay on one thread; threads split whole groups of 4 panels.
  const int64_t grain = std::max<int64_t>(1, kMinThreadBytes / (k * F::kStepBytes * kGroup));
  at::parallel_for(0, (panels + kGroup - 1) / kGroup, grain, [&](int64_t g0, int64_t g1) {
    std::vector<float> buffer;
    for (int64_t g = g0 * kGroup; g < std::min(panels, g1 * kGroup); g += kGroup) {
      if (m < kDequantRows)
        fused_group(pr, m, g, panels);
      else
        dequant_group(pr, m, g, panels, buffer);
    }
  });
  return y;
}

}  // namespace

at::Tensor packed_linear_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                              const at::Tensor& zero, const std::optional<at::Tensor>& bias, int64_t group_size) {
  return grouped_linear<Int4Format>(x, packed, scale, &zero, bias, group_size, at::kByte);
}

at::Tensor packed_linear_int8_grouped(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                      const std::optional<at::Tensor>& bias, int64_t group_size) {
  return grouped_linear<Int8Format>(x, packed, scale, nullptr, bias, group_size, at::kChar);
}

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_OPS, m) {
  m.def("packed_linear_int4(Tensor x, Tensor packed, Tensor scale, Tensor zero, Tensor? bias, int group_size) -> Tensor");
  m.def("packed_linear_int8_grouped(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_OPS, CPU, m) {
  m.impl("packed_linear_int4", &packed_linear_int4);
  m.impl("packed_linear_int8_grouped", &packed_linear_int8_grouped);
}
