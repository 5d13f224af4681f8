#include "loom/precision/formats.h"

#include <algorithm>
#include <cmath>

#include "loom/core/error.h"

namespace loom {

const MiniFormatInfo& format_info(MiniFormat f) {
  static const MiniFormatInfo infos[FMT_COUNT] = {
      {"fp16", 5, 10, 15, true, true, 65504.0, 16},
      {"e4m3", 4, 3, 7, false, true, 448.0, 8},
      {"e5m2", 5, 2, 15, true, true, 57344.0, 8},
      {"e2m1", 2, 1, 1, false, false, 6.0, 4},
  };
  LOOM_CHECK(f < FMT_COUNT, "unknown number format ", static_cast<int>(f));
  return infos[f];
}

namespace {

uint32_t exp_all_ones(const MiniFormatInfo& i) { return (1u << i.exp_bits) - 1u; }

uint32_t nan_code(MiniFormat f, const MiniFormatInfo& i, uint32_t sign) {
  if (f == FMT_E4M3) return sign | 0x7Fu;  // S.1111.111
  return sign | (exp_all_ones(i) << i.man_bits) | (1u << (i.man_bits - 1));  // quiet NaN
}

uint32_t inf_code(const MiniFormatInfo& i, uint32_t sign) { return sign | (exp_all_ones(i) << i.man_bits); }

// The code of an exactly representable magnitude v >= 0 (v <= max).
uint32_t code_of(const MiniFormatInfo& i, double v, uint32_t sign) {
  if (v == 0.0) return sign;
  const int emin = 1 - i.bias;
  int e2 = 0;
  std::frexp(v, &e2);
  const int e = e2 - 1;  // floor(log2 v)
  if (e < emin) return sign | static_cast<uint32_t>(std::ldexp(v, i.man_bits - emin));  // subnormal
  const uint32_t mantissa = static_cast<uint32_t>(std::ldexp(v, i.man_bits - e)) - (1u << i.man_bits);
  return sign | (static_cast<uint32_t>(e + i.bias) << i.man_bits) | mantissa;
}

uint32_t overflow_code(MiniFormat f, const MiniFormatInfo& i, bool saturate, uint32_t sign) {
  if (saturate || f == FMT_E2M1) return code_of(i, i.max, sign);
  return i.has_inf ? inf_code(i, sign) : nan_code(f, i, sign);
}

}  // namespace

uint32_t encode(MiniFormat f, float x, bool saturate, Rounding rounding, uint32_t random) {
  const MiniFormatInfo& i = format_info(f);
  const uint32_t sign = std::signbit(x) ? 1u << (i.bits - 1) : 0u;
  if (std::isnan(x)) return f == FMT_E2M1 ? 0u : nan_code(f, i, sign);
  if (std::isinf(x)) return overflow_code(f, i, saturate, sign);
  const double a = std::fabs(static_cast<double>(x));
  if (a == 0.0) return sign;
  const int emin = 1 - i.bias;
  int e2 = 0;
  std::frexp(a, &e2);
  const int e = std::max(e2 - 1, emin);
  const double quantum = std::ldexp(1.0, e - i.man_bits);  // spacing of representable values at a
  const double n = a / quantum;                             // exact: a is a float, quantum a power of 2
  const double lower = std::floor(n), frac = n - lower;
  bool up;
  if (rounding == ROUND_STOCHASTIC) {
    up = static_cast<double>(random) * 0x1p-32 < frac;
  } else {
    up = frac > 0.5 || (frac == 0.5 && std::fmod(lower, 2.0) != 0.0);
  }
  const double v = (lower + (up ? 1.0 : 0.0)) * quantum;
  if (v > i.max) return overflow_code(f, i, saturate, sign);
  return code_of(i, v, sign);
}

float decode(MiniFormat f, uint32_t code) {
  const MiniFormatInfo& i = format_info(f);
  LOOM_CHECK(code < (1u << i.bits), "code ", code, " does not fit ", i.name, " (", i.bits, " bits)");
  const bool negative = (code >> (i.bits - 1)) & 1u;
  const uint32_t exp = (code >> i.man_bits) & exp_all_ones(i), man = code & ((1u << i.man_bits) - 1u);
  double v;
  if (i.has_inf && exp == exp_all_ones(i)) {
    v = man == 0 ? INFINITY : NAN;
  } else if (f == FMT_E4M3 && exp == exp_all_ones(i) && man == (1u << i.man_bits) - 1u) {
    v = NAN;
  } else if (exp == 0) {
    v = std::ldexp(static_cast<double>(man), 1 - i.bias - i.man_bits);
  } else {
    v = std::ldexp(1.0 + std::ldexp(static_cast<double>(man), -i.man_bits), static_cast<int>(exp) - i.bias);
  }
  return static_cast<float>(negative ? -v : v);
}

uint8_t encode_e8m0(float x) {
  if (!(x > 0.0f) || std::isinf(x)) return 0xFF;
  int e2 = 0;
  std::frexp(static_cast<double>(x), &e2);
  return static_cast<uint8_t>(std::clamp(e2 - 1, -127, 127) + 127);
}

float decode_e8m0(uint8_t code) {
  if (code == 0xFF) return NAN;
  return static_cast<float>(std::ldexp(1.0, static_cast<int>(code) - 127));
}

namespace {

size_t blocks_of(size_t n, size_t block) { return (n + block - 1) / block; }

}  // namespace

void mxfp4_quantize(std::span<const float> x, std::span<uint8_t> codes, std::span<uint8_t> scales) {
  LOOM_CHECK(codes.size() == x.size() && scales.size() == blocks_of(x.size(), kMxBlock), "mxfp4_quantize: ", x.size(),
             " values need ", x.size(), " codes and ", blocks_of(x.size(), kMxBlock), " scales, got ", codes.size(), " and ",
             scales.size());
  for (size_t b = 0; b < scales.size(); ++b) {
    const size_t begin = b * kMxBlock, end = std::min(x.size(), begin + kMxBlock);
    float amax = 0.0f;
    bool nan = false;
    for (size_t k = begin; k < end; ++k) {
      nan = nan || std::isnan(x[k]);
      amax = std::max(amax, std::fabs(x[k]));
    }
    if (nan || std::isinf(amax)) {  // OCP MX: a block with a NaN (or inf) has a NaN scale
      scales[b] = 0xFF;
      std::fill(codes.begin() + static_cast<ptrdiff_t>(begin), codes.begin() + static_cast<ptrdiff_t>(end), 0);
      continue;
    }
    int e = -127;
    if (amax > 0.0f) {
      int e2 = 0;
      std::frexp(static_cast<double>(amax), &e2);
      e = std::clamp(e2 - 1 - 2, -127, 127);  // floor(log2 amax) - emax(E2M1)
    }
    scales[b] = static_cast<uint8_t>(e + 127);
    for (size_t k = begin; k < end; ++k) {
      codes[k] = static_cast<uint8_t>(encode(FMT_E2M1, static_cast<float>(std::ldexp(static_cast<double>(x[k]), -e))));
    }
  }
}

void mxfp4_dequantize(std::span<const uint8_t> codes, std::span<const uint8_t> scales, std::span<float> out) {
  LOOM_CHECK(out.size() == codes.size() && scales.size() == blocks_of(codes.size(), kMxBlock), "mxfp4_dequantize: sizes");
  for (size_t k = 0; k < codes.size(); ++k) out[k] = decode(FMT_E2M1, codes[k]) * decode_e8m0(scales[k / kMxBlock]);
}

float nvfp4_quantize(std::span<const float> x, std::span<uint8_t> codes, std::span<uint8_t> scales,
                     std::span<const uint32_t> random) {
  LOOM_CHECK(codes.size() == x.size() && scales.size() == blocks_of(x.size(), kNvBlock) &&
                 (random.empty() || random.size() == x.size()),
             "nvfp4_quantize: ", x.size(), " values need ", x.size(), " codes, ", blocks_of(x.size(), kNvBlock),
             " scales and no or one random number each");
  float amax = 0.0f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  LOOM_CHECK(std::isfinite(amax), "nvfp4_quantize: the tensor holds inf or NaN");
  const float global = amax > 0.0f ? amax / (448.0f * 6.0f) : 1.0f;
  for (size_t b = 0; b < scales.size(); ++b) {
    const size_t begin = b * kNvBlock, end = std::min(x.size(), begin + kNvBlock);
    float block_amax = 0.0f;
    for (size_t k = begin; k < end; ++k) block_amax = std::max(block_amax, std::fabs(x[k]));
    scales[b] = static_cast<uint8_t>(encode(FMT_E4M3, (block_amax / 6.0f) / global));
    const float scale = decode(FMT_E4M3, scales[b]) * global;
    for (size_t k = begin; k < end; ++k) {
      if (scale == 0.0f) {
        codes[k] = 0;
        continue;
      }
      const Rounding r = random.empty() ? ROUND_NEAREST_EVEN : ROUND_STOCHASTIC;
      codes[k] = static_cast<uint8_t>(encode(FMT_E2M1, x[k] / scale, true, r, random.empty() ? 0u : random[k]));
    }
  }
  return global;
}

void nvfp4_dequantize(std::span<const uint8_t> codes, std::span<const uint8_t> scales, float global_scale, std::span<float> out) {
  LOOM_CHECK(out.size() == codes.size() && scales.size() == blocks_of(codes.size(), kNvBlock), "nvfp4_dequantize: sizes");
  for (size_t k = 0; k < codes.size(); ++k) {
    out[k] = decode(FMT_E2M1, codes[k]) * (decode(FMT_E4M3, scales[k / kNvBlock]) * global_scale);
  }
}

}  // namespace loom
