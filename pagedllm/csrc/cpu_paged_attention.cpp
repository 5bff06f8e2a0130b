// Paged decode attention for CPU: one query token per sequence, K/V read straight from the
// paged cache through the block table (no gathered copy). Grouped-query attention: the G
// query heads that share a KV head are processed together, so each K/V row is read once.
// Layout: key/value cache [num_blocks, block_size, num_kv_heads, head_dim].
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace {

using namespace pagedllm_vec;

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// Per-thread scratch, reused across the (sequence, KV head) tasks a thread runs.
struct Scratch {
  std::vector<float> q, scores, acc;
};

// q . k for each of the G query heads against one key row; q is pre-scaled float32.
template <typename T>
inline void dot_group(const float* q, const T* k, int64_t group, int64_t dim, float* out, int64_t out_stride) {
  if constexpr (std::is_same_v<T, float>) {
    if (dim % kWidth == 0) {  // vector sums, one horizontal add per head
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q + g * dim;
        Vec s = load(qg) * load(k);
        for (int64_t d = kWidth; d < dim; d += kWidth) s = fmadd(load(qg + d), load(k + d), s);
        out[g * out_stride] = reduce_add(s);
      }
      return;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * dim;
    float s = 0.f;
    for (int64_t d = 0; d < dim; ++d) s += qg[d] * to_f(k[d]);
    out[g * out_stride] = s;
  }
}

// a += p * v over dim features: vector lanes for float32 rows, scalar for the 16-bit types.
template <typename T>
inline void accumulate(float* a, float p, const T* v, int64_t dim) {
  int64_t d = 0;
  if constexpr (std::is_same_v<T, float>) {
    const Vec pv = broadcast(p);
    for (; d + kWidth <= dim; d += kWidth) store(a + d, fmadd(pv, load(v + d), load(a + d)));
  }
  for (; d < dim; ++d) a[d] += p * to_f(v[d]);
}

// Scores -> probabilities in place (one query head's n scores).
inline void softmax(float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (n >= kWidth) {
    Vec vmax = load(s);
    for (i = kWidth; i + kWidth <= n; i += kWidth) vmax = max(vmax, load(s + i));
    m = reduce_max(vmax);
  }
  for (; i < n; ++i) m = std::max(m, s[i]);
  float sum = 0.f;
  i = 0;
  Vec vsum = zero();
  const Vec vm = broadcast(m);
  for (; i + kWidth <= n; i += kWidth) {
    const Vec e = exp(load(s + i) - vm);
    store(s + i, e);
    vsum = vsum + e;
  }
  sum = reduce_add(vsum);
  for (; i < n; ++i) { s[i] = std::exp(s[i] - m); sum += s[i]; }
  const float inv = 1.f / sum;
  for (i = 0; i < n; ++i) s[i] *= inv;
}

// One sequence, KV heads [h0, h0 + nh): q/out point at the first of their nh * G query heads
// (consecutive), kc/vc at head h0's row in the caches. The nh heads' K (or V) rows of a position
// are one contiguous run, read once per pass. (One task per head, reading a short run and
// skipping the other heads', ran ~3x slower: the hardware prefetcher does not follow it.)
template <typename T>
void decode_seq(const T* q, T* out, const T* kc, const T* vc, const int64_t* table, int64_t seq_len,
                int64_t window, int64_t block_size, int64_t kv_stride_block, int64_t kv_stride_tok,
                int64_t nh, int64_t group, int64_t dim, float scale, Scratch& buf) {
  const int64_t start = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
  const int64_t n = seq_len - start, rows = nh * group;
  buf.scores.resize(rows * n);
  buf.acc.assign(rows * dim, 0.f);
  buf.q.resize(rows * dim);
  float* qf = buf.q.data();
  float* scores = buf.scores.data();
  float* acc = buf.acc.data();
  for (int64_t i = 0; i < rows * dim; ++i) qf[i] = to_f(q[i]) * scale;
  const auto row = [&](int64_t pos) { return table[pos / block_size] * kv_stride_block + (pos % block_size) * kv_stride_tok; };
  // Pass 1: scores = q . k for every visible key; each K row serves the G heads that share it.
  for (int64_t pos = start; pos < seq_len; ++pos) {
    const T* k = kc + row(pos);
    for (int64_t h = 0; h < nh; ++h)
      dot_group(qf + h * group * dim, k + h * dim, group, dim, scores + h * group * n + (pos - start), n);
  }
  for (int64_t r = 0; r < rows; ++r) softmax(scores + r * n, n);
  // Pass 2: out = sum_j p_j v_j, element-wise over d.
  for (int64_t pos = start; pos < seq_len; ++pos) {
    const T* v = vc + row(pos);
    for (int64_t r = 0; r < rows; ++r) accumulate(acc + r * dim, scores[r * n + (pos - start)], v + (r / group) * dim, dim);
  }
  for (int64_t i = 0; i < rows * dim; ++i) out[i] = static_cast<T>(acc[i]);
}

}  // namespace

// query/out: [B, H, D] (query rows may be strided); caches: [num_blocks, block_size, KVH, D]; block_table: [B, max_blocks] int64;
// seq_lens: [B] int64 (tokens to attend, the new one included); window <= 0: no sliding window.
void paged_decode_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                            at::Tensor value_cache, at::Tensor block_table, at::Tensor seq_lens,
                            double scale, int64_t window) {
  // The query may be a strided view (rows of the fused qkv output); heads and features are dense.
  TORCH_CHECK(out.is_contiguous() && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "out must be contiguous and query rows [H, D] dense");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_table.is_contiguous() && seq_lens.is_contiguous(), "tables must be contiguous");
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const int64_t group = heads / kv_heads, max_blocks = block_table.size(1);
  const int64_t q_row_stride = query.stride(0);
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* kc = key_cache.data_ptr<scalar_t>();
    const scalar_t* vc = value_cache.data_ptr<scalar_t>();
    // A task is a sequence with all its KV heads; a batch too small to keep every thread busy
    // is split per KV head instead.
    const int64_t splits = batch >= 2 * at::get_num_threads() ? 1 : kv_heads, nh = kv_heads / splits;
    at::parallel_for(0, batch * splits, 1, [&](int64_t begin, int64_t end) {
      Scratch buf;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / splits, h0 = (i % splits) * nh;
        decode_seq<scalar_t>(q + b * q_row_stride + h0 * group * dim, o + (b * heads + h0 * group) * dim,
                             kc + h0 * dim, vc + h0 * dim, table + b * max_blocks, lens[b], window, block_size,
                             block_size * kv_heads * dim, kv_heads * dim, nh, group, dim,
                             static_cast<float>(scale), buf);
      }
    });
  });
}
