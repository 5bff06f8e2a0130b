// AVX-512 helpers the CPU kernels share (only when the build targets AVX-512).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace pagedllm_vec {

// e^x for 16 floats: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial
// (truncation below 1e-8 relative), then scaled by 2^n. std::exp does not vectorise without
// -ffast-math. Inputs are clamped to the range where e^x is a normal float, so a huge |x| gives
// 0 or a FLT_MAX-scale value instead of NaN.
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 split in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  const float coef[] = {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};
  for (float c : coef) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

}  // namespace pagedllm_vec
#endif
