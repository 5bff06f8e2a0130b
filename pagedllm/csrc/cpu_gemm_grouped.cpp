// Group-wise weight-only GEMM y = x W^T (+ b) for CPU, two weight formats over one source:
// - int4: W[n, k] = (q[n, k] - z[n, g]) * s[n, g] with q in 0..15 (the int4 method, AWQ, GPTQ,
//   GGUF's Q4_0 / Q4_1 / Q4_K blocks); op packed_linear_int4. Or W[n, k] = t[q[n, k]] * s[n, g]
//   with t a 16-entry code table (bitsandbytes' NF4 / FP4); op packed_linear_int4_table.
// - int8: W[n, k] = q[n, k] * s[n, g] with q in -127..127 (GGUF's Q8_0 blocks; the LM head of the
//   quantized methods), or (q[n, k] - z[n, g]) * s[n, g] when a zero point is given (GGUF's other
//   block types); op packed_linear_int8_grouped.
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
//   (cpu_gemm_int8.cpp), one 64-byte line per k step of a full group. Optionally with a zero point
//   (Int8ZeroFormat): W = (q - z) * s.
// scale, zero: [N / 16, K / G, 16] float32, a panel's groups contiguous, or float16 when every
// value is one exactly (GroupValues: half the bytes of the streams read beside the weights). G must
// be a multiple of the block's k steps. With `offset` (int4 and w4a8 ops) the zero tensor holds
// per-group offsets b instead, W = q s + b: GGUF Q4_1's m, a float16 where its zero point -m / d
// is not, so the default model's linears read 16-bit parameters too.
//
// Two paths:
// - Fewer than 20 rows (decode): the fused tile. Per group it sums x[m, k] * q[n, k] over the group's k in
//   registers (the weights are widened to floats as they are loaded, never stored), then folds
//   the group in: acc += s * (sum - z * sum_k x[m, k]) (int8: acc += s * sum; the x sums per group
//   are computed once per call). Each weight byte is read once per row tile; the widening is the
//   tile's main work besides the FMAs (AVX-512 int4: a shift and a vpermps per 16 weights).
// - 20 rows and more (prefill, big batches): compute-bound, so the vector work of widening must not be
//   paid per row. Each thread dequantizes a group of 4 panels into a small fp32 buffer in the fp32
//   kernel's layout (exactly (q - z) * s, or q * s) and runs the fp32 micro-kernel
//   (cpu_gemm_common.h) on it for all rows.
// Threads split whole groups of 4 panels (at::parallel_for) in both paths.
//
// W4A8 (op packed_linear_w4a8, --quantization w4a8): the int4 layout and parameters above with the
// activations quantized to int8 inside the op, per row and run of A = 32 inputs (A = G when 32
// does not divide G): xs = max|x| / 127, xq = round(x / xs), as llama.cpp quantizes activations
// to Q8_0 for its Q4 matrices. Then sum_k xq q is exact in int32 and 4 byte products per
// instruction: a block's words give the even steps' nibbles with a mask and the odd steps' with a
// shift and a mask, each a dot with 4 activation bytes (stored in that even/odd order) per lane:
// AVX-512 VNNI vpdpbusd (unsigned weights x signed activations), AVX-VNNI, or vpmaddubsw + vpmaddwd
// (products <= 15 * 127, pairs < 2^15: no saturation); Arm vdotq_s32, or vmull_s8 + pairwise
// adds; scalar in the portable build. Per run: acc += s * xs * (sum - z * sum_k xq). One tile
// serves every row count (the fused tile's shapes), about 5 vector instructions per 128 weights and row
// instead of the float tile's 24: 1.6-1.8x int4 from 16 rows, level at one row (both wait on memory
// there), at the cost of the activations' rounding error.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_gemm_common.h"
#include "cpu_kernels.h"

using namespace pagedllm_gemm;

