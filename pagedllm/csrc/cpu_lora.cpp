// LoRA deltas of a mixed-adapter batch, one call per linear layer (layers: lora/layers.py).
//
// y [T, O] already holds x W^T. For every token t whose slot s = token_slots[t] is >= 0 and every
// projection i fused into the layer (q/k/v, gate/up, or one), shrink then expand:
//   h = A_i[s] x[t]                (R dot products of length I; A rows of all slots stacked as
//                                   a [n * S * R, I] tensor, projection-major, then slot, then rank)
//   y[t, off_i : off_i + O_i] += sum_r h[r] * B_i[s * R + r, :]   (B_i: [S * R, O_i], scale folded)
// Base-model tokens (slot -1) are skipped, so the work is the tokens' own adapters only, whatever
// the number of slots; zero rows of a smaller rank add nothing and are skipped. Threads split the
// tokens; a slot's A and B rows (tens to hundreds of KiB) stay in cache across its tokens.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu_vec.h"

using namespace pagedllm_vec;

namespace {

float dot(const float* a, const float* b, int64_t n) {
  Vec acc0 = zero(), acc1 = zero();
  int64_t k = 0;
  for (; k + 2 * kWidth <= n; k += 2 * kWidth) {
    acc0 = fmadd(load(a + k), load(b + k), acc0);
    acc1 = fmadd(load(a + k + kWidth), load(b + k + kWidth), acc1);
  }
  for (; k + kWidth <= n; k += kWidth) acc0 = fmadd(load(a + k), load(b + k), acc0);
  float sum = reduce_add(acc0 + acc1);
  for (; k < n; ++k) sum += a[k] * b[k];
  return sum;
}

void axpy(float* y, float alpha, const float* x, int64_t n) {
  const Vec a = broadcast(alpha);
  int64_t k = 0;
  for (; k + kWidth <= n; k += kWidth) store(y + k, fmadd(a, load(x + k), load(y + k)));
  for (; k < n; ++k) y[k] += alpha * x[k];
}

struct Layer {
  const float* a;
  std::vector<const float*> b;
  std::vector<int64_t> out, offset;
  int64_t in, slots, rank;
};

void token_delta(const Layer& l, const float* x, float* y, int64_t slot, float* h) {
  for (size_t i = 0; i < l.b.size(); ++i) {
    const float* a = l.a + ((static_cast<int64_t>(i) * l.slots + slot) * l.rank) * l.in;
    for (int64_t r = 0; r < l.rank; ++r) h[r] = dot(a + r * l.in, x, l.in);
    const float* b = l.b[i] + slot * l.rank * l.out[i];
    for (int64_t r = 0; r < l.rank; ++r) {
      if (h[r] != 0.0f) axpy(y + l.offset[i], h[r], b + r * l.out[i], l.out[i]);
    }
  }
}

}  // namespace

// y: [T, O] fp32 (rows contiguous, updated in place); x: [T, I]; a: [n * S * R, I]; b: n tensors
// [S * R, O_i] with sum O_i = O; token_slots: [T] int64, -1 for the base model.
void lora_add_(at::Tensor y, const at::Tensor& x, const at::Tensor& a, at::TensorList b,
               const at::Tensor& token_slots, int64_t max_loras, int64_t max_rank) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat,
              "lora_add_: float32 only");
  TORCH_CHECK(x.is_contiguous() && a.is_contiguous() && y.stride(1) == 1, "lora_add_: contiguous rows");
  TORCH_CHECK(token_slots.scalar_type() == at::kLong && token_slots.is_contiguous(), "lora_add_: int64 slots");
  const int64_t tokens = x.size(0);
  Layer l{a.data_ptr<float>(), {}, {}, {}, x.size(1), max_loras, max_rank};
  int64_t offset = 0;
  for (const auto& bi : b) {
    TORCH_CHECK(bi.is_contiguous() && bi.scalar_type() == at::kFloat, "lora_add_: B contiguous float32");
    l.b.push_back(bi.data_ptr<float>());
    l.out.push_back(bi.size(1));
    l.offset.push_back(offset);
    offset += bi.size(1);
  }
  TORCH_CHECK(offset == y.size(1) && a.size(0) == static_cast<int64_t>(b.size()) * max_loras * max_rank,
              "lora_add_: shapes do not match");
  const int64_t* slots = token_slots.data_ptr<int64_t>();
  float* yp = y.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const int64_t y_stride = y.stride(0);
  at::parallel_for(0, tokens, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> h(max_rank);
    for (int64_t t = t0; t < t1; ++t) {
      if (slots[t] >= 0) token_delta(l, xp + t * l.in, yp + t * y_stride, slots[t], h.data());
    }
  });
}

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_OPS, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor a, Tensor[] b, Tensor token_slots, int max_loras, int max_rank) -> ()");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_OPS, CPU, m) {
  m.impl("lora_add_", &lora_add_);
}
