// Storage formats for KV-cache rows: fp32, bf16, and KIVI-style asymmetric integer quantization
// (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"): the formats,
// their byte layout and the reading side (dequantization), which backends need for decode
// attention (backend/kv_attention.h). The writing side, kv_quantize_tile, is infer/kv_quant.h
// (it rounds through precision/formats.h).
//
// Dims: a tile is (tokens, width) fp32 values, row-major: `tokens` cache positions of one layer's
// K (or V) row of `width` channels.
//
// Integer formats (b = 8, 4 or 2 bits). A group of values x gets
//     m = min(x) rounded down to fp16,   s = (max(x) - m) / (2^b - 1) rounded up to fp16,
//     q = clamp(round((x - m) / s), 0, 2^b - 1)        (q = 0 when s = 0),
//     x' = q * s + m                                   (fp32 arithmetic).
// Rounding m down and s up keeps every x of the group inside [m, m + (2^b - 1) s], so
// |x - x'| <= s / 2 for the stored s (up to fp32 rounding), even where fp16 cannot hold min(x)
// exactly. A constant group whose value is an fp16 number has s = 0 and round-trips exactly.
// Values must be finite, and m and s must be finite fp16 numbers (min(x) >= -65504 and
// (max(x) - m) / (2^b - 1) <= 65504; |x| < 65504 is enough), else the quantizer throws.
//   KV_PER_TOKEN:   each row is cut into width / group groups of `group` consecutive channels
//                   (group 0 = the whole row; group must divide width).
//   KV_PER_CHANNEL: each channel of the tile is one group spanning the tile's `tokens` rows
//                   (KIVI's key quantization: outliers live in fixed channels).
// fp32 and bf16 (round to nearest even) store each element alone; the axis does not apply.
//
// Byte layout of a tile (exact; no padding; rows of codes are padded to whole bytes only):
//   KV_FP32: (tokens, width) fp32.            KV_BF16: (tokens, width) bf16 bits.
//   integer, per token:   tokens rows of kv_row_bytes = 4 * (width / group) + ceil(width * b / 8):
//                         [group] (fp16 scale, fp16 min) pairs, then the row's codes.
//   integer, per channel: [width] (fp16 scale, fp16 min) pairs, then tokens rows of
//                         kv_row_bytes = ceil(width * b / 8) bytes of codes.
//   Codes: element c of a row sits in byte (c * b) / 8 at bit (c * b) % 8 (low bits first).
// So kv_tile_bytes = tokens * kv_row_bytes + kv_tile_param_bytes, where kv_tile_param_bytes is
// 4 * width for integer per-channel tiles and 0 otherwise. Bytes per position, asymptotically:
//   fp32 4w, bf16 2w, integer per token w b / 8 + 4 w / group, integer per channel over tiles
//   of T tokens w b / 8 + 4 w / T.
#pragma once
#include <cstdint>
#include <string_view>

namespace loom {

enum KvFormat : uint8_t { KV_FP32, KV_BF16, KV_INT8, KV_INT4, KV_INT2, KV_FORMAT_COUNT };
enum KvAxis : uint8_t { KV_PER_TOKEN, KV_PER_CHANNEL, KV_AXIS_COUNT };

std::string_view kv_format_name(KvFormat format);  // "fp32", "bf16", "int8", "int4", "int2"
KvFormat parse_kv_format(std::string_view name);   // throws naming the accepted names
std::string_view kv_axis_name(KvAxis axis);         // "token", "channel"
KvAxis parse_kv_axis(std::string_view name);        // throws naming the accepted names
int kv_format_bits(KvFormat format);                // 32, 16, 8, 4, 2
bool kv_format_is_integer(KvFormat format);         // int8, int4, int2

// How a tile of rows is stored. Validated by validate(): width > 0, group >= 0 and, for integer
// per-token formats, group divides width.
struct KvQuantSpec {
  KvFormat format = KV_FP32;
  KvAxis axis = KV_PER_TOKEN;
  int64_t width = 0;  // channels per row
  int64_t group = 0;  // integer per-token: channels sharing one (scale, min); 0 = the whole row

  void validate() const;                 // throws naming the field and what was expected
  int64_t group_size() const { return group > 0 ? group : width; }
  bool per_channel_integer() const { return kv_format_is_integer(format) && axis == KV_PER_CHANNEL; }
};

// Bytes of a row's codes: ceil(width * bits / 8).
int64_t kv_code_bytes(const KvQuantSpec& spec);
// Bytes of one stored row: its codes and, per token, its (scale, min) pairs (see the layout above).
int64_t kv_row_bytes(const KvQuantSpec& spec);
// Bytes of a tile's shared (scale, min) pairs: 4 * width for integer per-channel, else 0.
int64_t kv_tile_param_bytes(const KvQuantSpec& spec);
// Exact bytes of a (tokens, width) tile: tokens * kv_row_bytes + kv_tile_param_bytes.
int64_t kv_tile_bytes(const KvQuantSpec& spec, int64_t tokens);
int64_t kv_tile_bytes(KvFormat format, KvAxis axis, int64_t tokens, int64_t width, int64_t group);

// Rows [begin, end) of a stored tile of `tokens` rows -> out (end - begin, width) fp32.
void kv_dequantize_tile(const KvQuantSpec& spec, const uint8_t* tile, int64_t tokens, int64_t begin, int64_t end,
                        float* out);

// The (scale, min) that element (row, channel) of a stored integer tile was quantized with.
struct KvGroupParams {
  float scale;
  float min;
};
KvGroupParams kv_group_params(const KvQuantSpec& spec, const uint8_t* tile, int64_t tokens, int64_t row,
                              int64_t channel);

}  // namespace loom
