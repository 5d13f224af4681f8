// AVX2 helpers shared by the CPU weight kernels (cpu_int_linear.cpp, cpu_bf16_linear.cpp).
#pragma once
#include <immintrin.h>

namespace loom::cpu {

// The sum of v's 8 lanes (a fixed order: halves, then pairs, then the last two).
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

}  // namespace loom::cpu
