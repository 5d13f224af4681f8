// Dynamic loss scaling for fp16 training (Micikevicius et al. 2018), with exactly the semantics of
// torch.amp.GradScaler (torch/amp/grad_scaler.py): the loss is multiplied by S before backward;
// the gradients are unscaled by inv = float32(1 / float64(S)) (left alone when inv == 1) and
// checked for inf/NaN; a step with a non-finite gradient is skipped. Then: overflow ->
// S *= backoff, counter = 0; else the counter counts clean steps and after growth_interval of them
// S *= growth (only if the result is finite), counter = 0. Optional hysteresis H (Megatron-LM /
// TransformerEngine): the backoff waits for H consecutive overflows; H = 1 is GradScaler.
#pragma once
#include <cstdint>

#include "loom/backend/backend.h"

namespace loom {

struct LossScalerConfig {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  int64_t hysteresis = 1;

  void validate() const;  // throws naming the precision.* key
};

struct LossScalerState {
  float scale = 65536.0f;
  int64_t growth_tracker = 0;      // clean steps since the last change
  int64_t hysteresis_tracker = 1;  // overflows still tolerated before a backoff
};

class DynamicLossScaler {
 public:
  explicit DynamicLossScaler(LossScalerConfig config);

  float scale() const { return state_.scale; }
  // grads *= inv = fp32(1 / scale) (unless inv == 1), through the backend (a GPU's gradients
  // too); returns true when any element is inf or NaN. A sum of squares in double of finite
  // floats is finite (at most 1.2e77 per element), so it is finite exactly when every element is.
  bool unscale(Backend& backend, const Tensor& grads) const;
  // After each step (taken or skipped), with what unscale found.
  void update(bool found_inf);

  const LossScalerState& state() const { return state_; }
  void restore(const LossScalerState& state) { state_ = state; }

 private:
  LossScalerConfig config_;
  LossScalerState state_;
};

}  // namespace loom
