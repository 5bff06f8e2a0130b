// A Llama decoder stack's decode step in one call: every layer's norms, GEMMs (packed fp32, int8, w8a8 or int4), RoPE, K/V
// write, paged decode attention and SwiGLU, in the order the Python modules run them and with the
// same kernels, so the result is bitwise the modules' result.
//
// Why: at decode the arithmetic per layer is a few microseconds of kernel work around the GEMMs,
// but the Python around them (module calls, views, dispatch) ran ~20 ms per step on a 30-layer
// model at batch 1 (a third of the step on an AVX2 machine), much of it on caches that the
// weights streaming past have just emptied. One C++ call per step removes it.
// With LoRA (lora_slots given), each linear adds its adapters' deltas right after its GEMM
// (lora_add_, cpu_lora.cpp), as LinearBase.add_lora does in the modules.
// Under tensor parallelism (shm_segment given) each rank holds its heads' and MLP columns' shards
// and sums the row-parallel outputs (o_proj, down_proj) over the ranks right after them with the
// shared-memory all-reduce (cpu_shm_allreduce.cpp), as RowParallelLinear does through TPGroup.
// Op: decode_stack_ (layers/cpu_decode_stack.py decides when it applies). decode_stack_phases turns
// on (or off) a wall-clock split of the stack's steps by phase and hands back what it summed:
// benchmarks/decode_breakdown.py prints it (where a step's time goes at each batch size, ISA and
// weight method); while off, each phase costs one predictable branch.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <chrono>
#include <optional>
#include <vector>

#include "cpu_kernels.h"

namespace {

// The phases of a step that decode_stack_phases times, in its tensor's order.
enum Phase : int { kNorms, kQkv, kRope, kKvWrite, kAttention, kOProj, kGateUp, kSilu, kDown, kAllReduce, kPhases };

struct PhaseTimes {
  std::atomic<bool> on{false};
  std::array<double, kPhases> seconds{};  // summed over the steps since the last read
  int64_t steps = 0;
};
PhaseTimes phase_times;

// Adds the time since the last mark (or construction) to a phase, when timing is on.
class PhaseClock {
 public:
  PhaseClock() : on_(phase_times.on.load(std::memory_order_relaxed)) {
    if (on_) last_ = std::chrono::steady_clock::now();
  }
  void mark(Phase phase) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    phase_times.seconds[phase] += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  bool on_;
  std::chrono::steady_clock::time_point last_;
};

// How each of the stack's linears is stored (its layer's quant_method; a GGUF file's may differ).
// kInt4Offset / kW4A8Offset: int4 / w4a8 whose zero tensor holds offsets, W = q s + b (GGUF Q4_1).
// kInt4Table: int4 codes looked up in a 16-value table (bitsandbytes NF4 / FP4), which the comps
// entry holds, W = table[q] s.
enum class Method : int64_t {
  kPacked = 0,
  kInt8 = 1,
  kW8A8 = 2,
  kInt4 = 3,
  kW4A8 = 4,
  kInt8Groups = 5,
  kInt4Offset = 6,
  kW4A8Offset = 7,
  kInt4Table = 8
};

// The per-layer tensors, as lists indexed by layer; the linears 4 per layer (qkv, o, gate_up,
// down), with each one's scale and w8a8 compensation (int4, int8 groups: zero point) where its method has them.
struct Layers {
  at::TensorList input_norm, post_norm, kv_cache, linears;
  const std::vector<std::optional<at::Tensor>>& scales;
  const std::vector<std::optional<at::Tensor>>& comps;
  // Per linear: the input permutation of GPTQ's act-order groups (x[..., perm] is multiplied), or none.
  const std::vector<std::optional<at::Tensor>>& perms;
  const std::vector<std::optional<at::Tensor>>& qkv_bias;
  const std::vector<int64_t>& windows;
  const std::vector<Method>& methods;  // per linear: a GGUF file's layers may mix block types
  int64_t w8a8_path;
  // LoRA: per linear its stacked A, per projection its B (7 per layer: q, k, v, o, gate, up, down).
  at::TensorList lora_a, lora_b;
  const std::optional<at::Tensor>& lora_slots;
  int64_t max_loras, max_rank;
  const ShmGroup* tp;  // nullptr: one rank

  // Linear j (0 qkv, 1 o, 2 gate_up, 3 down) of layer i, as the layer's quant_method applies it,
  // plus the step's LoRA deltas.
  at::Tensor linear(size_t i, int j, const at::Tensor& x, const std::optional<at::Tensor>& bias) const {
    at::Tensor y = gemm(4 * i + j, x, bias);
    if (lora_slots.has_value()) {
      static constexpr int kFirstB[4] = {0, 3, 4, 6}, kNumB[4] = {3, 1, 2, 1};
      lora_add_(y, x, lora_a[4 * i + j], lora_b.slice(7 * i + kFirstB[j], kNumB[j]), *lora_slots, max_loras,
                max_rank);
    }
    return y;
  }

