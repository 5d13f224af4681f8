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

}  // namespace loom
