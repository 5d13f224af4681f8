// The training loop: gradient accumulation over micro-batches, global-norm clipping, AdamW
// with warmup + cosine LR, and evaluation. All buffers are allocated once at construction;
// a step allocates nothing.
#pragma once
#include <cstdint>
#include "loom/data/batch_source.h"
#include "loom/model/transformer.h"
#include "loom/optim/adamw.h"
#include "loom/optim/schedule.h"

namespace loom {

struct TrainConfig {
  int64_t batch_size = 4;
  int64_t seq_len = 64;
  int64_t grad_accum = 1;  // micro-batches per optimizer step
  int64_t steps = 100;
  int64_t warmup_steps = 10;
  double lr = 6e-4;
  double min_lr = 6e-5;
  double grad_clip = 1.0;  // <= 0 disables
  AdamWConfig adamw;

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
  const AdamW& optimizer() const { return optimizer_; }
  // After a checkpoint restored the weights and the optimizer moments: continue at `step`.
  void restore(int64_t step, int64_t optimizer_steps);

 private:
  Backend& backend_;
  Transformer& model_;
  TrainConfig config_;
  ActivationStore store_;
  AdamW optimizer_;
  CosineSchedule schedule_;
  int64_t step_ = 0;
};

}  // namespace loom
