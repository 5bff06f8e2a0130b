// Group-wise weight-only GEMM y = x W^T (+ b) for CPU, two weight formats over one source:
// - int4: W[n, k] = (q[n, k] - z[n, g]) * s[n, g] with q in 0..15 (the int4 method, AWQ, GPTQ,
//   GGUF's Q4_0 / Q4_1 / Q4_K blocks); op packed_linear_int4.
// - int8: W[n, k] = q[n, k] * s[n, g] with q in -127..127 (GGUF's Q8_0 blocks; the LM head of the
//   quantized methods); op packed_linear_int8_grouped.
// g = k / G (G inputs per group), one float32 scale (and zero point) per output and group; x and y
// float32. Batch-1 decode streams every weight once per step, so fewer bytes is a faster step
// while the widening keeps up.
//
// Packed layouts: a panel (16 outputs) is stored in blocks of kSteps k steps, and the panels of
// each group of 4 are interleaved block by block, so a tile over a group reads one sequential
// stream (see Int4Format / Int8Format below):
// - int4 [N / 16, K, 8] uint8 (the bytes): a block is 8 k steps, 16 little-endian 32-bit words,
//   word n holding output n's 8 nibbles (k step i in bits 4i..4i+3); cpu_vec.h's load_u4_step
//   widens one k step of a block with a shift and a mask or a 16-entry table lookup, in output order.
// - int8 [N / 16, K, 16] int8: a block is 1 k step, 16 bytes: the per-channel int8 kernel's layout
//   (cpu_gemm_int8.cpp), one 64-byte line per k step of a full group.
// scale, zero: [N / 16, K / G, 16] float32, a panel's groups contiguous. G must be a multiple of
// the block's k steps.
//
// Two paths:
// - Fewer than 16 rows (decode): the fused tile. Per group it sums x[m, k] * q[n, k] over the group's k in
//   registers (the weights are widened to floats as they are loaded, never stored), then folds
//   the group in: acc += s * (sum - z * sum_k x[m, k]) (int8: acc += s * sum; the x sums per group
//   are computed once per call). Each weight byte is read once per row tile; the widening is the
//   tile's main work besides the FMAs (AVX-512 int4: a shift and a vpermps per 16 weights).
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

// Both layouts: block b of panel j of the group starting at panel g is at
// g * (K / kSteps) * kBlockBytes + (b * width + j) * kBlockBytes, width the group's panels (4; the
// last group may have 1-3). Separate streams per panel streamed 1.45x slower on one Zen 4 core
// than one interleaved stream (cpu_gemm_int8.cpp).
// int4: a block is 8 k steps of 16 outputs, 16 32-bit words (word n: output n, step i in its
// bits 4i..4i+3), 64 bytes: cpu_vec.h's load_u4_step widens step i of it.
struct Int4Format {
  using T = uint8_t;
  static constexpr bool kZero = true;
  static constexpr const char* kName = "uint8 [N/16, K, 8]";
  static constexpr int kSteps = 8;
  static constexpr int64_t kBlockBytes = 64, kStepBytes = kBlockBytes / kSteps;
  static Vec load(const T* block, int v, int i) { return load_u4_step(block, v, i); }
};

// int8: a block is 1 k step of 16 outputs, 16 bytes (the per-channel int8 kernel's layout).
struct Int8Format {
  using T = int8_t;
  static constexpr bool kZero = false;
  static constexpr const char* kName = "int8 [N/16, K, 16]";
  static constexpr int kSteps = 1;
  static constexpr int64_t kBlockBytes = kLanes, kStepBytes = kBlockBytes;
  static Vec load(const T* block, int v, int) { return load_i8(block + v * kWidth); }
};

// How far ahead (in blocks of each panel) the fused tile prefetches its stream into L2: 1 KiB of
// each panel. Streaming all 30 int4 layers of SmolLM2's shape at one row (2 threads, Zen 4) took
// ~8% less time with it than without (medians of 6 noisy rounds; 2 KiB was level with 1 KiB).
template <class F>
constexpr int64_t kPrefetchBlocks = 1024 / F::kBlockBytes;

// The first block of panel j of the group starting at panel g (see the layouts above).
template <class F>
const typename F::T* panel_start(const typename F::T* base, int64_t k, int64_t g, int64_t j) {
  return base + g * (k / F::kSteps) * F::kBlockBytes + j * F::kBlockBytes;
}
// The step from one block of a panel to its next in a group of `width` panels.
template <class F>
int64_t stride_of_blocks(int64_t width) { return width * F::kBlockBytes; }

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

