// Small fused ops for CPU decode: at batch 1 a step is ~30 layers x a few dozen tiny torch ops,
// and each op's dispatch costs more than its arithmetic. These replace the worst offenders with
// one call each: RoPE on q and k in place, SiLU(gate) * up, and the paged K/V write.
// float32 only (the CPU default); callers keep the torch path for other dtypes.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "cpu_kernels.h"
#include "cpu_vec.h"

namespace {

using namespace pagedllm_vec;

// Token rows per thread's task in RoPE, the K/V write and the norms: a batch of more than 8 rows
// splits over the step's threads. Their inputs were written by both threads (the GEMMs split the
// columns) and the K/V rows go to cache lines last touched long ago, so a row costs more than
// its arithmetic: at 64 rows on one thread the write took ~30 us a layer inside a step, 3.5 us
// on warm lines. RoPE and the K/V write split a batch alike, so a thread writes the keys it rotated.
constexpr int64_t kRowsPerTask = 8;

// Rotate every head of one token row. No FMA contraction here: rounding each product like torch
// does keeps the result bitwise equal to the reference (and to Hugging Face) in float32.
__attribute__((optimize("fp-contract=off")))
void rotate_heads(float* x, int64_t heads, int64_t head_dim, int64_t half, const float* cos, const float* sin) {
  for (int64_t h = 0; h < heads; ++h) {
    float* x1 = x + h * head_dim;
    float* x2 = x1 + half;
    for (int64_t i = 0; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      const float ac = a * cos[i], bs = b * sin[i], bc = b * cos[i], as = a * sin[i];
      x1[i] = ac - bs;
      x2[i] = bc + as;
    }
  }
}

}  // namespace

// query [T, H * D] and key [T, KVH * D] (row stride may exceed the width: views of the fused
// qkv output); cos_sin_cache [max_pos, rot] = [cos | sin], rot = rotary_dim. Neox style: the
// first rot/2 features pair with the next rot/2 of each head; features past rot pass through.
void rotary_embedding_(at::Tensor positions, at::Tensor query, at::Tensor key,
                       at::Tensor cos_sin_cache, int64_t head_dim) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(query.stride(1) == 1 && key.stride(1) == 1 && cos_sin_cache.is_contiguous(), "bad layout");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "int64 positions");
  const int64_t tokens = query.size(0), half = cos_sin_cache.size(1) / 2;
  const int64_t q_heads = query.size(1) / head_dim, k_heads = key.size(1) / head_dim;
  const int64_t* pos = positions.data_ptr<int64_t>();
  float* q = query.data_ptr<float>();
  float* k = key.data_ptr<float>();
  const float* cache = cos_sin_cache.data_ptr<float>();
  const int64_t q_stride = query.stride(0), k_stride = key.stride(0), max_pos = cos_sin_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " is outside the RoPE table (", max_pos, ")");
  }
  at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cache + pos[t] * 2 * half;
      rotate_heads(q + t * q_stride, q_heads, head_dim, half, cos, cos + half);
      rotate_heads(k + t * k_stride, k_heads, head_dim, half, cos, cos + half);
    }
  });
}

// x [T, 2I] = [gate | up] -> out [T, I] = silu(gate) * up, with the vector exp of cpu_vec.h
// (relative error a few ulp, far below the fp32 matmuls around it); a scalar loop for the tail.
at::Tensor silu_and_mul(at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.stride(1) == 1, "float32 rows only");
  const int64_t tokens = x.size(0), inter = x.size(1) / 2, stride = x.stride(0);
  auto out = at::empty({tokens, inter}, x.options());
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(inter, 1));  // rows per task
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = in + t * stride;
      const float* up = gate + inter;
      float* dst = o + t * inter;
      int64_t i = 0;
      for (; i + kWidth <= inter; i += kWidth) {
        const Vec g = load(gate + i);
        store(dst + i, g / (broadcast(1.f) + exp(zero() - g)) * load(up + i));
      }
      for (; i < inter; ++i) dst[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

namespace {

// One token's key and value rows (width floats each) into its K and V cache rows, converted to the
// cache's T (a copy for float32).
template <typename T>
void write_kv_rows(const float* k, const float* v, T* kc, T* vc, int64_t width) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(kc, k, width * sizeof(float));
    std::memcpy(vc, v, width * sizeof(float));
  } else {
    for (int64_t i = 0; i < width; ++i) {
      kc[i] = static_cast<T>(k[i]);
      vc[i] = static_cast<T>(v[i]);
    }
  }
}

