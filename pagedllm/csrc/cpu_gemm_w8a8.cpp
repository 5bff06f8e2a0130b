// W8A8 GEMM for CPU: y = (qx qw^T) * sx[m] * sw[n] (+ b), int8 activations quantized per token
// inside the op, int8 weights with one scale per output channel, exact int32 accumulation.
//
// Where the fp32 GEMM is compute-bound (decode batches from ~16 rows, prefill), one 4-byte int8
// dot product instruction does 4x the multiply-adds of an fp32 FMA on the same vector width.
// The op takes float32 x [..., K]: each row m is quantized (sx = max|x_m| / 127, q = round-half-
// even(x * (127 / max|x_m|)), the formula of layers/quantization/w8a8.py's reference) by the
// threads themselves, block by block into a thread-local buffer (see run_panels), so the layer
// makes one call and the op one parallel region.
//
// Weight layout [N / 16, ceil(K / 4), 16, 4] int8 (K zero-padded to a multiple of 4): one k4 step
// of a panel of 16 outputs is 64 bytes, output n's 4 consecutive k in one int32 lane, which is
// what the dot instructions take. Paths (the build's macros pick them; "path" 0 is the best one
// compiled, 1 the next, ...; w8a8_paths() lists them so tests run each):
//   vnni512 / vnni256 (AVX-512 VNNI vpdpbusd, AVX-VNNI): unsigned times signed bytes, so the
//     activations are stored as u = q + 128 and the op subtracts comp[n] = 128 * sum_k w[n, k]
//     (precomputed at pack time). |sum| <= K * 255 * 127 < 2^31 for K <= 65536 (checked).
//   maddubs512 / maddubs256 (AVX-512BW, AVX2 without VNNI): vpmaddubsw multiplies u8 x s8 and
//     adds pairs into int16 with saturation. With a = |x| (u8 in [0, 127]) and b = w negated
//     where x < 0 (in [-127, 127]: w is never -128) each product a * b = x * w has magnitude
//     <= 127 * 127 = 16129, a pair <= 32258 < 32767: no saturation; vpmaddwd by 1 then widens the
//     pairs to int32 exactly.
//   dotprod (Arm vdotq_s32: signed x signed, exact) / mull (vmull_s8: int16 products <= 16129,
//     vpadalq_s16 adds pairs into int32).
//   scalar (portable build): plain int32 loops.
// Register tiles (rows x panels): accumulators + weight vectors + the broadcast fit the register
// file: vnni512 6 x 4 (24 + 4 + 1 of 32 zmm), maddubs512 5 x 4, AVX2 6 x 1 / 4 x 1 (a panel is
// 2 ymm; 12 + 2 + 1 of 16), NEON 6 x 1 (a panel is 4 q: 24 + 4 + 1 of 32) / 3 x 1 (8 pair
// accumulators per panel).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_vec.h"

#if defined(__linux__) && defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kPanel = 16;  // outputs per panel
constexpr int64_t kStep = 64;  // bytes of one k4 step of a panel
constexpr int64_t kMaxK = 65536;  // keeps every int32 sum exact (see the top)
constexpr int64_t kXBlockBytes = 256 * 1024;  // quantized rows per block: stays in L2
constexpr int64_t kMinThreadMacs = 1 << 20;  // least work worth waking a second thread for

struct Problem {
  const float* x;  // [M, K] fp32 rows, row stride ldx
  int64_t ldx, k;
  const uint8_t* xq;  // a block's quantized rows [rows, 4 * k4] (u8 = q + 128 for the unsigned paths)
  const float* xs;  // the block's token scales
  const int8_t* w;  // [N / 16, k4, 16, 4]
  const float* ws;  // [N] channel scales
  const int32_t* comp;  // [N] 128 * sum_k w (the unsigned paths only)
  const float* bias;  // [N] or nullptr
  float* y;  // [M, N] (from the block's first row)
  int64_t n, k4;
};