  at::Tensor gemm(size_t at, const at::Tensor& input, const std::optional<at::Tensor>& bias) const {
    // The inputs in the order the packed groups hold them, as Int4KernelMethod.apply gathers them.
    const at::Tensor x = perms[at].has_value() ? input.index_select(-1, *perms[at]) : input;
    switch (methods[at]) {
      case Method::kInt8:
        return packed_linear_int8(x, linears[at], *scales[at], bias);
      case Method::kW8A8:
        return linear_w8a8(x, linears[at], *scales[at], *comps[at], bias, w8a8_path);
      case Method::kInt4:  // the group size: K over the scale's groups
      case Method::kInt4Offset:
        return packed_linear_int4(x, linears[at], *scales[at], *comps[at], bias,
                                  linears[at].size(1) / scales[at]->size(1), methods[at] == Method::kInt4Offset);
      case Method::kW4A8:
      case Method::kW4A8Offset:
        return packed_linear_w4a8(x, linears[at], *scales[at], *comps[at], bias,
                                  linears[at].size(1) / scales[at]->size(1), methods[at] == Method::kW4A8Offset);
      case Method::kInt4Table:
        return packed_linear_int4_table(x, linears[at], *scales[at], *comps[at], bias,
                                        linears[at].size(1) / scales[at]->size(1));
      case Method::kInt8Groups:
        return packed_linear_int8_grouped(x, linears[at], *scales[at], bias, linears[at].size(1) / scales[at]->size(1),
                                          comps[at]);
      default:
        return packed_linear(x, linears[at], bias);
    }
  }
};

// hidden (the layer's input) and residual -> (the layer's MLP output, the residual stream before
// it), as LlamaDecoderLayer.forward returns them; residual is undefined before the first layer.
void decoder_layer(at::Tensor& hidden, at::Tensor& residual, const Layers& w, size_t i, const at::Tensor& positions,
                   const at::Tensor& cos_sin, const at::Tensor& slots, const at::Tensor& table,
                   const at::Tensor& seq_lens, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale,
                   double eps) {
  const int64_t tokens = hidden.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  PhaseClock clock;
  if (!residual.defined()) {
    residual = hidden;
    hidden = at::empty_like(residual);
    rms_norm(hidden, residual, w.input_norm[i], eps);
  } else {
    fused_add_rms_norm_(hidden, residual, w.input_norm[i], eps);
  }
  clock.mark(kNorms);
  const at::Tensor qkv = w.linear(i, 0, hidden, w.qkv_bias[i]);
  clock.mark(kQkv);
  const at::Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size);
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
  rotary_embedding_(positions, q, k, cos_sin, head_dim);
  clock.mark(kRope);
  write_kv_cache(k, v, w.kv_cache[i], slots);
  clock.mark(kKvWrite);
  at::Tensor attn = at::empty({tokens, heads, head_dim}, hidden.options());
  paged_decode_attention(attn, q.view({tokens, heads, head_dim}), w.kv_cache[i][0], w.kv_cache[i][1], table,
                         seq_lens, scale, w.windows[i]);
  clock.mark(kAttention);
  hidden = w.linear(i, 1, attn.view({tokens, q_size}), std::nullopt);
  clock.mark(kOProj);
  if (w.tp) w.tp->all_reduce(hidden);
  clock.mark(kAllReduce);
  fused_add_rms_norm_(hidden, residual, w.post_norm[i], eps);
  clock.mark(kNorms);
  const at::Tensor gate_up = w.linear(i, 2, hidden, std::nullopt);
  clock.mark(kGateUp);
  const at::Tensor act = silu_and_mul(gate_up);
  clock.mark(kSilu);
  hidden = w.linear(i, 3, act, std::nullopt);
  clock.mark(kDown);
  if (w.tp) w.tp->all_reduce(hidden);
  clock.mark(kAllReduce);
}

