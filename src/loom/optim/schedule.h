// Learning-rate schedule: linear warmup to max_lr over `warmup` steps, then cosine decay to
// min_lr at `total` steps (Loshchilov & Hutter 2017, SGDR without restarts):
//   lr(t) = max_lr (t+1)/warmup                                         t < warmup
//   lr(t) = min_lr + (max_lr - min_lr) (1 + cos(pi (t - warmup)/(total - warmup))) / 2
// t is the 0-based step; a pure function of t, so a resumed run needs only the step.
#pragma once
#include <cstdint>

namespace loom {

struct CosineSchedule {
  double max_lr = 3e-4;
  double min_lr = 3e-5;
  int64_t warmup = 0;
  int64_t total = 1;

  double lr(int64_t step) const;
};

}  // namespace loom
