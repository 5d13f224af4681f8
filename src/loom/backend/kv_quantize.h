// Writing KV-cache rows in their storage formats (backend/kv_format.h states the formulas and the
// byte layout), as host and device code: one definition for the host caches (infer/kv_quant.h's
// kv_quantize_tile), the CPU backend's kv_store and the CUDA kernel of kv_store, so every writer
// stores the same bytes.
//
// (scale, min) of a group of values in [lo, hi] (b-bit codes, levels = 2^b - 1):
//     min = the largest fp16 <= lo,   scale = the smallest fp16 >= (hi - min) / levels  (f32),
//     q = clamp(floor((x - min) / scale + 0.5), 0, levels)   (q = 0 when scale = 0).
// The directed fp16 roundings are done on the magnitude: truncating its significand to 10 bits
// (or, for the other direction, truncating and stepping one code up when that lost anything);
// values beyond fp16's range truncate to 65504 and step up to inf. A group holding a non-finite
// value, or whose min or scale is not a finite fp16, is refused (kv_fit_status).
//
// Work split, so device threads never share a byte: a per-token row is one unit (its groups and
// codes), a per-channel tile is cut into its code bytes (byte j holds channels [j 8/b, (j+1) 8/b):
// their (scale, min) pairs and that byte of every row), fp32 and bf16 store each element alone.
#pragma once
#include <math.h>
#include <stdint.h>

#include "loom/backend/scalar_math.h"  // LOOM_HOST_DEVICE

namespace loom::kvq {

// fp16 bits -> f32, exactly (every half is a float).
LOOM_HOST_DEVICE float f16_value(uint32_t h) {
  const uint32_t sign = h & 0x8000u, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  float magnitude;
  if (exponent == 0x1f) magnitude = mantissa ? NAN : INFINITY;
  else if (exponent == 0) magnitude = static_cast<float>(mantissa) * 0x1p-24f;
  else magnitude = ldexpf(static_cast<float>(mantissa | 0x400u), static_cast<int>(exponent) - 25);
  return sign ? -magnitude : magnitude;
}

// The fp16 magnitude code of a finite a >= 0 with its significand truncated (toward 0); 0x7bff
// (65504) for anything beyond.
LOOM_HOST_DEVICE uint32_t f16_truncate(float a) {
  if (a >= 65520.0f) return 0x7bffu;
  if (a < 0x1p-14f) return static_cast<uint32_t>(a * 0x1p24f);  // subnormals: a 2^24 is exact, floor by the cast
  int e = 0;
  const float m = frexpf(a, &e);                                 // a = m 2^e, m in [0.5, 1)
  const uint32_t significand = static_cast<uint32_t>(ldexpf(m, 11));  // 11 bits, the leading one included
  const uint32_t code = static_cast<uint32_t>(e + 14) << 10 | (significand & 0x3ffu);
  return code > 0x7bffu ? 0x7bffu : code;
}

// The fp16 magnitude code of a >= 0 rounded away from 0 (0x7c00, inf, beyond 65504).
LOOM_HOST_DEVICE uint32_t f16_round_up(float a) {
  const uint32_t code = f16_truncate(a);
  return f16_value(code) < a ? code + 1 : code;
}

// The largest fp16 <= x and the smallest fp16 >= x, as fp16 bits (x finite; -0 keeps its sign).
LOOM_HOST_DEVICE uint32_t f16_floor(float x) {
  return signbit(x) ? 0x8000u | f16_round_up(-x) : f16_truncate(x);
}
LOOM_HOST_DEVICE uint32_t f16_ceil(float x) {
  return signbit(x) ? 0x8000u | f16_truncate(-x) : f16_round_up(x);
}

enum KvFitStatus : int32_t { KV_FIT_OK = 0, KV_FIT_NON_FINITE = 1, KV_FIT_OUT_OF_RANGE = 2 };

// One group's grid: x' = q scale + min, q in [0, levels]; codes as stored (fp16 bits).
struct KvGrid {
  float scale = 0, min = 0;
  uint32_t levels = 0, scale_code = 0, min_code = 0;
  int32_t status = KV_FIT_OK;
};

// The grid of values in [lo, hi] (finite: all of them were finite).
LOOM_HOST_DEVICE KvGrid kv_fit(float lo, float hi, bool finite, uint32_t levels) {
  KvGrid g;
  g.levels = levels;
  if (!finite) {
    g.status = KV_FIT_NON_FINITE;
    return g;
  }
  g.min_code = f16_floor(lo);
  g.min = f16_value(g.min_code);
  g.scale_code = f16_ceil((hi - g.min) / static_cast<float>(levels));
  g.scale = f16_value(g.scale_code);
  if (!isfinite(g.min) || !isfinite(g.scale)) g.status = KV_FIT_OUT_OF_RANGE;
  return g;
}

LOOM_HOST_DEVICE uint32_t kv_code(float x, const KvGrid& g) {
  if (g.scale == 0.0f) return 0;
  const float q = floorf((x - g.min) / g.scale + 0.5f);
  return static_cast<uint32_t>(q < 0.0f ? 0.0f : (q > static_cast<float>(g.levels) ? static_cast<float>(g.levels) : q));
}

LOOM_HOST_DEVICE void store_u16(uint8_t* p, uint32_t v) {
  p[0] = static_cast<uint8_t>(v & 0xffu);
  p[1] = static_cast<uint8_t>((v >> 8) & 0xffu);
}

LOOM_HOST_DEVICE void store_params(uint8_t* p, const KvGrid& g) {
  store_u16(p, g.scale_code);
  store_u16(p + 2, g.min_code);
}

// A stream's storage as the writers read it (filled on the host from a KvQuantSpec:
// kv_store_format in kv_format.h's terms).
struct KvStoreFormat {
  int32_t kind = 0;         // 0 fp32, 1 bf16, 2 integer
  int32_t bits = 32;        // integer: 8, 4 or 2
  int32_t per_channel = 0;  // integer: one (scale, min) per channel of a tile
  int64_t width = 0;        // channels of a row
  int64_t group = 0;        // integer per token: channels per (scale, min)
  int64_t row_bytes = 0;    // kv_row_bytes
  int64_t code_bytes = 0;   // kv_code_bytes
  int64_t param_bytes = 0;  // kv_tile_param_bytes
};

LOOM_HOST_DEVICE uint32_t float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  return std::bit_cast<uint32_t>(x);
#endif
}