inline int32_t load4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(PAGEDLLM_VEC_AVX512)
// What the 512-bit paths share: a panel's k4 step is one zmm, one int32 accumulator per panel.
struct Int512 {
  static constexpr int kAcc = 1;
  using Acc = __m512i;
  using W = __m512i;
  static Acc zero() { return _mm512_setzero_si512(); }
  static W load(const int8_t* p) { return _mm512_loadu_si512(p); }
  static void finish(const Acc* acc, int32_t* out) { _mm512_storeu_si512(out, acc[0]); }
};
#if defined(__AVX512VNNI__)
struct Vnni512 : Int512 {
  static constexpr const char* kName = "vnni512";
  static constexpr int kRows = 6, kPanels = 4;
  static constexpr bool kUnsigned = true;
  using X = __m512i;
  static X bcast(const uint8_t* p) { return _mm512_set1_epi32(load4(p)); }
  static Acc dot(Acc acc, X x, W w, int) { return _mm512_dpbusd_epi32(acc, x, w); }
};
#endif
struct Maddubs512 : Int512 {
  static constexpr const char* kName = "maddubs512";
  static constexpr int kRows = 5, kPanels = 4;
  static constexpr bool kUnsigned = false;
  struct X {
    __m512i abs;
    __mmask64 neg;
  };
  static X bcast(const uint8_t* p) {
    const __m512i x = _mm512_set1_epi32(load4(p));
    return {_mm512_abs_epi8(x), _mm512_movepi8_mask(x)};
  }
  static Acc dot(Acc acc, const X& x, W w, int) {
    const __m512i signed_w = _mm512_mask_sub_epi8(w, x.neg, _mm512_setzero_si512(), w);
    const __m512i pairs = _mm512_maddubs_epi16(x.abs, signed_w);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
  }
};
#endif

