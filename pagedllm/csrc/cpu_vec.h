// The one vector abstraction every CPU kernel is written over: a float32 vector `Vec` of the
// widest width the build targets, with the same operations on each backend. The build picks the
// backend from the compile flags (layers/cpu_kernels.py passes them per ISA level):
//   AVX-512 (x86-64-v4): 16 lanes, 32 registers;  AVX2 + FMA (x86-64-v3): 8 lanes, 16 registers;
//   NEON (aarch64): 4 lanes, 32 registers;  portable: 4 lanes of GCC's generic vectors, which the
//   compiler lowers to whatever the target has (SSE2, or scalar code).
// Kernels size their register tiles from kWidth and kRegisters, so one source fits each ISA.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

// PAGEDLLM_PORTABLE (the portable level's build) forces the generic backend on any CPU.
#if !defined(PAGEDLLM_PORTABLE) && defined(__AVX512F__)
#define PAGEDLLM_VEC_AVX512 1
#elif !defined(PAGEDLLM_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
#define PAGEDLLM_VEC_AVX2 1
#elif !defined(PAGEDLLM_PORTABLE) && defined(__ARM_NEON) && defined(__aarch64__)
#define PAGEDLLM_VEC_NEON 1
#endif

#if defined(PAGEDLLM_VEC_AVX512) || defined(PAGEDLLM_VEC_AVX2)
#include <immintrin.h>
#elif defined(PAGEDLLM_VEC_NEON)
#include <arm_neon.h>
#endif

namespace pagedllm_vec {

// One float16 (raw bits) -> float (exact: subnormals, infinities and NaN included).
inline float f16_to_float(uint16_t h) {
  const int exponent = (h >> 10) & 31, mantissa = h & 1023;
  float magnitude;
  if (exponent == 31)
    magnitude = mantissa ? NAN : INFINITY;
  else if (exponent == 0)
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  else
    magnitude = std::ldexp(static_cast<float>(mantissa | 1024), exponent - 25);
  return (h & 0x8000) ? -magnitude : magnitude;
}

#if defined(PAGEDLLM_VEC_AVX512)
constexpr const char* kBackend = "avx512";
constexpr int kWidth = 16, kRegisters = 32;
struct Vec { __m512 v; };
inline Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
inline Vec broadcast(float x) { return {_mm512_set1_ps(x)}; }
inline Vec zero() { return {_mm512_setzero_ps()}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c
inline Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec min(Vec a, Vec b) { return {_mm512_min_ps(a.v, b.v)}; }
inline float reduce_add(Vec a) { return _mm512_reduce_add_ps(a.v); }
// out[p] = reduce_add(a[p]) for 8 vectors: each folded to 8 lanes, then as on AVX2.
inline __m256 fold_halves(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
inline void reduce_add_8(const Vec* a, float* out) {
  const __m256 h01 = _mm256_hadd_ps(fold_halves(a[0].v), fold_halves(a[1].v));
  const __m256 h23 = _mm256_hadd_ps(fold_halves(a[2].v), fold_halves(a[3].v));
  const __m256 h45 = _mm256_hadd_ps(fold_halves(a[4].v), fold_halves(a[5].v));
  const __m256 h67 = _mm256_hadd_ps(fold_halves(a[6].v), fold_halves(a[7].v));
  const __m256 q0 = _mm256_hadd_ps(h01, h23), q1 = _mm256_hadd_ps(h45, h67);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31)));
}
inline float reduce_max(Vec a) { return _mm512_reduce_max_ps(a.v); }
inline Vec round_nearest(Vec a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// a * 2^n for integral n in [-126, 127].
inline Vec ldexp(Vec a, Vec n) { return {_mm512_scalef_ps(a.v, n.v)}; }
// kWidth int8 values -> floats (exact).
inline Vec load_i8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
// kWidth bfloat16 values (raw bits) -> floats (exact: bf16 is float32's upper half).
inline Vec load_bf16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}
// kWidth float16 values (raw bits) -> floats (exact).
inline Vec load_f16(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
// The 4-bit weights of 16 outputs over 8 k steps as 16 little-endian 32-bit words (word n: output
// n, k step i in bits 4i..4i+3; int4's layout, csrc/cpu_gemm_grouped.cpp): vector v of step i,
// as floats 0..15 in output order (exact). AVX-512: one vector is all 16 words; a shift brings
// nibble i to each lane's low 4 bits and one 16-entry table lookup (vpermps reads only those 4
// bits) makes it a float, 2 instructions besides the (L1) load.
inline Vec load_u4_step(const uint8_t* p, int, int i) {
  const __m512i words = _mm512_loadu_si512(p);
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return {_mm512_permutexvar_ps(_mm512_srli_epi32(words, 4 * i), values)};
}
// A 16-entry float table for 4-bit codes (a codebook: bitsandbytes' NF4 / FP4), held in registers.
struct Table16 { __m512 v; };
inline Table16 load_table16(const float* t) { return {_mm512_loadu_ps(t)}; }
// load_u4_step with each nibble looked up in `table` instead of taken as 0..15: the same 2 instructions.
inline Vec load_u4_step(const uint8_t* p, int, int i, const Table16& table) {
  return {_mm512_permutexvar_ps(_mm512_srli_epi32(_mm512_loadu_si512(p), 4 * i), table.v)};
}
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
// a > b ? t : f per lane (an ordered compare: a NaN lane takes f).
inline Vec select_greater(Vec a, Vec b, Vec t, Vec f) {
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ), f.v, t.v)};
}
inline bool any_nan(Vec a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q) != 0; }
inline Vec lane_indices() { return {_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)}; }

