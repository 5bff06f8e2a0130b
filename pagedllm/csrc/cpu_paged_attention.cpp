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
#include "cpu_kv_load.h"
#include "cpu_vec.h"

namespace {

using namespace pagedllm_vec;

// Per-thread scratch, reused across the tasks a thread runs.
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

// Scores -> probabilities in place (one query head's n scores). With max_out / sum_out (a task
// over part of the positions, see Partial): e^(s - max) left unnormalized, max and sum stored.
inline void softmax(float* s, int64_t n, float* max_out = nullptr, float* sum_out = nullptr) {
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
  if (max_out) {
    *max_out = m, *sum_out = sum;
    return;
  }
  const float inv = 1.f / sum;
  for (i = 0; i < n; ++i) s[i] *= inv;
}

// The cache rows at rows[0, count) (elements of elem bytes from base; bytes each) into L2, one
// prefetch per 64-byte line they touch: blocks lie anywhere in the pool, so the hardware
// prefetcher, which stops at page boundaries, would start every block cold.
inline void prefetch_rows(const void* base, const int64_t* rows, int64_t count, int64_t elem, int64_t bytes) {
  for (int64_t p = 0; p < count; ++p) {
    const uintptr_t start = reinterpret_cast<uintptr_t>(base) + rows[p] * elem;
    for (uintptr_t line = start & ~uintptr_t(63); line < start + bytes; line += 64)
      prefetch_l2(reinterpret_cast<const void*>(line));
  }
}

// Positions ahead of the tile in use whose rows are prefetched.
constexpr int64_t kAhead = 32;

// Pass 1 on the vector path: scores[r * n + i] for every query row r against every visible key,
// in tiles of kKeys positions (their K rows stay in L1 while all the rows use them).
// Each tile prefetches the K rows kAhead positions on; the tiles with none left there (the last
// kAhead / kKeys) prefetch the V rows of pass 2's first kAhead positions instead, shared out.
template <typename T>
inline void scores_vec(const float* qf, const T* kc, const T* vc, const int64_t* rows, int64_t n, int64_t nh,
                       int64_t group, int64_t dim, float* scores) {
  const int64_t row_bytes = nh * dim * sizeof(T), tiles = (n + kKeys - 1) / kKeys;
  const int64_t first_v = std::max<int64_t>(0, (n - kAhead + kKeys - 1) / kKeys), v_count = std::min(n, kAhead);
  const int64_t v_share = (v_count + tiles - first_v - 1) / (tiles - first_v);
  for (int64_t i0 = 0, tile = 0; i0 < n; i0 += kKeys, ++tile) {
    const int64_t np = std::min<int64_t>(kKeys, n - i0);
    if (tile < first_v) {
      prefetch_rows(kc, rows + i0 + kAhead, std::min<int64_t>(kKeys, n - i0 - kAhead), sizeof(T), row_bytes);
    } else if (const int64_t v0 = (tile - first_v) * v_share; v0 < v_count) {
      prefetch_rows(vc, rows + v0, std::min(v_share, v_count - v0), sizeof(T), row_bytes);
    }
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

// Pass 2 on the vector path: out row r = sum_i p_ri v_i (float32), in tiles of kValueTile
// positions (out holds the sums so far between them) and column tiles of kOutVecs vectors.
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

// Where a task over part of a sequence's positions leaves its result, per query row r: the
// unnormalized acc[r] = sum_i e^(s_ri - max[r]) v_i, max[r] and sum[r] = sum_i e^(s_ri - max[r]).
struct Partial {
  float *acc, *max, *sum;
};

// One sequence, KV heads [h0, h0 + nh), positions [lo, hi): q/out point at the first of their
// nh * G query heads (consecutive), kc/vc at head h0's row in the caches. The nh heads' K (or V)
// rows of a position are one contiguous run, read once per pass. (One task per head, reading a
// short run and skipping the other heads', ran ~3x slower: the hardware prefetcher does not
// follow it.) part: the range is part of the visible positions, its sums go there, not to out.
// Q: the query and output type; T: the cache's (Q itself, or a 16-bit cache under a float32
// query: --kv-cache-dtype).
template <typename Q, typename T>
void decode_seq(const Q* q, Q* out, const Partial* part, const T* kc, const T* vc, const int64_t* table, int64_t lo,
                int64_t hi, int64_t block_size, int64_t kv_stride_block, int64_t kv_stride_tok, int64_t nh,
                int64_t group, int64_t dim, float scale, Scratch& buf) {
  const int64_t n = hi - lo, rows = nh * group;
  if (n <= 0) {  // nothing visible (a zero length): zeros, as an empty sum
    if (part) {
      std::fill(part->acc, part->acc + rows * dim, 0.f);
      std::fill(part->max, part->max + rows, -std::numeric_limits<float>::infinity());
      std::fill(part->sum, part->sum + rows, 0.f);
    } else {
      std::fill(out, out + rows * dim, Q(0));
    }
    return;
  }
  buf.scores.resize(rows * n);
  buf.q.resize(rows * dim);
  buf.rows.resize(n);
  float* qf = buf.q.data();
  float* scores = buf.scores.data();
  int64_t* offs = buf.rows.data();
  for (int64_t i = 0; i < rows * dim; ++i) qf[i] = to_f(q[i]) * scale;
  // Cache offsets block by block (a division per position cost more than pass 1 at short contexts).
  for (int64_t pos = lo; pos < hi;) {
    const int64_t b = pos / block_size, end = std::min(hi, (b + 1) * block_size);
    const int64_t base = table[b] * kv_stride_block - b * block_size * kv_stride_tok;
    for (; pos < end; ++pos) offs[pos - lo] = base + pos * kv_stride_tok;
  }
  const auto probabilities = [&] {
    for (int64_t r = 0; r < rows; ++r)
      softmax(scores + r * n, n, part ? part->max + r : nullptr, part ? part->sum + r : nullptr);
  };
  if constexpr (kVectorCache<T>) {
    if (dim % kWidth == 0) {
      prefetch_rows(kc, offs, std::min(n, kAhead), sizeof(T), nh * dim * sizeof(T));  // pass 1's first rows
      scores_vec(qf, kc, vc, offs, n, nh, group, dim, scores);
      probabilities();
      if (part) {
        values_vec(scores, vc, offs, n, nh, group, dim, part->acc);
      } else if constexpr (std::is_same_v<Q, float>) {
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
  probabilities();
  // Pass 2: out = sum_j p_j v_j, element-wise over d.
  buf.acc.assign(rows * dim, 0.f);
  float* acc = buf.acc.data();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t r = 0; r < rows; ++r) accumulate_scalar(acc + r * dim, scores[r * n + i], vc + offs[i] + (r / group) * dim, dim);
  if (part) {
    std::copy(acc, acc + rows * dim, part->acc);
  } else {
    for (int64_t i = 0; i < rows * dim; ++i) out[i] = static_cast<Q>(acc[i]);
  }
}

// out row r = sum_c e^(max_c - M) acc_c / sum_c e^(max_c - M) sum_c over a sequence's parts c
// (M: the largest max), as one softmax over all its positions would give.
template <typename Q>
void merge_parts(const std::vector<Partial>& parts, int64_t rows, int64_t dim, Q* out, std::vector<float>& acc) {
  acc.assign(dim, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    float m = -std::numeric_limits<float>::infinity(), sum = 0.f;
    for (const Partial& p : parts) m = std::max(m, p.max[r]);
    std::fill(acc.begin(), acc.end(), 0.f);
    if (m == -std::numeric_limits<float>::infinity()) m = 0.f;  // no part saw a position: zeros
    for (const Partial& p : parts) {
      if (p.max[r] == -std::numeric_limits<float>::infinity()) continue;
      const float w = std::exp(p.max[r] - m);
      sum += w * p.sum[r];
      for (int64_t d = 0; d < dim; ++d) acc[d] += w * p.acc[r * dim + d];
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int64_t d = 0; d < dim; ++d) out[r * dim + d] = static_cast<Q>(acc[d] * inv);
  }
}

// Tasks cut into `parts` consecutive ranges of about equal work (a task's work: the positions it
// reads, or a cost in such units, plus a fixed cost): ranges of equal task counts left one thread
// waiting on the other when contexts differ (a batch's sequences do). Part t is [bounds[t], bounds[t + 1]).
std::vector<int64_t> balanced_ranges(const std::vector<int64_t>& work, int64_t parts) {
  constexpr int64_t kTaskCost = 16;  // positions' worth of per-task work (query, offsets, softmax)
  const int64_t tasks = static_cast<int64_t>(work.size());
  std::vector<int64_t> cost(tasks + 1, 0);
  for (int64_t i = 0; i < tasks; ++i) cost[i + 1] = cost[i] + work[i] + kTaskCost;
  std::vector<int64_t> bounds(parts + 1, tasks);
  bounds[0] = 0;
  for (int64_t t = 1, i = 0; t < parts; ++t) {
    const int64_t target = cost.back() * t / parts;
    while (i < tasks && cost[i + 1] <= target) ++i;
    if (i < tasks && cost[i + 1] - target < target - cost[i]) ++i;  // mostly before the cut: left
    bounds[t] = i;
  }
  return bounds;
}

// A unit of a call's work: sequence seq's KV heads [h0, h0 + nh) over positions [lo, hi); part:
// its Partial's index when [lo, hi) is a piece of the visible positions, else -1.
struct Task {
  int64_t seq, h0, lo, hi, part;
};

// Positions per piece, at the least, when a sequence's positions are cut into pieces.
constexpr int64_t kMinPiece = 128;

// How a call's work is shared: the tasks, thread t's [bounds[t], bounds[t + 1]) of them (balanced
// on cost), the KV heads each task covers and how many Partials the pieces among them fill.
struct Plan {
  std::vector<Task> tasks;
  std::vector<int64_t> cost, bounds;
  int64_t nh, parts;
};

// plan with its bounds cut for `threads`.
Plan share(Plan plan, int64_t threads) {
  plan.bounds = balanced_ranges(plan.cost, threads);
  return plan;
}

// The most work any thread gets under the plan.
int64_t makespan(const Plan& plan) {
  const std::vector<int64_t>& bounds = plan.bounds;
  const std::vector<int64_t>& cost = plan.cost;
  int64_t worst = 0;
  for (size_t t = 0; t + 1 < bounds.size(); ++t) {
    int64_t sum = 0;
    for (int64_t i = bounds[t]; i < bounds[t + 1]; ++i) sum += cost[i];
    worst = std::max(worst, sum);
  }
  return worst;
}

// The call's plan: a batch of at least two sequences per thread runs a task per sequence. Fewer sequences either run a task per sequence and KV head, or cut
// each sequence's positions into pieces of at least kMinPiece positions (up to 2 * threads /
// batch of them, at most threads), all its KV heads each, merged after: whichever leaves the
// busiest thread less to read, a head's third of each position's row counting 1.5x (read from
// memory it ran at about half the speed of whole rows). A task per head left one of 2 threads
// two of SmolLM's three heads; many threads and few positions favour the heads.
Plan plan_tasks(const int64_t* lens, int64_t batch, int64_t kv_heads, int64_t window, int64_t threads) {
  const auto first = [&](int64_t b) { return window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0; };
  if (batch >= 2 * threads) {
    Plan whole{{}, {}, {}, kv_heads, 0};
    for (int64_t b = 0; b < batch; ++b)
      whole.tasks.push_back({b, 0, first(b), lens[b], -1}), whole.cost.push_back(lens[b] - first(b));
    return share(std::move(whole), threads);
  }
  // Costs in 1 / (2 kv_heads) of a whole row per position.
  Plan heads{{}, {}, {}, 1, 0}, pieces{{}, {}, {}, kv_heads, 0};
  const int64_t max_pieces = std::clamp<int64_t>((2 * threads + batch - 1) / std::max<int64_t>(batch, 1), 1, threads);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t lo = first(b), n = lens[b] - lo, count = std::clamp<int64_t>(n / kMinPiece, 1, max_pieces);
    for (int64_t h = 0; h < kv_heads; ++h) heads.tasks.push_back({b, h, lo, lens[b], -1}), heads.cost.push_back(3 * n);
    for (int64_t c = 0; c < count; ++c) {
      const int64_t p0 = lo + n * c / count, p1 = lo + n * (c + 1) / count;
      pieces.tasks.push_back({b, 0, p0, p1, count > 1 ? pieces.parts++ : -1});
      pieces.cost.push_back(2 * kv_heads * (p1 - p0));
    }
  }
  heads = share(std::move(heads), threads);
  pieces = share(std::move(pieces), threads);
  return makespan(heads) <= makespan(pieces) ? heads : pieces;
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
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && key_cache.size(3) == dim,
              "paged_decode_attention: ", heads, " query heads of ", dim, " features over ", kv_heads,
              " KV heads of ", key_cache.size(3), ": the query heads must be a multiple of the KV heads, of one size");
  const int64_t group = heads / kv_heads, max_blocks = block_table.size(1);
  const int64_t q_row_stride = query.stride(0);
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t threads = at::get_num_threads();
  const Plan plan = plan_tasks(lens, batch, kv_heads, window, threads);
  const std::vector<Task>& tasks = plan.tasks;
  const std::vector<int64_t>& bounds = plan.bounds;
  const int64_t nh = plan.nh, num_parts = plan.parts;
  // Pieces' sums: per piece heads * dim accumulators, then heads maxima and heads sums.
  const int64_t part_floats = heads * (dim + 2);
  std::vector<float> part_data(num_parts * part_floats);
  std::vector<Partial> parts(num_parts);
  for (int64_t p = 0; p < num_parts; ++p) {
    float* base = part_data.data() + p * part_floats;
    parts[p] = {base, base + heads * dim, base + heads * dim + heads};
  }
  auto run = [&](auto* q, auto* o, const auto* kc, const auto* vc) {
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
      thread_local Scratch buf;  // grows to the longest context a thread has seen, then stays
      for (int64_t i = bounds[t0]; i < bounds[t1]; ++i) {
        const Task& t = tasks[i];
        decode_seq(q + t.seq * q_row_stride + t.h0 * group * dim, o + (t.seq * heads + t.h0 * group) * dim,
                   t.part >= 0 ? &parts[t.part] : nullptr, kc + t.h0 * dim, vc + t.h0 * dim,
                   table + t.seq * max_blocks, t.lo, t.hi, block_size, block_size * kv_heads * dim, kv_heads * dim,
                   nh, group, dim, static_cast<float>(scale), buf);
      }
    });
    if (num_parts == 0) return;
    std::vector<Partial> pieces;
    std::vector<float> acc;
    for (size_t i = 0; i < tasks.size();) {  // a sequence's pieces are consecutive tasks
      size_t j = i;
      pieces.clear();
      for (; j < tasks.size() && tasks[j].seq == tasks[i].seq; ++j)
        if (tasks[j].part >= 0) pieces.push_back(parts[tasks[j].part]);
      if (!pieces.empty()) merge_parts(pieces, heads, dim, o + tasks[i].seq * heads * dim, acc);
      i = j;
    }
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