#if defined(PAGEDLLM_VEC_AVX2)
// What the 256-bit paths share: a panel's k4 step is two ymm (outputs 0-7 and 8-15), one int32
// accumulator each.
struct Int256 {
  static constexpr int kAcc = 2;
  using Acc = __m256i;
  struct W {
    __m256i v[2];
  };
  static Acc zero() { return _mm256_setzero_si256(); }
  static W load(const int8_t* p) {
    return {{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))}};
  }
  static void finish(const Acc* acc, int32_t* out) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), acc[0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8), acc[1]);
  }
};
#if defined(__AVXVNNI__)
struct Vnni256 : Int256 {
  static constexpr const char* kName = "vnni256";
  static constexpr int kRows = 6, kPanels = 1;
  static constexpr bool kUnsigned = true;
  using X = __m256i;
  static X bcast(const uint8_t* p) { return _mm256_set1_epi32(load4(p)); }
  static Acc dot(Acc acc, X x, const W& w, int a) { return _mm256_dpbusd_avx_epi32(acc, x, w.v[a]); }
};
#endif
struct Maddubs256 : Int256 {
  static constexpr const char* kName = "maddubs256";
  static constexpr int kRows = 4, kPanels = 1;
  static constexpr bool kUnsigned = false;
  struct X {
    __m256i x, abs;
  };
  static X bcast(const uint8_t* p) {
    const __m256i x = _mm256_set1_epi32(load4(p));
    return {x, _mm256_abs_epi8(x)};
  }
  static Acc dot(Acc acc, const X& x, const W& w, int a) {
    // sign_epi8(w, x): w negated where x < 0, zeroed where x == 0 (|x| is 0 there anyway).
    const __m256i pairs = _mm256_maddubs_epi16(x.abs, _mm256_sign_epi8(w.v[a], x.x));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
};
#endif

#if defined(PAGEDLLM_VEC_NEON)
// What the NEON paths share: a panel's k4 step is four q registers of 4 outputs x 4 k; signed
// activations broadcast as one int32 (4 k) per lane.
struct Int128 {
  static constexpr bool kUnsigned = false;
  using Acc = int32x4_t;
  using X = int8x16_t;
  struct W {
    int8x16_t v[4];
  };
  static Acc zero() { return vdupq_n_s32(0); }
  static W load(const int8_t* p) { return {{vld1q_s8(p), vld1q_s8(p + 16), vld1q_s8(p + 32), vld1q_s8(p + 48)}}; }
  static X bcast(const uint8_t* p) { return vreinterpretq_s8_s32(vdupq_n_s32(load4(p))); }
};
#if defined(__ARM_FEATURE_DOTPROD)
struct Dotprod : Int128 {
  static constexpr const char* kName = "dotprod";
  static constexpr int kAcc = 4, kRows = 6, kPanels = 1;
  static Acc dot(Acc acc, X x, const W& w, int a) { return vdotq_s32(acc, w.v[a], x); }
  static void finish(const Acc* acc, int32_t* out) {
    for (int a = 0; a < 4; ++a) vst1q_s32(out + 4 * a, acc[a]);
  }
};
#endif
struct Mull : Int128 {
  static constexpr const char* kName = "mull";
  static constexpr int kAcc = 8, kRows = 3, kPanels = 1;
  // Vector v holds outputs 4v..4v+3; its low half times x gives 8 int16 products of outputs
  // 4v, 4v+1, which vpadalq adds in pairs into accumulator 2v ([n, n, n+1, n+1] partial sums);
  // the high half feeds accumulator 2v + 1.
  static Acc dot(Acc acc, X x, const W& w, int a) {
    const int8x16_t v = w.v[a / 2];
    return vpadalq_s16(acc, a % 2 ? vmull_high_s8(v, x) : vmull_s8(vget_low_s8(v), vget_low_s8(x)));
  }
  static void finish(const Acc* acc, int32_t* out) {
    for (int a = 0; a < 4; ++a) vst1q_s32(out + 4 * a, vpaddq_s32(acc[2 * a], acc[2 * a + 1]));
  }
};
#endif

struct Scalar {
  static constexpr const char* kName = "scalar";
  static constexpr int kAcc = 1, kRows = 4, kPanels = 1;
  static constexpr bool kUnsigned = false;
  struct Acc {
    int32_t v[kPanel];
  };
  using X = const int8_t*;
  using W = const int8_t*;
  static Acc zero() { return {}; }
  static W load(const int8_t* p) { return p; }
  static X bcast(const uint8_t* p) { return reinterpret_cast<const int8_t*>(p); }
  static Acc dot(Acc acc, X x, W w, int) {
    for (int64_t l = 0; l < kPanel; ++l)
      for (int t = 0; t < 4; ++t) acc.v[l] += int32_t{x[t]} * int32_t{w[4 * l + t]};
    return acc;
  }
  static void finish(const Acc* acc, int32_t* out) { std::memcpy(out, acc[0].v, sizeof(acc[0].v)); }
};

// The paths this build compiled, best first.
template <class... D>
struct PathList {};
#if defined(PAGEDLLM_VEC_AVX512) && defined(__AVX512VNNI__)
using Paths = PathList<Vnni512, Maddubs512>;
#elif defined(PAGEDLLM_VEC_AVX512)
using Paths = PathList<Maddubs512>;
#elif defined(PAGEDLLM_VEC_AVX2) && defined(__AVXVNNI__)
using Paths = PathList<Vnni256, Maddubs256>;
#elif defined(PAGEDLLM_VEC_AVX2)
using Paths = PathList<Maddubs256>;
#elif defined(PAGEDLLM_VEC_NEON) && defined(__ARM_FEATURE_DOTPROD)
using Paths = PathList<Dotprod, Mull>;
#elif defined(PAGEDLLM_VEC_NEON)
using Paths = PathList<Mull>;
#else
using Paths = PathList<Scalar>;
#endif

// MR rows at m0 x NP panels at p0: accumulate over all k4 steps, then y = (acc - comp) * sx * sw + b.
template <class D, int MR, int NP>
void tile(const Problem& pr, int64_t m0, int64_t p0) {
  // Accumulator a of panel j is acc[i][j * kAcc + a]; the array's address is never taken, so
  // the compiler keeps it in registers.
  constexpr int kA = D::kAcc;
  typename D::Acc acc[MR][NP * kA];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 32
    for (int j = 0; j < NP * kA; ++j) acc[i][j] = D::zero();
  const int8_t* w = pr.w + p0 * pr.k4 * kStep;
  const uint8_t* x = pr.xq + m0 * 4 * pr.k4;
  for (int64_t s = 0; s < pr.k4; ++s) {
    typename D::W wv[NP];
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) wv[j] = D::load(w + (j * pr.k4 + s) * kStep);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const typename D::X xv = D::bcast(x + (i * pr.k4 + s) * 4);
#pragma GCC unroll 32
      for (int j = 0; j < NP * kA; ++j) acc[i][j] = D::dot(acc[i][j], xv, wv[j / kA], j % kA);
    }
  }
  // Out of registers with constant indices only (a runtime index would put acc in memory).
  alignas(64) int32_t sums[MR][NP][kPanel];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      typename D::Acc panel[kA];
