// Paged causal attention for one sequence's prefill chunk on CPU: the chunk's query rows against
// every key before them (the cache's earlier context and the chunk itself, already written),
// read through the block table: no gathered K/V copies, no mask tensor.
//
// Why: torch's SDPA (its CPU flash kernel) needs K and V gathered out of the paged cache first
// (two index copies per layer), and at SmolLM's shapes (head_dim 64, 3 query heads per KV head)
// it ran a 512-token prompt's attention at ~85 GFLOP/s, 17% of a float32 prefill and 40% of a
// W8A8 one. Here every (query row, head) pair of a KV head's group is one "unit"; a tile of
// kUnits units shares each key vector: per kWidth keys the scores are kUnits accumulators, each
// step one load of kWidth keys' feature d (the keys transposed once per call into a
// [tiles, dim, kWidth] buffer) and kUnits FMAs with the units' q[d] broadcast. Softmax is online
// over blocks of kBlockTiles key vectors (running max and sum per unit, the output rescaled when
// the max moves; masks only where a block crosses a unit's causal or window edge), and p·v adds
// each visible key's V row (read in place from the cache) into the units' outputs, 4 units per V
// load; kSuperTiles tiles walk the keys together, so each block comes from L2 once per 48 units.
// ~125 GFLOP/s on 2 threads (Sapphire Rapids-class Xeon): 1.4-1.6x SDPA with its gather at 512
// tokens, 0.85x at 2048, where SDPA's larger blocks win; the backend caps the length it sends here.
// float32 queries; the cache float32, bfloat16 or float16 (widened as it is read).
// Op: paged_prefill_attention (layers/attention/backends/torch_sdpa.py calls it per prefill).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_kv_load.h"
#include "cpu_vec.h"

namespace {

using namespace pagedllm_vec;

constexpr int kUnits = 12;  // score accumulators per tile: 12 + a key vector + a broadcast fit AVX2's 16
constexpr int kPvUnits = 4;  // units per p·v pass
// Key tiles (kWidth keys each) per softmax step: the per-unit max, sum and rescale (horizontal
// reductions, a scalar exp) are paid once per kBlockKeys keys.
constexpr int kBlockTiles = 4, kBlockKeys = kBlockTiles * kWidth;
constexpr int kSuperTiles = 4;  // tiles sharing each key block (see tiles())


template <typename T>
struct Problem {
  const float* q;  // row t, head h at q + t * q_row + h * dim
  float* out;  // [T, H, D] contiguous
  const T* k_cache;  // [num_blocks, block_size, KVH, D]
  const T* v_cache;
  const int64_t* table;  // this sequence's block table
  int64_t q_row, heads, kv_heads, group, dim, block_size, context, tokens, window;
  float scale;