// bf16 bits of x, round to nearest even (NaN kept quiet), as core/dtype.h's f32_to_bf16.
LOOM_HOST_DEVICE uint32_t bf16_bits(float x) {
  uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x0040u;
  u += 0x7fffu + ((u >> 16) & 1u);
  return u >> 16;
}

// Element i of a (tokens, width) fp32 or bf16 tile (row r = i / width of row(r)); byte stores,
// since a tile need not be 4-byte aligned in the pool.
template <typename RowFn>
LOOM_HOST_DEVICE void kv_store_element(const KvStoreFormat& f, RowFn row, int64_t i, uint8_t* out) {
  const float x = row(i / f.width)[i % f.width];
  if (f.kind == 0) {
    const uint32_t bits = float_bits(x);
    for (int b = 0; b < 4; ++b) out[4 * i + b] = static_cast<uint8_t>((bits >> (8 * b)) & 0xffu);
  } else {
    store_u16(out + 2 * i, bf16_bits(x));
  }
}

// One per-token integer row x (width) -> its slot (groups (scale, min) pairs, then its codes).
// Returns the first failing group's status (the slot is then partly written).
LOOM_HOST_DEVICE int32_t kv_quantize_row_per_token(const KvStoreFormat& f, const float* x, uint8_t* slot) {
  const uint32_t levels = (1u << f.bits) - 1u;
  const int64_t G = f.group, groups = f.width / G, per_byte = 8 / f.bits;
  uint8_t* codes = slot + 4 * groups;
  for (int64_t j = 0; j < f.code_bytes; ++j) codes[j] = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * G;
    float lo = xg[0], hi = xg[0];
    bool finite = true;
    for (int64_t c = 0; c < G; ++c) {
      finite = finite && isfinite(xg[c]);
      lo = xg[c] < lo ? xg[c] : lo;
      hi = xg[c] > hi ? xg[c] : hi;
    }
    const KvGrid grid = kv_fit(lo, hi, finite, levels);
    if (grid.status != KV_FIT_OK) return grid.status;
    store_params(slot + 4 * g, grid);
    for (int64_t c = 0; c < G; ++c) {
      const int64_t channel = g * G + c;
      codes[channel / per_byte] = static_cast<uint8_t>(codes[channel / per_byte] |
                                                       (kv_code(xg[c], grid) << (channel % per_byte * f.bits)));
    }
  }
  return KV_FIT_OK;
}