#pragma GCC unroll 8
      for (int a = 0; a < kA; ++a) panel[a] = acc[i][j * kA + a];
      D::finish(panel, sums[i][j]);
    }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NP; ++j) {
      const int64_t m = m0 + i, n0 = (p0 + j) * kPanel;
      float* y = pr.y + m * pr.n + n0;
      for (int64_t l = 0; l < kPanel; ++l) {
        const int32_t exact = D::kUnsigned ? sums[i][j][l] - pr.comp[n0 + l] : sums[i][j][l];
        y[l] = static_cast<float>(exact) * (pr.xs[m] * pr.ws[n0 + l]) + (pr.bias ? pr.bias[n0 + l] : 0.f);
      }
    }
}

// Row x [k] -> q [4 * k4] (zero-padded), its scale: sx = amax / 127 (1 for an all-zero row, whose
// q is 0), q = nearbyint(x * (127 / amax)), stored + 128 for the unsigned paths.
void quantize_row(const float* x, int64_t k, int64_t padded, bool to_unsigned, uint8_t* q, float* scale) {
  using namespace pagedllm_vec;
  Vec vmax = zero();
  int64_t i = 0;
  for (; i + kWidth <= k; i += kWidth) {
    const Vec v = load(x + i);
    vmax = max(vmax, max(v, zero() - v));
  }
  alignas(64) float lanes[kWidth];
  store(lanes, vmax);
  float amax = 0.f;
  for (int l = 0; l < kWidth; ++l) amax = std::max(amax, lanes[l]);
  for (; i < k; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  *scale = amax > 0.f ? amax / 127.f : 1.f;
  const int32_t offset = to_unsigned ? 128 : 0;
  int64_t j = 0;
#if defined(PAGEDLLM_VEC_AVX512)
  // cvtps rounds half to even in the default rounding mode, as nearbyint does below.
  const __m512 vinv = _mm512_set1_ps(inv);
  for (; j + 16 <= k; j += 16) {
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + j), vinv));
    v = _mm512_min_epi32(_mm512_max_epi32(v, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j),
                     _mm512_cvtepi32_epi8(_mm512_add_epi32(v, _mm512_set1_epi32(offset))));
  }
#endif
  for (; j < k; ++j) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(x[j] * inv));
    q[j] = static_cast<uint8_t>(std::clamp(v, -127, 127) + offset);
  }
  for (; j < padded; ++j) q[j] = static_cast<uint8_t>(offset);
}

// One thread's panels [p0, p1) for all rows, in blocks of rows that stay in L2. The thread
// quantizes each block itself into its own buffer: one parallel region per call, no barrier
// between quantizing and multiplying; threads that share rows quantize them again, which costs
// (threads / N) of the multiply-adds. Within a block a group of D::kPanels panels is the outer
// loop (its weights come from memory once per block).
template <class D>
void run_panels(const Problem& pr, int64_t m, int64_t p0, int64_t p1) {
  const int64_t padded = 4 * pr.k4;
  const int64_t block = std::max<int64_t>(D::kRows, kXBlockBytes / padded / D::kRows * D::kRows);
  thread_local std::vector<uint8_t> q;
  thread_local std::vector<float> scales;
  q.resize(std::min(m, block) * padded);
  scales.resize(std::min(m, block));
  for (int64_t mb = 0; mb < m; mb += block) {
    const int64_t rows = std::min(m - mb, block);
    for (int64_t r = 0; r < rows; ++r)
      quantize_row(pr.x + (mb + r) * pr.ldx, pr.k, padded, D::kUnsigned, q.data() + r * padded, scales.data() + r);
    Problem blk = pr;  // the block's rows from 0
    blk.xq = q.data();
    blk.xs = scales.data();
    blk.y = pr.y + mb * pr.n;
    for (int64_t p = p0; p < p1; p += D::kPanels) {
      const int64_t np = std::min<int64_t>(D::kPanels, p1 - p);
      for (int64_t m0 = 0; m0 < rows; m0 += D::kRows)
        pagedllm_vec::dispatch<D::kRows>(rows - m0, [&](auto tr) {
          pagedllm_vec::dispatch<D::kPanels>(
              np, [&](auto tp) { tile<D, decltype(tr)::value, decltype(tp)::value>(blk, m0, p); });
        });
    }
  }
}

