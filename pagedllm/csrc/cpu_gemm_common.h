// What the fp32 and the int8 packed GEMM kernels share: the register tile (one source for every
// ISA, over cpu_vec.h's Vec), its shapes per ISA, the driver that walks a thread's panels in x
// blocks and row tiles, and the input/output checks. The kernels differ in the weight's element
// type (float, or int8 widened in registers) and in how a group of panels is laid out.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "cpu_vec.h"

#ifdef PAGEDLLM_TILE_TRACE  // benchmarks/gemm_tile_trace.py builds the fp32 GEMM with it (x86-64 only)
#include <x86intrin.h>

#include <atomic>
#endif

namespace pagedllm_gemm {

using namespace pagedllm_vec;

#ifdef PAGEDLLM_TILE_TRACE
// Cycles (rdtsc) and calls per row tile over a panel group, by row tile index (the last slot
// takes every tile from the 15th on), the thread's first group of a call [0] apart from the rest [1].
inline std::atomic<uint64_t> tile_cycles[2][16], tile_calls[2][16];
#endif

// Outputs per panel, a property of the layout, not of the ISA (the Python packing is the same
// for every build): one AVX-512 vector of fp32, two AVX2 vectors, four NEON ones.
constexpr int64_t kLanes = 16;
constexpr int kPanelVecs = static_cast<int>(kLanes) / kWidth;
static_assert(kPanelVecs * kWidth == kLanes, "a panel is a whole number of vectors");
constexpr int kGroup = 4;  // panels per group: 64 outputs, the int8 layout's interleave

// Vector registers an MR x NR tile keeps live per k step: the MR * NR * kPanelVecs accumulators,
// one broadcast x and one weight vector at the least, plus whichever of the two the tile holds
// for reuse: the weight vectors of a k step (when there are fewer of them than rows) or the rows'
// broadcasts (when there are fewer rows).
constexpr int tile_registers(int mr, int nr) {
  return mr * nr * kPanelVecs + std::min(mr, nr * kPanelVecs) + 1;
}
// The widest tile (in panels, at most a group) for MR rows that needs no spill; 0 if none.
constexpr int max_panels(int mr) {
  int nr = kGroup;
  while (nr > 0 && tile_registers(mr, nr) > kRegisters) --nr;
  return nr;
}
// The tallest tile: up to 6 rows, as many as one panel's tile allows. AVX-512: 6 rows x 4 panels
// (24 accumulators; per k step 4 weight vectors and 6 broadcasts feed 24 FMAs, compute-bound at
// prefill sizes). AVX2: 6 x 1 (12 accumulators), NEON 6 x 1 (24), portable 3 x 1 (12). Shorter
// tiles widen as far as the registers allow (AVX2: 1 x 4, 2 x 3, 3 x 2; see max_panels).
constexpr int tallest_rows() {
  int mr = 6;
  while (mr > 1 && max_panels(mr) == 0) --mr;
  return mr;
}
constexpr int64_t kMaxRows = tallest_rows();
static_assert(max_panels(1) >= 1, "one row of one panel must fit the registers");
// Rows of x per block: the block (rows x K floats) stays in L2 while the thread's panels stream
// past it; prefill batches are cut into such blocks, decode batches are one block.
constexpr int64_t kXBlockBytes = 384 * 1024;
// How many of a block's row tiles prefetch the next group: about 12 tile sweeps over K (AVX-512:
// 12 row tiles of one 4-panel tile; AVX2 and NEON: 3 row tiles of four 1-panel tiles), so a group
// arrives at a third to a half of a line per k step. Spread over every row tile of the block
// instead (a line every 10 k steps at 64 rows on AVX2), the avx2 build at 128 rows ran 0.97x the
// kernel before, against 1.04x like this (Zen 4); see for_each_tile.
constexpr int64_t kPrefetchRowTiles = 12 / ((kGroup + max_panels(kMaxRows) - 1) / max_panels(kMaxRows));
// AVX2, in a block of at most kShortBlockTiles row tiles (a decode batch of up to 96 rows): twice
// as many. On an AVX-512 Xeon, weights from memory, the 3 prefetching row tiles ran ~45% slower
// than the rest while a group's lines were in flight (14-15 against 10 kcycles a row tile over a
// 4-panel group at K = 576); 6 took a 64-row step's linears 1.04x faster (level at 16 and 128
// rows) but a 512-row prefill's 0.97x. avx512 with twice its 12 was 1.01x at 64 rows, 0.97x at 128.
constexpr int64_t kShortBlockTiles = 16;
constexpr int64_t kPrefetchRowTilesShort = (kWidth == 8 ? 2 : 1) * kPrefetchRowTiles;
// How many k steps ahead a tile that reads a whole int8 group straight from memory (streams)
// prefetches: a full group's k steps are a line each, one stream that the hardware prefetcher
// alone kept at ~6 GB/s a core on an AVX-512 Xeon (75% of the 1-row tile's samples waited on its
// first load). 3 KiB ahead, SmolLM2's 120 int8 linears at one row took 5.5 ms a step instead of
// 8.6 (16 lines ahead 7.2, 32 6.3, 64 5.7, 96 6.0).
constexpr int64_t kStreamAheadLines = 48;
// Least weight bytes worth waking a second thread for.
constexpr int64_t kMinThreadBytes = 64 * 1024;

// One thread's panels [p0, p1) for all m rows: rows(m0, mr, g, ge, f0, f1, streams, first) per row tile
// and panel group. Within an x block, a group of panels is the outer loop: its weights come from
// memory once and from cache for every further row tile. So that the memory does not idle while
// those tiles run from cache (and the next group's first tile does not wait on it), the first
// kPrefetchRowTiles row tiles share out the next group's k steps (16 weights each, panel after
// panel: unit u is at element 16 u) to prefetch as they go: [f0, f1), empty for the rest; each
// tile spreads its slice evenly over its k steps (row_tiles). Handing whole panels to the first
// tiles instead (2 lines a k step, then none) left the memory idle for most of the group: on an
// AVX-512 Xeon (2 threads, a SmolLM2-sized step's linears) spreading them was 1.21x at 16 rows
// and 1.06x at 64 on the avx2 build, 1.08x at 64 rows on avx512, level at 16 there. A block
// of one row tile (streams: every decode batch of at most kMaxRows rows) reads each weight once,
// straight from memory; row_tiles then prefetches ahead within the thread's own panels instead.
// first: the block's first row tile, the one that reads the group from memory.
// The blocks are of even size (whole row tiles) and may exceed kXBlockBytes by a quarter rather
// than leave a short last block: every block streams the thread's weights again, so 64 rows at
// K = 1536 (down_proj) in 60 + 4 rows read the weights twice (1.04x for one block of 64, avx2
// build, weights from memory).
template <class F>
void for_each_tile(int64_t m, int64_t k, int64_t p0, int64_t p1, F&& rows) {
  const int64_t cap = std::max(kMaxRows, kXBlockBytes / (k * 4) / kMaxRows * kMaxRows);
  const int64_t blocks = std::max<int64_t>(1, (4 * m + 5 * cap - 1) / (5 * cap));
  const int64_t block = ((m + blocks - 1) / blocks + kMaxRows - 1) / kMaxRows * kMaxRows;
  for (int64_t mb = 0; mb < m; mb += block) {
    const int64_t me = std::min(m, mb + block), tiles = (me - mb + kMaxRows - 1) / kMaxRows;
    for (int64_t g = p0; g < p1; g += kGroup) {
      const int64_t ge = std::min(p1, g + kGroup);
      // The next group: in this block, else the first of the next block (none after the last).
      const int64_t next = tiles == 1 ? p1 : ge < p1 ? ge : me < m ? p0 : p1;
      // Its k steps (panel after panel, K each), shared out evenly over the first row tiles.
      const int64_t u0 = next * k, units = (std::min(p1, next + kGroup) - next) * k;
      const int64_t pt = std::min(tiles, tiles <= kShortBlockTiles ? kPrefetchRowTilesShort : kPrefetchRowTiles);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m0 = mb + t * kMaxRows, a = std::min(t, pt), b = std::min(t + 1, pt);
#ifdef PAGEDLLM_TILE_TRACE
        const uint64_t start = __rdtsc();
#endif
        rows(m0, std::min(kMaxRows, me - m0), g, ge, u0 + units * a / pt, u0 + units * b / pt, tiles == 1,
             t == 0);
#ifdef PAGEDLLM_TILE_TRACE
        const int first = g == p0 && mb == 0 ? 0 : 1, slot = static_cast<int>(std::min<int64_t>(m0 / kMaxRows, 15));
        tile_cycles[first][slot].fetch_add(__rdtsc() - start, std::memory_order_relaxed);
        tile_calls[first][slot].fetch_add(1, std::memory_order_relaxed);
#endif
      }
    }
  }
}