namespace {

// From this many rows the dequantize-then-fp32 path is used: the fused tile's widening grows with
// the row tiles (4 rows each on AVX-512), the dequantization is paid once. Measured on the
// SmolLM2-shaped int4 linears (benchmarks/int4_decode.py --baseline, AVX-512 Zen 4, 2 threads): 16
// and 19 rows took 26.7 / 30.4 ms fused against 28.9 / 32.5 dequantized, level at 20 and 24 rows;
// the int8-group LM head at 16 rows 6.3 ms fused against 7.8. Each format may switch earlier
// (its kDequantRows): on AVX2, whose 3-row tiles widen each weight more often and at half the width.
constexpr int64_t kDequantRows = 20;

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
  // AVX2: 13 rows (SmolLM2-shaped int4 linears, 2 threads, Xeon with AVX-512 running the avx2
  // build: fused against dequantized 23.2 / 23.9 ms at 12 rows, 26.3 / 25.8 at 13, 36.7 / 33.1 at 19).
  static constexpr int64_t kDequantRows = kWidth == 8 ? 13 : ::kDequantRows;
  struct Lut {};  // the formats with a code table (Int4TableFormat) hold it in registers here
  static Lut lut(const float*) { return {}; }
  static Vec load(const T* block, int v, int i, Lut) { return load_u4_step(block, v, i); }
};

// int4 codes looked up in a 16-entry table, no zero point: W[n, k] = table[q[n, k]] * s[n, g]
// (bitsandbytes' NF4 / FP4 blocks: the code book times the block's absmax). The same layout.
struct Int4TableFormat : Int4Format {
  static constexpr bool kZero = false;
  // AVX2's lookup is two vpermps and a blend: from 7 rows dequantizing first is faster (same
  // shapes: 15.6 / 16.7 ms at 6 rows, 20.8 / 18.5 at 7, 41.4 / 28.6 at 16). AVX-512's is one
  // vpermps, as int4's: fused up to 16 rows 1.3-2.8x faster there, so ::kDequantRows.
  static constexpr int64_t kDequantRows = kWidth == 8 ? 7 : ::kDequantRows;
  using Lut = Table16;
  static Lut lut(const float* table) { return load_table16(table); }
  static Vec load(const T* block, int v, int i, const Lut& table) { return load_u4_step(block, v, i, table); }
};

