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
#include <vector>

namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

template <typename T>
void decode_one(const T* q, T* out, const T* kc, const T* vc, const int64_t* table, int64_t seq_len,
                int64_t window, int64_t block_size, int64_t kv_stride_block, int64_t kv_stride_tok,
                int64_t group, int64_t dim, float scale, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t start = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
  const int64_t n = seq_len - start;
  scores.assign(group * n, 0.f);
  acc.assign(group * dim, 0.f);
  std::vector<float> qf(group * dim);
  for (int64_t i = 0; i < group * dim; ++i) qf[i] = to_f(q[i]) * scale;
  // Pass 1: scores = q . k for every visible key.
  for (int64_t pos = start; pos < seq_len; ++pos) {
    const T* k = kc + table[pos / block_size] * kv_stride_block + (pos % block_size) * kv_stride_tok;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf.data() + g * dim;
      float s = 0.f;
      for (int64_t d = 0; d < dim; ++d) s += qg[d] * to_f(k[d]);
      scores[g * n + (pos - start)] = s;
    }
  }
  // Softmax per query head.
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * n;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) m = std::max(m, sg[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) { sg[i] = std::exp(sg[i] - m); sum += sg[i]; }
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < n; ++i) sg[i] *= inv;
  }
  // Pass 2: out = sum_j p_j v_j.
  for (int64_t pos = start; pos < seq_len; ++pos) {
    const T* v = vc + table[pos / block_size] * kv_stride_block + (pos % block_size) * kv_stride_tok;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * n + (pos - start)];
      float* a = acc.data() + g * dim;
      for (int64_t d = 0; d < dim; ++d) a[d] += p * to_f(v[d]);
    }
  }
  for (int64_t i = 0; i < group * dim; ++i) out[i] = static_cast<T>(acc[i]);
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
    at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, acc;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / kv_heads, h = i % kv_heads;
        const int64_t q_off = b * q_row_stride + h * group * dim;
        const int64_t o_off = (b * heads + h * group) * dim;
        decode_one<scalar_t>(q + q_off, o + o_off, kc + h * dim, vc + h * dim, table + b * max_blocks,
                             lens[b], window, block_size, block_size * kv_heads * dim, kv_heads * dim,
                             group, dim, static_cast<float>(scale), scores, acc);
      }
    });
  });
}
