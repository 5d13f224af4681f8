#include "loom/optim/schedule.h"

#include <algorithm>
#include <cmath>

#include "loom/core/error.h"

namespace loom {

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names = {"constant", "linear", "cosine", "wsd", "step", "exponential", "inverse_sqrt"};
  return names;
}

void ScheduleConfig::validate() const {
  const auto& names = schedule_names();
  LOOM_CHECK(std::find(names.begin(), names.end(), kind) != names.end(), "optim.schedule: unknown schedule '", kind,
             "' (expected constant, linear, cosine, wsd, step, exponential or inverse_sqrt)");
  LOOM_CHECK(max_lr > 0.0 && min_lr >= 0.0 && min_lr <= max_lr, "optim.lr must be > 0 and optim.min_lr in [0, lr], got lr ",
             max_lr, ", min_lr ", min_lr);
  LOOM_CHECK(warmup >= 0, "optim.warmup_steps must be >= 0, got ", warmup);
  LOOM_CHECK(decay_fraction >= 0.0 && decay_fraction <= 1.0, "optim.decay_fraction must be in [0, 1], got ", decay_fraction);
  LOOM_CHECK(wsd_shape == "linear" || wsd_shape == "sqrt" || wsd_shape == "cosine",
             "optim.wsd_shape must be linear, sqrt or cosine, got '", wsd_shape, "'");
  LOOM_CHECK(step_size > 0, "optim.step_size must be > 0, got ", step_size);
  LOOM_CHECK(gamma > 0.0 && gamma <= 1.0, "optim.gamma must be in (0, 1], got ", gamma);
}

double ScheduleConfig::lr(int64_t step) const { return LrSchedule(*this).lr(step); }

LrSchedule::LrSchedule(const ScheduleConfig& config) : c_(config) {
  c_.validate();
  const auto& names = schedule_names();
  kind_ = static_cast<Kind>(std::find(names.begin(), names.end(), c_.kind) - names.begin());
  shape_ = c_.wsd_shape == "sqrt" ? SHAPE_SQRT : c_.wsd_shape == "cosine" ? SHAPE_COSINE : SHAPE_LINEAR;
}

double LrSchedule::lr(int64_t step) const {
  const double max_lr = c_.max_lr, min_lr = c_.min_lr;
  const int64_t warmup = c_.warmup, total = c_.total;
  if (step < warmup) return max_lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const double since = static_cast<double>(step - warmup);
  const double p = total > warmup ? std::min(1.0, since / static_cast<double>(total - warmup)) : 1.0;
  switch (kind_) {
    case CONSTANT: return max_lr;
    case LINEAR: return max_lr - (max_lr - min_lr) * p;
    case COSINE: return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + std::cos(M_PI * p));
    case WSD: {
      const double decay_steps = std::round(c_.decay_fraction * static_cast<double>(total));
      const double start = static_cast<double>(total) - decay_steps;
      if (static_cast<double>(step) < start || decay_steps <= 0.0) return max_lr;
      const double q = std::min(1.0, (static_cast<double>(step) - start) / decay_steps);
      double f = 1.0 - q;  // linear
      if (shape_ == SHAPE_SQRT) f = 1.0 - std::sqrt(q);
      else if (shape_ == SHAPE_COSINE) f = 0.5 * (1.0 + std::cos(M_PI * q));
      return min_lr + (max_lr - min_lr) * f;
    }
    case STEP: return max_lr * std::pow(c_.gamma, std::floor(since / static_cast<double>(c_.step_size)));
    case EXPONENTIAL: return max_lr * std::pow(c_.gamma, since);
    case INVERSE_SQRT: break;
  }
  return max_lr * std::sqrt(static_cast<double>(std::max<int64_t>(warmup, 1)) / static_cast<double>(step + 1));
}

}  // namespace loom