// int8: a block is 1 k step of 16 outputs, 16 bytes (the per-channel int8 kernel's layout).
struct Int8Format {
  using T = int8_t;
  static constexpr bool kZero = false;
  static constexpr const char* kName = "int8 [N/16, K, 16]";
  static constexpr int kSteps = 1;
  static constexpr int64_t kBlockBytes = kLanes, kStepBytes = kBlockBytes;
  static constexpr int64_t kDequantRows = ::kDequantRows;
  struct Lut {};
  static Lut lut(const float*) { return {}; }
  static Vec load(const T* block, int v, int, Lut) { return load_i8(block + v * kWidth); }
};
// int8 with a zero point per output and group, W = (q - z) * s: GGUF's other block types held
// exactly (Q5_0 / Q5_1 / Q5_K / Q6_K, and the 4-bit and Q8_0 parts of a layer that mixes them).
struct Int8ZeroFormat : Int8Format {
  static constexpr bool kZero = true;
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

// A layer's per-group values (scales, zero points) [N / 16, K / G, 16], float32 or float16. The
// format is one branch per group and vector, predicted the same way for a whole call. With float16
// parameters SmolLM2's 120 int4 linears read 6.6 MB less per step (of 66 MB).
struct GroupValues {
  const void* data = nullptr;
  bool half = false;
  Vec get(int64_t at) const {
    return half ? load_f16(static_cast<const uint16_t*>(data) + at) : load(static_cast<const float*>(data) + at);
  }
  const void* address(int64_t at) const { return static_cast<const char*>(data) + at * (half ? 2 : 4); }
};

template <class F>
struct GroupedProblem {
  const float* x;  // [M, K], row stride ldx
  const typename F::T* p;  // the format's packed weights
  GroupValues scale;  // [N / 16, K / G, 16]
  GroupValues zero;  // [N / 16, K / G, 16] (with a zero point only)
  bool offset;  // zero holds offsets b: W = q s + b
  const float* xsum;  // [M, K / G]: x summed over each group (int4 only)
  const float* table;  // [16]: the code table (Int4TableFormat only)
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

// Every element of a tile's register array set to value.
template <int MR, int V, class T>
inline void fill(T (&a)[MR][V], T value) {
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) a[r][v] = value;
}

// The tiles over all m rows of a group of `width` panels: row tiles of up to kFusedRows rows, each
// across the group in as few panel tiles of even widths as fused_panels_max allows;
// tile(rows, cols, m0, j) runs rows x cols (integral constants) at row m0 and panel j of the group.
template <class Tile>
void group_tiles(int64_t m, int64_t width, Tile&& tile) {
  for (int64_t m0 = 0; m0 < m; m0 += kFusedRows) {
    dispatch<static_cast<int>(kFusedRows)>(std::min(kFusedRows, m - m0), [&](auto rows) {
      constexpr int kNr = fused_panels_max(decltype(rows)::value);
      const int64_t tiles = (width + kNr - 1) / kNr, nr = (width + tiles - 1) / tiles;
      for (int64_t j = 0; j < width; j += nr)
        dispatch<kNr>(std::min<int64_t>(nr, width - j), [&](auto cols) { tile(rows, cols, m0, j); });
    });
  }
}

// MR rows at m0 times NR panels from panel p0 (its first block at w, panel j's at
// + j * F::kBlockBytes, block b at + b * block_stride), fused: see the top.
template <class F, int MR, int NR>
void fused_tile(const GroupedProblem<F>& pr, int64_t m0, int64_t p0, const typename F::T* w, int64_t block_stride) {
  constexpr int V = NR * kPanelVecs;
  const int64_t groups = pr.k / pr.group, panel_groups = groups * kLanes, blocks = pr.group / F::kSteps;
  const float* x = pr.x + m0 * pr.ldx;
  const auto lut = F::lut(pr.table);
  Vec acc[MR][V];
  fill(acc, zero());
  for (int64_t g = 0; g < groups; ++g) {
    Vec part[MR][V];
    fill(part, zero());
    for (int64_t b = g * blocks; b < (g + 1) * blocks; ++b) {
      const typename F::T* block = w + b * block_stride;
      // Each line of the tile's blocks once: int4 blocks are whole lines, int8 ones (16 bytes) share
      // a line with the group's other panels, so a block row starts a new line every 64 bytes.
      if ((b * block_stride) % 64 < block_stride) {
        for (int64_t off = 0; off < NR * F::kBlockBytes; off += 64) prefetch_l2(block + kPrefetchBlocks<F> * block_stride + off);
      }
#pragma GCC unroll 8
      for (int i = 0; i < F::kSteps; ++i) {
        Vec xv[MR];
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) xv[r] = broadcast(x[r * pr.ldx + b * F::kSteps + i]);
#pragma GCC unroll 16
        for (int v = 0; v < V; ++v) {
          const Vec wv = F::load(block + (v / kPanelVecs) * F::kBlockBytes, v % kPanelVecs, i, lut);
#pragma GCC unroll 16
          for (int r = 0; r < MR; ++r) part[r][v] = fmadd(xv[r], wv, part[r][v]);
        }
      }
    }
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) {
      const int64_t at = (p0 + v / kPanelVecs) * panel_groups + g * kLanes + (v % kPanelVecs) * kWidth;
      const Vec s = pr.scale.get(at);
      if constexpr (F::kZero) {
        const Vec z = pr.zero.get(at);
        if (pr.offset) {  // acc += s * sum + b * sum_k x
#pragma GCC unroll 16
          for (int r = 0; r < MR; ++r)
            acc[r][v] = fmadd(z, broadcast(pr.xsum[(m0 + r) * groups + g]), fmadd(s, part[r][v], acc[r][v]));
        } else {
#pragma GCC unroll 16
          for (int r = 0; r < MR; ++r) {
            const Vec t = fmadd(z, broadcast(-pr.xsum[(m0 + r) * groups + g]), part[r][v]);
            acc[r][v] = fmadd(s, t, acc[r][v]);
          }
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
  group_tiles(m, width, [&](auto rows, auto cols, int64_t m0, int64_t j) {
    fused_tile<F, decltype(rows)::value, decltype(cols)::value>(pr, m0, g + j, panel_start<F>(pr.p, pr.k, g, j),
                                                                block_stride);
  });
}

// The group of panels from g (width of them) as fp32 panels [width, K, 16] in out: exactly
// (q - z) * s, or q * s (+ b with offsets).
template <class F>
void dequantize_group(const GroupedProblem<F>& pr, int64_t g, int64_t width, float* out) {
  const int64_t groups = pr.k / pr.group, blocks = pr.group / F::kSteps, block_stride = stride_of_blocks<F>(width);
  const auto lut = F::lut(pr.table);
  for (int64_t j = 0; j < width; ++j) {
    const typename F::T* block = panel_start<F>(pr.p, pr.k, g, j);
    for (int64_t c = 0; c < groups; ++c) {
      // The group's scales (and zero points) once, in registers for its blocks (a division per
      // block here cost about as much as the fp32 micro-kernel at 16 rows).
      const int64_t at = ((g + j) * groups + c) * kLanes;
      Vec s[kPanelVecs], z[kPanelVecs];
#pragma GCC unroll 4
      for (int v = 0; v < kPanelVecs; ++v) {
        s[v] = pr.scale.get(at + v * kWidth);
        z[v] = F::kZero ? pr.zero.get(at + v * kWidth) : zero();
      }
      for (int64_t b = 0; b < blocks; ++b, block += block_stride) {
#pragma GCC unroll 8
        for (int i = 0; i < F::kSteps; ++i, out += kLanes) {
#pragma GCC unroll 4
          for (int v = 0; v < kPanelVecs; ++v) {
            const Vec q = F::load(block, v, i, lut);
            if constexpr (F::kZero)
              store(out + v * kWidth, pr.offset ? fmadd(q, s[v], z[v]) : (q - z[v]) * s[v]);
            else
              store(out + v * kWidth, q * s[v]);
          }
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
  // The next group's packed weights into L2 while the micro-kernel runs this one from cache:
  // dequantizing then reads cache, not memory.
  if (g + kGroup < pr.panels) {
    const typename F::T* next = panel_start<F>(pr.p, pr.k, g + kGroup, 0);
    const int64_t bytes = std::min<int64_t>(kGroup, pr.panels - g - kGroup) * (pr.k / F::kSteps) * F::kBlockBytes;
    for (int64_t off = 0; off < bytes; off += 64) prefetch_l2(next + off);
  }
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

GroupValues checked_groups(const at::Tensor& t, int64_t panels, int64_t groups, const char* what) {
  TORCH_CHECK((t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf) && t.is_contiguous() && t.dim() == 3 &&
                  t.size(0) == panels && t.size(1) == groups && t.size(2) == kLanes,
              what, " must be a contiguous float32 or float16 [", panels, ", ", groups, ", 16] tensor");
  return {t.data_ptr(), t.scalar_type() == at::kHalf};
}

// x: [..., K] fp32; packed: the format's [N / 16, K, bytes per step]; scale (and zero for int4):
// [N / 16, K / G, 16] fp32; bias: [N] or None -> [..., N].
template <class F>
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                          const at::Tensor* zero, const std::optional<at::Tensor>& bias, int64_t group_size,
                          at::ScalarType type, bool offset = false, const float* table = nullptr) {
  TORCH_CHECK(packed.scalar_type() == type && packed.dim() == 3 && packed.size(2) == F::kStepBytes &&
                  packed.is_contiguous(),
              "packed weight must be a contiguous ", F::kName, " tensor");
  const int64_t panels = packed.size(0), k = packed.size(1), n = panels * kLanes;
  TORCH_CHECK(group_size > 0 && k % group_size == 0, "group_size ", group_size, " must divide K = ", k);
  TORCH_CHECK(group_size % F::kSteps == 0, "group_size ", group_size, " must be a multiple of ", F::kSteps);
  const GroupValues s = checked_groups(scale, panels, k / group_size, "scale");
  const GroupValues z = zero ? checked_groups(*zero, panels, k / group_size, "zero") : GroupValues{};
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == k, "x must be float32 [..., ", k, "]");
  at::Tensor x2 = x.reshape({-1, k});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor y = at::empty(out_shape, x.options());
  const int64_t m = x2.size(0);
  if (m == 0) return y;
  const float* xp = x2.data_ptr<float>();
  const std::vector<float> xsum = F::kZero && m < F::kDequantRows ? group_sums(xp, m, k, x2.stride(0), group_size)
                                                                 : std::vector<float>();
  const GroupedProblem<F> pr{xp,          packed.data_ptr<typename F::T>(), s, z, offset, xsum.data(), table,
                             checked_vector(bias, n, "bias"), y.data_ptr<float>(), k, group_size, x2.stride(0), n,
                             panels};
  // Tiny weights (test models) stay on one thread; threads split whole groups of 4 panels.
  const int64_t grain = std::max<int64_t>(1, kMinThreadBytes / (k * F::kStepBytes * kGroup));
  at::parallel_for(0, (panels + kGroup - 1) / kGroup, grain, [&](int64_t g0, int64_t g1) {
    std::vector<float> buffer;
    for (int64_t g = g0 * kGroup; g < std::min(panels, g1 * kGroup); g += kGroup) {
      if (m < F::kDequantRows)
        fused_group(pr, m, g, panels);
      else
        dequant_group(pr, m, g, panels, buffer);
    }
  });
  return y;
}

// ---- W4A8 (see the top) ----
// IVec: kWidth int32 lanes, the words of a panel's block as the float tile's Vec holds floats.
#if defined(PAGEDLLM_VEC_AVX512)
struct IVec { __m512i v; };
inline IVec iload(const uint8_t* block, int) { return {_mm512_loadu_si512(block)}; }
inline IVec izero() { return {_mm512_setzero_si512()}; }
inline IVec even_steps(IVec a) { return {_mm512_and_si512(a.v, _mm512_set1_epi8(15))}; }
inline IVec odd_steps(IVec a) { return {_mm512_and_si512(_mm512_srli_epi32(a.v, 4), _mm512_set1_epi8(15))}; }
inline IVec dot4(IVec acc, IVec w, int32_t x) {  // acc += 4 byte products per lane, w unsigned, x signed
#if defined(__AVX512VNNI__)
  return {_mm512_dpbusd_epi32(acc.v, w.v, _mm512_set1_epi32(x))};
#else
  const __m512i pairs = _mm512_maddubs_epi16(w.v, _mm512_set1_epi32(x));
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))};
#endif
}
inline Vec to_float(IVec a) { return {_mm512_cvtepi32_ps(a.v)}; }
#elif defined(PAGEDLLM_VEC_AVX2)
struct IVec { __m256i v; };
inline IVec iload(const uint8_t* block, int v) { return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block) + v)}; }
inline IVec izero() { return {_mm256_setzero_si256()}; }
inline IVec even_steps(IVec a) { return {_mm256_and_si256(a.v, _mm256_set1_epi8(15))}; }
inline IVec odd_steps(IVec a) { return {_mm256_and_si256(_mm256_srli_epi32(a.v, 4), _mm256_set1_epi8(15))}; }
inline IVec dot4(IVec acc, IVec w, int32_t x) {
#if defined(__AVXVNNI__)
  return {_mm256_dpbusd_avx_epi32(acc.v, w.v, _mm256_set1_epi32(x))};
#else
  const __m256i pairs = _mm256_maddubs_epi16(w.v, _mm256_set1_epi32(x));
  return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))};
