// What a training step minimises (train.objective), as one component per objective behind one
// seam, each a row of the registry (objective.cpp), as the optimizers are rows of theirs:
//
//   lm       the mean next-token loss over the counted targets (plain text, and supervised
//            fine-tuning on chat-jsonl / jsonl data with its loss mask)        lm_objective.cpp
//   dpo      preference pairs: DPO, IPO, SimPO                                      dpo.cpp
//   grpo     rollouts of prompts with verifiable rewards                            grpo.cpp
//   distill  next-token loss and a teacher's softened distribution                 distill.cpp
//   orpo     preference pairs: the chosen NLL and an odds-ratio term, no reference    orpo.cpp
//   kto      labelled completions against a live reference                          kto.cpp
//
// The rows are one table (kObjectives in objective.cpp); each implementation is its own file
// behind its factory (make_<name>_objective). An objective owns everything that is its own: its
// config check (the row's `check`), the layout it runs in (the row's `layout`, which the
// compatibility table in layout.cpp reads: that table is the only place that refuses a
// combination), its data (read before the model exists, as model.vocab_size may follow it), its
// set-up (a reference model, a teacher, a rollout engine), the per-micro-batch loss (a
// RowObjective given to the trainer), its per-step and validation metrics with their report keys,
// and the charts `loom report` draws from them (the row's `series`). The run (train/run.h) calls
// these hooks and knows nothing else of any objective. A new objective is its file, its registry
// row, its config keys, its tests and its docs (docs/architecture.md "Where things go").
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/data/loader.h"
#include "loom/data/tokenizer.h"
#include "loom/train/metrics_schema.h"
#include "loom/train/trainer.h"

namespace loom {

struct LoomConfig;
struct TrainingModel;
class TrainingData;

// Where an objective's records and lines go: the run's metrics.jsonl and its observer.
class ObjectiveSink {
 public:
  virtual ~ObjectiveSink() = default;
  virtual void record(const ObjectiveRecord& record) = 0;  // {"step", key: {...}} (train/metrics_schema.h)
  virtual void line(const std::string& text) = 0;          // one printed line
};

// The training and held-out sources an objective's data makes (TrainingData slices them over the
// layout's ranks).
struct TrainingSplits {
  std::unique_ptr<ResumableSource> train, val;
  // Rows that are whole sequences (pairs, rollouts): every rank scores the whole held-out batches,
  // and no context-parallel slices are made. Token data (false): each data-parallel rank scores
  // its rows of every global validation batch, each context-parallel rank its positions.
  bool whole_sequences = false;
  // > 0: at most this many validation batches (one pass over held-out pairs).
  int64_t max_val_batches = 0;
};

// What set-up and the hooks may use.
struct ObjectiveContext {
  Backend& backend;
  const LoomConfig& config;
  TrainingModel& parts;  // this rank's model and trainer
  TrainingData& data;
  ObjectiveSink& sink;
};

// The held-out measure: a loss (metrics.jsonl's "val_loss") or a reward ("val_reward").
struct Validation {
  double value = 0.0;
  bool reward = false;
};

class Objective {
 public:
  virtual ~Objective() = default;
  // Before the model is built: reads its data (data.dir or data.input); model.vocab_size may
  // follow the data's tokenizer, data.tokenizer may become the shards'.
  virtual void read_data(LoomConfig& config) = 0;
  // Once this rank's model exists (GRPO's rollouts decode with it): the sources, moved out of
  // what read_data read.
  virtual TrainingSplits make_splits(const LoomConfig& config, Transformer& model) = 0;
  // After the batches exist, before a resume loads later weights: the trainer's RowObjective, a
  // reference, a teacher; its banner lines through ctx.sink.
  virtual void set_up(ObjectiveContext& ctx) { (void)ctx; }
  // A fresh run's step 0: the curve's start, recorded and reported as a validation of step 0
  // (GRPO: the initial weights' greedy reward); none by default.
  virtual std::optional<Validation> at_start(ObjectiveContext& ctx) {
    (void)ctx;
    return std::nullopt;
  }
  // After each step that updated the weights: its records; its lines when the step is logged.
  virtual void after_step(ObjectiveContext& ctx, const StepStats& stats, bool logged) {
    (void)ctx, (void)stats, (void)logged;
  }
  // The held-out measure (the run writes the validation record), then its own records and the
  // validation line.
  virtual Validation validate(ObjectiveContext& ctx);
  virtual void after_validation(ObjectiveContext& ctx, int64_t step, const Validation& v);
  // "loss": the summary's "final validation <what>".
  virtual std::string validation_name() const { return "loss"; }
};

// The parallel layouts an objective runs in; layout.cpp's table refuses the rest, naming them.
struct ObjectiveLayout {
  bool model_parallel = true;  // tensor, pipeline and context parallelism
  bool data_parallel = true;   // more than one data-parallel rank
  bool moe = true;             // MoE blocks
  // A frozen base not in fp32: peft.quantize_base (QLoRA, refused where false) and LoRA's base kept
  // in bf16 only (model/frozen_base.h; not used where false: the base stays in fp32).
  bool compact_base = true;
  std::string_view why;        // the reason given when one of the above is refused
};

// One row of the registry.
struct ObjectiveRow {
  std::string_view name;     // train.objective
  std::string_view meaning;  // the config key's help (docs/config.md)
  std::string_view formats;  // the data.format values it reads, "|"-separated ("text|chat-jsonl|jsonl")
  ObjectiveLayout layout;
  // Its keys and data.format against the rest of the config (LoomConfig::validate_objective);
  // throws naming the key.
  void (*check)(const LoomConfig& config);
  std::unique_ptr<Objective> (*make)(const LoomConfig& config);
  // The numbers of its records `loom report` charts (nullptr: none beyond the common ones).
  const std::vector<ObjectiveSeries>& (*series)() = nullptr;
};

std::span<const ObjectiveRow> objective_rows();
// train.objective's row; throws naming the known objectives.
const ObjectiveRow& objective_row(std::string_view name);
// "lm (...) | dpo (...) | ...": train.objective's help text, from each row's meaning.
const std::string& objective_names_help();
// The objectives whose rows read data.format = `format` ("dpo, orpo"), for refusals that name the
// way out.
std::string objectives_reading(std::string_view format);
// Every row's report series, in registry order (loom report's objective charts).
const std::vector<ObjectiveSeries>& objective_series();
// data.format against the objective's row: refused naming the objectives that read it.
void check_objective_format(const LoomConfig& config);

// For objectives over a tokenized data.input (pairs, prompts): data.tokenizer, which tokenizes
// the file and pads and decodes its rows (model.vocab_size follows it when 0).
std::shared_ptr<Tokenizer> objective_tokenizer(LoomConfig& config);

// The last `val_fraction` of `items` (at least one, and one left) moved out of it: the held-out
// examples. `what` and `input` name them in the refusal of fewer than two.
template <typename Item>
std::vector<Item> hold_out(std::vector<Item>& items, double val_fraction, const std::string& input, const char* what) {
  const auto n = static_cast<int64_t>(items.size());
  LOOM_CHECK(n >= 2, input, ": ", n, " ", what, "; at least 2 are needed (one held out for validation)");
  const int64_t held =
      std::clamp<int64_t>(static_cast<int64_t>(std::floor(static_cast<double>(n) * val_fraction)), 1, n - 1);
  std::vector<Item> val(std::make_move_iterator(items.end() - held), std::make_move_iterator(items.end()));
  items.resize(static_cast<size_t>(n - held));
  return val;
}

}  // namespace loom
