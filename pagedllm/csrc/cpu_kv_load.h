// Reading KV-cache rows as float32, shared by the decode and prefill attention kernels: a scalar
// to_f for tails and load_kv for a vector of the cache types the vector paths read (float32;
// bfloat16 widened by a shift; float16 by the ISA's conversion: F16C, AVX-512, NEON fcvtl).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#include "cpu_vec.h"

namespace pagedllm_vec {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

template <typename T>
constexpr bool kVectorCache =
    std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;
inline Vec load_kv(const float* p) { return load(p); }
inline Vec load_kv(const c10::BFloat16* p) { return load_bf16(reinterpret_cast<const uint16_t*>(p)); }
inline Vec load_kv(const c10::Half* p) { return load_f16(reinterpret_cast<const uint16_t*>(p)); }

}  // namespace pagedllm_vec
