// The CUDA simulator's cuda_bf16.h: __nv_bfloat16 and its conversions, rounding as the hardware's
// cvt instructions do (PTX ISA, "cvt"): .rn is round to nearest, ties to even; .rz truncates;
// overflow rounds to infinity under .rn; a NaN becomes the canonical NaN 0x7fff. Widening is exact.
#pragma once
#include <cstdint>
#include <cstring>

#include "loom/core/dtype.h"

struct __nv_bfloat16 {
  uint16_t __x;
};
using nv_bfloat16 = __nv_bfloat16;

// Loom's own bf16 (core/dtype.h) rounds the same way; only the NaN differs (it keeps the payload).
inline float __bfloat162float(__nv_bfloat16 h) { return loom::bf16_to_f32(loom::bf16{h.__x}); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  return __nv_bfloat16{f != f ? static_cast<uint16_t>(0x7fff) : loom::f32_to_bf16(f).bits};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{0x7fff};
  return __nv_bfloat16{static_cast<uint16_t>(u >> 16)};
}
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short x) { return __nv_bfloat16{x}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