#endif
}
inline Vec to_float(IVec a) { return {_mm256_cvtepi32_ps(a.v)}; }
#elif defined(PAGEDLLM_VEC_NEON)
struct IVec { int32x4_t v; };
inline IVec iload(const uint8_t* block, int v) { return {vreinterpretq_s32_u8(vld1q_u8(block + 16 * v))}; }
inline IVec izero() { return {vdupq_n_s32(0)}; }
inline IVec even_steps(IVec a) { return {vandq_s32(a.v, vdupq_n_s32(0x0F0F0F0F))}; }
inline IVec odd_steps(IVec a) {
  return {vreinterpretq_s32_u32(vandq_u32(vshrq_n_u32(vreinterpretq_u32_s32(a.v), 4), vdupq_n_u32(0x0F0F0F0F)))};
}
inline IVec dot4(IVec acc, IVec w, int32_t x) {  // the weights 0..15 are also signed bytes
  const int8x16_t wb = vreinterpretq_s8_s32(w.v), xb = vreinterpretq_s8_s32(vdupq_n_s32(x));
#if defined(__ARM_FEATURE_DOTPROD)
  return {vdotq_s32(acc.v, wb, xb)};
#else
  const int16x8_t lo = vmull_s8(vget_low_s8(wb), vget_low_s8(xb)), hi = vmull_high_s8(wb, xb);
  return {vaddq_s32(acc.v, vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)))};
