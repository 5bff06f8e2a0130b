// Two of the sampler's row ops on float32 logits [N, V], where torch's CPU kernels are scalar.
//
// argmax_rows: greedy sampling's argmax of each row, as torch.argmax(dim=-1) returns it: the
// first index of the row's maximum, or of its first NaN when it has one (NaN counts as the
// largest); an all -inf row gives 0. torch's along a row is a scalar loop, ~1.8 ns per element
// on Zen 4: 88 us for one 49152-entry row, 2.7 ms for 64 rows, as much as the rest of a batch-64
// step's sampling. Here each lane keeps its largest value and the index where it first saw it
// (indices held as floats, exact below 2^24), 4 vectors in flight; the lanes then meet, ties
// going to the smaller index. A NaN anywhere sends the row to a scalar scan for the first NaN.
//
// mask_below_: the top-k mask, in place (see it below).
//
// Ops: argmax_rows (sampling/ops.py greedy), mask_below_ (sampling/ops.py mask_below_).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "cpu_vec.h"

using namespace pagedllm_vec;

namespace {

constexpr int kInFlight = 4;  // independent (best, index) pairs: the compare-and-select chain is ~4 cycles
constexpr int64_t kExactIndex = int64_t(1) << 24;  // float indices are exact below this

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    if (std::isnan(x[j])) return j;
  return -1;
}

// The scalar rule from `from` on, given the best value and index so far (indices below `from`).
int64_t finish_scalar(const float* x, int64_t from, int64_t n, float best, int64_t at) {
  for (int64_t j = from; j < n; ++j) {
    if (std::isnan(x[j])) return j;  // no NaN before `from`: callers checked
    if (x[j] > best) {
      best = x[j];
      at = j;
    }
  }
  return at;
}

int64_t argmax_row(const float* x, int64_t n) {
  constexpr int64_t kStep = kInFlight * kWidth;
  if (n < kStep || n >= kExactIndex) return finish_scalar(x, 0, n, -std::numeric_limits<float>::infinity(), 0);
  Vec best[kInFlight], at[kInFlight], index[kInFlight];
  for (int u = 0; u < kInFlight; ++u) {
    best[u] = broadcast(-std::numeric_limits<float>::infinity());
    at[u] = zero();
    index[u] = lane_indices() + broadcast(static_cast<float>(u * kWidth));
  }
  const Vec step = broadcast(static_cast<float>(kStep));
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
#pragma GCC unroll 4
    for (int u = 0; u < kInFlight; ++u) {
      const Vec v = load(x + i + u * kWidth);
      if (any_nan(v)) return first_nan(x, n);
      at[u] = select_greater(v, best[u], index[u], at[u]);
      best[u] = max(v, best[u]);
      index[u] = index[u] + step;
    }
  }
  float values[kStep], indices[kStep];
  for (int u = 0; u < kInFlight; ++u) {
    store(values + u * kWidth, best[u]);
    store(indices + u * kWidth, at[u]);
  }
  float top = values[0];
  int64_t top_at = static_cast<int64_t>(indices[0]);
  for (int l = 1; l < kStep; ++l) {
    const int64_t j = static_cast<int64_t>(indices[l]);
    if (values[l] > top || (values[l] == top && j < top_at)) {
      top = values[l];
      top_at = j;
    }
  }
  return finish_scalar(x, i, n, top, top_at);
}

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && (x.size(1) <= 1 || x.stride(1) == 1), op,
              ": x must be a float32 [N, V] tensor with contiguous rows");
}

// row(r, its data) for every row of x (checked as check_rows does), the rows split over the
// threads (a few rows each at a 49k vocabulary).
template <class Row>
void for_each_row(const at::Tensor& x, const char* op, Row&& row) {
  check_rows(x, op);
  const int64_t ld = x.stride(0), grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(x.size(1), 1));
  float* xp = x.data_ptr<float>();
  at::parallel_for(0, x.size(0), grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) row(r, xp + r * ld);
  });
}

// x: [N, V] float32 with contiguous rows -> int64 [N], each row's argmax (see the top).
at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "argmax_rows");
  TORCH_CHECK(x.size(1) > 0 || x.size(0) == 0, "argmax_rows: a row needs at least one entry");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t n = x.size(1);
  for_each_row(x, "argmax_rows", [&](int64_t r, const float* row) { o[r] = argmax_row(row, n); });
  return out;
}

// x [N, V] float32 with contiguous rows, in place: every entry below its row's threshold [N]
// becomes -inf (a NaN entry or threshold compares false and stays), as
// x.masked_fill_(x < threshold[:, None], -inf) does. The top-k mask: torch's masked_fill_ took
// ~2 ns per entry here, 6.5 ms for 64 rows of 49k tokens, on top of building the boolean mask.
void mask_below_(at::Tensor x, const at::Tensor& threshold) {
  check_rows(x, "mask_below_");
  TORCH_CHECK(threshold.scalar_type() == at::kFloat && threshold.dim() == 1 && threshold.size(0) == x.size(0),
              "mask_below_: threshold must be float32 [N], one per row of x");
  const at::Tensor t = threshold.contiguous();
  const float* limits = t.data_ptr<float>();
  const int64_t n = x.size(1);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for_each_row(x, "mask_below_", [&](int64_t r, float* row) {
    const float limit = limits[r];
    const Vec vlimit = broadcast(limit), vinf = broadcast(neg_inf);
    int64_t i = 0;
    for (; i + kWidth <= n; i += kWidth) {
      const Vec v = load(row + i);
      store(row + i, select_greater(vlimit, v, vinf, v));
    }
    for (; i < n; ++i)
      if (row[i] < limit) row[i] = neg_inf;
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_OPS, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("mask_below_(Tensor(a!) x, Tensor threshold) -> ()");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_OPS, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("mask_below_", &mask_below_);
}