template <class D>
void run_path(const at::Tensor& x2, const at::Tensor& packed, const float* ws, const int32_t* comp, const float* bias,
              at::Tensor& y) {
  const int64_t m = x2.size(0), k = x2.size(1), panels = packed.size(0), k4 = packed.size(1);
  const Problem pr{x2.data_ptr<float>(), x2.stride(0), k, nullptr, nullptr, packed.data_ptr<int8_t>(), ws, comp,
                   bias, y.data_ptr<float>(), panels * kPanel, k4};
  const int64_t grain = std::max<int64_t>(1, kMinThreadMacs / (m * 4 * k4 * kPanel * D::kPanels));
  const int64_t groups = (panels + D::kPanels - 1) / D::kPanels;
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    run_panels<D>(pr, m, g0 * D::kPanels, std::min(panels, g1 * D::kPanels));
  });
}

// ---- AMX (Intel AMX-INT8: Sapphire Rapids and later) ----
// tdpbusd multiplies a tile of 16 rows x 64 unsigned activation bytes by a tile of 16 k4 rows x 16
// outputs x 4 signed weight bytes into 16 x 16 int32 sums: 16 k4 steps of a panel are one such B
// tile as packed (rows of 64 bytes, stride 64), and the activations are the vnni512 path's u = q + 128
// with comp subtracted after, so the sums are the same exact int32 as every other path's. The
// vnni512 tile does 6 x 4 x 16 multiply-adds of 4 bytes per k4 step; four tdpbusd do 32 x 32 x 16
// (8x the vnni512 rate per core, by Intel's figures). Used from kAmxMinRows rows (prefill and big decode
// batches); below, the vnni512 tile (the AMX tiles' 16 rows would be mostly padding).
#if defined(PAGEDLLM_VEC_AVX512) && defined(__AVX512VNNI__) && defined(__linux__) && defined(__x86_64__) && \
    (defined(__clang__) || __GNUC__ >= 11)
#define PAGEDLLM_AMX 1
#endif

#if defined(PAGEDLLM_AMX)
constexpr int64_t kAmxMinRows = 16;
constexpr int64_t kTileRows = 16;  // rows of every tile (the A tiles' rows, the B tiles' k4 steps)
constexpr int64_t kTileBytes = 64;  // bytes of every tile row

