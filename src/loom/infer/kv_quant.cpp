// KIVI-style asymmetric min/max quantization of KV rows (Liu et al. 2024); the formulas and the
// byte layout are stated in backend/kv_format.h. fp16 scales and mins go through
// precision/formats.h's exact fp16 codec, rounded outwards (min down, scale up) so every value
// stays inside its group's grid and the reconstruction error is at most half a step.
#include "loom/infer/kv_quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "loom/core/dtype.h"
#include "loom/core/error.h"
#include "loom/precision/formats.h"

namespace loom {

namespace {

// fp16 codes of the neighbours of a finite value towards -inf and +inf (-0 and +0 both step to
// the smallest subnormal of the right sign; stepping past the largest finite value gives inf).
uint32_t fp16_next_down(uint32_t code) { return code == 0x0000u ? 0x8001u : (code & 0x8000u) ? code + 1 : code - 1; }
uint32_t fp16_next_up(uint32_t code) { return code == 0x8000u ? 0x0001u : (code & 0x8000u) ? code - 1 : code + 1; }

// The largest fp16 <= x and the smallest fp16 >= x (inf when x is beyond fp16's range).
uint32_t fp16_floor(float x) {
  const uint32_t code = encode(FMT_FP16, x);
  return decode(FMT_FP16, code) > x ? fp16_next_down(code) : code;
}
uint32_t fp16_ceil(float x) {
  const uint32_t code = encode(FMT_FP16, x);
  return decode(FMT_FP16, code) < x ? fp16_next_up(code) : code;
}

void store_u16(uint8_t* p, uint32_t v) {
  const uint16_t bits = static_cast<uint16_t>(v);
  std::memcpy(p, &bits, sizeof bits);
}

// One group's fitted grid: x' = q * scale + min, q in [0, levels].
struct Grid {
  float scale, min;
  uint32_t levels;
};

// Fits (scale, min) to values in [lo, hi] and stores them as fp16 at `params` (scale, min).
Grid fit_group(float lo, float hi, bool finite, uint32_t levels, uint8_t* params) {
  LOOM_CHECK(finite, "kv quantization: a group holds a non-finite value (inf or NaN)");
  const uint32_t min_code = fp16_floor(lo);
  const float min = decode(FMT_FP16, min_code);
  const uint32_t scale_code = fp16_ceil((hi - min) / static_cast<float>(levels));
  const float scale = decode(FMT_FP16, scale_code);
  LOOM_CHECK(std::isfinite(min) && std::isfinite(scale), "kv quantization: values in [", lo, ", ", hi,
             "] do not fit an fp16 scale and min (expected |x| < 65504)");
  store_u16(params, scale_code);
  store_u16(params + 2, min_code);
  return {scale, min, levels};
}

uint32_t code_of(float x, const Grid& g) {
  if (g.scale == 0.0f) return 0;
  const float q = std::floor((x - g.min) / g.scale + 0.5f);
  return static_cast<uint32_t>(std::clamp(q, 0.0f, static_cast<float>(g.levels)));
}

// Codes never straddle a byte: bits is 8, 4 or 2.
void put_code(uint8_t* codes, int64_t c, int bits, uint32_t q) {
  const int64_t bit = c * bits;
  codes[bit >> 3] = static_cast<uint8_t>(codes[bit >> 3] | (q << (bit & 7)));
}

// One row (width) -> its per-token slot: [groups] (scale, min), then codes.
void quantize_row_per_token(const KvQuantSpec& spec, const float* x, uint8_t* row) {
  const int bits = kv_format_bits(spec.format);
  const uint32_t levels = (1u << bits) - 1u;
  const int64_t G = spec.group_size(), groups = spec.width / G;
  uint8_t* codes = row + 4 * groups;
  std::memset(codes, 0, static_cast<size_t>(kv_code_bytes(spec)));
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * G;
    float lo = xg[0], hi = xg[0];
    bool finite = true;
    for (int64_t c = 0; c < G; ++c) {
      finite = finite && std::isfinite(xg[c]);
      lo = std::min(lo, xg[c]);
      hi = std::max(hi, xg[c]);
    }
    const Grid grid = fit_group(lo, hi, finite, levels, row + 4 * g);
    for (int64_t c = 0; c < G; ++c) put_code(codes, g * G + c, bits, code_of(xg[c], grid));
  }
}

// A (tokens, width) tile -> [width] (scale, min), then tokens rows of codes.
void quantize_tile_per_channel(const KvQuantSpec& spec, const float* x, int64_t tokens, uint8_t* tile) {
  const int bits = kv_format_bits(spec.format);
  const uint32_t levels = (1u << bits) - 1u;
  const int64_t W = spec.width, cb = kv_code_bytes(spec);
  uint8_t* codes = tile + kv_tile_param_bytes(spec);
  std::memset(codes, 0, static_cast<size_t>(tokens * cb));
  for (int64_t c = 0; c < W; ++c) {
    float lo = x[c], hi = x[c];
    bool finite = true;
    for (int64_t t = 0; t < tokens; ++t) {
      const float v = x[t * W + c];
      finite = finite && std::isfinite(v);
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    const Grid grid = fit_group(lo, hi, finite, levels, tile + 4 * c);
    for (int64_t t = 0; t < tokens; ++t) put_code(codes + t * cb, c, bits, code_of(x[t * W + c], grid));
  }
}

}  // namespace

void kv_quantize_tile(const KvQuantSpec& spec, const float* x, int64_t tokens, uint8_t* out) {
  const int64_t W = spec.width, row_bytes = kv_row_bytes(spec);
  switch (spec.format) {
    case KV_FP32:
      std::memcpy(out, x, static_cast<size_t>(tokens * W) * sizeof(float));
      return;
    case KV_BF16:
      for (int64_t i = 0; i < tokens * W; ++i) store_u16(out + 2 * i, f32_to_bf16(x[i]).bits);
      return;
    default:
      if (spec.axis == KV_PER_CHANNEL) {
        if (tokens > 0) quantize_tile_per_channel(spec, x, tokens, out);
        return;
      }
      for (int64_t t = 0; t < tokens; ++t) quantize_row_per_token(spec, x + t * W, out + t * row_bytes);
  }
}

}  // namespace loom
