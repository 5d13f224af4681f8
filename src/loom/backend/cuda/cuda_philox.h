// Philox4x32-10 in device code (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as
// 1, 2, 3", SC'11): the rounds, multipliers and key schedule of core/philox.h, whose function is
// defined in a .cpp and so host-only. One copy for every kernel that draws the CPU's words:
// stochastic rounding and dropout (cuda_quant.cu), QSGD's levels (cuda_compress.cu).
#pragma once
#include <cstdint>

#include "loom/backend/cuda/cuda_device.h"

namespace loom::cuda {

struct Philox4 {
  uint32_t v[4];
};

// The four words of counter (c0, c1, c2, c3) under key (k0, k1).
__device__ __forceinline__ Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                                 uint32_t k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  return Philox4{{c0, c1, c2, c3}};
}

}  // namespace loom::cuda
