// Scalar math shared by the CPU kernels and the CUDA kernels, so both backends compute the same
// function. The float exp is a Cody-Waite range reduction x = n ln2 + r, |r| <= ln2/2, with
// exp(r) by its degree-7 Taylor polynomial (truncation error < 6e-9 relative) and 2^n assembled
// in the exponent bits. Within 2 ulp of expf for the inputs models produce, and inline so
// `#pragma omp simd` loops stay vectorized. Doubles (the reference path) use the libm functions.
#pragma once
#include <math.h>

#include <bit>
#include <cstdint>

#include "loom/core/targets.h"  // kIgnoreTarget, read by the cross-entropy kernels

#ifdef __CUDACC__
#define LOOM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LOOM_HOST_DEVICE inline
#endif

namespace loom::math {

LOOM_HOST_DEVICE float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = ::floorf(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;  // ln2 split hi + lo
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
#ifdef __CUDA_ARCH__
  return p * __int_as_float(bits);
#else
  return p * std::bit_cast<float>(bits);
#endif
}

template <typename T>
LOOM_HOST_DEVICE T exp_t(T x) {
  if constexpr (sizeof(T) == 4) return fast_exp(x);
  else return ::exp(x);
}

// tanh(u) = 1 - 2 / (exp(2u) + 1): saturates cleanly to +-1 for large |u|.
template <typename T>
LOOM_HOST_DEVICE T tanh_t(T u) {
  if constexpr (sizeof(T) == 4) return 1.0f - 2.0f / (fast_exp(2.0f * u) + 1.0f);
  else return ::tanh(u);
}

template <typename T>
LOOM_HOST_DEVICE T sigmoid_t(T x) {
  return T(1) / (T(1) + exp_t<T>(-x));
}

}  // namespace loom::math
