// Exact codecs for the low-precision number formats (docs/precision.md): IEEE fp16, OCP FP8
// E4M3 ("fn": no infinity, NaN = S.1111.111, max 448) and E5M2 (IEEE-style inf/NaN, max
// 57344), E2M1 (FP4: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}), the E8M0 power-of-two scale, and the block
// formats built on them: MXFP4 (OCP MX v1.0: 32 E2M1 elements share an E8M0 scale) and NVFP4
// (16 E2M1 elements share an E4M3 scale, times an fp32 tensor scale). bf16 lives in core/dtype.
//
// Encoding rounds to nearest, ties to even, or stochastically (round up with probability equal
// to the distance from the lower neighbour, from a caller-supplied 32-bit random number, so a
// Philox stream makes it reproducible). Out of range: saturating encodes clamp to ±max;
// non-saturating ones give ±inf where the format has it, NaN otherwise (E4M3). A value is out
// of range when it rounds above max (so a tie at max + ulp/2 rounds to max, to even). E2M1
// always saturates (it has no NaN). NaN input gives NaN (E2M1: 0).
#pragma once
#include <cstdint>
#include <span>

namespace loom {

enum MiniFormat : uint8_t { FMT_FP16, FMT_E4M3, FMT_E5M2, FMT_E2M1, FMT_COUNT };

struct MiniFormatInfo {
  const char* name;
  int exp_bits, man_bits, bias;
  bool has_inf;     // IEEE-style: all-ones exponent is inf/NaN
  bool has_nan;     // E4M3: only S.1111.111; E2M1: none
  double max;       // largest finite value
  int bits;         // code width
};
const MiniFormatInfo& format_info(MiniFormat f);

enum Rounding : uint8_t { ROUND_NEAREST_EVEN, ROUND_STOCHASTIC };

// x -> code. `random` is used only by ROUND_STOCHASTIC (uniform 32-bit).
uint32_t encode(MiniFormat f, float x, bool saturate = true, Rounding rounding = ROUND_NEAREST_EVEN, uint32_t random = 0);
float decode(MiniFormat f, uint32_t code);

// E8M0: code e means 2^(e - 127), e in [0, 254]; 0xFF is NaN; no zero, no sign.
// Encoding takes 2^floor(log2 x), clamped to [2^-127, 2^127]; x <= 0, inf or NaN gives 0xFF.
uint8_t encode_e8m0(float x);
float decode_e8m0(uint8_t code);

// MXFP4 (OCP MX v1.0): per block of 32, X = 2^(floor(log2 amax) - 2) (2 = E2M1's emax), stored
// as E8M0, and P_i = saturating RNE E2M1 of V_i / X. An all-zero block gets X = 2^-127.
// codes: one E2M1 code per element (low 4 bits of a byte); scales: one E8M0 per block.
constexpr int kMxBlock = 32;
void mxfp4_quantize(std::span<const float> x, std::span<uint8_t> codes, std::span<uint8_t> scales);
void mxfp4_dequantize(std::span<const uint8_t> codes, std::span<const uint8_t> scales, std::span<float> out);

// NVFP4 (NVIDIA TransformerEngine): s_global = amax(tensor) / (448 * 6) in fp32 (1 when the
// tensor is zero); per block of 16, s_block = (amax(block) / 6) / s_global stored as E4M3
// (saturating RNE); element codes E2M1 of x / (s_block * s_global). Stochastic rounding of the
// elements when `random` is given (one 32-bit value per element).
constexpr int kNvBlock = 16;
float nvfp4_quantize(std::span<const float> x, std::span<uint8_t> codes, std::span<uint8_t> scales,
                     std::span<const uint32_t> random = {});  // returns s_global
void nvfp4_dequantize(std::span<const uint8_t> codes, std::span<const uint8_t> scales, float global_scale, std::span<float> out);

}  // namespace loom
