// Element types and their conversions. bf16 is the upper half of an IEEE fp32; conversion
// from fp32 rounds to nearest, ties to even, and keeps NaN a (quiet) NaN.
#pragma once
#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace loom {

enum DType : uint8_t {
  DTYPE_F32,
  DTYPE_BF16,
  DTYPE_F64,  // reference checks (finite differences) only
  DTYPE_I32,  // token ids
  DTYPE_U8,   // packed codes (QLoRA's NF4 weights and their 8-bit scales, precision/nf4.h)
  DTYPE_F16,  // IEEE binary16: integer weights' compact group scales only (precision/int_quant.h)
  DTYPE_COUNT
};

size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);  // "f32", "bf16", ...

struct bf16 {
  uint16_t bits;
};

// fp32 -> bf16 with round-to-nearest-even.
inline bf16 f32_to_bf16(float value) {
  uint32_t u = std::bit_cast<uint32_t>(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

inline float bf16_to_f32(bf16 value) { return std::bit_cast<float>(static_cast<uint32_t>(value.bits) << 16); }

// IEEE 754 binary16 -> fp32, exact (every half is a float): normals re-biased (15 -> 127),
// subnormals man x 2^-24, infinities and NaNs kept (the NaN payload shifted along).
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;  // exact: mantissa < 2^10
    return sign ? -magnitude : magnitude;
  }
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

}  // namespace loom
