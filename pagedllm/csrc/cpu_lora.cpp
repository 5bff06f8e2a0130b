// LoRA deltas of a mixed-adapter batch, one call per linear layer (layers: lora/layers.py).
//
// y [T, O] already holds x W^T. For every token t whose slot s = token_slots[t] is >= 0 and every
// projection i fused into the layer (q/k/v, gate/up, or one), shrink then expand:
//   h = A_i[s] x[t]                (R dot products of length I; A rows of all slots stacked as
//                                   a [n * S * R, I] tensor, projection-major, then slot, then rank)
//   y[t, off_i : off_i + O_i] += sum_r h[r] * B_i[s * R + r, :]   (B_i: [S * R, O_i], scale folded)
// Base-model tokens (slot -1) are skipped, so the work is the tokens' own adapters only, whatever
// the number of slots; the zero rows of a smaller rank are skipped. Tokens of one slot run in
// groups of up to 4, so each A and B vector loaded serves all of them, and the expand keeps y's
// vectors in registers across the ranks. Threads split the groups. A and B are float32 or
// bfloat16 (--lora-dtype: half the bytes a memory-bound decode step reads for them), widened to
// float32 as they load; x, y and every sum stay float32.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu_vec.h"

using namespace pagedllm_vec;

namespace {

// Tokens of one slot run together, up to this many: each A and B vector loaded serves them all.
constexpr int kGroup = 4;

// A weight element -> float: float32 as is, bfloat16 (raw bits) widened.
inline Vec load_w(const float* p) { return load(p); }
inline Vec load_w(const uint16_t* p) { return load_bf16(p); }
inline float to_float(float w) { return w; }
inline float to_float(uint16_t w) { return bf16_to_float(w); }

template <class W>
struct Layer {
  const W* a;
  std::vector<const W*> b;
  std::vector<int64_t> out, offset;
  int64_t in, slots, rank;
};

// A run of tokens of one slot: their x and y rows.
struct Group {
  const float* x[kGroup];
  float* y[kGroup];
  int count;
  int64_t slot;
};

// h[j * rank + r] = A[r] . x_j for the group's tokens j (A: rank rows of length n).
template <class W>
void shrink(const W* a, int64_t rank, int64_t n, const Group& g, float* h) {
  for (int64_t r = 0; r < rank; ++r) {
    const W* ar = a + r * n;
    Vec acc[kGroup];
    for (int j = 0; j < g.count; ++j) acc[j] = zero();
    int64_t k = 0;
    for (; k + kWidth <= n; k += kWidth) {
      const Vec av = load_w(ar + k);
      for (int j = 0; j < g.count; ++j) acc[j] = fmadd(av, load(g.x[j] + k), acc[j]);
    }
    for (int j = 0; j < g.count; ++j) {
      float sum = reduce_add(acc[j]);
      for (int64_t t = k; t < n; ++t) sum += to_float(ar[t]) * g.x[j][t];
      h[j * rank + r] = sum;
    }
  }
}

// y_j[offset : offset + n] += sum_r h[j * rank + r] * B[r] for the group's tokens j (B: [rank, n]);
// each y vector is loaded and stored once.
template <class W>
void expand(const W* b, int64_t rank, int64_t n, int64_t offset, const Group& g, const float* h) {
  int64_t k = 0;
  for (; k + kWidth <= n; k += kWidth) {
    Vec acc[kGroup];
    for (int j = 0; j < g.count; ++j) acc[j] = load(g.y[j] + offset + k);
    for (int64_t r = 0; r < rank; ++r) {
      const Vec bv = load_w(b + r * n + k);
      for (int j = 0; j < g.count; ++j) acc[j] = fmadd(broadcast(h[j * rank + r]), bv, acc[j]);
    }
    for (int j = 0; j < g.count; ++j) store(g.y[j] + offset + k, acc[j]);
  }
  for (; k < n; ++k) {
    for (int j = 0; j < g.count; ++j) {
      float sum = 0.0f;
      for (int64_t r = 0; r < rank; ++r) sum += h[j * rank + r] * to_float(b[r * n + k]);
      g.y[j][offset + k] += sum;
    }
  }
}

// The highest rank any token of the group uses + 1: a smaller adapter's zero rows are skipped.
int64_t used_rank(const float* h, int64_t rank, int count) {
  int64_t used = 0;
  for (int j = 0; j < count; ++j)
    for (int64_t r = used; r < rank; ++r)
      if (h[j * rank + r] != 0.0f) used = r + 1;
  return used;
}

template <class W>
void group_delta(const Layer<W>& l, const Group& g, float* h) {
  for (size_t i = 0; i < l.b.size(); ++i) {
    shrink(l.a + ((static_cast<int64_t>(i) * l.slots + g.slot) * l.rank) * l.in, l.rank, l.in, g, h);
    const int64_t used = used_rank(h, l.rank, g.count);
    if (used == 0) continue;
    // h keeps its row stride (l.rank); expand reads only the first `used` ranks of each row.
    const W* b = l.b[i] + g.slot * l.rank * l.out[i];
    if (used == l.rank) {
      expand(b, l.rank, l.out[i], l.offset[i], g, h);
    } else {
      std::vector<float> packed(static_cast<size_t>(g.count * used));
      for (int j = 0; j < g.count; ++j)
        for (int64_t r = 0; r < used; ++r) packed[j * used + r] = h[j * l.rank + r];
      expand(b, used, l.out[i], l.offset[i], g, packed.data());
    }
  }
}

// The adapter tokens in runs of at most kGroup tokens of one slot (slot order, then token order).
std::vector<Group> make_groups(const int64_t* slots, int64_t tokens, int64_t max_loras, const float* x,
                               int64_t x_stride, float* y, int64_t y_stride) {
  std::vector<Group> groups;
  std::vector<std::vector<int64_t>> members(max_loras);
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] >= 0) members[slots[t]].push_back(t);
  for (int64_t s = 0; s < max_loras; ++s) {
    for (size_t first = 0; first < members[s].size(); first += kGroup) {
      Group g{{}, {}, 0, s};
      for (size_t m = first; m < members[s].size() && g.count < kGroup; ++m, ++g.count) {
        g.x[g.count] = x + members[s][m] * x_stride;
        g.y[g.count] = y + members[s][m] * y_stride;
      }
      groups.push_back(g);
    }
  }
  return groups;
}