#endif
}
inline Vec to_float(IVec a) { return {vcvtq_f32_s32(a.v)}; }
#else
struct IVec { int32_t v[4]; };
inline IVec iload(const uint8_t* block, int v) {
  IVec a;
  std::memcpy(a.v, block + 16 * v, sizeof(a.v));
  return a;
}
inline IVec izero() { return {{0, 0, 0, 0}}; }
inline IVec even_steps(IVec a) {
  for (int32_t& w : a.v) w &= 0x0F0F0F0F;
  return a;
}
inline IVec odd_steps(IVec a) {
  for (int32_t& w : a.v) w = static_cast<int32_t>((static_cast<uint32_t>(w) >> 4) & 0x0F0F0F0Fu);
  return a;
}
inline IVec dot4(IVec acc, IVec w, int32_t x) {
  int8_t xb[4];
  std::memcpy(xb, &x, 4);
  for (int l = 0; l < 4; ++l) {
    uint8_t wb[4];
    std::memcpy(wb, &w.v[l], 4);
    for (int j = 0; j < 4; ++j) acc.v[l] += int32_t(wb[j]) * int32_t(xb[j]);
  }
  return acc;
}
inline Vec to_float(IVec a) { return {F4{float(a.v[0]), float(a.v[1]), float(a.v[2]), float(a.v[3])}}; }
#endif

