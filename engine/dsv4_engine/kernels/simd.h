// What cpu.cpp and attention.cpp share for their AVX2+FMA loops: the target attribute (the files are
// built for baseline x86-64, and each AVX2 function is chosen at run time), the run-time check, and
// the horizontal sum.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#define DSV4_AVX2 __attribute__((target("avx2,fma")))

namespace dsv4 {

inline bool has_avx2_fma() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

DSV4_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace dsv4
#endif
