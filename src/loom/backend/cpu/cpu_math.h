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

// The chunk of an elementwise pass over a long array (AdamW, fill, sum of squares) handed to the
// threads one at a time (schedule(dynamic)): a thread that shares its core with another process
// takes fewer chunks instead of holding the others at the end of the pass, as a static split
// does. Arrays of at most one chunk run on the calling thread (no parallel region). The values
// do not depend on which thread runs a chunk.
constexpr int64_t kStreamChunk = 1 << 16;
// The forward kernels a decoding step runs on one row (norms, RoPE, activations, the input's
// int8 quantization) run on the calling thread below this many elements: a parallel region
// wakes every thread, which with passive waits (core/threads.h) cost about 77 us a region on a
// 2-core VM, and a Llama-3-8B decoding step ran about 1,000 of them (futex calls counted by
// perf), more than the work of a 4,096-element norm. Serial or split, each element's result is
// the same.
constexpr int64_t kParallelMinElements = int64_t{1} << 15;

// max(x[0..n)) (-inf for n = 0), vectorized: GCC keeps `m = std::max(m, x[i])` scalar even under
// `omp simd reduction(max)` (a loop-carried vmaxss, measured at 62% of the cross-entropy
// forward), and a 16-lane array of partial maxima stays scalar where the function is inlined
// into a larger loop (seen in the fused cross-entropy: 17% of it in vmaxss). So the lanes are
// two GCC vectors of the target's register width (vmaxps), then reduced across lanes. (A 64-byte
// vector on the AVX2 target compiled to code twice as slow as the scalar loop.)
// The maximum is exact, so the result is the same in any order; a NaN element is skipped as
// std::max skips it (the comparison x > m is false for a NaN x).
template <typename T>
inline T max_of(const T* x, int64_t n) {
  constexpr int64_t L = 32 / static_cast<int64_t>(sizeof(T));  // one AVX2 register (the build's target)
  typedef T Lanes __attribute__((vector_size(32)));
  if (n <= 0) return -INFINITY;
  int64_t i = 0;
  T m = x[0];
  if (n >= 2 * L) {
    Lanes a = x[0] - Lanes{}, b = a;  // x[0] in every lane; two registers for two loads per iteration
    for (; i + 2 * L <= n; i += 2 * L) {
      Lanes u, v;
      __builtin_memcpy(&u, x + i, sizeof(u));
      __builtin_memcpy(&v, x + i + L, sizeof(v));
      a = u > a ? u : a;
      b = v > b ? v : b;
    }
    a = b > a ? b : a;
    m = a[0];
    for (int64_t l = 1; l < L; ++l) m = a[l] > m ? a[l] : m;
  }
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// n floats rounded to bf16 (round to nearest even, NaNs kept quiet): bitwise core/dtype.h's
// f32_to_bf16, written without its branch so that the loop vectorizes (16 per instruction).
inline void round_to_bf16_bits(const float* x, uint16_t* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    __builtin_memcpy(&u, x + i, sizeof(u));
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet = (u >> 16) | 0x0040u;
    out[i] = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
  }
}

}  // namespace loom::cpu
