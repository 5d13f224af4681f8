// The training loop: gradient accumulation over micro-batches, global-norm clipping, the
// configured optimizer (optim/optimizer.h) and LR schedule, and evaluation. Buffers are allocated at construction
// (a few on first use, in the first step); a step after the first allocates nothing (tests/mpi_test_alloc.cpp).
#pragma once
#include <cstdint>
#include <memory>

#include <deque>

#include "loom/core/enum_names.h"
#include "loom/core/trace.h"
#include "loom/data/batch_source.h"
#include "loom/model/transformer.h"
#include "loom/optim/optimizer.h"
#include "loom/optim/schedule.h"
#include "loom/parallel/ddp.h"
#include "loom/parallel/pipeline.h"
#include "loom/memory/recompute.h"
#include "loom/parallel/zero.h"
#include "loom/precision/loss_scaler.h"
#include "loom/precision/policy.h"

namespace loom {

// What a step does when its loss is non-finite or a spike (train.on_anomaly): stop the run
// before the update (the default: the weights stay as they were), skip the step (no update, the
// batch recorded), or skip it and roll back to the last checkpoint (the caller's part: the
// trainer only reports the anomaly), as PaLM did for its loss spikes (Chowdhery et al. 2022, 5.1:
// restart from a checkpoint before the spike and skip the batches that followed).
enum class AnomalyPolicy { stop, skip, rollback };
template <>
struct EnumNames<AnomalyPolicy> {
  static constexpr std::array<std::string_view, 3> names{"stop", "skip", "rollback"};
};
// Fault injection for tests of the policy (train.inject_fault): the step's loss and gradients
// made NaN, or the loss and gradients multiplied by 100 (a spike).
enum class FaultKind { nan, spike };
template <>
struct EnumNames<FaultKind> {
  static constexpr std::array<std::string_view, 2> names{"nan", "spike"};
};
enum class Anomaly { none, nonfinite, spike };

struct AnomalyConfig {
  AnomalyPolicy policy = AnomalyPolicy::stop;
  // > 0: a loss more than this many standard deviations above the mean of the last spike_window
  // accepted losses is a spike (checked once the window is full). 0 = no spike detection.
  double spike_zscore = 0.0;
  int64_t spike_window = 50;
  int64_t fault_step = -1;  // >= 0: inject `fault` at this step (0-based), for tests
  FaultKind fault = FaultKind::nan;
};

struct TrainConfig {
  int64_t batch_size = 4;
  int64_t seq_len = 64;
  int64_t grad_accum = 1;  // micro-batches per optimizer step
  int64_t steps = 100;
  double grad_clip = 1.0;   // <= 0 disables
  OptimConfig optim;        // resolved by the trainer
  ScheduleConfig schedule;  // total is taken from steps
  PrecisionConfig precision;  // precision/policy.h: linear recipes, param/reduce/master dtypes
  // Dynamic loss scaling (GradScaler semantics): the loss is scaled by S before backward, the
  // gradients unscaled and checked, a step with inf/NaN gradients skipped. Off by default.
  bool loss_scaling = false;
  LossScalerConfig loss_scaler;
  // Activation checkpointing (memory/recompute.h): none | selective | full | every:K | budget,
  // the budget in MiB of the blocks' kept activations per micro-batch.
  std::string recompute = "none";
  double recompute_budget_mb = 0.0;
  // Activation offload: the checkpointed blocks' kept fields (their inputs; with selective also
  // the GEMM outputs) live in host memory between forward and backward (MEM_OFFLOADED; on the
  // CPU backend the same RAM, so only the accounting moves). Needs train.recompute != none.
  bool offload_activations = false;
  // FlashAttention (nn/block.h set_flash_attention): every block's attention keeps its rows'
  // log-sum-exp (B,H,T) instead of the probabilities (B,H,T,T). Not with pipeline stages yet.
  bool flash_attention = false;
  // > 0: the memory a device holds after setup (every category but MEM_OFFLOADED) must fit; a
  // run that does not is refused naming the remedies (offload, recompute, ZeRO).
  double device_budget_mb = 0.0;
  AnomalyConfig anomaly;

