// Python bindings of the CPU kernels (one extension module, several source files).
#include <torch/extension.h>

void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor seq_lens,
                            double scale, int64_t window);
void rotary_embedding_(torch::Tensor positions, torch::Tensor query, torch::Tensor key,
                       torch::Tensor cos_sin_cache, int64_t head_dim);
torch::Tensor silu_and_mul(torch::Tensor x);
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache, torch::Tensor slot_mapping);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("rotary_embedding_", &rotary_embedding_, "neox RoPE on q and k in place (float32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for x = [gate | up] (float32)");
  m.def("write_kv_cache", &write_kv_cache, "scatter K/V rows into the paged cache (float32)");
}
