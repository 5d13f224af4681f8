#include "loom/precision/loss_scaler.h"

#include <cmath>

#include "loom/core/error.h"

namespace loom {

void LossScalerConfig::validate() const {
  LOOM_CHECK(init_scale > 0.0 && std::isfinite(static_cast<float>(init_scale)), "precision.init_scale must be a positive fp32 value, got ",
             init_scale);
  LOOM_CHECK(growth_factor > 1.0, "precision.growth_factor must be > 1, got ", growth_factor);
  LOOM_CHECK(backoff_factor > 0.0 && backoff_factor < 1.0, "precision.backoff_factor must be in (0, 1), got ", backoff_factor);
  LOOM_CHECK(growth_interval >= 1, "precision.growth_interval must be >= 1, got ", growth_interval);
  LOOM_CHECK(hysteresis >= 1, "precision.hysteresis must be >= 1, got ", hysteresis);
}

DynamicLossScaler::DynamicLossScaler(LossScalerConfig config) : config_((config.validate(), config)) {
  state_.scale = static_cast<float>(config_.init_scale);
  state_.hysteresis_tracker = config_.hysteresis;
}

bool DynamicLossScaler::unscale(Backend& backend, const Tensor& grads) const {
  const float inv = static_cast<float>(1.0 / static_cast<double>(state_.scale));
  if (inv != 1.0f) backend.scale_inplace(grads, inv);
  return !std::isfinite(backend.sum_squares(grads));
}

void DynamicLossScaler::update(bool found_inf) {
  if (found_inf) {
    state_.growth_tracker = 0;
    if (--state_.hysteresis_tracker <= 0) {
      state_.scale = state_.scale * static_cast<float>(config_.backoff_factor);
      state_.hysteresis_tracker = config_.hysteresis;
    }
    return;
  }
  state_.hysteresis_tracker = config_.hysteresis;  // the overflows must be consecutive
  if (++state_.growth_tracker == config_.growth_interval) {
    const float grown = state_.scale * static_cast<float>(config_.growth_factor);
    if (std::isfinite(grown)) state_.scale = grown;
    state_.growth_tracker = 0;
  }
}

}  // namespace loom