  void validate() const;  // throws naming the key (e.g. "train.batch_size")
};

struct StepStats {
  int64_t step = 0;         // 0-based index of the step just taken
  double loss = 0.0;        // mean over the step's micro-batches
  double grad_norm = 0.0;   // before clipping (inf on a step loss scaling skipped, 0 on one with no counted target)
  bool skipped = false;     // no update: loss scaling found inf/NaN gradients, or every target was masked (loss NaN)
  float loss_scale = 1.0f;  // S used for this step (1 without loss scaling)
  double lr = 0.0;
  int64_t tokens = 0;
  double seconds = 0.0;
  // A non-finite or spiking loss under train.on_anomaly = skip / rollback: the step made no
  // update (skipped is true); spike_z is the loss's z-score over the window (0 without one).
  Anomaly anomaly = Anomaly::none;
  double spike_z = 0.0;
};

// A sequence-level objective over a micro-batch's rows (train.objective = dpo, train/dpo.h) in
// place of the mean next-token loss: after the forward, from the rows' summed cross-entropies
// (store.losses) and what the source says the rows are (BatchSource::rows), it returns the
// micro-batch's loss and sets store.row_weights, the loss's derivative with respect to each
// row's summed cross-entropy, which the backward then applies.
class RowObjective {
 public:
  virtual ~RowObjective() = default;
  virtual double weigh(Backend& backend, ActivationStore& store, const BatchSource& data) = 0;
  // Called with each micro-batch's rows loaded, before the model's forward (a live reference
  // pass may use the store; the forward that follows overwrites it).
  virtual void before_forward(Backend& backend, ActivationStore& store) {}
  // Whether evaluation reports this objective's loss (DPO, GRPO) or the plain next-token loss
  // (distillation: the held-out cross-entropy is what a teacher should lower).
  virtual bool evaluates_own_loss() const { return true; }
};

class Trainer {
 public:
  // With a communicator of more than one rank the trainer is data parallel (parallel/ddp.h):
  // `data` must then give this rank its part of each global batch (RankSliceSource), the
  // gradients are averaged over ranks, and the reported loss is the mean over ranks.
  // With a pipeline runner (parallel/pipeline.h) each step runs its schedule over grad_accum
  // micro-batches and the optimizer updates only this rank's stages.
  Trainer(Backend& backend, Transformer& model, TrainConfig config, Communicator* comm = nullptr, DdpConfig ddp = {},
          PipelineRunner* pipeline = nullptr);

