// Learning-rate schedules (docs/optimizers.md): linear warmup to max_lr over `warmup` steps,
// then constant, linear, cosine (Loshchilov & Hutter 2017, SGDR without restarts),
// warmup-stable-decay (Hu et al. 2024, MiniCPM; 1-sqrt decay, Hägele et al. 2024), step,
// exponential or inverse square root (Vaswani et al. 2017). A pure function of the 0-based
// step, so a resumed run needs only the step it stopped at.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "loom/core/enum_names.h"

namespace loom {

enum class LrScheduleKind { constant, linear, cosine, wsd, step, exponential, inverse_sqrt };
template <>
struct EnumNames<LrScheduleKind> {  // optim.schedule
  static constexpr std::array<std::string_view, 7> names{"constant", "linear",      "cosine",      "wsd",
                                                         "step",     "exponential", "inverse_sqrt"};
};
enum class WsdShape { linear, sqrt, cosine };
template <>
struct EnumNames<WsdShape> {  // optim.wsd_shape
  static constexpr std::array<std::string_view, 3> names{"linear", "sqrt", "cosine"};
};

struct ScheduleConfig {
  LrScheduleKind kind = LrScheduleKind::cosine;
  double max_lr = 3e-4;
  double min_lr = 3e-5;
  int64_t warmup = 0;
  int64_t total = 1;              // train.steps
  double decay_fraction = 0.2;    // wsd: the share of the steps spent decaying
  WsdShape wsd_shape = WsdShape::linear;  // wsd's decay
  int64_t step_size = 1000;       // step: steps between decays
  double gamma = 0.1;             // step, exponential: the decay factor

  void validate() const;  // throws naming the optim.* key
  double lr(int64_t step) const;  // resolves, then LrSchedule::lr (a step loop holds an LrSchedule)
};

// A validated schedule: what the trainer evaluates every step.
class LrSchedule {
 public:
  explicit LrSchedule(const ScheduleConfig& config);  // validates
  double lr(int64_t step) const;
  const ScheduleConfig& config() const { return c_; }

 private:
  ScheduleConfig c_;
};

}  // namespace loom
