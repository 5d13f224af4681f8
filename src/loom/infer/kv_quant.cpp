// KIVI-style asymmetric min/max quantization of KV rows (Liu et al. 2024); the formulas and the
// byte layout are stated in kv_quant.h. fp16 scales and mins go through precision/formats.h's
// exact fp16 codec, rounded outwards (min down, scale up) so every value stays inside its
// group's grid and the reconstruction error is at most half a step.
#include "loom/infer/kv_quant.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "loom/core/dtype.h"
#include "loom/core/error.h"
#include "loom/precision/formats.h"

namespace loom {

namespace {

constexpr std::string_view kFormatNames[] = {"fp32", "bf16", "int8", "int4", "int2"};
static_assert(sizeof(kFormatNames) / sizeof(kFormatNames[0]) == KV_FORMAT_COUNT);
constexpr int kFormatBits[] = {32, 16, 8, 4, 2};
static_assert(sizeof(kFormatBits) / sizeof(kFormatBits[0]) == KV_FORMAT_COUNT);
constexpr std::string_view kAxisNames[] = {"token", "channel"};
static_assert(sizeof(kAxisNames) / sizeof(kAxisNames[0]) == KV_AXIS_COUNT);

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

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
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

// fp16 bits -> fp32 by bit manipulation: decode(FMT_FP16, ...) of formats.h, without its
// per-call format lookup and double arithmetic (dequantization decodes one pair per group).
// Equal to it for every code (tested).
float fp16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in fp32
    const float v = static_cast<float>(man) * 0x1p-24f;
    return sign ? -v : v;
  }
  const uint32_t bits = exp == 0x1Fu ? sign | 0x7F800000u | (man << 13)  // inf, NaN
                                     : sign | ((exp + 112u) << 23) | (man << 13);
  return std::bit_cast<float>(bits);
}

KvGroupParams load_params(const uint8_t* params) {
  return {fp16_to_f32(load_u16(params)), fp16_to_f32(load_u16(params + 2))};
}

// Codes never straddle a byte: bits is 8, 4 or 2.
void put_code(uint8_t* codes, int64_t c, int bits, uint32_t q) {
  const int64_t bit = c * bits;
  codes[bit >> 3] = static_cast<uint8_t>(codes[bit >> 3] | (q << (bit & 7)));
}

int64_t code_bytes(const KvQuantSpec& spec) { return (spec.width * kv_format_bits(spec.format) + 7) / 8; }

// One row (width) -> its per-token slot: [groups] (scale, min), then codes.
void quantize_row_per_token(const KvQuantSpec& spec, const float* x, uint8_t* row) {
  const int bits = kv_format_bits(spec.format);
  const uint32_t levels = (1u << bits) - 1u;
  const int64_t G = spec.group_size(), groups = spec.width / G;
  uint8_t* codes = row + 4 * groups;
  std::memset(codes, 0, static_cast<size_t>(code_bytes(spec)));
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

// Code c of a row with BITS-bit codes (a compile-time width, so the loops below vectorize).
template <int BITS>
float code_value(const uint8_t* codes, int64_t c) {
  constexpr int64_t per_byte = 8 / BITS;
  return static_cast<float>((static_cast<uint32_t>(codes[c / per_byte]) >> (c % per_byte * BITS)) & ((1u << BITS) - 1u));
}

template <int BITS>
void dequantize_row_per_token(const KvQuantSpec& spec, const uint8_t* row, float* out) {
  const int64_t G = spec.group_size(), groups = spec.width / G;
  const uint8_t* codes = row + 4 * groups;
  for (int64_t g = 0; g < groups; ++g) {
    const KvGroupParams p = load_params(row + 4 * g);
    for (int64_t c = g * G; c < (g + 1) * G; ++c) out[c] = code_value<BITS>(codes, c) * p.scale + p.min;
  }
}

// A (tokens, width) tile -> [width] (scale, min), then tokens rows of codes.
void quantize_tile_per_channel(const KvQuantSpec& spec, const float* x, int64_t tokens, uint8_t* tile) {
  const int bits = kv_format_bits(spec.format);
  const uint32_t levels = (1u << bits) - 1u;
  const int64_t W = spec.width, cb = code_bytes(spec);
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

template <int BITS>
void dequantize_rows_per_channel(const KvQuantSpec& spec, const uint8_t* tile, int64_t begin, int64_t end, float* out) {
  constexpr int64_t kChunk = 64;  // channels whose (scale, min) are decoded at once
  const int64_t W = spec.width, cb = code_bytes(spec);
  const uint8_t* codes = tile + kv_tile_param_bytes(spec);
  float scale[kChunk], min[kChunk];
  for (int64_t c0 = 0; c0 < W; c0 += kChunk) {
    const int64_t n = std::min(kChunk, W - c0);
    for (int64_t j = 0; j < n; ++j) {
      const KvGroupParams p = load_params(tile + 4 * (c0 + j));
      scale[j] = p.scale;
      min[j] = p.min;
    }
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* row = codes + t * cb;
      float* o = out + (t - begin) * W + c0;
      for (int64_t j = 0; j < n; ++j) o[j] = code_value<BITS>(row, c0 + j) * scale[j] + min[j];
    }
  }
}

// Rows [begin, end) of an integer tile with BITS-bit codes.
template <int BITS>
void dequantize_integer_rows(const KvQuantSpec& spec, const uint8_t* tile, int64_t begin, int64_t end, float* out) {
  if (spec.axis == KV_PER_CHANNEL) {
    dequantize_rows_per_channel<BITS>(spec, tile, begin, end, out);
    return;
  }
  const int64_t row_bytes = kv_row_bytes(spec);
  for (int64_t t = begin; t < end; ++t) dequantize_row_per_token<BITS>(spec, tile + t * row_bytes, out + (t - begin) * spec.width);
}

}  // namespace