  // Throws on a non-finite loss or gradient norm before updating, unless train.on_anomaly says
  // to skip (StepStats::anomaly).
  StepStats train_step(BatchSource& data);
  double evaluate(BatchSource& data, int64_t batches);
  // The objective of train_step and evaluate (nullptr: the mean next-token loss); not owned.
  void set_objective(RowObjective* objective) { objective_ = objective; }
  // One batch from `data` through the forward, nothing recorded (no FP8 amax, no objective):
  // its per-position losses, e.g. a reference model's log-probabilities. Not with pipelines.
  const ActivationStore& forward_only(BatchSource& data);
  int64_t step() const { return step_; }
  // train.trace: the step's parts (data, forward, backward, gradient sync, optimizer) become
  // events of `tracer` (core/trace.h); null: none. Not owned.
  void set_tracer(Tracer* tracer) { tracer_ = tracer; }
  Backend& backend() const { return backend_; }
  const Optimizer& optimizer() const { return *optimizer_; }
  // The loss scaler (nullptr without loss scaling); its state goes into checkpoints.
  DynamicLossScaler* loss_scaler() { return scaler_.get(); }
  const std::vector<OptimParam>& optim_params() const { return optim_params_; }  // all parameters
  // ZeRO (stages 1-3 over more than one rank): this rank's shard and the gathers of sharded
  // state (nullptr otherwise).
  ZeroSharding* zero() { return zero_.get(); }
  const ZeroSharding* zero() const { return zero_.get(); }
  // The flat ranges this rank's optimizer updates (before ZeRO's sharding): its pipeline stages
  // (or all), less the experts other expert-parallel ranks compute.
  const RangeSet& domain() const { return domain_; }
  // After the parameters were written whole (a checkpoint load): ZeRO-3 releases what this
  // rank does not own, expert parallelism the experts other ranks compute.
  void params_loaded();
  // Makes the parameters whole on every rank (ZeRO-3; e.g. to sample after training): further
  // steps keep them whole.
  void gather_params();
  const ScheduleConfig& schedule() const { return schedule_.config(); }
  // Activation checkpointing: the per-layer plan, and its estimated bytes and measured seconds.
  struct RecomputeReport {
    std::vector<RecomputePolicy> plan;
    int64_t kept_bytes = 0;           // the blocks' kept activations + the shared record, per micro-batch
    int64_t no_recompute_bytes = 0;   // the same without recomputation
    double seconds = 0.0;             // measured recompute seconds per micro-batch (0 unless budget)
  };
  const RecomputeReport& recompute() const { return recompute_; }
  // After a checkpoint restored the weights and the optimizer moments: continue at `step`.
  void restore(int64_t step, int64_t optimizer_steps);

 private:
  Backend& backend_;
  Transformer& model_;
  TrainConfig config_;
  RecomputeReport recompute_;  // (before store_: it decides what the store keeps)
  ActivationStore store_;
  LrSchedule schedule_;  // kind parsed once
  std::vector<OptimParam> optim_params_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<DynamicLossScaler> scaler_;
  Communicator* comm_ = nullptr;
  std::unique_ptr<DataParallel> ddp_;
  std::unique_ptr<ZeroSharding> zero_;
  bool sharded_grads() const { return zero_ && zero_->stage() >= 2; }
  double sum_over(Communicator& group, double x);  // all-reduce of one f64 through scalar_
  PipelineRunner* pipeline_ = nullptr;
  RowObjective* objective_ = nullptr;
  double global_grad_norm();  // over every rank's part (ZeRO-2/3 shards, tensor and pipeline parallel)
  Communicator* tp_ = nullptr;      // the model's tensor-parallel group (more than one rank)
  std::vector<std::pair<int64_t, int64_t>> tp_replicated_;  // flat ranges of replicated parameters
  std::vector<std::pair<int64_t, int64_t>> tp_partial_;  // sequence parallel's norms, LoRA's replicated adapters: summed over tp once a step
  // The next batch into store_'s tokens and targets; returns how many targets count (not kIgnoreTarget).
  int64_t load_batch(BatchSource& data);
  CpuAllocator host_;  // host staging: scalar_ and, on a GPU backend, the batch
  Tensor scalar_;      // (1) f64 on the host: the loss, flags and norms summed over a group
  Tensor host_tokens_, host_targets_;  // the batch before it is written to the backend (GPU only)
  RangeSet domain_;
  RangeSet norm_ranges_;  // the gradient elements global_grad_norm sums on this rank
  int64_t step_ = 0;
  std::deque<double> recent_losses_;  // the accepted steps' losses, for spike detection
  bool fault_injected_ = false;       // train.inject_fault fires once per process
  Tracer* tracer_ = nullptr;
  // Multiplies the gradients this rank holds (all, or its ZeRO-2/3 shard), less the frozen ones.
  void scale_grads(double factor);
  // The step's anomaly (the same on every rank: the loss is the mean over ranks), or none.
  Anomaly classify(double loss, double& z) const;
  bool stops_on_anomaly() const { return config_.anomaly.policy == AnomalyPolicy::stop; }
};

}  // namespace loom
