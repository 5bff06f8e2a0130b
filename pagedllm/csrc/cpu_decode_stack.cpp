// A Llama decoder stack's decode step in one call: every layer's norms, packed GEMMs, RoPE, K/V
// write, paged decode attention and SwiGLU, in the order the Python modules run them and with the
// same kernels, so the result is bitwise the modules' result.
//
// Why: at decode the arithmetic per layer is a few microseconds of kernel work around the GEMMs,
// but the Python around them (module calls, views, dispatch) ran ~20 ms per step on a 30-layer
// model at batch 1 (a third of the step on an AVX2 machine), much of it on caches that the
// weights streaming past have just emptied. One C++ call per step removes it.
// Op: decode_stack_ (layers/cpu_decode_stack.py decides when it applies).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "cpu_kernels.h"

namespace {

// One layer's tensors, as lists indexed by layer.
struct Layers {
  at::TensorList input_norm, qkv, o, post_norm, gate_up, down, kv_cache;
  const std::vector<std::optional<at::Tensor>>& qkv_bias;
  const std::vector<int64_t>& windows;
};

// hidden (the layer's input) and residual -> (the layer's MLP output, the residual stream before
// it), as LlamaDecoderLayer.forward returns them; residual is undefined before the first layer.
void decoder_layer(at::Tensor& hidden, at::Tensor& residual, const Layers& w, size_t i, const at::Tensor& positions,
                   const at::Tensor& cos_sin, const at::Tensor& slots, const at::Tensor& table,
                   const at::Tensor& seq_lens, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale,
                   double eps) {
  const int64_t tokens = hidden.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  if (!residual.defined()) {
    residual = hidden;
    hidden = at::empty_like(residual);
    rms_norm(hidden, residual, w.input_norm[i], eps);
  } else {
    fused_add_rms_norm_(hidden, residual, w.input_norm[i], eps);
  }
  const at::Tensor qkv = packed_linear(hidden, w.qkv[i], w.qkv_bias[i]);
  const at::Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size);
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
  rotary_embedding_(positions, q, k, cos_sin, head_dim);
  write_kv_cache(k, v, w.kv_cache[i], slots);
  at::Tensor attn = at::empty({tokens, heads, head_dim}, hidden.options());
  paged_decode_attention(attn, q.view({tokens, heads, head_dim}), w.kv_cache[i][0], w.kv_cache[i][1], table,
                         seq_lens, scale, w.windows[i]);
  hidden = packed_linear(attn.view({tokens, q_size}), w.o[i], std::nullopt);
  fused_add_rms_norm_(hidden, residual, w.post_norm[i], eps);
  hidden = packed_linear(silu_and_mul(packed_linear(hidden, w.gate_up[i], std::nullopt)), w.down[i], std::nullopt);
}

// hidden: the embedded tokens [T, H] (consumed: it becomes the residual stream); one query row
// per token, every token's K/V written before attention reads it (decodes, speculative rows).
// Returns norm(last layer's output + residual), the stack's final hidden states.
at::Tensor decode_stack_(at::Tensor hidden, at::Tensor positions, at::TensorList input_norm, at::TensorList qkv,
                         std::vector<std::optional<at::Tensor>> qkv_bias, at::TensorList o,
                         at::TensorList post_norm, at::TensorList gate_up, at::TensorList down,
                         at::TensorList kv_cache, std::vector<int64_t> windows, at::Tensor final_norm,
                         at::Tensor cos_sin_cache, at::Tensor slot_mapping, at::Tensor block_table,
                         at::Tensor seq_lens, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale,
                         double eps) {
  const size_t n = input_norm.size();
  TORCH_CHECK(qkv.size() == n && qkv_bias.size() == n && o.size() == n && post_norm.size() == n &&
                  gate_up.size() == n && down.size() == n && kv_cache.size() == n && windows.size() == n,
              "decode_stack_: every per-layer list needs one entry per layer (", n, ")");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "decode_stack_: hidden must be a contiguous [T, H]");
  const Layers w{input_norm, qkv, o, post_norm, gate_up, down, kv_cache, qkv_bias, windows};
  at::Tensor residual;
  for (size_t i = 0; i < n; ++i)
    decoder_layer(hidden, residual, w, i, positions, cos_sin_cache, slot_mapping, block_table, seq_lens, heads,
                  kv_heads, head_dim, scale, eps);
  fused_add_rms_norm_(hidden, residual, final_norm, eps);
  return hidden;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_OPS, m) {
  m.def("decode_stack_(Tensor(a!) hidden, Tensor positions, Tensor[] input_norm, Tensor[] qkv, Tensor?[] qkv_bias, "
        "Tensor[] o, Tensor[] post_norm, Tensor[] gate_up, Tensor[] down, Tensor(b!)[] kv_cache, int[] windows, "
        "Tensor final_norm, Tensor cos_sin_cache, Tensor slot_mapping, Tensor block_table, Tensor seq_lens, "
        "int heads, int kv_heads, int head_dim, float scale, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_OPS, CPU, m) {
  m.impl("decode_stack_", &decode_stack_);
}