struct W4A8Problem {
  const int8_t* xq;  // [M, K]: each row's int8 activations, every 8 inputs as the even steps, then the odd
  const float* xs;  // [M, K / A]: the runs' scales
  const float* xqsum;  // [M, K / A]: sum of a run's xq
  const uint8_t* p;  // the int4 layout
  GroupValues scale;  // [N / 16, K / G, 16]
  GroupValues zero;  // [N / 16, K / G, 16]
  bool offset;  // zero holds offsets b: W = q s + b
  const float* bias;  // [N] or nullptr
  float* y;  // [M, N], row stride ldy
  int64_t k, group, run, ldy;
};

// The w4a8 tile prefetches into L2 as the fused tile does: its weight stream kPrefetchBlocks
// ahead and, kParamsAhead groups ahead, its panels' scales and zero points (each panel's a strided
// stream of its own beside the weights'). SmolLM2's 120 int4 linears at 1 and 4 rows (2 threads,
// Zen 4, benchmarks/int4_decode.py --baseline, 3 runs) took 0.81-0.92x the time without; the
// same scale prefetch in the fused float tile measured no faster, so it has none.
constexpr int64_t kParamsAhead = 2;
template <int NR>
inline void prefetch_group_params(const GroupValues& scale, const GroupValues& zero, int64_t p0, int64_t groups,
                                  int64_t g) {
  if (g >= groups) return;
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) {
    const int64_t at = ((p0 + j) * groups + g) * kLanes;
    prefetch_l2(scale.address(at));
    prefetch_l2(zero.address(at));
  }
}