inline Vec load_weights(const float* p) { return load(p); }
inline Vec load_weights(const int8_t* p) { return load_i8(p); }  // exact: |q| <= 127
// 16-bit float weights widen exactly: bfloat16 by a shift, float16 by the ISA's conversion.
inline Vec load_weights(const c10::BFloat16* p) { return load_bf16(reinterpret_cast<const uint16_t*>(p)); }
inline Vec load_weights(const c10::Half* p) { return load_f16(reinterpret_cast<const uint16_t*>(p)); }

// y = x W^T * scale + bias on packed weights of type T. Panel p starts at p * K * 16 elements;
// within a group of panels a k step is 16 elements of one panel (fp32: panel after panel) or of
// every panel of the group side by side (int8: one 64-byte line per k step for a full group).
template <class T>
struct Problem {
  const float* x;  // [M, K], row stride ldx
  const T* p;  // [N / 16, K, 16]
  const float* scale;  // [N] or nullptr (1)
  const float* bias;  // [N] or nullptr
  float* y;  // [M, N], row stride ldy
  int64_t k, ldx, ldy;
  bool interleaved;
};

// How a tile prefetches into L2 as it goes (see row_tiles): not at all, line k of pf and of pf2
// at each k step (kAhead), or `spread` panel k steps (16 weights each) from pf, spread evenly over
// its K steps (kSpread).
enum class Prefetch { kNone, kAhead, kSpread };