  // The cache offset of position j's row of KV head g.
  int64_t row(int64_t j, int64_t g) const {
    return ((table[j / block_size] * block_size + j % block_size) * kv_heads + g) * dim;
  }
};

// KV head g's keys at positions [0, len) transposed into kt [ceil(len / kWidth), dim, kWidth]; the
// last tile's positions past len are zero (masked anyway).
template <typename T>
void transpose_keys(const Problem<T>& pr, int64_t g, int64_t len, float* kt) {
  for (int64_t t0 = 0; t0 < len; t0 += kWidth) {
    float* tile = kt + (t0 / kWidth) * pr.dim * kWidth;
    for (int64_t l = 0; l < kWidth; ++l) {
      const int64_t j = t0 + l;
      if (j < len) {
        const T* k = pr.k_cache + pr.row(j, g);
        for (int64_t d = 0; d < pr.dim; ++d) tile[d * kWidth + l] = to_f(k[d]);
      } else {
        for (int64_t d = 0; d < pr.dim; ++d) tile[d * kWidth + l] = 0.f;
      }
    }
  }
}

// o[i] += sum_j p[i][j] v_j for N units (o rows of dim floats, p rows of kBlockKeys), one V load
// per N FMAs, the units' accumulators in registers across the keys.
template <int N, typename T>
inline void add_pv(float* o, const float* p, const T* const* v_rows, int64_t keys, int64_t dim) {
  for (int64_t d = 0; d < dim; d += kWidth) {
    Vec acc[N];
#pragma GCC unroll 4
    for (int i = 0; i < N; ++i) acc[i] = load(o + i * dim + d);
    for (int64_t j = 0; j < keys; ++j) {
      const Vec v = load_kv(v_rows[j] + d);
#pragma GCC unroll 4
      for (int i = 0; i < N; ++i) acc[i] = fmadd(broadcast(p[i * kBlockKeys + j]), v, acc[i]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < N; ++i) store(o + i * dim + d, acc[i]);
  }
}

// Units [u0, u0 + U) of KV head g (unit u: chunk row u / group, query head g * group + u % group):
// their running softmax state and scratch (qs dim * U floats: the units' scaled queries,
// feature-major, so one base pointer serves every broadcast; o U * dim; p U * kBlockKeys).
template <int U>
struct Tile {
  float pos[U], lo[U], m[U], l[U];
  float *qs, *o, *p;
  int64_t u0, first, last;  // the first position any unit sees, the last unit's position
};

template <int U, typename T>
void tile_start(const Problem<T>& pr, int64_t g, int64_t u0, Tile<U>& st) {
  st.u0 = u0;
  for (int u = 0; u < U; ++u) {
    const int64_t r = (u0 + u) / pr.group, h = g * pr.group + (u0 + u) % pr.group;
    const float* q = pr.q + r * pr.q_row + h * pr.dim;
    for (int64_t d = 0; d < pr.dim; ++d) st.qs[d * U + u] = q[d] * pr.scale;
    st.pos[u] = static_cast<float>(pr.context + r);  // exact: positions < 2^24
    st.lo[u] = pr.window > 0 ? st.pos[u] - static_cast<float>(pr.window) + 1.f : 0.f;
    st.m[u] = -std::numeric_limits<float>::infinity();
    st.l[u] = 0.f;
  }
  std::fill(st.o, st.o + U * pr.dim, 0.f);
  st.last = pr.context + (u0 + U - 1) / pr.group;
  st.first = pr.window > 0 ? std::max<int64_t>(0, pr.context + u0 / pr.group - pr.window + 1) : 0;
}

// Unit u's running state after a block with maximum m_new (>= its old one) and exp-sum `sum`: the
// sum and output so far rescaled by e^(m - m_new) (0 while m is -inf).
template <int U>
inline void rescale(Tile<U>& st, int u, float m_new, float sum, int64_t dim) {
  const float correction = std::exp(st.m[u] - m_new);
  st.l[u] = st.l[u] * correction + sum;
  st.m[u] = m_new;
  if (correction != 1.f) {
    const Vec c = broadcast(correction);
    for (int64_t d = 0; d < dim; d += kWidth) store(st.o + u * dim + d, load(st.o + u * dim + d) * c);
  }
}

// The key block at t0 (a multiple of kWidth; up to kBlockKeys keys, none past st.last): scores,
// the online softmax step and o += p v.
template <int U, typename T>
void tile_block(const Problem<T>& pr, int64_t g, const float* kt, Tile<U>& st, int64_t t0) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const T* v_rows[kBlockKeys];
  // Scores of up to kBlockTiles key tiles, one tile's U accumulators at a time, into p.
  const int nt = static_cast<int>(std::min<int64_t>(kBlockTiles, (st.last + 1 - t0 + kWidth - 1) / kWidth));
  for (int b = 0; b < nt; ++b) {
    Vec s[U];
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) s[u] = zero();
    const float* kv = kt + ((t0 / kWidth) + b) * pr.dim * kWidth;
    for (int64_t d = 0; d < pr.dim; ++d) {
      const Vec k = load(kv + d * kWidth);
#pragma GCC unroll 16
      for (int u = 0; u < U; ++u) s[u] = fmadd(broadcast(st.qs[d * U + u]), k, s[u]);
    }
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) store(st.p + u * kBlockKeys + b * kWidth, s[u]);
  }
  // Online softmax over the block, unit by unit: visible keys are lo <= position <= the unit's.
  // Most blocks lie wholly inside every unit's range: no masking there.
  const bool inside = static_cast<float>(t0 + nt * kWidth - 1) <= st.pos[0] &&
                      (pr.window <= 0 || static_cast<float>(t0) >= st.lo[U - 1]);
  for (int u = 0; u < U; ++u) {
    const Vec bpos = broadcast(st.pos[u]), blo = broadcast(st.lo[u]);
    float* pu = st.p + u * kBlockKeys;
    Vec vmax = broadcast(ninf);
    if (inside) {
      for (int b = 0; b < nt; ++b) vmax = max(vmax, load(pu + b * kWidth));
      const float m_new = std::max(st.m[u], reduce_max(vmax));
      Vec sum = zero();
      for (int b = 0; b < nt; ++b) {
        const Vec e = exp(load(pu + b * kWidth) - broadcast(m_new));
        store(pu + b * kWidth, e);
        sum = sum + e;
      }
      rescale(st, u, m_new, reduce_add(sum), pr.dim);
      continue;
    }
    for (int b = 0; b < nt; ++b) {
      const Vec kp = lane_indices() + broadcast(static_cast<float>(t0 + b * kWidth));
      Vec x = select_greater(kp, bpos, broadcast(ninf), load(pu + b * kWidth));
      x = select_greater(blo, kp, broadcast(ninf), x);
      store(pu + b * kWidth, x);
      vmax = max(vmax, x);
    }
    const float block_max = reduce_max(vmax);
    if (block_max == ninf) {  // nothing visible in this block
      for (int b = 0; b < nt; ++b) store(pu + b * kWidth, zero());
      continue;
    }
    const float m_new = std::max(st.m[u], block_max);
    Vec sum = zero();
    for (int b = 0; b < nt; ++b) {
      const Vec kp = lane_indices() + broadcast(static_cast<float>(t0 + b * kWidth));
      Vec e = exp(load(pu + b * kWidth) - broadcast(m_new));
      e = select_greater(kp, bpos, zero(), e);  // exp(-inf) exactly 0, whatever the vector exp gives
      e = select_greater(blo, kp, zero(), e);
      store(pu + b * kWidth, e);
      sum = sum + e;
    }
    rescale(st, u, m_new, reduce_add(sum), pr.dim);
  }
  // o += p v over the block's keys up to the tile's last position, kPvUnits units per V load.
  const int64_t keys = std::min<int64_t>(nt * kWidth, st.last + 1 - t0);
  for (int64_t j = 0; j < keys; ++j) v_rows[j] = pr.v_cache + pr.row(t0 + j, g);
  for (int u = 0; u < U; u += kPvUnits)
    dispatch<kPvUnits>(U - u, [&](auto n) {
      add_pv<decltype(n)::value>(st.o + u * pr.dim, st.p + u * kBlockKeys, v_rows, keys, pr.dim);
    });
}

