// RoPE's frequencies (Su et al. 2021, RoFormer): pair j of a d-wide rotation (d: the head's dim,
// or its first RopeSpec::rotary_dim dims) turns by
// position x inv_freq(j), inv_freq(j) = theta^(-2j/d), optionally rescaled for contexts longer
// than the model was trained on:
//   linear  (Chen et al. 2023, position interpolation): inv_freq / factor;
//   llama3  (Meta's Llama 3.1 release, `rope_type: "llama3"` in its config.json): with the
//           wavelength w = 2 pi / inv_freq and the original context L, wavelengths shorter than
//           L / high_freq_factor keep their frequency, longer than L / low_freq_factor are
//           divided by factor, and those between blend the two with
//           s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor):
//           inv_freq ((1 - s) / factor + s);
//   yarn    (Peng et al. 2023, YaRN): with the original context L and
//           c(n) = d ln(L / (2 pi n)) / (2 ln theta), pairs below floor(c(beta_fast)) keep their
//           frequency, pairs above ceil(c(beta_slow)) are divided by factor, a linear ramp in j
//           between (unrounded ends with yarn_truncate = false: GPT-OSS); cos and sin are
//           multiplied by `amplitude` (YaRN's attention factor);
//   longrope (Ding et al. 2024, LongRoPE; Phi-3's 128k models): pair j's frequency divided by
//           short_factor[j], or by long_factor[j] when the rotated span reaches past the original
//           context L (rope_span: transformers' choice by the sequence's length, made per
//           forward); cos and sin times `amplitude` (sqrt(1 + ln(s) / ln L) for s = context / L).
// Host and device code share rope_inv_freq, so both backends compute the same angles (double).
#pragma once
#include <math.h>

#include <array>
#include <cstdint>
#include <string_view>

#include "loom/backend/scalar_math.h"
#include "loom/core/enum_names.h"

namespace loom {

enum RopeScaling : uint8_t {
  ROPE_SCALING_NONE, ROPE_SCALING_LINEAR, ROPE_SCALING_LLAMA3, ROPE_SCALING_YARN, ROPE_SCALING_LONGROPE
};

template <>
struct EnumNames<RopeScaling> {  // model.rope_scaling
  static constexpr std::array<std::string_view, 5> names{"none", "linear", "llama3", "yarn", "longrope"};
};

// The RoPE of a model, as the rope ops take it (plain values, passed to CUDA kernels by value).
struct RopeSpec {
  double theta = 10000.0;
  RopeScaling scaling = ROPE_SCALING_NONE;
  double factor = 1.0;              // linear, llama3, yarn
  double low_freq_factor = 1.0;     // llama3
  double high_freq_factor = 4.0;    // llama3
  double original_context = 8192.0;  // llama3, yarn: the context the model was pre-trained with
  double beta_fast = 32.0, beta_slow = 1.0;  // yarn: the ramp's ends, in rotations over the context
  double amplitude = 1.0;           // cos and sin are multiplied by it (yarn's, longrope's attention factor)
  bool yarn_truncate = true;        // yarn: the ramp's ends rounded (floor, ceil); GPT-OSS's truncate = false keeps them
  // longrope: the pairs' short and long factors (head_dim / 2 of each), and which one this span uses.
  static constexpr int kMaxPairs = 128;
  float short_factor[kMaxPairs] = {};
  float long_factor[kMaxPairs] = {};
  bool long_span = false;
  // Partial rotary embedding (GPT-NeoX's rotary_pct; Qwen3-Next's partial_rotary_factor): only a
  // head's first rotary_dim dims rotate, as pairs (j, j + rotary_dim / 2) with rotary_dim as the
  // frequencies' d; the rest pass through. 0: the whole head.
  int64_t rotary_dim = 0;
};

// The dims of a head_dim-wide head that rotate (RopeSpec::rotary_dim, 0: all).
LOOM_HOST_DEVICE int64_t rope_rotary_dim(const RopeSpec& r, int64_t head_dim) {
  return r.rotary_dim > 0 && r.rotary_dim < head_dim ? r.rotary_dim : head_dim;
}

// The RoPE a span of positions [.., end) rotates with: LongRoPE's long factors when the span
// reaches past the original context (every other scaling as it is).
inline RopeSpec rope_span(RopeSpec r, int64_t end) {
  r.long_span = r.scaling == ROPE_SCALING_LONGROPE && static_cast<double>(end) > r.original_context;
  return r;
}

// Inverse frequency of pair j (0 <= j < dim / 2) of a dim-wide rotation.
LOOM_HOST_DEVICE double rope_inv_freq(const RopeSpec& r, int64_t j, int64_t dim) {
  const double base = ::pow(r.theta, -2.0 * static_cast<double>(j) / static_cast<double>(dim));
  if (r.scaling == ROPE_SCALING_LINEAR) return base / r.factor;
  if (r.scaling == ROPE_SCALING_LONGROPE) return base / static_cast<double>(r.long_span ? r.long_factor[j] : r.short_factor[j]);
  if (r.scaling == ROPE_SCALING_YARN) {
    const double log_theta = 2.0 * ::log(r.theta), two_pi = 2.0 * 3.14159265358979323846;
    double low = static_cast<double>(dim) * ::log(r.original_context / (r.beta_fast * two_pi)) / log_theta;
    double high = static_cast<double>(dim) * ::log(r.original_context / (r.beta_slow * two_pi)) / log_theta;
    if (r.yarn_truncate) low = ::floor(low), high = ::ceil(high);
    low = low < 0.0 ? 0.0 : low;
    high = high > static_cast<double>(dim - 1) ? static_cast<double>(dim - 1) : high;
    if (low == high) high += 0.001;
    double ramp = (static_cast<double>(j) - low) / (high - low);
    ramp = ramp < 0.0 ? 0.0 : (ramp > 1.0 ? 1.0 : ramp);
    return base / r.factor * ramp + base * (1.0 - ramp);
  }
  if (r.scaling != ROPE_SCALING_LLAMA3) return base;
  const double wavelength = 2.0 * 3.14159265358979323846 / base;
  if (wavelength < r.original_context / r.high_freq_factor) return base;
  if (wavelength > r.original_context / r.low_freq_factor) return base / r.factor;
  const double s = (r.original_context / wavelength - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  return (1.0 - s) * base / r.factor + s * base;
}

}  // namespace loom