// MR rows at m0 times NR panels from p0 (the weights at w: panel j at w + j * panel_stride, k step
// k at + k * k_stride): the accumulators live in registers; each k step loads the NR panels'
// weight vectors once and reuses them for all MR rows, and prefetches as PF says (a k step's FMAs
// leave the load ports room for it).
template <int MR, int NR, Prefetch PF, class T>
inline void tile(const Problem<T>& pr, int64_t m0, int64_t p0, const T* w, int64_t panel_stride, int64_t k_stride,
                 const T* pf, const T* pf2, int64_t spread) {
  constexpr int V = NR * kPanelVecs;  // vectors per row and k step
  static_assert(tile_registers(MR, NR) <= kRegisters, "the tile must fit the vector registers");
  const float* x = pr.x + m0 * pr.ldx;
  Vec acc[MR][V];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) acc[i][v] = zero();
  int64_t debt = 0;  // kSpread: k steps so far times spread, less K per unit prefetched
  for (int64_t k = 0; k < pr.k; ++k) {
    if constexpr (PF == Prefetch::kAhead) {
      prefetch_l2(pf + k * k_stride);
      prefetch_l2(pf2 + k * k_stride);
    } else if constexpr (PF == Prefetch::kSpread) {
      for (debt += spread; debt >= pr.k; debt -= pr.k, pf += kLanes) prefetch_l2(pf);
    }
    const T* wk = w + k * k_stride;
    const auto weight = [&](int v) { return load_weights(wk + (v / kPanelVecs) * panel_stride + (v % kPanelVecs) * kWidth); };
    if constexpr (V < MR) {  // hold the weight vectors, broadcast one row at a time
      Vec wv[V];
#pragma GCC unroll 16
      for (int v = 0; v < V; ++v) wv[v] = weight(v);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const Vec xv = broadcast(x[i * pr.ldx + k]);
#pragma GCC unroll 16
        for (int v = 0; v < V; ++v) acc[i][v] = fmadd(xv, wv[v], acc[i][v]);
      }
    } else {  // hold the rows' broadcasts, load one weight vector at a time
      Vec xv[MR];
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) xv[i] = broadcast(x[i * pr.ldx + k]);
#pragma GCC unroll 16
      for (int v = 0; v < V; ++v) {
        const Vec wv = weight(v);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) acc[i][v] = fmadd(xv[i], wv, acc[i][v]);
      }
    }
  }
#pragma GCC unroll 16
  for (int v = 0; v < V; ++v) {
    const int64_t n = p0 * kLanes + v * kWidth;
    const Vec s = pr.scale ? load(pr.scale + n) : broadcast(1.f);
    const Vec b = pr.bias ? load(pr.bias + n) : zero();
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) store(pr.y + (m0 + i) * pr.ldy + n, fmadd(acc[i][v], s, b));
  }
}