// hidden: the embedded tokens [T, H] (consumed: it becomes the residual stream); one query row
// per token, every token's K/V written before attention reads it (decodes, speculative rows).
// Returns norm(last layer's output + residual), the stack's final hidden states.
at::Tensor decode_stack_(at::Tensor hidden, at::Tensor positions, at::TensorList input_norm,
                         at::TensorList post_norm, at::TensorList linears,
                         std::vector<std::optional<at::Tensor>> scales, std::vector<std::optional<at::Tensor>> comps,
                         std::vector<std::optional<at::Tensor>> perms, std::vector<std::optional<at::Tensor>> qkv_bias, std::vector<int64_t> methods,
                         int64_t w8a8_path,
                         at::TensorList kv_cache, std::vector<int64_t> windows, at::Tensor final_norm,
                         at::Tensor cos_sin_cache, at::Tensor slot_mapping, at::Tensor block_table,
                         at::Tensor seq_lens, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale,
                         double eps, at::TensorList lora_a, at::TensorList lora_b,
                         std::optional<at::Tensor> lora_slots, int64_t max_loras, int64_t max_rank,
                         std::optional<at::Tensor> shm_segment, std::optional<at::Tensor> shm_state, int64_t tp_rank,
                         int64_t tp_size, int64_t shm_slot_bytes, double shm_timeout_s) {
  const size_t n = input_norm.size();
  TORCH_CHECK(post_norm.size() == n && qkv_bias.size() == n && kv_cache.size() == n && windows.size() == n &&
                  linears.size() == 4 * n && scales.size() == 4 * n && comps.size() == 4 * n && perms.size() == 4 * n,
              "decode_stack_: every per-layer list needs one entry per layer (", n, "), the linears four");
  TORCH_CHECK(methods.size() == 4 * n, "decode_stack_: one method per linear");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "decode_stack_: hidden must be a contiguous [T, H]");
  TORCH_CHECK(!lora_slots.has_value() || (lora_a.size() == 4 * n && lora_b.size() == 7 * n),
              "decode_stack_: LoRA needs one A per linear and one B per projection (7 per layer)");
  TORCH_CHECK(tp_size == 1 || (shm_segment.has_value() && shm_state.has_value()),
              "decode_stack_: tensor parallelism needs the shared-memory all-reduce's segment and counter");
  std::vector<Method> ms(methods.size());
  for (size_t j = 0; j < linears.size(); ++j) {
    TORCH_CHECK(methods[j] >= 0 && methods[j] <= 8, "decode_stack_: linear ", j,
                "'s method must be 0 (packed), 1 (int8), 2 (w8a8), 3 (int4), 4 (w4a8), 5 (int8 groups), "
                "6 (int4 with offsets), 7 (w4a8 with offsets) or 8 (int4 codes in a table)");
    const Method m = ms[j] = static_cast<Method>(methods[j]);
    TORCH_CHECK(m == Method::kPacked ||
                    (scales[j].has_value() && (m == Method::kInt8 || m == Method::kInt8Groups || comps[j].has_value())),
                "decode_stack_: linear ", j, " lacks the scale (or w8a8 compensation, int4 zero, code table) of its method");
  }
  std::optional<ShmGroup> tp;
  if (tp_size > 1) tp = ShmGroup{*shm_segment, *shm_state, tp_rank, tp_size, shm_slot_bytes, shm_timeout_s};
  const Layers w{input_norm, post_norm, kv_cache, linears,  scales,    comps,     perms,     qkv_bias,
                 windows,    ms,        w8a8_path, lora_a, lora_b, lora_slots, max_loras, max_rank,
                 tp ? &*tp : nullptr};
  at::Tensor residual;
  for (size_t i = 0; i < n; ++i)
    decoder_layer(hidden, residual, w, i, positions, cos_sin_cache, slot_mapping, block_table, seq_lens, heads,
                  kv_heads, head_dim, scale, eps);
  PhaseClock clock;
  fused_add_rms_norm_(hidden, residual, final_norm, eps);
  clock.mark(kNorms);
  if (phase_times.on.load(std::memory_order_relaxed)) ++phase_times.steps;
  return hidden;
}

// The seconds each phase took, summed over the stack's steps since the last call, then the number
// of those steps ([kPhases + 1] float64); clears them, and times the next steps when `on`.
at::Tensor decode_stack_phases(bool on) {
  at::Tensor out = at::empty({kPhases + 1}, at::TensorOptions().dtype(at::kDouble));
  double* o = out.data_ptr<double>();
  for (int p = 0; p < kPhases; ++p) o[p] = phase_times.seconds[p];
  o[kPhases] = static_cast<double>(phase_times.steps);
  phase_times.seconds.fill(0.0);
  phase_times.steps = 0;
  phase_times.on.store(on, std::memory_order_relaxed);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_OPS, m) {
  m.def("decode_stack_(Tensor(a!) hidden, Tensor positions, Tensor[] input_norm, Tensor[] post_norm, "
        "Tensor[] linears, Tensor?[] scales, Tensor?[] comps, Tensor?[] perms, Tensor?[] qkv_bias, int[] methods, "
        "int w8a8_path, "
        "Tensor(b!)[] kv_cache, int[] windows, Tensor final_norm, Tensor cos_sin_cache, Tensor slot_mapping, "
        "Tensor block_table, Tensor seq_lens, int heads, int kv_heads, int head_dim, float scale, float eps, "
        "Tensor[] lora_a, Tensor[] lora_b, Tensor? lora_slots, int max_loras, int max_rank, Tensor(c!)? shm_segment, "
        "Tensor(d!)? shm_state, int tp_rank, int tp_size, int shm_slot_bytes, float shm_timeout_s) -> Tensor");
  m.def("decode_stack_phases(bool on) -> Tensor", &decode_stack_phases);  // no tensor in: one kernel for all
}

TORCH_LIBRARY_IMPL(PAGEDLLM_OPS, CPU, m) {
  m.impl("decode_stack_", &decode_stack_);
}
