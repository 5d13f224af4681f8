// Pipeline parallelism (GPipe, Huang et al. 2019; 1F1B and interleaved 1F1B, Narayanan et al.
// 2021; ZB-H1, Qi et al. 2024): the model's layers are cut into p x v stages, model stage s on
// rank s mod p; micro-batch activations flow forward and their gradients backward between
// neighbouring stages by point-to-point messages. One runner executes any schedule of
// parallel/pipeline_schedule.h: each rank runs its action list in order; F receives its input
// from the previous stage (blocking), computes, and sends its output on (non-blocking); B
// receives d(output) from the next stage, computes (for split schedules the input gradient
// only), and sends d(input) back; W computes the kept weight gradients. Each message's tag is
// the round parallel/pipe_messages.h plans for it (NCCL pairs sends and receives by those
// rounds), and the plan picks each F's activation store. A rank holds every
// parameter in its flat buffers but computes and updates only its stages' (the optimizer gets
// owned() only). With a tied head (GPT-2) the first and the last stage both hold the embedding,
// and its two gradient parts are summed over the pipeline group after the step's backward.
#pragma once
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "loom/comm/communicator.h"
#include "loom/data/batch_source.h"
#include "loom/model/transformer.h"
#include "loom/parallel/pipe_messages.h"
#include "loom/parallel/pipeline_schedule.h"

namespace loom {

// Layers [first, last) of each of `stages` model stages, balanced by cost: the contiguous split
// that minimises the largest stage cost, a stage costing its layers (layer_cost each) plus
// first_cost on stage 0 (the embedding) and last_cost on the last (final norm, head, loss);
// among equal splits, earlier stages take more layers. Exact, by dynamic programming over (stage,
// layers so far). With no end costs the layers are split as evenly as possible. Throws naming
// parallel.pp when a stage would be empty.
std::vector<std::pair<int64_t, int64_t>> pipeline_layer_split(int64_t layers, int stages, double layer_cost = 1.0,
                                                              double first_cost = 0.0, double last_cost = 0.0);
// The split of `config`'s layers by estimated forward FLOPs per token: a block's weight GEMMs
// and attention at seq_len, the head's 2 V C.
std::vector<std::pair<int64_t, int64_t>> pipeline_stage_split(const ModelConfig& config, int stages, int64_t seq_len);

// The flat ranges (merged, ascending) of the parameters pipeline rank `rank` holds: the units
// (arch/param_layout.h) of its stages' layers, the embeddings on the first stage, the final norm
// (and untied head) on the last. norm: the ranges it counts in a global gradient norm; else with
// a tied head the last stage also holds the embedding.
RangeSet pipeline_owned_ranges(const ModelConfig& config, const ParamLayout& layout, const PipeSchedule& schedule,
                               int rank, const std::vector<std::pair<int64_t, int64_t>>& layers, bool norm);

class PipelineRunner {
 public:
  PipelineRunner(Transformer& model, Communicator& pp, PipeSchedule schedule, int64_t batch, int64_t seq_len);

  // One step: draws the schedule's m micro-batches from data (every rank draws all of them, in
  // order, as a one-process run with grad_accum = m would), runs the schedule with each
  // micro-batch's loss weighted by loss_weight, and returns the sum of the micro-batch losses
  // (on every rank). Gradients accumulate into the model's buffer for this rank's stages.
  // first_pass: micro-batch i's LoRA dropout pass is first_pass + i (0: no dropout), as the
  // trainer numbers a one-process step's micro-batches. Packed documents (data.document_mask)
  // give each micro-batch its spans.
  double run(BatchSource& data, float loss_weight, uint32_t first_pass = 0);
  // The mean loss of `batches` micro-batches from data, forward only, one at a time through the
  // stages (evaluation: no schedule), on every rank; with loss masks the mean over the counted
  // positions.
  double evaluate(BatchSource& data, int64_t batches);
  // Loss masks: the positions whose target counts, and all positions, of the last run's
  // micro-batches (each micro-batch's loss is its mean over all positions, masked ones 0, as the
  // model's forward; the trainer rescales to the mean over the counted ones).
  int64_t valid_targets() const { return valid_; }
  int64_t positions() const { return positions_; }

  const PipeSchedule& schedule() const { return schedule_; }
  Communicator& comm() const { return pp_; }
  // Flat ranges of the parameters this rank's stages hold, and of those it counts in a global
  // gradient norm (the same less the tied embedding on the last stage: counted by the first).
  const RangeSet& owned() const { return owned_; }
  const RangeSet& norm_ranges() const { return norm_ranges_; }
  // Seconds of the last run computing, and waiting for a neighbour's message.
  double busy_seconds() const { return busy_; }
  double idle_seconds() const { return idle_; }

 private:
  // The sum of `local` over the pipeline ranks, through loss_.
  double reduce_loss(double local);
  void forward(const PipeAction& a, const PipeMessagePlan& plan);
  void backward(const PipeAction& a, const PipeMessagePlan& plan);
  int acquire(int chunk, int micro, int slot);  // the plan's store for the micro-batch's F
  void release(int chunk, int micro);         // after its B (or W)
  ActivationStore& store_of(int chunk, int micro);
  void wait_sends();
  void fill_micro(BatchSource& data, int micro);  // tokens_[micro], targets_[micro] from data

  Transformer& model_;
  Communicator& pp_;
  PipeSchedule schedule_;
  std::vector<PipeMessagePlan> plan_;  // [action] of this rank's list: store, message rounds (the tags)
  std::vector<std::pair<int64_t, int64_t>> layers_;  // [model stage] layer range
  std::vector<std::vector<ActivationStore>> stores_;  // [chunk][slot]: the schedule's peak live micro-batches
  std::vector<std::vector<int>> slot_;                // [chunk][micro] its store while live, else -1
  std::vector<std::vector<std::unique_ptr<CommWork>>> pending_;  // [chunk][slot] its output's send
  CpuAllocator host_;                                 // host_tokens_'s (declared first: released last)
  std::vector<Tensor> tokens_, targets_;              // [micro] drawn at the start of a step
  Tensor host_tokens_, host_targets_;                // the batch staged on the host (device memory only)
  std::vector<std::vector<Tensor>> grad_out_;         // [chunk][micro] (B,T,C) d(input) being sent
  std::vector<std::unique_ptr<CommWork>> sends_;
  RangeSet owned_, norm_ranges_;
  std::pair<int64_t, int64_t> tied_{0, 0};  // the tied embedding's flat range (empty if untied)
  Tensor loss_;                             // (1) f64
  float loss_weight_ = 1.0f;
  double loss_sum_ = 0.0, busy_ = 0.0, idle_ = 0.0;
  int64_t valid_ = 0, positions_ = 0;  // the last run's (or evaluation's) counted and all positions
  std::vector<DocumentSpans> docs_;    // [micro]: its packed documents' spans (empty: none)
  uint32_t first_pass_ = 0;            // the run's first LoRA dropout pass (0: none)
};

}  // namespace loom