// The group of panels [g, ge) (1-4 panels) for MR rows at m0, in as few tiles of max_panels(MR)
// panels as cover it, of even widths; [f0, f1): the next group's k steps to prefetch (fp32
// layout), shared out evenly over the tiles, each spreading its share over its K steps. When the
// tiles stream their weights from memory (streams) and are narrower than the group (AVX2's tiles
// of 2 to 6 rows are 1 or 2 panels wide, NEON's and portable's 1), they prefetch ahead instead:
// the hardware prefetcher alone keeps too few lines in flight on one or two sequential streams.
// In the fp32 layout each tile prefetches the panels one tile ahead, up to the thread's last
// panel p1 (they follow in memory; avx2 build on Zen 4, a decode step's linears: 1.16x at 3 rows,
// 1.42-1.47x at 4-6). In the int8 layout every tile of a group reads the group's lines, the first
// from memory and the rest from cache; in the block's first row tile (first) the second tile
// prefetches the next group (1.11-1.27x at 2-6 rows, 1.13-1.20x at 8-12, level to 1.10x at 16).
// A tile as wide as the group (AVX-512, and every 1-row tile) reads 4 panels side by side: in
// the fp32 layout four streams, which the hardware prefetcher keeps busy; in the int8 layout one,
// which it does not, so when such a tile streams it prefetches kStreamAheadLines ahead (1.42x at
// 1 row and 1.53x at 4 on SmolLM2's int8 linears, AVX-512 Xeon).
template <int MR, class T>
void row_tiles(const Problem<T>& pr, int64_t m0, int64_t g, int64_t ge, int64_t f0, int64_t f1, bool streams, bool first,
               int64_t p1) {
  constexpr int kNr = max_panels(MR);
  const int64_t width = ge - g, tiles = (width + kNr - 1) / kNr, nr = (width + tiles - 1) / tiles;
  const int64_t panel = pr.k * kLanes;
  const int64_t panel_stride = pr.interleaved ? kLanes : panel, k_stride = pr.interleaved ? width * kLanes : kLanes;
  const T* w = pr.p + g * panel;  // every group before is full, in either layout
  for (int64_t j = 0; j < width; j += nr) {
    const int64_t cols = std::min(nr, width - j);
    // kAhead: line k of pf and of pf2 at each k step (pf2 == pf for one panel); kSpread: `spread`
    // k steps of the next group from pf.
    const T* pf = nullptr;
    const T* pf2 = nullptr;
    int64_t spread = 0;
    if (streams && tiles > 1 && !pr.interleaved) {  // the panels one tile ahead (nr <= 2 here)
      const int64_t q0 = std::min(p1, g + j + cols), q1 = std::min(p1, q0 + cols);
      if (q1 > q0) pf = pr.p + q0 * panel, pf2 = pr.p + (q1 - 1) * panel;
    } else if (streams && tiles == 1 && pr.interleaved) {  // int8: kStreamAheadLines down the group's stream
      pf = pf2 = w + kStreamAheadLines * k_stride;
    } else if (first && tiles > 1 && pr.interleaved) {  // int8: the next group, if full (its k stride is this one's)
      if (j == nr && width == kGroup && ge + kGroup <= p1) pf = pf2 = pr.p + ge * panel;
    } else if (!pr.interleaved && f1 > f0) {  // this tile's even share of the row tile's share of the next group
      const int64_t t = j / nr, u0 = f0 + (f1 - f0) * t / tiles;
      spread = f0 + (f1 - f0) * (t + 1) / tiles - u0;
      if (spread > 0) pf = pr.p + u0 * kLanes;
    }
    dispatch<kNr>(cols, [&](auto c) {
      constexpr int NR = decltype(c)::value;
      const T* wj = w + j * panel_stride;
      if (spread > 0)
        tile<MR, NR, Prefetch::kSpread>(pr, m0, g + j, wj, panel_stride, k_stride, pf, pf2, spread);
      else if (pf)
        tile<MR, NR, Prefetch::kAhead>(pr, m0, g + j, wj, panel_stride, k_stride, pf, pf2, 0);
      else
        tile<MR, NR, Prefetch::kNone>(pr, m0, g + j, wj, panel_stride, k_stride, pf, pf2, 0);
    });
  }
}

// One thread's panels [p0, p1) for all m rows (see for_each_tile), with a tile exactly as tall
// as the rows left (decode batches of fewer than kMaxRows rows are one tile), so each weight
// vector is loaded once per row tile.
template <class T>
void run_panels(const Problem<T>& pr, int64_t m, int64_t p0, int64_t p1) {
  for_each_tile(m, pr.k, p0, p1, [&](int64_t m0, int64_t mr, int64_t g, int64_t ge, int64_t f0, int64_t f1, bool streams,
                                     bool first) {
    dispatch<static_cast<int>(kMaxRows)>(mr, [&](auto rows) {
      row_tiles<decltype(rows)::value>(pr, m0, g, ge, f0, f1, streams, first, p1);
    });
  });
}

// The data of an optional contiguous float32 vector of n elements (nullptr when absent).
inline const float* checked_vector(const std::optional<at::Tensor>& t, int64_t n, const char* what) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->is_contiguous() && t->numel() == n && t->scalar_type() == at::kFloat,
              what, " must be a contiguous float32 tensor of ", n, " elements");
  return t->data_ptr<float>();
}

// x [..., K] as rows with unit feature stride, and the [..., N] output to fill.
struct GemmIo {
  at::Tensor x2, y;
};

inline GemmIo gemm_io(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kLanes && packed.is_contiguous(),
              "packed weight must be a contiguous [N/16, K, 16] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  const int64_t k = packed.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "x has ", x.size(-1), " features, the weight ", k);
  at::Tensor x2 = x.reshape({-1, k});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  return {x2, at::empty(out_shape, x.options())};
}

}  // namespace pagedllm_gemm