// The tile shapes are the fused tile's (fused_registers): the int32 sums take the place of the
// group's float sums, the words and their two nibble vectors that of the broadcasts.
template <int MR, int NR>
void w4a8_tile(const W4A8Problem& pr, int64_t m0, int64_t p0, const uint8_t* w, int64_t block_stride) {
  constexpr int V = NR * kPanelVecs;
  const int64_t runs = pr.k / pr.run, run_blocks = pr.run / 8, groups = pr.k / pr.group;
  Vec acc[MR][V];
  fill(acc, zero());
  for (int64_t c = 0; c < runs; ++c) {
    if (c * pr.run % pr.group == 0)
      prefetch_group_params<NR>(pr.scale, pr.zero, p0, groups, c * pr.run / pr.group + kParamsAhead);
    IVec sum[MR][V];
    fill(sum, izero());
    for (int64_t b = c * run_blocks; b < (c + 1) * run_blocks; ++b) {
      const uint8_t* block = w + b * block_stride;
      for (int64_t off = 0; off < NR * Int4Format::kBlockBytes; off += 64)
        prefetch_l2(block + kPrefetchBlocks<Int4Format> * block_stride + off);
      int32_t xe[MR], xo[MR];
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        std::memcpy(&xe[r], pr.xq + (m0 + r) * pr.k + 8 * b, 4);
        std::memcpy(&xo[r], pr.xq + (m0 + r) * pr.k + 8 * b + 4, 4);
      }
#pragma GCC unroll 16
      for (int v = 0; v < V; ++v) {
        const IVec words = iload(block + (v / kPanelVecs) * Int4Format::kBlockBytes, v % kPanelVecs);
        const IVec even = even_steps(words), odd = odd_steps(words);
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) sum[r][v] = dot4(dot4(sum[r][v], even, xe[r]), odd, xo[r]);
      }
    }
    const int64_t g = c * pr.run / pr.group;
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) {
      const int64_t at = ((p0 + v / kPanelVecs) * groups + g) * kLanes + (v % kPanelVecs) * kWidth;
      const Vec s = pr.scale.get(at), z = pr.zero.get(at);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const int64_t rc = (m0 + r) * runs + c;
        if (pr.offset) {  // acc += xs * (s * sum + b * sum_k xq)
          const Vec t = fmadd(s, to_float(sum[r][v]), z * broadcast(pr.xqsum[rc]));
          acc[r][v] = fmadd(broadcast(pr.xs[rc]), t, acc[r][v]);
        } else {
          const Vec t = fmadd(z, broadcast(-pr.xqsum[rc]), to_float(sum[r][v]));
          acc[r][v] = fmadd(s * broadcast(pr.xs[rc]), t, acc[r][v]);
        }
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

// The group of panels [g, g + 4) ∩ [g, p1) for all m rows.
void w4a8_group(const W4A8Problem& pr, int64_t m, int64_t g, int64_t p1) {
  const int64_t width = std::min<int64_t>(kGroup, p1 - g), block_stride = stride_of_blocks<Int4Format>(width);
  group_tiles(m, width, [&](auto rows, auto cols, int64_t m0, int64_t j) {
    w4a8_tile<decltype(rows)::value, decltype(cols)::value>(pr, m0, g + j, panel_start<Int4Format>(pr.p, pr.k, g, j),
                                                            block_stride);
  });
}

// Row m of x [K] -> xq (every 8 inputs: the even ones, then the odd), and per run of A inputs its
// scale and the sum of its xq. The max and the rounding in vectors: at one row this ran once per
// linear on one thread while the other waited, 3.4 us for K = 576 and 8.3 us for K = 1536 as
// scalar code (libm's nearbyint / fmin / fmax per input), ~0.5 ms of a SmolLM2-shaped step.
// NaN inputs are ignored by the max and become -127, as the scalar std::max / fmax did.
inline float clamp_rounded(float v) { return std::fmin(127.f, std::fmax(-127.f, std::nearbyint(v))); }

void quantize_row(const float* x, int64_t k, int64_t run, int8_t* xq, float* xs, float* xqsum) {
  std::vector<float> rounded(static_cast<size_t>(run));
  for (int64_t c = 0; c < k / run; ++c) {
    const float* xr = x + c * run;
    Vec vmax = zero();
    int64_t j = 0;
    for (; j + kWidth <= run; j += kWidth) {
      const Vec v = load(xr + j), a = max(v, zero() - v);
      vmax = select_greater(a, vmax, a, vmax);  // ordered: a NaN lane keeps the max so far
    }
    float amax = reduce_max(vmax);
    for (; j < run; ++j) amax = std::max(amax, std::fabs(xr[j]));
    float inv = 127.f / amax;
    if (!(amax > 0.f) || !std::isfinite(inv)) inv = 0.f;  // zeros, a subnormal run, inf / NaN: q = 0
    const Vec vinv = broadcast(inv), lo = broadcast(-127.f), hi = broadcast(127.f);
    for (j = 0; j + kWidth <= run; j += kWidth) {
      const Vec r = round_nearest(load(xr + j) * vinv);
      const Vec floor_ = select_greater(r, lo, r, lo);  // NaN -> -127
      store(rounded.data() + j, select_greater(hi, floor_, floor_, hi));
    }
    for (; j < run; ++j) rounded[j] = clamp_rounded(xr[j] * inv);
    int32_t total = 0;
    for (j = 0; j < run; ++j) {
      const int32_t q = static_cast<int32_t>(rounded[j]);
      total += q;
      xq[c * run + (j / 8) * 8 + (j % 2) * 4 + (j % 8) / 2] = static_cast<int8_t>(q);
    }
    xs[c] = amax / 127.f;
    xqsum[c] = static_cast<float>(total);
  }
}

}  // namespace