#elif defined(PAGEDLLM_VEC_AVX2)
constexpr const char* kBackend = "avx2";
constexpr int kWidth = 8, kRegisters = 16;
struct Vec { __m256 v; };
inline Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void store(float* p, Vec a) { _mm256_storeu_ps(p, a.v); }
inline Vec broadcast(float x) { return {_mm256_set1_ps(x)}; }
inline Vec zero() { return {_mm256_setzero_ps()}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
inline Vec min(Vec a, Vec b) { return {_mm256_min_ps(a.v, b.v)}; }
inline float reduce_add(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
// out[p] = reduce_add(a[p]) for 8 vectors at once: two rounds of pairwise adds leave each
// 128-bit half holding 4 vectors' partial sums, and one add of the halves finishes all 8 (9
// instructions where 8 separate reductions take 32).
inline void reduce_add_8(const Vec* a, float* out) {
  const __m256 h01 = _mm256_hadd_ps(a[0].v, a[1].v), h23 = _mm256_hadd_ps(a[2].v, a[3].v);
  const __m256 h45 = _mm256_hadd_ps(a[4].v, a[5].v), h67 = _mm256_hadd_ps(a[6].v, a[7].v);
  const __m256 q0 = _mm256_hadd_ps(h01, h23), q1 = _mm256_hadd_ps(h45, h67);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31)));
}
inline float reduce_max(Vec a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline Vec round_nearest(Vec a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline Vec ldexp(Vec a, Vec n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23);
  return {_mm256_mul_ps(a.v, _mm256_castsi256_ps(e))};
}
inline Vec load_i8(const int8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
}
inline Vec load_bf16(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))};
}
inline Vec load_f16(const uint16_t* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
// load_u4_step (see the AVX-512 backend): words 8 v .. 8 v + 7, a shift, a mask and a conversion.
inline Vec load_u4_step(const uint8_t* p, int v, int i) {
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p) + v);
  return {_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(words, 4 * i), _mm256_set1_epi32(15)))};
}
// Table16 / load_u4_step with a table (see the AVX-512 backend): vpermps reads 3 index bits, so
// two 8-entry halves are looked up and the nibble's bit 3, shifted to the sign bit, picks one.
struct Table16 { __m256 lo, hi; };
inline Table16 load_table16(const float* t) { return {_mm256_loadu_ps(t), _mm256_loadu_ps(t + 8)}; }
inline Vec load_u4_step(const uint8_t* p, int v, int i, const Table16& table) {
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p) + v);
  const __m256i q = _mm256_srli_epi32(words, 4 * i);
  const __m256 lo = _mm256_permutevar8x32_ps(table.lo, q), hi = _mm256_permutevar8x32_ps(table.hi, q);
  return {_mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(q, 28)))};
}
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
inline Vec select_greater(Vec a, Vec b, Vec t, Vec f) {
  return {_mm256_blendv_ps(f.v, t.v, _mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ))};
}
inline bool any_nan(Vec a) { return _mm256_movemask_ps(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q)) != 0; }
inline Vec lane_indices() { return {_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7)}; }