template <int U, typename T>
void tile_finish(const Problem<T>& pr, int64_t g, const Tile<U>& st) {
  for (int u = 0; u < U; ++u) {
    const int64_t r = (st.u0 + u) / pr.group, h = g * pr.group + (st.u0 + u) % pr.group;
    float* dst = pr.out + (r * pr.heads + h) * pr.dim;
    const Vec inv = broadcast(st.l[u] > 0.f ? 1.f / st.l[u] : 0.f);  // every unit sees its own key: l > 0
    for (int64_t d = 0; d < pr.dim; d += kWidth) store(dst + d, load(st.o + u * pr.dim + d) * inv);
  }
}

// Tiles [u0, u0 + n * U) of KV head g side by side: each key block, once in L1, serves all n
// tiles (4 x 12 units: K and V come from L2 or memory a quarter as often as tile by tile).
template <int U, typename T>
void tiles(const Problem<T>& pr, int64_t g, int64_t u0, int n, const float* kt, float* scratch) {
  Tile<U> st[kSuperTiles];
  const int64_t per_tile = 2 * U * pr.dim + U * kBlockKeys;
  for (int i = 0; i < n; ++i) {
    float* base = scratch + i * per_tile;
    st[i].qs = base;
    st[i].o = base + U * pr.dim;
    st[i].p = base + 2 * U * pr.dim;
    tile_start(pr, g, u0 + i * U, st[i]);
  }
  for (int64_t t0 = st[0].first / kWidth * kWidth; t0 <= st[n - 1].last; t0 += kBlockKeys)
    for (int i = 0; i < n; ++i)
      if (t0 <= st[i].last && t0 + kBlockKeys > st[i].first) tile_block(pr, g, kt, st[i], t0);
  for (int i = 0; i < n; ++i) tile_finish(pr, g, st[i]);
}

