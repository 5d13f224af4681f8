// RoPE's frequencies (Su et al. 2021, RoFormer): pair j of a d-wide rotation turns by
// position x inv_freq(j), inv_freq(j) = theta^(-2j/d), optionally rescaled for contexts longer
// than the model was trained on:
//   linear  (Chen et al. 2023, position interpolation): inv_freq / factor;
//   llama3  (Meta's Llama 3.1 release, `rope_type: "llama3"` in its config.json): with the
//           wavelength w = 2 pi / inv_freq and the original context L, wavelengths shorter than
//           L / high_freq_factor keep their frequency, longer than L / low_freq_factor are
//           divided by factor, and those between blend the two with
//           s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor):
//           inv_freq ((1 - s) / factor + s).
// Host and device code share rope_inv_freq, so both backends compute the same angles (double).
#pragma once
#include <math.h>

#include <array>
#include <cstdint>
#include <string_view>

#include "loom/backend/scalar_math.h"
#include "loom/core/enum_names.h"

namespace loom {

enum RopeScaling : uint8_t { ROPE_SCALING_NONE, ROPE_SCALING_LINEAR, ROPE_SCALING_LLAMA3 };

template <>
struct EnumNames<RopeScaling> {  // model.rope_scaling
  static constexpr std::array<std::string_view, 3> names{"none", "linear", "llama3"};
};

// The RoPE of a model, as the rope ops take it (plain values, passed to CUDA kernels by value).
struct RopeSpec {
  double theta = 10000.0;
  RopeScaling scaling = ROPE_SCALING_NONE;
  double factor = 1.0;              // linear, llama3
  double low_freq_factor = 1.0;     // llama3
  double high_freq_factor = 4.0;    // llama3
  double original_context = 8192.0;  // llama3: the context the model was pre-trained with
};

// Inverse frequency of pair j (0 <= j < dim / 2) of a dim-wide rotation.
LOOM_HOST_DEVICE double rope_inv_freq(const RopeSpec& r, int64_t j, int64_t dim) {
  const double base = ::pow(r.theta, -2.0 * static_cast<double>(j) / static_cast<double>(dim));
  if (r.scaling == ROPE_SCALING_LINEAR) return base / r.factor;
  if (r.scaling != ROPE_SCALING_LLAMA3) return base;
  const double wavelength = 2.0 * 3.14159265358979323846 / base;
  if (wavelength < r.original_context / r.high_freq_factor) return base;
  if (wavelength > r.original_context / r.low_freq_factor) return base / r.factor;
  const double s = (r.original_context / wavelength - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  return (1.0 - s) * base / r.factor + s * base;
}

}  // namespace loom
