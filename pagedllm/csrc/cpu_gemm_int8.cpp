// Weight-only int8 GEMM y = (x (Q^T)) * scale (+ b) for CPU decode: W ~ Q * scale[n] with Q int8
// (symmetric, one float32 scale per output channel) and x, y float32.
//
// Batch-1 decode streams every weight once per step, so it is bound by memory bandwidth; int8
// weights are a quarter of the fp32 bytes. The kernel widens a vector's worth of int8 weights to
// floats in registers (load_i8: vpmovsxbd + vcvtdq2ps on x86, sxtl + scvtf on NEON), FMAs them
// with a broadcast x in float32, and applies the channel scale once per output at the end (the
// scale is constant along k, so it factors out). The tile is the fp32 kernel's, one source for
// every ISA (cpu_gemm_common.h), on int8 elements.
//
// Packed layout: like the fp32 kernel's panels of 16 outputs (cpu_gemm.cpp), but 4 panels are
// interleaved along k: Q [N, K] is cut into groups of 64 output rows (the last may have 16, 32
// or 48), each stored transposed, [K, 64]: one k step of a group is one 64-byte cache line, so a
// tile reads one sequential stream (4 streams of 16 bytes per k step, the fp32 layout in int8,
// streamed 1.45x slower on one Zen 4 core: 13 vs 19 GB/s). The tensor keeps the shape
// [N / 16, K, 16] (same bytes) so shapes check as for fp32; threads split whole groups. A tile
// may cover part of a group (AVX2 and NEON tiles are 1-4 panels wide): it reads its panels' 16
// bytes of each line, and the group's first tile brings the lines from memory for the others: in
// a block's first row tile, the second tile of a group prefetches the next group, and a tile
// over a whole group that streams from memory prefetches 3 KiB down its stream (row_tiles).
// The widening costs two extra vector ops per vector of weights: measured with the AVX-512 tile,
// at one row the kernel was close to compute-bound (~24 GB/s per core from L2), and from ~16 rows on,
// where fp32 is compute-bound too, int8 was no faster than fp32 (level at 256 rows): it buys
// memory, not prefill speed.
//
// Op: packed_linear_int8.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_gemm_common.h"
#include "cpu_kernels.h"

using namespace pagedllm_gemm;

// x: [..., K] fp32; packed: [N / 16, K, 16] int8; scale: [N] fp32; bias: [N] or None -> [..., N].
at::Tensor packed_linear_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                              const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kChar, "packed weight must be int8");
  const int64_t k = packed.size(1), panels = packed.size(0), n = panels * kLanes;
  const float* scale_ptr = checked_vector(scale, n, "scale");
  TORCH_CHECK(scale_ptr != nullptr, "scale is required");
  const GemmIo io = gemm_io(x, packed, n);
  const int64_t m = io.x2.size(0);
  if (m == 0) return io.y;
  const Problem<int8_t> pr{io.x2.data_ptr<float>(), packed.data_ptr<int8_t>(), scale_ptr, checked_vector(bias, n, "bias"),
                           io.y.data_ptr<float>(), k, io.x2.stride(0), n, true};
  // Tiny weights (test models) stay on one thread: a parallel region costs more than they do.
  const int64_t grain = std::max<int64_t>(1, kMinThreadBytes / (k * kLanes));
  // Threads split whole groups of 4 panels (the interleaved unit of the layout).
  const int64_t groups = (panels + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, std::max<int64_t>(1, grain / kGroup), [&](int64_t g0, int64_t g1) {
    run_panels(pr, m, g0 * kGroup, std::min(panels, g1 * kGroup));
  });
  return io.y;
}

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_OPS, m) {
  m.def("packed_linear_int8(Tensor x, Tensor packed, Tensor scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_OPS, CPU, m) {
  m.impl("packed_linear_int8", &packed_linear_int8);
}
