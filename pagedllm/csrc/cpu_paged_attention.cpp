// Paged decode attention for CPU: one query token per sequence, K/V read straight from the
// paged cache through the block table (no gathered copy). Grouped-query attention: the G
// query heads that share a KV head are processed together, so each K/V row is read once.
// Layout: key/value cache [num_blocks, block_size, num_kv_heads, head_dim].
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_vec.h"

namespace {

using namespace pagedllm_vec;

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// The cache types the vector path reads, each K/V vector widened to float32 as it is loaded:
// bfloat16 by a shift, float16 by the ISA's conversion (F16C, AVX-512, NEON fcvtl).
template <typename T>
constexpr bool kVectorCache =
    std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;
inline Vec load_kv(const float* p) { return load(p); }
inline Vec load_kv(const c10::BFloat16* p) { return load_bf16(reinterpret_cast<const uint16_t*>(p)); }
inline Vec load_kv(const c10::Half* p) { return load_f16(reinterpret_cast<const uint16_t*>(p)); }

// Per-thread scratch, reused across the (sequence, KV head) tasks a thread runs.
struct Scratch {
  std::vector<float> q, scores, acc;
  std::vector<int64_t> rows;  // cache offset of each visible position's row
};

// Keys per score tile and vectors per output tile of the vector path: enough independent
// accumulators that the FMAs overlap instead of waiting on one another's latency (a single
// running sum per dot product ran at a tenth of the FMA rate), few enough for every ISA's
// registers (8 accumulators + 2 operands of AVX2's 16).
constexpr int kKeys = 8, kOutVecs = 8;

// Vector path (a kVectorCache type, dim a multiple of kWidth). Scores of one query row q (float32,
// pre-scaled) against the P keys at k[p] + off: P sums side by side, one q load serving P key loads.
template <int P, typename T>
inline void dot_keys(const float* q, const T* const* k, int64_t off, int64_t dim, float* out) {
  Vec acc[P];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) acc[p] = zero();
  for (int64_t d = 0; d < dim; d += kWidth) {
    const Vec qv = load(q + d);
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) acc[p] = fmadd(qv, load_kv(k[p] + off + d), acc[p]);
  }
  if constexpr (P == 8) {
    reduce_add_8(acc, out);  // a full tile's 8 sums at once
  } else {
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) out[p] = reduce_add(acc[p]);
  }
}

// out[0, V * kWidth) (+)= sum_i probs[i] * v[rows[i]][0, V * kWidth) over n positions (float32;
// added to what out holds when accumulate). A tile of few vectors (AVX-512's 4 for a head of 64)
// sums even and odd positions apart: one chain of dependent FMAs per vector waited on the FMA
// latency rather than the loads.
template <int V, typename T>
inline void weighted_sum(const float* probs, const T* v, const int64_t* rows, int64_t n, float* out, bool accumulate) {
  constexpr int C = 2 * V <= kOutVecs ? 2 : 1;
  Vec acc[C][V];
#pragma GCC unroll 8
  for (int j = 0; j < V; ++j) acc[0][j] = accumulate ? load(out + j * kWidth) : zero();
#pragma GCC unroll 8
  for (int c = 1; c < C; ++c)
#pragma GCC unroll 8
    for (int j = 0; j < V; ++j) acc[c][j] = zero();
  int64_t i = 0;
  for (; i + C <= n; i += C) {
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) {
      const Vec p = broadcast(probs[i + c]);
      const T* vi = v + rows[i + c];
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) acc[c][j] = fmadd(p, load_kv(vi + j * kWidth), acc[c][j]);
    }
  }
  for (; i < n; ++i) {
    const Vec p = broadcast(probs[i]);
    const T* vi = v + rows[i];
#pragma GCC unroll 8
    for (int j = 0; j < V; ++j) acc[0][j] = fmadd(p, load_kv(vi + j * kWidth), acc[0][j]);
  }
#pragma GCC unroll 8
  for (int j = 0; j < V; ++j) {
#pragma GCC unroll 2
    for (int c = 1; c < C; ++c) acc[0][j] = acc[0][j] + acc[c][j];
    store(out + j * kWidth, acc[0][j]);
  }
}

// Generic path (float64, or dim not a multiple of kWidth): scalar sums.
template <typename T>
inline float dot_scalar(const float* q, const T* k, int64_t dim) {
  float s = 0.f;
  for (int64_t d = 0; d < dim; ++d) s += q[d] * to_f(k[d]);
  return s;
}

template <typename T>
inline void accumulate_scalar(float* a, float p, const T* v, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) a[d] += p * to_f(v[d]);
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

