// The training loop: gradient accumulation over micro-batches, global-norm clipping, the
// configured optimizer (optim/optimizer.h) and LR schedule, and evaluation. All buffers are allocated once at construction;
// a step allocates nothing.
#pragma once
#include <cstdint>
#include <memory>

#include "loom/data/batch_source.h"
#include "loom/model/transformer.h"
#include "loom/optim/optimizer.h"
#include "loom/optim/schedule.h"

namespace loom {

struct TrainConfig {
  int64_t batch_size = 4;
  int64_t seq_len = 64;
  int64_t grad_accum = 1;  // micro-batches per optimizer step
  int64_t steps = 100;
  double grad_clip = 1.0;   // <= 0 disables
  OptimConfig optim;        // resolved by the trainer
  ScheduleConfig schedule;  // total is taken from steps

  void validate() const;  // throws naming the key (e.g. "train.batch_size")
};

struct StepStats {
  int64_t step = 0;         // 0-based index of the step just taken
  double loss = 0.0;        // mean over the step's micro-batches
  double grad_norm = 0.0;   // before clipping
  double lr = 0.0;
  int64_t tokens = 0;
  double seconds = 0.0;
};

class Trainer {
 public:
  Trainer(Backend& backend, Transformer& model, TrainConfig config);

  StepStats train_step(BatchSource& data);  // throws on a non-finite loss, before updating
  double evaluate(BatchSource& data, int64_t batches);
  int64_t step() const { return step_; }
  const Optimizer& optimizer() const { return *optimizer_; }
  const std::vector<OptimParam>& optim_params() const { return optim_params_; }
  const ScheduleConfig& schedule() const { return schedule_; }
  // After a checkpoint restored the weights and the optimizer moments: continue at `step`.
  void restore(int64_t step, int64_t optimizer_steps);

 private:
  Backend& backend_;
  Transformer& model_;
  TrainConfig config_;
  ActivationStore store_;
  ScheduleConfig schedule_;
  std::vector<OptimParam> optim_params_;
  std::unique_ptr<Optimizer> optimizer_;
  int64_t step_ = 0;
};

}  // namespace loom
