#include "loom/optim/schedule.h"

#include <algorithm>
#include <cmath>

#include "loom/core/error.h"

namespace loom {

void ScheduleConfig::validate() const {
  LOOM_CHECK(max_lr > 0.0 && min_lr >= 0.0 && min_lr <= max_lr, "optim.lr must be > 0 and optim.min_lr in [0, lr], got lr ",
             max_lr, ", min_lr ", min_lr);
  LOOM_CHECK(warmup >= 0, "optim.warmup_steps must be >= 0, got ", warmup);
  LOOM_CHECK(decay_fraction >= 0.0 && decay_fraction <= 1.0, "optim.decay_fraction must be in [0, 1], got ", decay_fraction);
  LOOM_CHECK(step_size > 0, "optim.step_size must be > 0, got ", step_size);
  LOOM_CHECK(gamma > 0.0 && gamma <= 1.0, "optim.gamma must be in (0, 1], got ", gamma);
}

double ScheduleConfig::lr(int64_t step) const { return LrSchedule(*this).lr(step); }

LrSchedule::LrSchedule(const ScheduleConfig& config) : c_(config) { c_.validate(); }

double LrSchedule::lr(int64_t step) const {
  const double max_lr = c_.max_lr, min_lr = c_.min_lr;
  const int64_t warmup = c_.warmup, total = c_.total;
  if (step < warmup) return max_lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const double since = static_cast<double>(step - warmup);
  const double p = total > warmup ? std::min(1.0, since / static_cast<double>(total - warmup)) : 1.0;
  switch (c_.kind) {
    case LrScheduleKind::constant: return max_lr;
    case LrScheduleKind::linear: return max_lr - (max_lr - min_lr) * p;
    case LrScheduleKind::cosine: return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + std::cos(M_PI * p));
    case LrScheduleKind::wsd: {
      const double decay_steps = std::round(c_.decay_fraction * static_cast<double>(total));
      const double start = static_cast<double>(total) - decay_steps;
      if (static_cast<double>(step) < start || decay_steps <= 0.0) return max_lr;
      const double q = std::min(1.0, (static_cast<double>(step) - start) / decay_steps);
      double f = 1.0 - q;  // linear
      if (c_.wsd_shape == WsdShape::sqrt) f = 1.0 - std::sqrt(q);
      else if (c_.wsd_shape == WsdShape::cosine) f = 0.5 * (1.0 + std::cos(M_PI * q));
      return min_lr + (max_lr - min_lr) * f;
    }
    case LrScheduleKind::step: return max_lr * std::pow(c_.gamma, std::floor(since / static_cast<double>(c_.step_size)));
    case LrScheduleKind::exponential: return max_lr * std::pow(c_.gamma, since);
    case LrScheduleKind::inverse_sqrt: break;
  }
  return max_lr * std::sqrt(static_cast<double>(std::max<int64_t>(warmup, 1)) / static_cast<double>(step + 1));
}

}  // namespace loom
