// The CUDA simulator's cuda_fp16.h: __half and its conversions, rounding as the hardware's cvt
// instructions do (PTX ISA, "cvt"): .rn rounds to nearest, ties to even, through the subnormals;
// .rz truncates; overflow gives infinity under .rn and the largest finite value under .rz; a NaN
// becomes the canonical NaN 0x7fff. Widening to float is exact.
#pragma once
#include <cstdint>
#include <cstring>

#include "loom/core/dtype.h"

struct __half {
  uint16_t __x;
};

inline float __half2float(__half h) { return loom::f16_to_f32(h.__x); }  // exact (core/dtype.h)

namespace loom::sim::detail {
// float -> binary16: round_up(bits dropped, keep lsb) decides; toward_zero for .rz.
inline uint16_t float_to_half(float f, bool toward_zero) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fff;
  if (a >= 0x477ff000u) {  // at or above 65520 (half-way past the largest finite, 65504) or inf
    if (toward_zero) return a == 0x7f800000u ? static_cast<uint16_t>(sign | 0x7c00u) : static_cast<uint16_t>(sign | 0x7bffu);
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  const int exponent = static_cast<int>(a >> 23) - 127;
  if (exponent < -25) return sign;  // below half of the smallest subnormal (2^-24): zero
  uint32_t mantissa = (a & 0x7fffffu) | 0x800000u;  // 24 bits with the hidden one
  // Normal halves keep 10 fraction bits (shift 13); subnormals (exponent < -14) shift more.
  const int shift = exponent < -14 ? 13 + (-14 - exponent) : 13;
  const uint32_t kept = mantissa >> shift, dropped = mantissa & ((1u << shift) - 1), half = 1u << (shift - 1);
  uint32_t result = exponent < -14 ? kept : ((static_cast<uint32_t>(exponent + 15) << 10) | (kept & 0x3ffu));
  if (!toward_zero && (dropped > half || (dropped == half && (kept & 1u)))) ++result;  // may carry into the exponent
  return static_cast<uint16_t>(sign | result);
}
}  // namespace loom::sim::detail

inline __half __float2half_rn(float f) { return __half{loom::sim::detail::float_to_half(f, false)}; }
inline __half __float2half(float f) { return __float2half_rn(f); }
inline __half __float2half_rz(float f) { return __half{loom::sim::detail::float_to_half(f, true)}; }
inline __half __ushort_as_half(unsigned short x) { return __half{x}; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