template <typename T>
void write_kv_tokens(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const int64_t* slots) {
  const int64_t tokens = key.size(0), width = key.size(1), plane = kv_cache.numel() / 2;
  const int64_t k_stride = key.stride(0), v_stride = value.stride(0);
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  T* cache = static_cast<T*>(kv_cache.data_ptr());
  at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      write_kv_rows<T>(k + t * k_stride, v + t * v_stride, cache + slots[t] * width, cache + plane + slots[t] * width,
                       width);
    }
  });
}

}  // namespace

// key/value [T, KVH * D] float32 rows (stride may exceed the width); kv_cache [2, blocks,
// block_size, KVH, D] float32, or bfloat16 / float16 (--kv-cache-dtype on a float32 model: each
// value rounded to nearest even, as torch's .to() rounds); slot_mapping [T]: the flat slot of each
// token; a negative slot skips the token (padding).
void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor kv_cache, at::Tensor slot_mapping) {
  const at::ScalarType cache_type = kv_cache.scalar_type();
  TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat,
              "write_kv_cache: float32 keys and values only");
  TORCH_CHECK(key.stride(1) == 1 && value.stride(1) == 1 && kv_cache.is_contiguous(), "bad layout");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "int64 slots");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  if (cache_type == at::kFloat) {
    write_kv_tokens<float>(key, value, kv_cache, slots);
  } else if (cache_type == at::kBFloat16) {
    write_kv_tokens<c10::BFloat16>(key, value, kv_cache, slots);
  } else {
    TORCH_CHECK(cache_type == at::kHalf, "write_kv_cache: the cache must be float32, bfloat16 or float16");
    write_kv_tokens<c10::Half>(key, value, kv_cache, slots);
  }
}

namespace {

// out = x / sqrt(mean(x^2) + eps) * w for one row, in float32 like the torch reference. The sum
// of squares is a reduction, which the compiler leaves scalar without -ffast-math: vector lanes
// here (an order of summation different from torch's too, within a few ulp).
void rms_norm_row(float* out, const float* x, const float* w, int64_t n, float eps) {
  Vec squares = zero();
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) {
    const Vec v = load(x + i);
    squares = fmadd(v, v, squares);
  }
  float sum = reduce_add(squares);
  for (; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  const Vec vinv = broadcast(inv);
  for (i = 0; i + kWidth <= n; i += kWidth) store(out + i, load(x + i) * vinv * load(w + i));
  for (; i < n; ++i) out[i] = x[i] * inv * w[i];
}

}  // namespace

// out/x [T, H] contiguous, weight [H]: out = rms_norm(x) * weight.
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && out.is_contiguous(), "float32 rows only");
  const int64_t tokens = x.size(0), n = x.size(1);
  const float* in = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rms_norm_row(o + t * n, in + t * n, w, n, static_cast<float>(eps));
  });
}

// The pre-norm decoder's residual step, in place: residual += x; x = rms_norm(residual) * weight.
void fused_add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && residual.is_contiguous(), "float32 rows only");
  const int64_t tokens = x.size(0), n = x.size(1);
  float* h = x.data_ptr<float>();
  float* r = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* hr = h + t * n;
      float* rr = r + t * n;
      for (int64_t i = 0; i < n; ++i) rr[i] += hr[i];
      rms_norm_row(hr, rr, w, n, static_cast<float>(eps));
    }
  });
}