// The layer's A and B pointers and sizes, checked against y and the slots.
template <class W>
Layer<W> make_layer(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, at::TensorList b,
                    int64_t max_loras, int64_t max_rank) {
  Layer<W> l{static_cast<const W*>(a.data_ptr()), {}, {}, {}, x.size(1), max_loras, max_rank};
  int64_t offset = 0;
  for (const auto& bi : b) {
    TORCH_CHECK(bi.is_contiguous() && bi.scalar_type() == a.scalar_type(), "lora_add_: B contiguous, A's dtype");
    l.b.push_back(static_cast<const W*>(bi.data_ptr()));
    l.out.push_back(bi.size(1));
    l.offset.push_back(offset);
    offset += bi.size(1);
  }
  TORCH_CHECK(offset == y.size(1) && a.size(0) == static_cast<int64_t>(b.size()) * max_loras * max_rank,
              "lora_add_: shapes do not match");
  return l;
}

template <class W>
void run_groups(const Layer<W>& l, const std::vector<Group>& groups, int64_t max_rank) {
  at::parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> h(kGroup * max_rank);
    for (int64_t g = g0; g < g1; ++g) group_delta(l, groups[g], h.data());
  });
}

}  // namespace

// y: [T, O] fp32 (rows contiguous, updated in place); x: [T, I] fp32; a: [n * S * R, I] and b: n
// tensors [S * R, O_i] with sum O_i = O, both float32 or both bfloat16; token_slots: [T] int64,
// -1 for the base model.
void lora_add_(at::Tensor y, const at::Tensor& x, const at::Tensor& a, at::TensorList b,
               const at::Tensor& token_slots, int64_t max_loras, int64_t max_rank) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat, "lora_add_: float32 activations");
  const bool bf16 = a.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || a.scalar_type() == at::kFloat, "lora_add_: A and B float32 or bfloat16");
  TORCH_CHECK(x.is_contiguous() && a.is_contiguous() && y.stride(1) == 1, "lora_add_: contiguous rows");
  TORCH_CHECK(token_slots.scalar_type() == at::kLong && token_slots.is_contiguous(), "lora_add_: int64 slots");
  const int64_t tokens = x.size(0);
  TORCH_CHECK(token_slots.numel() == tokens && y.size(0) == tokens, "lora_add_: one slot per token");
  const int64_t* slots = token_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slots[t] < max_loras, "lora_add_: slot out of range");
  const std::vector<Group> groups =
      make_groups(slots, tokens, max_loras, x.data_ptr<float>(), x.size(1), y.data_ptr<float>(), y.stride(0));
  if (bf16) {
    run_groups(make_layer<uint16_t>(y, x, a, b, max_loras, max_rank), groups, max_rank);
  } else {
    run_groups(make_layer<float>(y, x, a, b, max_loras, max_rank), groups, max_rank);
  }
}

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_OPS, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor a, Tensor[] b, Tensor token_slots, int max_loras, int max_rank) -> ()");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_OPS, CPU, m) {
  m.impl("lora_add_", &lora_add_);
}
