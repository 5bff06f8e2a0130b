// The CPU kernels' C++ entry points, for the files that register them (cpu_ops.cpp) and those
// that call them from another kernel (cpu_decode_stack.cpp). Each is defined in its own file.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

void paged_decode_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                            at::Tensor block_table, at::Tensor seq_lens, double scale, int64_t window);
void rotary_embedding_(at::Tensor positions, at::Tensor query, at::Tensor key, at::Tensor cos_sin_cache,
                       int64_t head_dim);
at::Tensor silu_and_mul(at::Tensor x);
void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor kv_cache, at::Tensor slot_mapping);
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps);
void fused_add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
// cpu_gemm.cpp: x [..., K] times a weight packed [N / 16, K, 16] (+ bias [N]).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
// cpu_gemm_int8.cpp: weight-only int8, packed like the fp32 weight, one scale per output.
at::Tensor packed_linear_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                              const std::optional<at::Tensor>& bias);
// cpu_gemm_grouped.cpp: group-wise int4, packed [N / 16, K, 8]; scale, zero [N / 16, K / G, 16].
// offset: zero holds per-group offsets b, W = q s + b, instead of zero points (GGUF Q4_1's m).
at::Tensor packed_linear_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                              const at::Tensor& zero, const std::optional<at::Tensor>& bias, int64_t group_size,
                              bool offset = false);
// cpu_gemm_grouped.cpp: int4 codes in packed_linear_int4's layout looked up in a 16-value float32
// table, W = table[q] s, no zero point (bitsandbytes' NF4 / FP4).
at::Tensor packed_linear_int4_table(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                    const at::Tensor& table, const std::optional<at::Tensor>& bias, int64_t group_size);
// cpu_gemm_grouped.cpp: int4 weights as packed_linear_int4's, activations quantized to int8 inside.
at::Tensor packed_linear_w4a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                              const at::Tensor& zero, const std::optional<at::Tensor>& bias, int64_t group_size,
                              bool offset = false);
// cpu_gemm_grouped.cpp: group-wise int8 (Q8_0-like), packed as packed_linear_int8's; scale (and the
// optional zero point: W = (q - z) s) [N / 16, K / G, 16].
at::Tensor packed_linear_int8_grouped(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                      const std::optional<at::Tensor>& bias, int64_t group_size,
                                      const std::optional<at::Tensor>& zero);
// cpu_lora.cpp: y [T, O] += each token's LoRA delta (slot -1: none); b: one [S * R, O_i] per projection.
void lora_add_(at::Tensor y, const at::Tensor& x, const at::Tensor& a, at::TensorList b, const at::Tensor& token_slots,
               int64_t max_loras, int64_t max_rank);
// cpu_gemm_w8a8.cpp: int8 weights x per-token int8 activations; path indexes w8a8_paths().
at::Tensor linear_w8a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale,
                       const at::Tensor& w_comp, const std::optional<at::Tensor>& bias, int64_t path);
// cpu_shm_allreduce.cpp: the tensor-parallel ranks' shared-memory collectives (distributed/shm_allreduce.py
// owns the segment): segment uint8 (flags, then two sets of slots); state int64 [4]: ops done so
// far, nanoseconds spent in them, bytes all-reduced, bytes all-gathered (this rank's).
struct ShmGroup {
  at::Tensor segment, state;
  int64_t rank, world_size, slot_bytes;
  double timeout_s;
  // Publish x and wait for every peer's op: their slots (views of x's shape; read them now).
  std::vector<at::Tensor> exchange(const at::Tensor& x) const;
  void all_reduce(at::Tensor x) const;  // sums x over the ranks in place, in rank order
};