#elif defined(PAGEDLLM_VEC_NEON)
constexpr const char* kBackend = "neon";
constexpr int kWidth = 4, kRegisters = 32;
struct Vec { float32x4_t v; };
inline Vec load(const float* p) { return {vld1q_f32(p)}; }
inline void store(float* p, Vec a) { vst1q_f32(p, a.v); }
inline Vec broadcast(float x) { return {vdupq_n_f32(x)}; }
inline Vec zero() { return {vdupq_n_f32(0.f)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
inline Vec operator+(Vec a, Vec b) { return {vaddq_f32(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {vsubq_f32(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {vmulq_f32(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {vdivq_f32(a.v, b.v)}; }
inline Vec max(Vec a, Vec b) { return {vmaxq_f32(a.v, b.v)}; }
inline Vec min(Vec a, Vec b) { return {vminq_f32(a.v, b.v)}; }
inline float reduce_add(Vec a) { return vaddvq_f32(a.v); }
inline void reduce_add_8(const Vec* a, float* out) {  // pairwise adds, 4 sums per vector
  vst1q_f32(out, vpaddq_f32(vpaddq_f32(a[0].v, a[1].v), vpaddq_f32(a[2].v, a[3].v)));
  vst1q_f32(out + 4, vpaddq_f32(vpaddq_f32(a[4].v, a[5].v), vpaddq_f32(a[6].v, a[7].v)));
}
inline float reduce_max(Vec a) { return vmaxvq_f32(a.v); }
inline Vec round_nearest(Vec a) { return {vrndnq_f32(a.v)}; }
inline Vec ldexp(Vec a, Vec n) {
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n.v), vdupq_n_s32(127)), 23);
  return {vmulq_f32(a.v, vreinterpretq_f32_s32(e))};
}
inline Vec load_i8(const int8_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, 4);
  const int16x8_t w16 = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(bits)));
  return {vcvtq_f32_s32(vmovl_s16(vget_low_s16(w16)))};
}
inline Vec load_bf16(const uint16_t* p) { return {vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16))}; }
inline Vec load_f16(const uint16_t* p) { return {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)))}; }
// load_u4_step (see the AVX-512 backend): words 4 v .. 4 v + 3, a shift, a mask and a conversion.
inline Vec load_u4_step(const uint8_t* p, int v, int i) {
  const uint32x4_t words = vld1q_u32(reinterpret_cast<const uint32_t*>(p) + 4 * v);
  const uint32x4_t q = vandq_u32(vshlq_u32(words, vdupq_n_s32(-4 * i)), vdupq_n_u32(15));
  return {vcvtq_f32_u32(q)};
}
// Table16 / load_u4_step with a table (see the AVX-512 backend): a 64-byte byte lookup (tbl) with
// the indices 4q .. 4q + 3 of each lane's float.
struct Table16 { uint8x16x4_t bytes; };
inline Table16 load_table16(const float* t) { return {vld1q_u8_x4(reinterpret_cast<const uint8_t*>(t))}; }
inline Vec load_u4_step(const uint8_t* p, int v, int i, const Table16& table) {
  const uint32x4_t words = vld1q_u32(reinterpret_cast<const uint32_t*>(p) + 4 * v);
  const uint32x4_t q = vandq_u32(vshlq_u32(words, vdupq_n_s32(-4 * i)), vdupq_n_u32(15));
  const uint32x4_t index = vmlaq_n_u32(vdupq_n_u32(0x03020100u), q, 0x04040404u);
  return {vreinterpretq_f32_u8(vqtbl4q_u8(table.bytes, vreinterpretq_u8_u32(index)))};
}
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
inline Vec select_greater(Vec a, Vec b, Vec t, Vec f) { return {vbslq_f32(vcgtq_f32(a.v, b.v), t.v, f.v)}; }
inline bool any_nan(Vec a) { return vminvq_u32(vceqq_f32(a.v, a.v)) == 0; }
inline Vec lane_indices() {
  static const float kLaneIndex[4] = {0.f, 1.f, 2.f, 3.f};
  return {vld1q_f32(kLaneIndex)};
}