// The cache rows (bytes each) of positions [i, i + count) into L2, one prefetch per line: blocks
// lie anywhere in the pool, so the hardware prefetcher, which stops at page boundaries, would
// start every block cold.
inline void prefetch_rows(const void* base, const int64_t* rows, int64_t count, int64_t elem, int64_t bytes) {
  const char* b = static_cast<const char*>(base);
  for (int64_t p = 0; p < count; ++p)
    for (int64_t o = 0; o < bytes; o += 64) prefetch_l2(b + rows[p] * elem + o);
}

// Positions ahead of the tile in use whose rows are prefetched.
constexpr int64_t kAhead = 32;

// Pass 1 on the vector path: scores[r * n + i] for every query row r against every visible key,
// in tiles of kKeys positions (their K rows stay in L1 while all the rows use them).
template <typename T>
inline void scores_vec(const float* qf, const T* kc, const int64_t* rows, int64_t n, int64_t nh, int64_t group,
                       int64_t dim, float* scores) {
  for (int64_t i0 = 0; i0 < n; i0 += kKeys) {
    const int64_t np = std::min<int64_t>(kKeys, n - i0);
    if (i0 + kAhead < n)
      prefetch_rows(kc, rows + i0 + kAhead, std::min<int64_t>(kKeys, n - i0 - kAhead), sizeof(T), nh * dim * sizeof(T));
    const T* k[kKeys];
    for (int64_t p = 0; p < np; ++p) k[p] = kc + rows[i0 + p];
    for (int64_t r = 0; r < nh * group; ++r) {
      const int64_t off = (r / group) * dim;
      dispatch<kKeys>(np, [&](auto keys) {
        dot_keys<decltype(keys)::value>(qf + r * dim, k, off, dim, scores + r * n + i0);
      });
    }
  }
}

// Positions per tile of pass 2: every query row sums a tile's V rows while they are in L1 (one
// read of V from memory; sweeping all positions per row read V once per query head).
constexpr int64_t kValueTile = 32;

// Pass 2 on the vector path: out row r = sum_i p_ri v_i (float32), in column tiles of kOutVecs vectors.
template <typename T>
inline void values_vec(const float* scores, const T* vc, const int64_t* rows, int64_t n, int64_t nh, int64_t group,
                       int64_t dim, float* out) {
  for (int64_t i0 = 0; i0 < n; i0 += kValueTile) {
    const int64_t np = std::min<int64_t>(kValueTile, n - i0);
    if (i0 + kAhead < n)
      prefetch_rows(vc, rows + i0 + kAhead, std::min<int64_t>(kValueTile, n - i0 - kAhead), sizeof(T),
                    nh * dim * sizeof(T));
    for (int64_t r = 0; r < nh * group; ++r) {
      const T* v = vc + (r / group) * dim;
      for (int64_t d = 0; d < dim; d += kOutVecs * kWidth) {
        dispatch<kOutVecs>((dim - d) / kWidth, [&](auto vecs) {
          weighted_sum<decltype(vecs)::value>(scores + r * n + i0, v + d, rows + i0, np, out + r * dim + d, i0 > 0);
        });
      }
    }
  }
}

// One sequence, KV heads [h0, h0 + nh): q/out point at the first of their nh * G query heads
// (consecutive), kc/vc at head h0's row in the caches. The nh heads' K (or V) rows of a position
// are one contiguous run, read once per pass. (One task per head, reading a short run and
// skipping the other heads', ran ~3x slower: the hardware prefetcher does not follow it.)
// Q: the query and output type; T: the cache's (Q itself, or a 16-bit cache under a float32
// query: --kv-cache-dtype).
template <typename Q, typename T>
void decode_seq(const Q* q, Q* out, const T* kc, const T* vc, const int64_t* table, int64_t seq_len,
                int64_t window, int64_t block_size, int64_t kv_stride_block, int64_t kv_stride_tok,
                int64_t nh, int64_t group, int64_t dim, float scale, Scratch& buf) {
  const int64_t start = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
  const int64_t n = seq_len - start, rows = nh * group;
  buf.scores.resize(rows * n);
  buf.q.resize(rows * dim);
  buf.rows.resize(n);
  float* qf = buf.q.data();
  float* scores = buf.scores.data();
  int64_t* offs = buf.rows.data();
  for (int64_t i = 0; i < rows * dim; ++i) qf[i] = to_f(q[i]) * scale;
  // Cache offsets block by block (a division per position cost more than pass 1 at short contexts).
  for (int64_t pos = start; pos < seq_len;) {
    const int64_t b = pos / block_size, end = std::min(seq_len, (b + 1) * block_size);
    const int64_t base = table[b] * kv_stride_block - b * block_size * kv_stride_tok;
    for (; pos < end; ++pos) offs[pos - start] = base + pos * kv_stride_tok;
  }
  if constexpr (kVectorCache<T>) {
    if (dim % kWidth == 0) {
      scores_vec(qf, kc, offs, n, nh, group, dim, scores);
      for (int64_t r = 0; r < rows; ++r) softmax(scores + r * n, n);
      if constexpr (std::is_same_v<Q, float>) {
        values_vec(scores, vc, offs, n, nh, group, dim, out);
      } else {  // summed in float32, rounded once
        buf.acc.resize(rows * dim);
        values_vec(scores, vc, offs, n, nh, group, dim, buf.acc.data());
        for (int64_t i = 0; i < rows * dim; ++i) out[i] = static_cast<Q>(buf.acc[i]);
      }
      return;
    }
  }
  // Pass 1: scores = q . k for every visible key; each K row serves the G heads that share it.
  for (int64_t i = 0; i < n; ++i)
    for (int64_t r = 0; r < rows; ++r) scores[r * n + i] = dot_scalar(qf + r * dim, kc + offs[i] + (r / group) * dim, dim);
  for (int64_t r = 0; r < rows; ++r) softmax(scores + r * n, n);
  // Pass 2: out = sum_j p_j v_j, element-wise over d.
  buf.acc.assign(rows * dim, 0.f);
  float* acc = buf.acc.data();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t r = 0; r < rows; ++r) accumulate_scalar(acc + r * dim, scores[r * n + i], vc + offs[i] + (r / group) * dim, dim);
  for (int64_t i = 0; i < rows * dim; ++i) out[i] = static_cast<Q>(acc[i]);
}

