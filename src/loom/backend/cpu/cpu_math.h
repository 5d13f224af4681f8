// The CPU kernels' scalar math: backend/scalar_math.h's (shared with the CUDA kernels).
#pragma once
#include <cmath>
#include <cstdint>

#include "loom/backend/scalar_math.h"

namespace loom::cpu {

using math::exp_t;
using math::fast_exp;
using math::sigmoid_t;
using math::tanh_t;

// max(x[0..n)) (-inf for n = 0), vectorized: GCC keeps `m = std::max(m, x[i])` scalar even under
// `omp simd reduction(max)` (a loop-carried vmaxss, measured at 62% of the cross-entropy
// forward), so the maximum is taken in 16 independent lanes and then across them. The maximum is
// exact, so the result is the same in any order; a NaN element is skipped as std::max skips it.
template <typename T>
inline T max_of(const T* x, int64_t n) {
  constexpr int64_t L = 16;
  if (n <= 0) return -INFINITY;
  T lanes[L];
  for (int64_t l = 0; l < L; ++l) lanes[l] = x[0];
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    for (int64_t l = 0; l < L; ++l) lanes[l] = x[i + l] > lanes[l] ? x[i + l] : lanes[l];
  }
  T m = lanes[0];
  for (int64_t l = 1; l < L; ++l) m = lanes[l] > m ? lanes[l] : m;
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

}  // namespace loom::cpu
