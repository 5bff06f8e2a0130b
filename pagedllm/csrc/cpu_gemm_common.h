// What the fp32 and the int8 packed GEMM kernels share: the tiling constants, the driver that
// walks a thread's panels in x blocks and row tiles, and the input/output checks. Each kernel
// brings its own tile (how a panel's weights are loaded) and its own layout details.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

namespace pagedllm_gemm {

constexpr int64_t kLanes = 16;  // outputs per panel: one AVX-512 vector of fp32
constexpr int kGroup = 4;  // panels per tile: 64 outputs
// The tallest tile: 6 rows x 4 panels = 24 accumulators; per k step 4 weight vectors and 6
// broadcasts feed 24 FMAs (enough to be compute-bound at prefill sizes).
constexpr int64_t kMaxRows = 6;
// Rows of x per block: the block (rows x K floats) stays in L2 while the thread's panels stream
// past it; prefill batches are cut into such blocks, decode batches are one block.
constexpr int64_t kXBlockBytes = 384 * 1024;
// Least weight bytes worth waking a second thread for.
constexpr int64_t kMinThreadBytes = 64 * 1024;

// Calls tile_rows(std::integral_constant<int, MR>) with a tile exactly as tall as the mr rows
// left (decode batches of 1-5 rows are one tile), so each weight vector is loaded once.
template <class F>
void dispatch_rows(int64_t mr, F&& tile_rows) {
  switch (mr) {
    case 1: return tile_rows(std::integral_constant<int, 1>{});
    case 2: return tile_rows(std::integral_constant<int, 2>{});
    case 3: return tile_rows(std::integral_constant<int, 3>{});
    case 4: return tile_rows(std::integral_constant<int, 4>{});
    case 5: return tile_rows(std::integral_constant<int, 5>{});
    default: return tile_rows(std::integral_constant<int, kMaxRows>{});
  }
}

// One thread's panels [p0, p1) for all m rows: rows(m0, mr, g, ge, f0, f1) per row tile and panel
// group. Within an x block, a group of panels is the outer loop: its weights come from memory once
// and from cache for every further row tile. So that the memory does not idle while those tiles
// run from cache (and the next group's first tile does not wait on it), the row tiles share out
// the next group's panels to prefetch as they go: [f0, f1), at most 2 panels (a block has at
// least 2 row tiles when it prefetches), empty for the rest. Not in a block of one row tile: 1-6
// rows stream each weight once, at the memory's pace already.
template <class F>
void for_each_tile(int64_t m, int64_t k, int64_t p0, int64_t p1, F&& rows) {
  const int64_t block = std::max(kMaxRows, kXBlockBytes / (k * 4) / kMaxRows * kMaxRows);
  for (int64_t mb = 0; mb < m; mb += block) {
    const int64_t me = std::min(m, mb + block), tiles = (me - mb + kMaxRows - 1) / kMaxRows;
    for (int64_t g = p0; g < p1; g += kGroup) {
      const int64_t ge = std::min(p1, g + kGroup);
      // The next group: in this block, else the first of the next block (none after the last).
      const int64_t next = tiles == 1 ? p1 : ge < p1 ? ge : me < m ? p0 : p1;
      const int64_t next_end = std::min(p1, next + kGroup), share = (next_end - next + tiles - 1) / tiles;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m0 = mb + t * kMaxRows, f0 = std::min(next_end, next + t * share);
        rows(m0, std::min(kMaxRows, me - m0), g, ge, f0, std::min(next_end, f0 + share));
      }
    }
  }
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
