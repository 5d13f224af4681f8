// Integer weight formats of post-training quantization (docs/compression.md): b-bit codes (b =
// 8, 4 or 3) per group of G consecutive input columns of one output row, each group with an f32
// scale s and an integer zero point z, dequantized as w^ = s (q - z) (the asymmetric "zero point"
// scheme of GPTQ, Frantar et al. 2022, and AWQ, Lin et al. 2024, as AutoGPTQ / AutoAWQ store
// it). SmoothQuant's W8A8 (Xiao et al. 2023) is the same format with b = 8, one group per row
// and z = 128 (symmetric int8 q - 128 in [-127, 127]), its activations quantized per token.
//
// Packing of one row of `cols` codes (cols a multiple of 32, G a multiple of 32 dividing cols):
//   - 8 bits: one code per byte, in column order;
//   - 4 bits: each chunk of 32 columns in 16 bytes, byte j holding column j in its low nibble
//     and column j + 16 in its high one (two AVX loads unpack a chunk without shuffles);
//   - 3 bits: each chunk of 8 columns in 3 bytes, a little-endian bit stream, column j of the
//     chunk at bits 3j .. 3j + 2.
// Rows follow each other; row_bytes(bits, cols) = cols, cols / 2, 3 cols / 8.
//
// A checkpoint stores one quantized weight W (rows, cols) of parameter NAME as
//   NAME.qweight  U8 (rows, row_bytes)     the packed codes
//   NAME.scales   F32 or F16 (rows, cols / G)  (IntStorage::f16_scales)
//   NAME.zeros    U8 (rows, cols / G), absent for symmetric groups (IntStorage::symmetric)
//   NAME.input_scale F32 (cols), optional: the input is multiplied by it column-wise first
//                 (AWQ's and SmoothQuant's 1 / s; the weight was quantized as W diag(s))
// with the file's metadata naming the method, bits, group and activation format.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "loom/backend/backend.h"

namespace loom {

int64_t int_row_bytes(int bits, int64_t cols);

// How the group parameters are stored (loom quantize --scales, --symmetric). The defaults are
// AutoGPTQ's: f32 scales and a u8 zero point per group (min-max). Compact, as ggml's blocks:
//   f16_scales  each scale rounded up to an f16 value before the group's codes are chosen, so
//               the codes are those of the stored scale and the group's range still fits (no
//               value clipped by the rounding; an Error beyond f16's range);
//   symmetric   AutoGPTQ's sym=True: s = 2 max|x| / (2^b - 1) and z = 2^(b - 1) for every group,
//               so no zero point is stored.
// In memory a backend with compact_int_weights keeps them so (int_weight_to_backend); others
// read f32 scales and u8 zeros either way.
struct IntStorage {
  bool f16_scales = false;
  bool symmetric = false;
  bool operator==(const IntStorage&) const = default;
};

// One quantized weight on the host.
struct IntWeight {
  IntWeightSpec spec;
  IntStorage storage;
  std::vector<uint8_t> codes;       // rows x row_bytes
  std::vector<float> scales;        // rows x cols / group
  std::vector<uint8_t> zeros;       // rows x cols / group
  std::vector<float> input_scale;   // cols, or empty
  int64_t bytes() const;            // bytes in memory: codes, f32 scales, zeros, input scale
  int64_t stored_bytes() const;     // bytes in a file: scales of storage's width, zeros unless symmetric
};

// Checks bits (8, 4, 3) and group (a multiple of 32 dividing cols; 0 = one group per row);
// returns the resolved spec or throws naming `what`.
IntWeightSpec int_weight_spec(int bits, int64_t group, int64_t rows, int64_t cols, bool act_int8, const std::string& what);

// The code of one column from a packed row.
uint8_t int_code(const uint8_t* row, int bits, int64_t col);
// Packs `cols` codes (each < 2^bits) into row_bytes bytes.
void int_pack_row(const uint8_t* codes, int bits, int64_t cols, uint8_t* out);
void int_unpack_row(const uint8_t* packed, int bits, int64_t cols, uint8_t* codes);

// The group's scale and zero point for values x (asymmetric min-max over [min(x, 0), max(x, 0)],
// AutoGPTQ's Quantizer.find_params): s = (max - min) / (2^b - 1), z = round(-min / s); s = 1,
// z = 0 when the group is all zeros. With `symmetric` (W8A8): s = max |x| / 127, z = 128.
struct GroupParams {
  float scale = 1.0f;
  uint8_t zero = 0;
};
GroupParams int_group_params(std::span<const float> x, int bits, bool symmetric);
// A weight-only group's parameters stored as `storage` says, from the group's min(x, 0) = lo and
// max(x, 0) = hi (computed in double; the scale rounded to f32, then up to f16 if asked; a scale
// beyond f16 comes back infinite, for check_stored_scales).
GroupParams int_stored_params(double lo, double hi, int bits, const IntStorage& storage);
// An Error naming `what` when a scale is not finite (beyond f16's range).
void check_stored_scales(const IntWeight& q, const std::string& what);
// q's scales as f16 bits (a compact checkpoint's NAME.scales, a backend's compact scales); an
// Error naming `what` when one is not exactly an f16 value.
std::vector<uint16_t> int_f16_scales(const IntWeight& q, const std::string& what);
// clamp(round(x / s) + z, 0, 2^b - 1) (round half to even).
inline uint8_t int_quantize_value(float x, const GroupParams& p, int bits) {
  const float q = __builtin_nearbyintf(x / p.scale) + static_cast<float>(p.zero);
  const float top = static_cast<float>((1 << bits) - 1);
  return static_cast<uint8_t>(q < 0.0f ? 0.0f : (q > top ? top : q));
}
inline float int_dequantize_value(uint8_t q, const GroupParams& p) {
  return p.scale * (static_cast<float>(q) - static_cast<float>(p.zero));
}

// Round-to-nearest of a row-major (rows, cols) weight with spec's groups, stored as `storage`.
IntWeight rtn_quantize(std::span<const float> w, const IntWeightSpec& spec, const IntStorage& storage = {});
// The weight back in f32 (rows x cols), without the input scale: what the kernels multiply with.
std::vector<float> int_dequantize(const IntWeight& q);

// A weight on a backend, as Backend::int_linear reads it.
struct IntWeightDevice {
  IntWeightSpec spec;
  Tensor codes, scales, zeros, input_scale;  // input_scale undefined when absent; zeros when symmetric and compact
  int64_t bytes = 0;
};
// `compact` (default: the backend's compact_int_weights): f16 scales when q.storage has them, no
// zeros when its groups are symmetric, so the weight takes q.stored_bytes() as in its file;
// otherwise f32 scales and u8 zeros (q.bytes()). An Error when q's values contradict its storage.
IntWeightDevice int_weight_to_backend(const IntWeight& q, Backend& backend, MemCategory category,
                                      std::optional<bool> compact = std::nullopt);

}  // namespace loom
