// Registers the CPU kernels as torch.ops.<PAGEDLLM_OPS>.* (pagedllm_avx2, ...: one namespace per ISA
// level, set by the build; a plain shared library, no pybind: the build is several times faster
// and a call costs ~2 us of dispatch). The GEMM files add their ops to the same namespace.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_kernels.h"

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_OPS, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_table, Tensor seq_lens, float scale, int window) -> ()");
  m.def("rotary_embedding_(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_sin_cache, "
        "int head_dim) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_OPS, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("rotary_embedding_", &rotary_embedding_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("write_kv_cache", &write_kv_cache);
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm_", &fused_add_rms_norm_);
}