// Code byte j of a per-channel integer tile of `tokens` rows (row(t)): the (scale, min) of its
// channels and byte j of every row's codes. Returns the first failing channel's status.
template <typename RowFn>
LOOM_HOST_DEVICE int32_t kv_quantize_channel_byte(const KvStoreFormat& f, RowFn row, int64_t tokens, int64_t j,
                                                  uint8_t* tile) {
  const uint32_t levels = (1u << f.bits) - 1u;
  const int64_t per_byte = 8 / f.bits, c0 = j * per_byte;
  const int64_t c1 = c0 + per_byte < f.width ? c0 + per_byte : f.width;
  KvGrid grids[4];  // per_byte <= 4 (bits >= 2)
  for (int64_t c = c0; c < c1; ++c) {
    float lo = row(0)[c], hi = lo;
    bool finite = true;
    for (int64_t t = 0; t < tokens; ++t) {
      const float v = row(t)[c];
      finite = finite && isfinite(v);
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
    }
    grids[c - c0] = kv_fit(lo, hi, finite, levels);
    if (grids[c - c0].status != KV_FIT_OK) return grids[c - c0].status;
    store_params(tile + 4 * c, grids[c - c0]);
  }
  uint8_t* codes = tile + f.param_bytes;
  for (int64_t t = 0; t < tokens; ++t) {
    const float* x = row(t);
    uint32_t byte = 0;
    for (int64_t c = c0; c < c1; ++c) byte |= kv_code(x[c], grids[c - c0]) << ((c - c0) * f.bits);
    codes[t * f.code_bytes + j] = static_cast<uint8_t>(byte);
  }
  return KV_FIT_OK;
}

// `tokens` rows (row(t)) stored as one unit of f's layout at `out` (kv_quantize_tile's bytes):
// the units of work first, first + step, ... (elements, per-token rows or per-channel code bytes,
// as above), so a host loop passes (0, 1) and a GPU block (threadIdx.x, blockDim.x). Returns the
// first failing group's status among the units it stored (KV_FIT_OK when none failed).
template <typename RowFn>
LOOM_HOST_DEVICE int32_t store_rows(const KvStoreFormat& f, RowFn row, int64_t tokens, uint8_t* out, int64_t first,
                                    int64_t step) {
  int32_t failed = KV_FIT_OK;
  if (tokens <= 0) return failed;
  if (f.kind != 2) {
    for (int64_t i = first; i < tokens * f.width; i += step) kv_store_element(f, row, i, out);
  } else if (f.per_channel) {
    for (int64_t j = first; j < f.code_bytes; j += step) {
      const int32_t s = kv_quantize_channel_byte(f, row, tokens, j, out);
      failed = failed == KV_FIT_OK ? s : failed;
    }
  } else {
    for (int64_t t = first; t < tokens; t += step) {
      const int32_t s = kv_quantize_row_per_token(f, row(t), out + t * f.row_bytes);
      failed = failed == KV_FIT_OK ? s : failed;
    }
  }
  return failed;
}

}  // namespace loom::kvq