template <typename T>
void run(const Problem<T>& pr) {
  const int64_t len = pr.context + pr.tokens, units = pr.tokens * pr.group;
  const int64_t full = units / kUnits, rest = units % kUnits, ktiles = (len + kWidth - 1) / kWidth;
  std::vector<float> kt(pr.kv_heads * ktiles * pr.dim * kWidth);
  at::parallel_for(0, pr.kv_heads, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) transpose_keys(pr, g, len, kt.data() + g * ktiles * pr.dim * kWidth);
  });
  // Tasks per KV head, in row order: groups of kSuperTiles full tiles, then the partial tile. A
  // task's cost grows with its position, so threads take every n-th task (early and late alike).
  const int64_t supers = (full + kSuperTiles - 1) / kSuperTiles, per_head = supers + (rest > 0 ? 1 : 0);
  const int64_t tasks = pr.kv_heads * per_head, threads = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch(kSuperTiles * (2 * kUnits * pr.dim + kUnits * kBlockKeys));
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t task = t; task < tasks; task += threads) {
        const int64_t g = task / per_head, i = task % per_head;
        const float* ktg = kt.data() + g * ktiles * pr.dim * kWidth;
        if (i < supers) {
          const int n = static_cast<int>(std::min<int64_t>(kSuperTiles, full - i * kSuperTiles));
          tiles<kUnits>(pr, g, i * kSuperTiles * kUnits, n, ktg, scratch.data());
        } else {
          dispatch<kUnits>(rest, [&](auto u) {
            tiles<decltype(u)::value>(pr, g, full * kUnits, 1, ktg, scratch.data());
          });
        }
      }
  });
}

}  // namespace

// out [T, H, D] contiguous; query [T, H, D] (rows may be strided: views of the fused qkv output);
// caches [num_blocks, block_size, KVH, D]; block_table [max_blocks] int64 (this sequence's);
// context: positions already cached before the chunk (the chunk's K/V are written too); window
// <= 0: none, else each query sees the `window` positions ending at its own.
void paged_prefill_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                             at::Tensor block_table, int64_t context, double scale, int64_t window) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_prefill_attention: float32 queries and output");
  TORCH_CHECK(out.is_contiguous() && query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "paged_prefill_attention: out must be contiguous and query rows [H, D] dense");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 4,
              "paged_prefill_attention: caches must be contiguous [blocks, block_size, KVH, D]");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.is_contiguous() && block_table.dim() == 1,
              "paged_prefill_attention: block_table must be a contiguous int64 row");
  const int64_t tokens = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && key_cache.size(3) == dim && dim % kWidth == 0,
              "paged_prefill_attention: ", heads, " query heads of ", dim, " features over ", kv_heads,
              " KV heads of ", key_cache.size(3), ": the query heads must be a multiple of the KV heads, of one "
              "size, a multiple of ", kWidth);
  TORCH_CHECK(out.sizes() == query.sizes(), "paged_prefill_attention: out must be shaped like query");
  TORCH_CHECK(context >= 0 && (context + tokens + block_size - 1) / block_size <= block_table.size(0),
              "paged_prefill_attention: the block table holds ", block_table.size(0), " blocks, not ",
              context + tokens, " positions");
  if (tokens == 0) return;
  auto go = [&](const auto* k, const auto* v) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(k)>>;
    const Problem<T> pr{query.data_ptr<float>(), out.data_ptr<float>(), k, v, block_table.data_ptr<int64_t>(),
                        query.stride(0), heads, kv_heads, heads / kv_heads, dim, block_size, context, tokens,
                        window, static_cast<float>(scale)};
    run(pr);
  };
  const at::ScalarType type = key_cache.scalar_type();
  TORCH_CHECK(value_cache.scalar_type() == type, "paged_prefill_attention: K and V caches of one dtype");
  if (type == at::kFloat)
    go(key_cache.data_ptr<float>(), value_cache.data_ptr<float>());
  else if (type == at::kBFloat16)
    go(key_cache.data_ptr<c10::BFloat16>(), value_cache.data_ptr<c10::BFloat16>());
  else if (type == at::kHalf)
    go(key_cache.data_ptr<c10::Half>(), value_cache.data_ptr<c10::Half>());
  else
    TORCH_CHECK(false, "paged_prefill_attention: a float32, bfloat16 or float16 cache, not ", type);
}

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_OPS, m) {
  m.def("paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_table, int context, float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_OPS, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
