// fp32 GEMM y = x W^T (+ b) for CPU on a weight packed once into column panels, tuned for
// decode: at a few rows the step is bound by streaming the weight, so the kernel reads every
// weight byte exactly once per call, in long sequential runs, and keeps all sums in registers.
//
// Packed layout: W [N, K] -> P [N / 16, K, 16], P[p, k, j] = W[16 p + j, k]. One k step of a
// panel is one 64-byte line (16 outputs), so the inner loop is a broadcast of x[m, k] times
// vector loads: no horizontal sums, and the same layout serves 1 row and a prefill's thousands.
// Threads split the panels (at::parallel_for), so each weight byte is read by one core.
//
// One source for every ISA level: the tile (cpu_gemm_common.h) is written over cpu_vec.h's Vec,
// a panel being 16 / kWidth vectors, and its shape is chosen per ISA from the vector width and
// register count. Op: packed_linear.
// Only light ATen headers (no torch/extension.h, no pybind): the first-use build takes seconds.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_gemm_common.h"
#include "cpu_kernels.h"

using namespace pagedllm_gemm;

// y = x W^T (+ b) into io.y (float32) for weights of element type T packed as at the top.
template <class T>
void run_packed(const GemmIo& io, const at::Tensor& packed, const float* bias) {
  const int64_t k = packed.size(1), panels = packed.size(0), m = io.x2.size(0);
  if (m == 0) return;
  const Problem<T> pr{io.x2.data_ptr<float>(), packed.data_ptr<T>(), nullptr, bias, io.y.data_ptr<float>(),
                      k, io.x2.stride(0), panels * kLanes, false};
  // Tiny weights (test models) stay on one thread: a parallel region costs more than they do.
  const int64_t grain = std::max<int64_t>(1, kMinThreadBytes / (k * kLanes * static_cast<int64_t>(sizeof(T))));
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) { run_panels(pr, m, p0, p1); });
}

// x: [..., K] fp32; packed: [N / 16, K, 16] fp32 (see the top); bias: [N] or None -> [..., N].
// Not file-local: the decoder-stack op (cpu_decode_stack.cpp) calls it directly.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kFloat, "packed weight must be float32");
  const int64_t n = packed.size(0) * kLanes;
  const GemmIo io = gemm_io(x, packed, n);
  run_packed<float>(io, packed, checked_vector(bias, n, "bias"));
  return io.y;
}

// A 16-bit model's linears (--dtype bfloat16 / float16): packed [N / 16, K, 16] bfloat16 or
// float16 weights (the same layout), widened to float32 as they are loaded, so a decode step reads
// half the bytes of float32. x [..., K] and bias in any float type; the sums are float32 and the
// result is rounded once to x's type.
at::Tensor packed_linear_16(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  const auto type = packed.scalar_type();
  TORCH_CHECK(type == at::kBFloat16 || type == at::kHalf, "packed weight must be bfloat16 or float16");
  const int64_t n = packed.size(0) * kLanes;
  const GemmIo io = gemm_io(x.scalar_type() == at::kFloat ? x : x.to(at::kFloat), packed, n);
  std::optional<at::Tensor> bias32;
  if (bias.has_value() && bias->defined()) bias32 = bias->to(at::kFloat);
  const float* b = checked_vector(bias32, n, "bias");
  if (type == at::kBFloat16)
    run_packed<c10::BFloat16>(io, packed, b);
  else
    run_packed<c10::Half>(io, packed, b);
  return x.scalar_type() == at::kFloat ? io.y : io.y.to(x.scalar_type());
}

#ifdef PAGEDLLM_TILE_TRACE
// The row-tile counters since the last read, [2 (cycles, calls), 2 (first group, rest), 16], zeroed.
at::Tensor tile_trace(const at::Tensor& like) {
  at::Tensor out = at::empty({2, 2, 16}, like.options().dtype(at::kDouble));
  auto a = out.accessor<double, 3>();
  for (int f = 0; f < 2; ++f)
    for (int t = 0; t < 16; ++t) {
      a[0][f][t] = static_cast<double>(tile_cycles[f][t].exchange(0));
      a[1][f][t] = static_cast<double>(tile_calls[f][t].exchange(0));
    }
  return out;
}
#endif

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_OPS, m) {
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("packed_linear_16(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
#ifdef PAGEDLLM_TILE_TRACE
  m.def("tile_trace(Tensor like) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(PAGEDLLM_OPS, CPU, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("packed_linear_16", &packed_linear_16);
#ifdef PAGEDLLM_TILE_TRACE
  m.impl("tile_trace", &tile_trace);
#endif
}
