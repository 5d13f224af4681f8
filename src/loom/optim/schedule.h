// Learning-rate schedules (docs/optimizers.md): linear warmup to max_lr over `warmup` steps,
// then constant, linear, cosine (Loshchilov & Hutter 2017, SGDR without restarts),
// warmup-stable-decay (Hu et al. 2024, MiniCPM; 1-sqrt decay, Hägele et al. 2024), step,
// exponential or inverse square root (Vaswani et al. 2017). A pure function of the 0-based
// step, so a resumed run needs only the step it stopped at.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace loom {

struct ScheduleConfig {
  std::string kind = "cosine";  // constant | linear | cosine | wsd | step | exponential | inverse_sqrt
  double max_lr = 3e-4;
  double min_lr = 3e-5;
  int64_t warmup = 0;
  int64_t total = 1;              // train.steps
  double decay_fraction = 0.2;    // wsd: the share of the steps spent decaying
  std::string wsd_shape = "linear";  // wsd decay: linear | sqrt | cosine
  int64_t step_size = 1000;       // step: steps between decays
  double gamma = 0.1;             // step, exponential: the decay factor

  void validate() const;  // throws naming the optim.* key
  double lr(int64_t step) const;  // resolves, then LrSchedule::lr (a step loop holds an LrSchedule)
};

// A schedule with its kind and shape parsed once (the strings stay in the config): what the
// trainer evaluates every step.
class LrSchedule {
 public:
  enum Kind : uint8_t { CONSTANT, LINEAR, COSINE, WSD, STEP, EXPONENTIAL, INVERSE_SQRT };
  enum Shape : uint8_t { SHAPE_LINEAR, SHAPE_SQRT, SHAPE_COSINE };
  explicit LrSchedule(const ScheduleConfig& config);  // validates
  double lr(int64_t step) const;
  const ScheduleConfig& config() const { return c_; }

 private:
  ScheduleConfig c_;
  Kind kind_;
  Shape shape_;
};

const std::vector<std::string>& schedule_names();

}  // namespace loom