at::Tensor packed_linear_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                              const at::Tensor& zero, const std::optional<at::Tensor>& bias, int64_t group_size,
                              bool offset) {
  return grouped_linear<Int4Format>(x, packed, scale, &zero, bias, group_size, at::kByte, offset);
}

at::Tensor packed_linear_int4_table(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                    const at::Tensor& table, const std::optional<at::Tensor>& bias, int64_t group_size) {
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.is_contiguous() && table.numel() == 16,
              "table must be a contiguous float32 tensor of 16 values");
  return grouped_linear<Int4TableFormat>(x, packed, scale, nullptr, bias, group_size, at::kByte, false,
                                         table.data_ptr<float>());
}

at::Tensor packed_linear_int8_grouped(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                      const std::optional<at::Tensor>& bias, int64_t group_size,
                                      const std::optional<at::Tensor>& zero) {
  if (zero.has_value() && zero->defined())
    return grouped_linear<Int8ZeroFormat>(x, packed, scale, &*zero, bias, group_size, at::kChar);
  return grouped_linear<Int8Format>(x, packed, scale, nullptr, bias, group_size, at::kChar);
}

at::Tensor packed_linear_w4a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                              const at::Tensor& zero, const std::optional<at::Tensor>& bias, int64_t group_size,
                              bool offset) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == Int4Format::kStepBytes &&
                  packed.is_contiguous(),
              "packed weight must be a contiguous ", Int4Format::kName, " tensor");
  const int64_t panels = packed.size(0), k = packed.size(1), n = panels * kLanes;
  TORCH_CHECK(group_size > 0 && k % group_size == 0 && group_size % 8 == 0, "group_size ", group_size,
              " must divide K = ", k, " and be a multiple of 8");
  const GroupValues s = checked_groups(scale, panels, k / group_size, "scale");
  const GroupValues z = checked_groups(zero, panels, k / group_size, "zero");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == k, "x must be float32 [..., ", k, "]");
  at::Tensor x2 = x.reshape({-1, k});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor y = at::empty(out_shape, x.options());
  const int64_t m = x2.size(0), run = group_size % 32 == 0 ? 32 : group_size;
  if (m == 0) return y;
  std::vector<int8_t> xq(static_cast<size_t>(m * k));
  std::vector<float> xs(static_cast<size_t>(m * (k / run))), xqsum(xs.size());
  const float* xp = x2.data_ptr<float>();
  const int64_t ldx = x2.stride(0);
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      quantize_row(xp + r * ldx, k, run, xq.data() + r * k, xs.data() + r * (k / run), xqsum.data() + r * (k / run));
  });
  const W4A8Problem pr{xq.data(), xs.data(), xqsum.data(), packed.data_ptr<uint8_t>(), s, z, offset,
                       checked_vector(bias, n, "bias"), y.data_ptr<float>(), k, group_size, run, n};
  const int64_t grain = std::max<int64_t>(1, kMinThreadBytes / (k * Int4Format::kStepBytes * kGroup));
  at::parallel_for(0, (panels + kGroup - 1) / kGroup, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0 * kGroup; g < std::min(panels, g1 * kGroup); g += kGroup) w4a8_group(pr, m, g, panels);
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_OPS, m) {
  m.def(
      "packed_linear_int4(Tensor x, Tensor packed, Tensor scale, Tensor zero, Tensor? bias, int group_size, "
      "bool offset=False) -> Tensor");
  m.def(
      "packed_linear_int4_table(Tensor x, Tensor packed, Tensor scale, Tensor table, Tensor? bias, int group_size) "
      "-> Tensor");
  m.def(
      "packed_linear_int8_grouped(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int group_size, "
      "Tensor? zero=None) -> Tensor");
  m.def(
      "packed_linear_w4a8(Tensor x, Tensor packed, Tensor scale, Tensor zero, Tensor? bias, int group_size, "
      "bool offset=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_OPS, CPU, m) {
  m.impl("packed_linear_int4", &packed_linear_int4);
  m.impl("packed_linear_int4_table", &packed_linear_int4_table);
  m.impl("packed_linear_int8_grouped", &packed_linear_int8_grouped);
  m.impl("packed_linear_w4a8", &packed_linear_w4a8);
}