// Tasks [0, batch * splits) (sequence b's are b * splits ...) cut into `parts` consecutive ranges
// of about equal work, a task's work being the positions it reads plus a fixed cost: ranges of
// equal task counts left one thread waiting on the other when contexts differ (a batch's
// sequences do). Part t is [bounds[t], bounds[t + 1]).
std::vector<int64_t> balanced_ranges(const int64_t* lens, int64_t batch, int64_t splits, int64_t window,
                                     int64_t parts) {
  constexpr int64_t kTaskCost = 16;  // positions' worth of per-task work (query, offsets, softmax)
  std::vector<int64_t> cost(batch * splits + 1, 0);
  for (int64_t i = 0; i < batch * splits; ++i) {
    const int64_t len = lens[i / splits];
    cost[i + 1] = cost[i] + (window > 0 ? std::min(len, window) : len) + kTaskCost;
  }
  std::vector<int64_t> bounds(parts + 1, batch * splits);
  bounds[0] = 0;
  for (int64_t t = 1, i = 0; t < parts; ++t) {
    const int64_t target = cost.back() * t / parts;
    while (i < batch * splits && cost[i + 1] <= target) ++i;
    if (i < batch * splits && cost[i + 1] - target < target - cost[i]) ++i;  // mostly before the cut: left
    bounds[t] = i;
  }
  return bounds;
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
  // A task is a sequence with all its KV heads; a batch too small to keep every thread busy
  // is split per KV head instead.
  const int64_t threads = at::get_num_threads(), splits = batch >= 2 * threads ? 1 : kv_heads;
  const int64_t nh = kv_heads / splits;
  const std::vector<int64_t> bounds = balanced_ranges(lens, batch, splits, window, threads);
  auto run = [&](auto* q, auto* o, const auto* kc, const auto* vc) {
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
      thread_local Scratch buf;  // grows to the longest context a thread has seen, then stays
      for (int64_t i = bounds[t0]; i < bounds[t1]; ++i) {
        const int64_t b = i / splits, h0 = (i % splits) * nh;
        decode_seq(q + b * q_row_stride + h0 * group * dim, o + (b * heads + h0 * group) * dim, kc + h0 * dim,
                   vc + h0 * dim, table + b * max_blocks, lens[b], window, block_size, block_size * kv_heads * dim,
                   kv_heads * dim, nh, group, dim, static_cast<float>(scale), buf);
      }
    });
  };
  const at::ScalarType cache_type = key_cache.scalar_type();
  TORCH_CHECK(value_cache.scalar_type() == cache_type && out.scalar_type() == query.scalar_type(),
              "paged_decode_attention: K and V caches of one dtype, out in the query's");
  if (query.scalar_type() == at::kFloat && cache_type != at::kFloat) {  // a 16-bit cache under float32
    const float* q = query.data_ptr<float>();
    float* o = out.data_ptr<float>();
    if (cache_type == at::kBFloat16) {
      run(q, o, key_cache.data_ptr<c10::BFloat16>(), value_cache.data_ptr<c10::BFloat16>());
    } else {
      TORCH_CHECK(cache_type == at::kHalf, "paged_decode_attention: a float32 query reads a float32, "
                  "bfloat16 or float16 cache");
      run(q, o, key_cache.data_ptr<c10::Half>(), value_cache.data_ptr<c10::Half>());
    }
    return;
  }
  TORCH_CHECK(cache_type == query.scalar_type(), "paged_decode_attention: a ", query.scalar_type(),
              " query reads a cache of its own dtype, not ", cache_type);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    run(query.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
        value_cache.data_ptr<scalar_t>());
  });
}