// The CPU has AMX-TILE and AMX-INT8 (CPUID leaf 7: EDX bits 24, 25), Linux lets this process use
// the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: once, for every thread)
// and PAGEDLLM_AMX is not 0 (cpu_info.amx_int8 says the same to Python).
bool amx_usable() {
  static const bool usable = [] {
    const char* env = std::getenv("PAGEDLLM_AMX");
    if (env != nullptr && std::string(env) == "0") return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1)) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Panels [p0, p1) for all rows: per pair of panels, per 32 rows, C tiles 0-3 (rows 0-15 / 16-31 x
// panel 0 / 1) sum over K in chunks of 16 k4 steps: A tiles 4, 5 (the two row halves), B tiles 6, 7
// (the two panels). xq holds mpad (a multiple of 32) rows of lda (a multiple of 64) bytes, zero past
// each row's 4 * k4; a K that is not a multiple of 64 takes its last B tile from a zeroed copy
// (reading on from the packed weight would run past the tensor's end).
template <bool kTwoPanels>
__attribute__((target("amx-tile,amx-int8"))) void amx_pair(const Problem& pr, int64_t mpad, int64_t lda,
                                                          int64_t p, int64_t m, int8_t (*tail)[kTileRows * kTileBytes]) {
  const int64_t full = pr.k4 / kTileRows, chunks = (pr.k4 + kTileRows - 1) / kTileRows;
  const int8_t* w0 = pr.w + p * pr.k4 * kStep;
  const int8_t* w1 = w0 + pr.k4 * kStep;
  alignas(64) int32_t sums[kTileRows * kPanel];
  for (int64_t r0 = 0; r0 < mpad; r0 += 2 * kTileRows) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (kTwoPanels) {
      _tile_zero(2);
      _tile_zero(3);
    }
    const uint8_t* a = pr.xq + r0 * lda;
    for (int64_t ch = 0; ch < chunks; ++ch) {
      _tile_loadd(4, a + ch * kTileBytes, lda);
      _tile_loadd(5, a + kTileRows * lda + ch * kTileBytes, lda);
      _tile_loadd(6, ch < full ? w0 + ch * kTileRows * kStep : tail[0], kTileBytes);
      _tile_dpbusd(0, 4, 6);
      _tile_dpbusd(1, 5, 6);
      if constexpr (kTwoPanels) {
        _tile_loadd(7, ch < full ? w1 + ch * kTileRows * kStep : tail[1], kTileBytes);
        _tile_dpbusd(2, 4, 7);
        _tile_dpbusd(3, 5, 7);
      }
    }
    for (int t = 0; t < (kTwoPanels ? 4 : 2); ++t) {
      switch (t) {  // tile numbers are immediates
        case 0: _tile_stored(0, sums, kPanel * 4); break;
        case 1: _tile_stored(1, sums, kPanel * 4); break;
        case 2: _tile_stored(2, sums, kPanel * 4); break;
        default: _tile_stored(3, sums, kPanel * 4); break;
      }
      // y = (sum - comp) * (sx * sw) + b, a panel's 16 outputs per vector.
      const int64_t first = r0 + (t % 2) * kTileRows, n0 = (p + t / 2) * kPanel;
      const __m512i comp = _mm512_loadu_si512(pr.comp + n0);
      const __m512 ws = _mm512_loadu_ps(pr.ws + n0);
      const __m512 bias = pr.bias ? _mm512_loadu_ps(pr.bias + n0) : _mm512_setzero_ps();
      for (int64_t i = 0; i < kTileRows && first + i < m; ++i) {
        const __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(sums + i * kPanel), comp));
        const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(pr.xs[first + i]), ws);
        _mm512_storeu_ps(pr.y + (first + i) * pr.n + n0, _mm512_fmadd_ps(exact, scale, bias));
      }
    }
  }
}

__attribute__((target("amx-tile,amx-int8"))) void amx_panels(const Problem& pr, int64_t m, int64_t mpad, int64_t lda,
                                                            int64_t p0, int64_t p1) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTileRows;
    config.colsb[t] = kTileBytes;
  }
  _tile_loadconfig(&config);
  alignas(64) int8_t tail[2][kTileRows * kTileBytes] = {};
  const int64_t rest = pr.k4 % kTileRows, full = pr.k4 / kTileRows;
  for (int64_t p = p0; p < p1; p += 2) {
    const bool two = p + 1 < p1;
    for (int j = 0; j < (two ? 2 : 1) && rest; ++j)
      std::memcpy(tail[j], pr.w + ((p + j) * pr.k4 + full * kTileRows) * kStep, rest * kStep);
    if (two)
      amx_pair<true>(pr, mpad, lda, p, m, tail);
    else
      amx_pair<false>(pr, mpad, lda, p, m, tail);
  }
  _tile_release();
}

// The rows quantized once (threads split them), then threads split pairs of panels.
void run_amx(const at::Tensor& x2, const at::Tensor& packed, const float* ws, const int32_t* comp, const float* bias,
             at::Tensor& y) {
  const int64_t m = x2.size(0), k = x2.size(1), panels = packed.size(0), k4 = packed.size(1);
  const int64_t lda = (4 * k4 + kTileBytes - 1) / kTileBytes * kTileBytes;
  const int64_t mpad = (m + 2 * kTileRows - 1) / (2 * kTileRows) * (2 * kTileRows);
  std::vector<uint8_t> xq(mpad * lda, 0);
  std::vector<float> xs(m);
  const float* x = x2.data_ptr<float>();
  const int64_t ldx = x2.stride(0);
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row(x + r * ldx, k, 4 * k4, true, xq.data() + r * lda, xs.data() + r);
  });
  Problem pr{x, ldx, k, xq.data(), xs.data(), packed.data_ptr<int8_t>(), ws, comp, bias, y.data_ptr<float>(),
             panels * kPanel, k4};
  const int64_t grain = std::max<int64_t>(1, kMinThreadMacs / (m * 4 * k4 * kPanel * 2));
  at::parallel_for(0, (panels + 1) / 2, grain, [&](int64_t g0, int64_t g1) {
    amx_panels(pr, m, mpad, lda, 2 * g0, std::min(panels, 2 * g1));
  });
}
#else
bool amx_usable() { return false; }
#endif

