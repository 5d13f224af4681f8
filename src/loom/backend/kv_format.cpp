// The KV-cache storage formats' names, sizes and reading side (backend/kv_format.h states the
// formats and the byte layout; writing them is infer/kv_quant.cpp).
#include "loom/backend/kv_format.h"

#include <algorithm>
#include <cstring>

#include "loom/core/dtype.h"
#include "loom/core/error.h"

namespace loom {

namespace {

constexpr std::string_view kFormatNames[] = {"fp32", "bf16", "int8", "int4", "int2"};
static_assert(sizeof(kFormatNames) / sizeof(kFormatNames[0]) == KV_FORMAT_COUNT);
constexpr int kFormatBits[] = {32, 16, 8, 4, 2};
static_assert(sizeof(kFormatBits) / sizeof(kFormatBits[0]) == KV_FORMAT_COUNT);
constexpr std::string_view kAxisNames[] = {"token", "channel"};
static_assert(sizeof(kAxisNames) / sizeof(kAxisNames[0]) == KV_AXIS_COUNT);

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// fp16 bits -> fp32 with core/dtype.h's exact f16_to_f32 (every half is a float).
KvGroupParams load_params(const uint8_t* params) {
  return {f16_to_f32(load_u16(params)), f16_to_f32(load_u16(params + 2))};
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

template <int BITS>
void dequantize_rows_per_channel(const KvQuantSpec& spec, const uint8_t* tile, int64_t begin, int64_t end, float* out) {
  constexpr int64_t kChunk = 64;  // channels whose (scale, min) are decoded at once
  const int64_t W = spec.width, cb = kv_code_bytes(spec);
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

int64_t kv_code_bytes(const KvQuantSpec& spec) { return (spec.width * kv_format_bits(spec.format) + 7) / 8; }

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
  return params + kv_code_bytes(spec);
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

