#include "loom/optim/schedule.h"

#include <algorithm>
#include <cmath>

namespace loom {

double CosineSchedule::lr(int64_t step) const {
  if (step < warmup) return max_lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (total <= warmup) return min_lr;
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / static_cast<double>(total - warmup));
  return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace loom