template <class... D>
std::vector<std::string> path_names(PathList<D...>) {
  return {D::kName...};
}

// The paths, best first: "amx" where the CPU and the OS allow it (from kAmxMinRows rows; fewer take
// the next path), then the build's compiled Paths.
std::vector<std::string> w8a8_paths() {
  std::vector<std::string> names = path_names(Paths{});
  if (amx_usable()) names.insert(names.begin(), "amx");
  return names;
}

template <class D, class... Rest, class F>
void with_path(int64_t path, PathList<D, Rest...>, F&& f) {
  if (path == 0) return f(D{});
  if constexpr (sizeof...(Rest) > 0) return with_path(path - 1, PathList<Rest...>{}, f);
}

const float* float_vector(const std::optional<at::Tensor>& t, int64_t n, const char* what) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->is_contiguous() && t->numel() == n && t->scalar_type() == at::kFloat,
              what, " must be a contiguous float32 tensor of ", n, " elements");
  return t->data_ptr<float>();
}

}  // namespace

// x: [..., K] fp32; packed: [N / 16, ceil(K / 4), 16, 4] int8; w_scale [N] fp32; w_comp [N]
// int32 (128 * sum_k w); bias [N] or None; path: an index into w8a8_paths() -> [..., N] fp32.
at::Tensor linear_w8a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale,
                       const at::Tensor& w_comp, const std::optional<at::Tensor>& bias, int64_t path) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == kPanel &&
                  packed.size(3) == 4 && packed.is_contiguous(),
              "packed weight must be a contiguous int8 [N/16, ceil(K/4), 16, 4] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "x must be a float32 tensor [..., K]");
  const int64_t k = x.size(-1), n = packed.size(0) * kPanel;
  TORCH_CHECK((k + 3) / 4 == packed.size(1), "x has ", k, " features, the weight ", 4 * packed.size(1), " (padded)");
  TORCH_CHECK(k <= kMaxK, "w8a8 takes at most ", kMaxK, " input features, got ", k);
  TORCH_CHECK(w_comp.scalar_type() == at::kInt && w_comp.numel() == n && w_comp.is_contiguous(),
              "w_comp must be a contiguous int32 tensor of ", n, " elements");
  const float* ws = float_vector(w_scale, n, "w_scale");
  TORCH_CHECK(ws != nullptr, "w_scale is required");
  const int64_t count = static_cast<int64_t>(w8a8_paths().size());
  TORCH_CHECK(path >= 0 && path < count, "path must be in [0, ", count, ") for this build, got ", path);
  at::Tensor x2 = x.reshape({-1, k});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor y = at::empty(out_shape, x.options());
  if (x2.size(0) == 0) return y;
  const float* b = float_vector(bias, n, "bias");
  if (amx_usable()) {
#if defined(PAGEDLLM_AMX)
    if (path == 0 && x2.size(0) >= kAmxMinRows) {
      run_amx(x2, packed, ws, w_comp.data_ptr<int32_t>(), b, y);
      return y;
    }
#endif
    path = std::max<int64_t>(0, path - 1);  // the amx path's few rows run on the next path
  }
  with_path(path, Paths{}, [&](auto d) {
    run_path<decltype(d)>(x2, packed, ws, w_comp.data_ptr<int32_t>(), b, y);
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_OPS, m) {
  m.def("linear_w8a8(Tensor x, Tensor packed, Tensor w_scale, Tensor w_comp, Tensor? bias, int path=0) -> Tensor");
  m.def("w8a8_paths() -> str[]", &w8a8_paths);  // no tensor argument: one kernel for every key
}

TORCH_LIBRARY_IMPL(PAGEDLLM_OPS, CPU, m) {
  m.impl("linear_w8a8", &linear_w8a8);
}