// MR rows at m0 times NR panels from panel p0 (its first block at w, panel j's at
// + j * F::kBlockBytes, block b at + b * block_stride), fused: see the top.
template <class F, int MR, int NR>
void fused_tile(const GroupedProblem<F>& pr, int64_t m0, int64_t p0, const typename F::T* w, int64_t block_stride) {
  constexpr int V = NR * kPanelVecs;
  const int64_t groups = pr.k / pr.group, panel_groups = groups * kLanes, blocks = pr.group / F::kSteps;
  const float* x = pr.x + m0 * pr.ldx;
  Vec acc[MR][V];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) acc[r][v] = zero();
  for (int64_t g = 0; g < groups; ++g) {
    Vec part[MR][V];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
      for (int v = 0; v < V; ++v) part[r][v] = zero();
    for (int64_t b = g * blocks; b < (g + 1) * blocks; ++b) {
      const typename F::T* block = w + b * block_stride;
      if (b % (64 / F::kBlockBytes) == 0) {  // once per 64-byte line of each panel
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) prefetch_l2(block + kPrefetchBlocks<F> * block_stride + j * F::kBlockBytes);
      }
#pragma GCC unroll 8
      for (int i = 0; i < F::kSteps; ++i) {
        Vec xv[MR];
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) xv[r] = broadcast(x[r * pr.ldx + b * F::kSteps + i]);
#pragma GCC unroll 16
        for (int v = 0; v < V; ++v) {
          const Vec wv = F::load(block + (v / kPanelVecs) * F::kBlockBytes, v % kPanelVecs, i);
#pragma GCC unroll 16
          for (int r = 0; r < MR; ++r) part[r][v] = fmadd(xv[r], wv, part[r][v]);
        }
      }
    }
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) {
      const int64_t at = (p0 + v / kPanelVecs) * panel_groups + g * kLanes + (v % kPanelVecs) * kWidth;
      const Vec s = load(pr.scale + at);
      if constexpr (F::kZero) {
        const Vec z = load(pr.zero + at);
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
          const Vec t = fmadd(z, broadcast(-pr.xsum[(m0 + r) * groups + g]), part[r][v]);
          acc[r][v] = fmadd(s, t, acc[r][v]);
        }
      } else {
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) acc[r][v] = fmadd(s, part[r][v], acc[r][v]);
      }
    }
  }
#pragma GCC unroll 16
  for (int v = 0; v < V; ++v) {
    const int64_t n = p0 * kLanes + v * kWidth;
    const Vec bias = pr.bias ? load(pr.bias + n) : zero();
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) store(pr.y + (m0 + r) * pr.ldy + n, acc[r][v] + bias);
  }
}

// The group of panels [g, g + 4) ∩ [g, p1) for all m rows through the fused tile.
template <class F>
void fused_group(const GroupedProblem<F>& pr, int64_t m, int64_t g, int64_t p1) {
  const int64_t width = std::min<int64_t>(kGroup, p1 - g), block_stride = stride_of_blocks<F>(width);
  for (int64_t m0 = 0; m0 < m; m0 += kFusedRows) {
    dispatch<static_cast<int>(kFusedRows)>(std::min(kFusedRows, m - m0), [&](auto rows) {
      constexpr int MR = decltype(rows)::value, kNr = fused_panels_max(MR);
      const int64_t tiles = (width + kNr - 1) / kNr, nr = (width + tiles - 1) / tiles;  // even widths
      for (int64_t j = 0; j < width; j += nr)
        dispatch<kNr>(std::min<int64_t>(nr, width - j), [&](auto cols) {
          fused_tile<F, MR, decltype(cols)::value>(pr, m0, g + j, panel_start<F>(pr.p, pr.k, g, j), block_stride);
        });
    });
  }
}

// The group of panels from g (width of them) as fp32 panels [width, K, 16] in out: exactly
// (q - z) * s, or q * s.
template <class F>
void dequantize_group(const GroupedProblem<F>& pr, int64_t g, int64_t width, float* out) {
  const int64_t groups = pr.k / pr.group, block_stride = stride_of_blocks<F>(width);
  for (int64_t j = 0; j < width; ++j) {
    const typename F::T* w = panel_start<F>(pr.p, pr.k, g, j);
    for (int64_t b = 0; b < pr.k / F::kSteps; ++b) {
      const typename F::T* block = w + b * block_stride;
      const int64_t at = ((g + j) * groups + b * F::kSteps / pr.group) * kLanes;
      for (int i = 0; i < F::kSteps; ++i, out += kLanes) {
#pragma GCC unroll 4
        for (int v = 0; v < kPanelVecs; ++v) {
          Vec q = F::load(block, v, i);
          if constexpr (F::kZero) q = q - load(pr.zero + at + v * kWidth);
          store(out + v * kWidth, q * load(pr.scale + at + v * kWidth));
        }
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
  TORCH_CHECK(group_size % F::kSteps == 0, "group_size ", group_size, " must be a multiple of ", F::kSteps);
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
