// The parallelisms of a layout applied to one rank's model, as passes in one written order
// (torchtitan's parallelize_module steps):
//
//   1. tp  tensor (+ sequence) parallel: the model is built as this rank's slice; a whole copy
//          keeps the one-process initialisation and stages checkpoints and sampling
//   2. cp  context parallel: ring or Ulysses attention over the cp group
//   3. ep  expert parallel: each rank computes its experts, tokens go by all-to-all
//   4. pp  pipeline: a runner over this rank's stages and the schedule
//   5. dp  data parallel / ZeRO, with recompute and precision: the trainer
//
// Each pass reads only the layout's groups and what the passes before it built. A new
// parallelism is a row of the compatibility table (layout.cpp), a pass here, and its own files.
#pragma once
#include <memory>

#include "loom/data/loader.h"
#include "loom/data/shard.h"
#include "loom/model/transformer.h"
#include "loom/parallel/pipeline.h"
#include "loom/parallel/slice_source.h"
#include "loom/train/config.h"
#include "loom/train/layout.h"
#include "loom/train/objective.h"
#include "loom/train/trainer.h"

namespace loom {

struct TrainingModel {
  ModelConfig local_config;            // this rank's slice (the whole model without tp)
  std::unique_ptr<Transformer> model;  // what this rank computes
  std::unique_ptr<Transformer> whole;  // tp > 1: the whole model (init, checkpoints, sampling)
  std::unique_ptr<PipelineRunner> pipeline;
  std::unique_ptr<Trainer> trainer;
};

// Runs the five passes. `layout` may gain a device communicator (NCCL) for a GPU's gradients.
TrainingModel parallelize(Backend& backend, const LoomConfig& config, ParallelLayout& layout);

// The batches each rank trains and validates on, from an objective's splits (train/objective.h):
// the source draws every global batch (all ranks draw the same), each data-parallel rank keeps
// its rows, each context-parallel rank its positions (token data). The sources' staging is in
// `allocator` when host code can read it, else in host memory (the trainer writes each batch to
// the device).
class TrainingData {
 public:
  TrainingData(TrainingSplits splits, const LoomConfig& config, const ParallelLayout& layout, Allocator& allocator);
  BatchSource& train() { return cp_train_ ? static_cast<BatchSource&>(*cp_train_) : *rank_; }
  ResumableSource& loader() { return *train_; }
  // The validation loss over loop.eval_batches batches from the start of the split (at most the
  // splits' max_val_batches); with context parallelism the mean over the cp group (equal token
  // counts per rank); token data: the global batches' rows split over the data-parallel ranks
  // and their losses averaged, the same sequences in every layout.
  double validation_loss(Trainer& trainer, int64_t batches, Allocator& allocator);

 private:
  CpuAllocator host_;  // the sources' staging when `allocator` is a device's (declared first: released last)
  std::unique_ptr<ResumableSource> train_, val_;
  int64_t max_val_batches_ = 0;
  std::unique_ptr<RankSliceSource> rank_;
  std::unique_ptr<ContextSliceSource> cp_train_, cp_val_;
  Communicator* cp_ = nullptr;
  // Token data: each data-parallel rank scores its rows of each global validation batch, and the
  // loss is their mean, so every layout scores the same sequences (those of batch x dp rows).
  std::unique_ptr<RankSliceSource> val_rank_;
  Communicator* dp_ = nullptr;
};

}  // namespace loom