#else
constexpr const char* kBackend = "portable";
constexpr int kWidth = 4, kRegisters = 16;
typedef float F4 __attribute__((vector_size(16)));
struct Vec { F4 v; };
inline Vec load(const float* p) { Vec a; std::memcpy(&a.v, p, sizeof(F4)); return a; }
inline void store(float* p, Vec a) { std::memcpy(p, &a.v, sizeof(F4)); }
inline Vec broadcast(float x) { return {F4{x, x, x, x}}; }
inline Vec zero() { return broadcast(0.f); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {a.v * b.v + c.v}; }
inline Vec operator+(Vec a, Vec b) { return {a.v + b.v}; }
inline Vec operator-(Vec a, Vec b) { return {a.v - b.v}; }
inline Vec operator*(Vec a, Vec b) { return {a.v * b.v}; }
inline Vec operator/(Vec a, Vec b) { return {a.v / b.v}; }
inline Vec max(Vec a, Vec b) { return {a.v > b.v ? a.v : b.v}; }
inline Vec min(Vec a, Vec b) { return {a.v < b.v ? a.v : b.v}; }
inline float reduce_add(Vec a) { return (a.v[0] + a.v[1]) + (a.v[2] + a.v[3]); }
inline void reduce_add_8(const Vec* a, float* out) {
  for (int p = 0; p < 8; ++p) out[p] = reduce_add(a[p]);
}
inline float reduce_max(Vec a) { return std::fmax(std::fmax(a.v[0], a.v[1]), std::fmax(a.v[2], a.v[3])); }
inline Vec round_nearest(Vec a) {
  for (int i = 0; i < 4; ++i) a.v[i] = std::nearbyint(a.v[i]);
  return a;
}
inline Vec ldexp(Vec a, Vec n) {
  for (int i = 0; i < 4; ++i) a.v[i] = std::ldexp(a.v[i], static_cast<int>(n.v[i]));
  return a;
}
inline Vec load_i8(const int8_t* p) { return {F4{float(p[0]), float(p[1]), float(p[2]), float(p[3])}}; }
inline Vec load_bf16(const uint16_t* p) {
  uint32_t bits[4] = {uint32_t(p[0]) << 16, uint32_t(p[1]) << 16, uint32_t(p[2]) << 16, uint32_t(p[3]) << 16};
  Vec a;
  std::memcpy(&a.v, bits, sizeof(F4));
  return a;
}
inline Vec load_f16(const uint16_t* p) {
  return {F4{f16_to_float(p[0]), f16_to_float(p[1]), f16_to_float(p[2]), f16_to_float(p[3])}};
}
inline Vec load_u4_step(const uint8_t* p, int v, int i) {  // as on NEON
  uint32_t w[4];
  std::memcpy(w, p + 16 * v, sizeof(w));
  const int s = 4 * i;
  return {F4{float((w[0] >> s) & 15), float((w[1] >> s) & 15), float((w[2] >> s) & 15), float((w[3] >> s) & 15)}};
}
struct Table16 { const float* t; };
inline Table16 load_table16(const float* t) { return {t}; }
inline Vec load_u4_step(const uint8_t* p, int v, int i, const Table16& table) {
  uint32_t w[4];
  std::memcpy(w, p + 16 * v, sizeof(w));
  const int s = 4 * i;
  const float* t = table.t;
  return {F4{t[(w[0] >> s) & 15], t[(w[1] >> s) & 15], t[(w[2] >> s) & 15], t[(w[3] >> s) & 15]}};
}
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
inline Vec select_greater(Vec a, Vec b, Vec t, Vec f) { return {a.v > b.v ? t.v : f.v}; }
inline bool any_nan(Vec a) { return std::isnan(a.v[0]) || std::isnan(a.v[1]) || std::isnan(a.v[2]) || std::isnan(a.v[3]); }
inline Vec lane_indices() { return {F4{0.f, 1.f, 2.f, 3.f}}; }
#endif

// One bfloat16 (raw bits) -> float, for scalar tails.
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// e^x: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial (truncation
// below 1e-8 relative), then scaled by 2^n. std::exp does not vectorise without -ffast-math.
// Inputs are clamped to where e^x is a normal float, so a huge |x| gives 0 or ~1e38, not NaN.
inline Vec exp(Vec x) {
  x = min(max(x, broadcast(-87.3f)), broadcast(88.3f));
  const Vec n = round_nearest(x * broadcast(1.44269504088896341f));
  Vec r = fmadd(n, broadcast(-0.693145751953125f), x);  // ln2 split in two parts
  r = fmadd(n, broadcast(-1.428606765330187e-06f), r);
  Vec p = broadcast(1.f / 5040.f);
  const float coef[] = {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};
  for (float c : coef) p = fmadd(p, r, broadcast(c));
  return ldexp(p, n);
}

// Calls f(std::integral_constant<int, N>) for the runtime n in [1, Max] (Max for anything larger):
// a register tile sized at compile time for a runtime count of rows, panels or keys.
template <int Max, int N = 1, class F>
void dispatch(int64_t n, F&& f) {
  if constexpr (N < Max) {
    if (n == N) return f(std::integral_constant<int, N>{});
    return dispatch<Max, N + 1>(n, f);
  } else {
    return f(std::integral_constant<int, Max>{});
  }
}

}  // namespace pagedllm_vec