std::string_view kv_format_name(KvFormat format) {
  LOOM_CHECK(format < KV_FORMAT_COUNT, "unknown kv format ", static_cast<int>(format));
  return kFormatNames[format];
}

KvFormat parse_kv_format(std::string_view name) {
  for (int f = 0; f < KV_FORMAT_COUNT; ++f) {
    if (kFormatNames[f] == name) return static_cast<KvFormat>(f);
  }
  throw Error(str_cat("unknown kv cache format '", name, "', expected one of: fp32, bf16, int8, int4, int2"));
}

std::string_view kv_axis_name(KvAxis axis) {
  LOOM_CHECK(axis < KV_AXIS_COUNT, "unknown kv quantization axis ", static_cast<int>(axis));
  return kAxisNames[axis];
}

KvAxis parse_kv_axis(std::string_view name) {
  for (int a = 0; a < KV_AXIS_COUNT; ++a) {
    if (kAxisNames[a] == name) return static_cast<KvAxis>(a);
  }
  throw Error(str_cat("unknown kv quantization axis '", name, "', expected one of: token, channel"));
}

int kv_format_bits(KvFormat format) {
  LOOM_CHECK(format < KV_FORMAT_COUNT, "unknown kv format ", static_cast<int>(format));
  return kFormatBits[format];
}

bool kv_format_is_integer(KvFormat format) { return format == KV_INT8 || format == KV_INT4 || format == KV_INT2; }

void KvQuantSpec::validate() const {
  LOOM_CHECK(format < KV_FORMAT_COUNT, "kv quantization: unknown format ", static_cast<int>(format));
  LOOM_CHECK(axis < KV_AXIS_COUNT, "kv quantization: unknown axis ", static_cast<int>(axis));
  LOOM_CHECK(width > 0, "kv quantization: width must be > 0, got ", width);
  LOOM_CHECK(group >= 0, "kv quantization: group must be >= 0 (0 = the whole row), got ", group);
  if (kv_format_is_integer(format) && axis == KV_PER_TOKEN) {
    LOOM_CHECK(width % group_size() == 0, "kv quantization: group ", group, " must divide the row width ", width);
  }
}

int64_t kv_row_bytes(const KvQuantSpec& spec) {
  if (!kv_format_is_integer(spec.format)) return spec.width * kv_format_bits(spec.format) / 8;
  const int64_t params = spec.axis == KV_PER_TOKEN ? 4 * (spec.width / spec.group_size()) : 0;
  return params + code_bytes(spec);
}

int64_t kv_tile_param_bytes(const KvQuantSpec& spec) { return spec.per_channel_integer() ? 4 * spec.width : 0; }

int64_t kv_tile_bytes(const KvQuantSpec& spec, int64_t tokens) {
  spec.validate();
  LOOM_CHECK(tokens >= 0, "kv quantization: tokens must be >= 0, got ", tokens);
  return tokens * kv_row_bytes(spec) + kv_tile_param_bytes(spec);
}

int64_t kv_tile_bytes(KvFormat format, KvAxis axis, int64_t tokens, int64_t width, int64_t group) {
  return kv_tile_bytes(KvQuantSpec{format, axis, width, group}, tokens);
}

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

void kv_dequantize_tile(const KvQuantSpec& spec, const uint8_t* tile, int64_t tokens, int64_t begin, int64_t end,
                        float* out) {
  LOOM_CHECK(0 <= begin && begin <= end && end <= tokens, "kv dequantization: rows [", begin, ", ", end,
             ") are not inside a tile of ", tokens, " rows");
  const int64_t W = spec.width, row_bytes = kv_row_bytes(spec);
  switch (spec.format) {
    case KV_FP32:
      std::memcpy(out, tile + begin * row_bytes, static_cast<size_t>((end - begin) * W) * sizeof(float));
      return;
    case KV_BF16:
      for (int64_t i = 0; i < (end - begin) * W; ++i) out[i] = bf16_to_f32(bf16{load_u16(tile + begin * row_bytes + 2 * i)});
      return;
    case KV_INT8:
      dequantize_integer_rows<8>(spec, tile, begin, end, out);
      return;
    case KV_INT4:
      dequantize_integer_rows<4>(spec, tile, begin, end, out);
      return;
    case KV_INT2:
      dequantize_integer_rows<2>(spec, tile, begin, end, out);
      return;
    default:
      throw Error(str_cat("kv dequantization: unknown format ", static_cast<int>(spec.format)));
  }
}

KvGroupParams kv_group_params(const KvQuantSpec& spec, const uint8_t* tile, int64_t tokens, int64_t row,
                              int64_t channel) {
  LOOM_CHECK(kv_format_is_integer(spec.format), "kv quantization: ", kv_format_name(spec.format),
             " has no (scale, min); expected int8, int4 or int2");
  LOOM_CHECK(0 <= row && row < tokens && 0 <= channel && channel < spec.width, "kv quantization: element (", row,
             ", ", channel, ") is outside a (", tokens, ", ", spec.width, ") tile");
  if (spec.axis == KV_PER_CHANNEL) return load_params(tile + 4 * channel);
  return load_params(tile + row * kv_row_bytes(spec) + 4 * (channel / spec.group_size()));
}

}  // namespace loom
