#include "loom/train/trainer.h"

#include <chrono>
#include <algorithm>
#include <cmath>

#include "loom/core/error.h"
#include "loom/core/pages.h"
#include "loom/parallel/tensor_parallel.h"

namespace loom {

namespace {
// Philox key of stochastic rounding of bf16 master weights (draw = step): fixed, so a resumed
// run rounds exactly as an uninterrupted one.
constexpr uint64_t kRoundingSeed = 0x5EEDB16F;

// The flat ranges this rank's optimizer updates before ZeRO: its pipeline stages (or all),
// less the experts other expert-parallel ranks compute.
RangeSet update_domain(const Transformer& model, const PipelineRunner* pipeline) {
  const RangeSet base = pipeline == nullptr || pipeline->comm().size() == 1 ? RangeSet::span(0, model.layout().total)
                                                                            : pipeline->owned();
  return base.subtract(model.foreign_expert_ranges()).subtract(model.frozen_ranges());
}

// The parameters this rank's optimizer updates: its domain, or its ZeRO shard of the domain.
std::vector<OptimParam> rank_params(const std::vector<OptimParam>& all, const Communicator* comm, const DdpConfig& ddp,
                                    const Transformer& model, const OptimConfig& optim, const PipelineRunner* pipeline) {
  const std::string& optimizer = optim.name;  // optim: resolved
  LOOM_CHECK(ddp.zero_stage >= 0 && ddp.zero_stage <= 3, "parallel.zero_stage must be 0, 1, 2 or 3, got ",
             ddp.zero_stage);
  const bool piped = pipeline != nullptr && pipeline->comm().size() > 1;
  const bool experts = model.expert_parallel() != nullptr;
  const bool sharded = ddp.zero_stage > 0 && comm != nullptr && comm->size() > 1;
  const bool frozen = !model.frozen_ranges().empty();
  if (!piped && !experts && !sharded && !frozen) return all;
  // ZeRO shards one domain over the data-parallel ranks; under expert parallelism those ranks
  // hold different experts (Megatron shards experts over the expert-data-parallel group instead).
  LOOM_REFUSED(!experts || !sharded, "parallel.zero_stage = ", ddp.zero_stage, " with parallel.ep > 1 is not supported "
               "yet (the data-parallel ranks hold different experts): use zero_stage 0");
  if (piped || experts) {
    const char* what = piped ? "parallel.pp > 1" : "parallel.ep > 1";
    LOOM_REFUSED(ddp.zero_stage <= 1, "parallel.zero_stage = ", ddp.zero_stage, " with ", what, ": ZeRO-2/3 "
                 "shard the whole model, this rank updates only its own part; use zero_stage 0 or 1");
    LOOM_REFUSED(elementwise_optimizer(optim.kind), what, " needs an element-wise optimizer (each rank updates its own "
                 "part of the model), got optim.name = ", optimizer);
  } else if (sharded) {
    LOOM_REFUSED(elementwise_optimizer(optim.kind), "parallel.zero_stage = ", ddp.zero_stage, " shards at element "
                 "boundaries and needs an element-wise optimizer (sgd, momentum, nesterov, adagrad, rmsprop, adam, adamw, "
                 "lion), got optim.name = ", optimizer);
  }
  std::vector<OptimParam> mine;
  if (sharded && ddp.zero_stage >= 2) {  // the shard of the whole buffer (ZeroSharding's), less the frozen elements
    const ShardRange shard = shard_range(model.layout().total, comm->rank(), comm->size());
    for (const Range& piece : RangeSet::span(shard.begin, shard.end).subtract(model.frozen_ranges())) {
      for (OptimParam& p : shard_optim_params(all, piece.begin, piece.end)) mine.push_back(std::move(p));
    }
    return mine;
  }
  const RangeSet domain = update_domain(model, pipeline);
  const int64_t length = domain.size();
  const ShardRange shard = sharded ? shard_range(length, comm->rank(), comm->size()) : ShardRange{0, length, length};
  for (const Range& piece : domain.pieces(shard.begin, shard.end)) {
    for (OptimParam& p : shard_optim_params(all, piece.begin, piece.end)) mine.push_back(std::move(p));
  }
  return mine;
}
// Activation checkpointing: the plan train.recompute names, set on the model before its stores.
Trainer::RecomputeReport configure_recompute(Transformer& model, const TrainConfig& config) {
  Trainer::RecomputeReport r;
  const ModelConfig& c = model.config();
  model.set_flash_attention(config.flash_attention);  // first: it decides what attention keeps, counted below
  PlanChoices choices;  // what the kept fields' sizes depend on
  choices.flash = config.flash_attention;
  choose_precision(choices, resolve_policy(config.precision));
  RecomputeCosts costs;
  for (int64_t l = 0; l < c.n_layer; ++l) {
    std::array<int64_t, RECOMPUTE_COUNT> bytes{};
    for (int p = 0; p < RECOMPUTE_COUNT; ++p) {
      bytes[p] = block_kept_bytes(c, config.batch_size, config.seq_len, static_cast<RecomputePolicy>(p), choices);
    }
    costs.bytes.push_back(bytes);
  }
  costs.scratch_bytes = block_kept_bytes(c, config.batch_size, config.seq_len, RECOMPUTE_NONE, choices) +
                        4 * config.batch_size * config.seq_len * std::max(c.d_model, c.n_head * c.head_dim());
  costs.seconds.assign(static_cast<size_t>(c.n_layer), {0.0, 0.0, 0.0});
  if (config.recompute == "budget") {
    LOOM_CHECK(config.recompute_budget_mb > 0.0, "train.recompute = budget needs train.recompute_budget_mb > 0");
    costs.seconds = model.measure_recompute_seconds(config.batch_size, config.seq_len);
    r.plan = budget_recompute_plan(costs, static_cast<int64_t>(config.recompute_budget_mb * (1 << 20)));
  } else {
    r.plan = recompute_plan(config.recompute, c.n_layer);
  }
  r.kept_bytes = plan_bytes(costs, r.plan);
  r.no_recompute_bytes = plan_bytes(costs, recompute_plan("none", c.n_layer));
  r.seconds = plan_seconds(costs, r.plan);
  model.set_recompute(r.plan, config.offload_activations);
  return r;
}
}  // namespace

void TrainConfig::validate() const {
  LOOM_CHECK(batch_size > 0, "train.batch_size must be > 0, got ", batch_size);
  LOOM_CHECK(seq_len > 0, "train.seq_len must be > 0, got ", seq_len);
  LOOM_CHECK(grad_accum > 0, "train.grad_accum must be > 0, got ", grad_accum);
  LOOM_CHECK(steps > 0, "train.steps must be > 0, got ", steps);
  LOOM_CHECK(!offload_activations || recompute != "none", "train.offload_activations offloads the checkpointed "
             "blocks' activations: set train.recompute (selective, full, every:K or budget)");
  LOOM_CHECK(anomaly.spike_zscore >= 0.0, "train.spike_zscore must be >= 0 (0 = off), got ", anomaly.spike_zscore);
  LOOM_CHECK(anomaly.spike_window >= 2, "train.spike_window must be >= 2, got ", anomaly.spike_window);
  schedule.validate();
  if (loss_scaling) loss_scaler.validate();
  precision.validate();
  (void)optim.resolved();  // throws naming the optim.* key
}

Trainer::Trainer(Backend& backend, Transformer& model, TrainConfig config, Communicator* comm, DdpConfig ddp,
                 PipelineRunner* pipeline)
    : backend_(backend),
      model_(model),
      config_((config.validate(), config)),
      recompute_(pipeline != nullptr ? RecomputeReport{} : configure_recompute(model, config_)),
      schedule_([&] {
        ScheduleConfig s = config.schedule;
        s.total = config.steps;
        return s;
      }()),
      optim_params_(loom::optim_params(model.layout(), config.optim.resolved())),
      optimizer_(make_optimizer(backend, model.params(), model.grads(),
                                rank_params(optim_params_, comm, ddp, model, config.optim.resolved(), pipeline),
                                config.optim)),
      pipeline_(pipeline) {
  LOOM_REFUSED(pipeline_ == nullptr || config_.recompute == "none", "train.recompute = ", config_.recompute,
               " with parallel.pp > 1 is not supported yet");
  LOOM_REFUSED(pipeline_ == nullptr || !config_.flash_attention,
               "train.flash_attention with parallel.pp > 1 is not supported yet");
  LOOM_CHECK(pipeline_ == nullptr || pipeline_->schedule().micro == config_.grad_accum, "the pipeline schedule runs ",
             pipeline_ ? pipeline_->schedule().micro : 0, " micro-batches per step: set train.grad_accum to match (got ",
             config_.grad_accum, ")");
  domain_ = update_domain(model_, pipeline_);
  model_.set_precision(resolve_policy(config_.precision));
  // After the precision (the bf16-saved fields, nn/plan.h); a pipeline keeps its own stage
  // stores (parallel/pipeline.h), allocated by its runner after the same policy was set.
  if (pipeline_ == nullptr) store_ = model_.allocate_store(config_.batch_size, config_.seq_len);
  // ZeRO-Offload (Ren et al. 2021): with a 16-bit weight copy for the compute, the fp32 master
  // weights live in host memory beside the optimizer state; the device keeps the copy.
  if (config_.optim.offload && model_.precision().param_bf16) model_.params().move_to_category(MEM_OFFLOADED);
  if (comm != nullptr && comm->size() > 1) {
    LOOM_REFUSED(!optimizer_->keeps_gradients(), "data parallelism is not supported with optim.name = ", optimizer_->name(),
                 " (its error feedback lives in the gradient buffer, which the all-reduce would average)");
    comm_ = comm;
    const BackendCapabilities caps = backend_.capabilities();
    LOOM_REFUSED((ddp.zero_stage == 0 || caps.zero_sharding) && (ddp.compression == Compression::none || caps.gradient_compression),
                 "parallel.zero_stage > 0 and parallel.compression are not supported on the ", backend_.name(),
                 " backend yet (it lacks their ops): use plain data parallelism");
    if (ddp.zero_stage <= 1) {  // gradients all-reduced (stage 1 then shards the update)
      // Sequence parallel and LoRA under tp sum some gradients over the tp group after backward:
      // the data-parallel reduction then follows it instead of overlapping backward.
      if (!model_.tp_partial_ranges().empty()) ddp.overlap = false;
      ddp.frozen_below = model_.frozen_ranges().empty() ? 0 : model_.frozen_ranges().ranges()[0].end;
      ddp_ = std::make_unique<DataParallel>(*comm, backend_, model_.grads(), model_.layout(), ddp);
    } else {
      LOOM_REFUSED(ddp.compression == Compression::none, "parallel.compression = ", enum_name(ddp.compression), " replaces DDP's all-reduce; "
                   "parallel.zero_stage = ", ddp.zero_stage, " reduce-scatters instead: use zero_stage 0 or 1");
    }
    if (ddp.zero_stage >= 1) {
      LOOM_REFUSED(ddp.zero_stage < 3 || (!model_.precision().param_bf16 && !model_.precision().master_bf16),
                   "parallel.zero_stage = 3 shards the fp32 parameters; the bf16 weights of precision.param = bf16 or "
                   "precision.master = bf16 are not sharded: use f32 for both");
      // Stages 2 and 3 shard the whole buffer, a frozen base included (stage 3 its parameters);
      // stage 1 the update domain.
      const int64_t frozen_end = model_.frozen_ranges().empty() ? 0 : model_.frozen_ranges().ranges()[0].end;
      zero_ = std::make_unique<ZeroSharding>(*comm, backend_, static_cast<int>(ddp.zero_stage), model_.params(),
                                             model_.grads(), model_.param_units(),
                                             ddp.zero_stage >= 2 ? RangeSet{} : domain_,
                                             ddp.zero_stage >= 2 ? frozen_end : 0);
      if (zero_->stage() == 3) {
        model_.set_param_use_hooks({[this](int u, bool b) { zero_->use(u, b); }, [this](int u, bool b) { zero_->done(u, b); }});
      }
    }
  }
  if (Communicator* tp = model_.tensor_parallel(); tp != nullptr && tp->size() > 1) {
    LOOM_REFUSED(!optimizer_->keeps_gradients() && elementwise_optimizer(optimizer_->kind()),
                 "tensor parallelism needs an element-wise optimizer (each rank updates its slice), got optim.name = ",
                 optimizer_->name());
    tp_ = tp;
    tp_replicated_ = tp_replicated_ranges(model_.config());
    tp_partial_ = model_.tp_partial_ranges();
    LOOM_REFUSED(tp_partial_.empty() || !sharded_grads(), "parallel.sequence_parallel or peft.method = lora with "
                 "parallel.tp > 1 and parallel.zero_stage = ", ddp.zero_stage, " is not supported: the norms' (or the "
                 "adapters') gradients are summed over the tp group after backward, ZeRO-2/3 reduce-scatter them during "
                 "it; use zero_stage 0 or 1");
  }
  scalar_ = Tensor::zeros(host_, {1}, DTYPE_F64, MEM_WORKSPACE);
  if (store_.tokens.defined() && !store_.tokens.host_accessible()) {  // a GPU's batch is staged on the host
    host_tokens_ = Tensor::empty(host_, store_.tokens.shape(), DTYPE_I32, MEM_WORKSPACE);
    host_targets_ = Tensor::empty(host_, store_.targets.shape(), DTYPE_I32, MEM_WORKSPACE);
  }
  // The gradient elements the norm sums: the stages' (or all), within this rank's ZeRO-2/3 shard.
  norm_ranges_ = pipeline_ != nullptr ? pipeline_->norm_ranges() : RangeSet::span(0, model_.grads().numel());
  if (sharded_grads()) norm_ranges_ = norm_ranges_.intersect(RangeSet::span(zero_->range().begin, zero_->range().end));
  norm_ranges_ = norm_ranges_.subtract(model_.frozen_ranges());
  if (model_.precision().master_bf16) {  // no fp32 master: the weights are bf16 values from the start
    backend_.round_bf16(model_.params(), false, RoundingDraw{});
  }
  if (config_.loss_scaling) {
    LOOM_REFUSED(!optimizer_->keeps_gradients(), "precision.loss_scaling is not supported with optim.name = ",
                 optimizer_->name(), " (its error feedback lives in the gradient buffer, which unscaling would rescale)");
    scaler_ = std::make_unique<DynamicLossScaler>(config_.loss_scaler);
  }
  // The gradient buffer starts at zero; an optimizer that keeps error feedback in it (LDAdam)
  // leaves it for the next backward to add into, the others are zeroed before each step.
  if (!sharded_grads()) model_.zero_grads();
  // Frozen parameters have no gradients: their pages of the gradient buffer go back to the OS
  // (never written again, they hold no memory; `loom memory` measures the resident bytes).
  for (const auto& [b, e] : model_.frozen_ranges()) {
    if (model_.grads().host_accessible()) release_elements(model_.grads(), b, e);
  }
  params_loaded();
  if (config_.device_budget_mb > 0.0) {
    const MemoryTracker& mem = backend_.allocator().tracker();
    const int64_t device = static_cast<int64_t>(mem.current_total() - mem.current(MEM_OFFLOADED));
    const int64_t budget = static_cast<int64_t>(config_.device_budget_mb * (1 << 20));
    LOOM_CHECK(device <= budget, "device memory after setup is ", format_bytes(static_cast<size_t>(device)),
               " (optimizer state ", format_bytes(mem.current(MEM_OPTIMIZER_STATE)), ", activations ",
               format_bytes(mem.current(MEM_ACTIVATIONS)), "), above train.device_budget_mb = ",
               config_.device_budget_mb, " MiB: offload the optimizer state (optim.offload = true), recompute "
               "activations (train.recompute) or shard it (parallel.zero_stage)");
  }
}

StepStats Trainer::train_step(BatchSource& data) {
  const auto start = std::chrono::steady_clock::now();
  if (sharded_grads()) {
    zero_->zero_grads();  // this rank's shard zeroed, the rest released
  } else if (!optimizer_->keeps_gradients()) {
    model_.zero_grads();
  }
  model_.sync_weight_copy();  // the bf16 weight copy follows the master weights (if kept)
  double loss_sum = 0.0;
  const float loss_scale = scaler_ ? scaler_->scale() : 1.0f;
  const float loss_weight = loss_scale / static_cast<float>(config_.grad_accum);
  if (pipeline_ != nullptr) {
    const TraceSpan span(tracer_, "pipeline schedule", "compute");
    // All micro-batches, by the schedule; their LoRA dropout passes numbered as one process's.
    loss_sum = pipeline_->run(data, loss_weight, static_cast<uint32_t>(step_ * config_.grad_accum + 1));
    LOOM_CHECK(scaler_ || !stops_on_anomaly() || std::isfinite(loss_sum), "loss is ", loss_sum, " at step ", step_,
               "; stopping before the update, the weights are unchanged");
  }
  int64_t valid = 0;  // positions whose target counts (loss masks: the others are kIgnoreTarget)
  for (int64_t micro = 0; pipeline_ == nullptr && micro < config_.grad_accum; ++micro) {
    {
      const TraceSpan span(tracer_, "data", "data");
      valid += load_batch(data);
    }
    const int64_t forward_start = tracer_ != nullptr ? Tracer::now_ns() : 0;
    if (objective_ != nullptr) objective_->before_forward(backend_, store_);
    store_.dropout_pass = static_cast<uint32_t>(step_ * config_.grad_accum + micro + 1);  // peft.dropout's masks
    // The plain loss: its gradient comes with it (the objectives weigh the losses after the forward).
    store_.fused_loss_weight = objective_ == nullptr ? loss_weight : 0.0f;
    double loss = model_.forward(store_);
    if (objective_ != nullptr) loss = objective_->weigh(backend_, store_, data);
    if (tracer_ != nullptr) tracer_->complete("forward", "compute", forward_start);
    const TraceSpan backward_span(tracer_, "backward", "compute");
    // With loss scaling a non-finite loss (an fp16 overflow) makes non-finite gradients: skipped.
    // Data parallel ranks check the mean over ranks below, so that all of them stop together.
    LOOM_CHECK(scaler_ || ddp_ || !stops_on_anomaly() || std::isfinite(loss), "loss is ", loss, " at step ", step_,
               " (micro-batch ", micro, "); stopping before the update, the weights are unchanged");
    loss_sum += loss;
    if (sharded_grads() && !model_.frozen_ranges().empty()) {  // LoRA: the adapters, after the whole backward
      model_.backward(store_, loss_weight);
      zero_->reduce_from(0);  // (from the frozen end)
      zero_->finish_micro();
    } else if (sharded_grads()) {  // ZeRO-2/3: every micro-batch's gradients are reduce-scattered
      model_.backward(store_, loss_weight, [this](int64_t offset) { zero_->reduce_from(offset); });
      zero_->finish_micro();
    } else if (ddp_ && micro + 1 == config_.grad_accum) {  // earlier micro-batches: no-sync
      model_.backward(store_, loss_weight, [this](int64_t offset) { ddp_->ready_from(offset); });
    } else {
      model_.backward(store_, loss_weight);
    }
  }
  for (const auto& [b, e] : tp_partial_) {  // partial sums over the tp group: the sequence shards', the slices'
    model_.tensor_parallel()->all_reduce(model_.grads().view(b, {e - b}));
  }
  if (comm_ != nullptr) {
    const TraceSpan span(tracer_, "gradient sync", "sync");  // (its collectives are "comm" events)
    if (ddp_) ddp_->finish();
    if (sharded_grads()) zero_->finish();
    loss_sum = sum_over(*comm_, loss_sum) / comm_->size();
    LOOM_CHECK(scaler_ || !stops_on_anomaly() || std::isfinite(loss_sum), "loss is ", loss_sum, " at step ", step_,
               " (mean over ranks); stopping before the update, the weights are unchanged");
  }
  if (step_ == config_.anomaly.fault_step && !fault_injected_) {  // train.inject_fault: what a bad batch would do
    fault_injected_ = true;  // once: the batch that follows a rollback is another
    const double factor = config_.anomaly.fault == FaultKind::nan ? NAN : 100.0;
    loss_sum *= factor;
    scale_grads(factor);
  }
  // Loss masks: backward gave the mean over all of the step's positions, the masked ones counted
  // as 0; the loss is the mean over the positions that count, on every rank and micro-batch
  // together, so every layout gives the one-process loss: loss and gradients times
  // positions / valid (a no-op without masks, skipped).
  // A step whose every target is masked (short windows of supervised data can fall between
  // replies) has no loss: it makes no update (skipped, loss NaN).
  // (Pipelines: the runner counted its micro-batches' positions, on every rank of the pipeline.)
  if (pipeline_ != nullptr) valid = pipeline_->valid_targets();
  const int64_t local = pipeline_ != nullptr ? pipeline_->positions() : config_.grad_accum * store_.tokens.numel();
  const int64_t positions = (comm_ != nullptr ? comm_->size() : 1) * local;
  bool nothing_counted = false;
  if (objective_ == nullptr) {  // (an objective's loss is its own mean)
    if (comm_ != nullptr) valid = static_cast<int64_t>(sum_over(*comm_, static_cast<double>(valid)));
    nothing_counted = valid == 0;
    if (valid != positions && !nothing_counted) {
      const double factor = static_cast<double>(positions) / static_cast<double>(valid);
      scale_grads(factor);
      loss_sum *= factor;
    }
  }
  StepStats stats;
  stats.step = step_;
  stats.loss = nothing_counted ? NAN : loss_sum / static_cast<double>(config_.grad_accum);
  stats.loss_scale = loss_scale;
  stats.tokens = config_.grad_accum * config_.batch_size * config_.seq_len;
  stats.lr = schedule_.lr(step_);
  const PrecisionPolicy& policy = model_.precision();
  // The gradient elements this rank holds: all, or (ZeRO-2/3) its shard.
  const int64_t g_begin = sharded_grads() ? zero_->range().begin : 0;
  const Tensor grads = sharded_grads() ? model_.grads().view(g_begin, {zero_->range().end - g_begin}) : model_.grads();
  if (policy.reduce_bf16) {  // the gradient reduction's dtype (one rank: the accumulated sum)
    backend_.round_bf16(grads, false, RoundingDraw{});
  }
  stats.skipped = nothing_counted;
  if (!scaler_ && !nothing_counted) {  // train.on_anomaly: a non-finite or spiking loss
    stats.anomaly = classify(stats.loss, stats.spike_z);
    if (stats.anomaly != Anomaly::none) stats.grad_norm = NAN;  // (not computed for a step the loss rules out)
    LOOM_CHECK(stats.anomaly != Anomaly::nonfinite || !stops_on_anomaly(), "loss is ", stats.loss, " at step ", step_,
               "; stopping before the update, the weights are unchanged (train.on_anomaly = skip or rollback continue "
               "instead)");
    LOOM_CHECK(stats.anomaly != Anomaly::spike || !stops_on_anomaly(), "loss ", stats.loss, " at step ", step_,
               " is a spike (z-score ", stats.spike_z, " over the last ", recent_losses_.size(), " steps, above "
               "train.spike_zscore = ", config_.anomaly.spike_zscore, "); stopping before the update, the weights "
               "are unchanged (train.on_anomaly = skip or rollback continue instead)");
    stats.skipped = stats.anomaly != Anomaly::none;
  }
  if (scaler_ && !nothing_counted) {
    // GradScaler: unscale; with inf/NaN gradients skip the step, leaving the weights and the
    // optimizer state as they are (the next step zeroes the gradients).
    stats.skipped = scaler_->unscale(backend_, grads);
    if (sharded_grads()) stats.skipped = sum_over(*comm_, stats.skipped ? 1.0 : 0.0) > 0.0;
    scaler_->update(stats.skipped);
  }
  if (!stats.skipped) {
    stats.grad_norm = global_grad_norm();
    LOOM_CHECK(std::isfinite(stats.grad_norm) || !stops_on_anomaly(), "gradient norm is ", stats.grad_norm, " at step ",
               step_, "; stopping before the update, the weights are unchanged");
    if (!std::isfinite(stats.grad_norm) && !scaler_) stats.anomaly = Anomaly::nonfinite, stats.skipped = true;
  }
  if (stats.skipped) {
    if (stats.anomaly == Anomaly::none) stats.grad_norm = nothing_counted ? 0.0 : INFINITY;
  } else {
    const TraceSpan span(tracer_, "optimizer", "compute");
    optimizer_->step(static_cast<float>(stats.lr), clip_coefficient(stats.grad_norm, config_.grad_clip));
    if (policy.master_bf16) {  // no fp32 master: the update lands in bf16 (nearest or stochastic)
      backend_.round_bf16(model_.params(), policy.stochastic_rounding,
                          RoundingDraw{kRoundingSeed, 0, static_cast<uint32_t>(step_)});
    }
    if (zero_ && zero_->stage() <= 2) zero_->gather_params();  // every rank's updated shard to all
  }
  if (!stats.skipped) {  // the window of accepted losses
    recent_losses_.push_back(stats.loss);
    if (static_cast<int64_t>(recent_losses_.size()) > config_.anomaly.spike_window) recent_losses_.pop_front();
  }
  model_.moe_end_step(comm_);  // routing statistics over the data-parallel ranks; the routing bias update
  model_.end_step();
  backend_.synchronize();  // a device's queued work belongs to this step's time
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ++step_;
  return stats;
}

void Trainer::scale_grads(double factor) {
  const int64_t begin = sharded_grads() ? zero_->range().begin : 0;
  const int64_t end = sharded_grads() ? zero_->range().end : model_.grads().numel();
  for (const Range& r : RangeSet::span(begin, end).subtract(model_.frozen_ranges())) {
    backend_.scale_inplace(model_.grads().view(r.begin, {r.end - r.begin}), factor);
  }
}

Anomaly Trainer::classify(double loss, double& z) const {
  z = 0.0;
  if (!std::isfinite(loss)) return Anomaly::nonfinite;
  const auto n = static_cast<int64_t>(recent_losses_.size());
  if (config_.anomaly.spike_zscore <= 0.0 || n < config_.anomaly.spike_window || n < 2) return Anomaly::none;
  double mean = 0.0, var = 0.0;
  for (double l : recent_losses_) mean += l;
  mean /= static_cast<double>(n);
  for (double l : recent_losses_) var += (l - mean) * (l - mean);
  const double sd = std::sqrt(var / static_cast<double>(n - 1));
  // A flat window (sd 0) flags any rise; a floor of 1e-3 of the mean keeps noise from counting.
  z = (loss - mean) / std::max(sd, 1e-3 * std::abs(mean) + 1e-12);
  return z > config_.anomaly.spike_zscore ? Anomaly::spike : Anomaly::none;
}

double Trainer::global_grad_norm() {
  const Tensor& grads = model_.grads();
  const RangeSet& ranges = norm_ranges_;  // ZeRO-2/3: this rank holds its shard's gradients
  double sq = 0.0, replicated = 0.0;
  for (const auto& [b, e] : ranges) {
    if (b < e) sq += std::pow(grad_norm(backend_, grads.view(b, {e - b})), 2);
  }
  if (tp_ != nullptr) {  // sliced parameters: their squares summed over the group; replicated ones once
    for (const auto& [rb, re] : tp_replicated_) {
      for (const auto& [b, e] : ranges) {
        const int64_t lo = std::max(b, rb), hi = std::min(e, re);
        if (lo < hi) replicated += std::pow(grad_norm(backend_, grads.view(lo, {hi - lo})), 2);
      }
    }
  }
  if (sharded_grads()) {  // the shards' parts
    sq = sum_over(*comm_, sq);
    if (tp_ != nullptr) replicated = sum_over(*comm_, replicated);
  }
  if (tp_ != nullptr) sq = std::max(0.0, sum_over(*tp_, sq - replicated)) + replicated;
  if (pipeline_ != nullptr && pipeline_->comm().size() > 1) sq = sum_over(pipeline_->comm(), sq);  // the stages' parts
  return std::sqrt(sq);
}

double Trainer::sum_over(Communicator& group, double x) {
  scalar_.data<double>()[0] = x;
  group.all_reduce(scalar_);
  return scalar_.data<double>()[0];
}

void Trainer::params_loaded() {
  if (zero_) zero_->release_params();
  // Expert parallel: the experts other ranks compute are never read here; their pages go back
  // to the OS (core/pages.h), so each rank's resident expert weights are its 1/ep. A device's
  // memory is not paged by the host: they are zeroed through the backend, the same values.
  for (const auto& [b, e] : model_.foreign_expert_ranges()) {
    if (model_.params().host_accessible()) release_elements(model_.params(), b, e);
    else backend_.fill(model_.params().view(b, {e - b}), 0.0);
  }
}

void Trainer::gather_params() {
  if (zero_) zero_->gather_params();
}

void Trainer::restore(int64_t step, int64_t optimizer_steps) {
  LOOM_CHECK(step >= 0 && step <= config_.steps, "checkpoint step ", step, " outside [0, train.steps = ", config_.steps, "]");
  step_ = step;
  optimizer_->restore_steps_taken(optimizer_steps);
}

int64_t Trainer::load_batch(BatchSource& data) {
  const Tensor& targets = store_.tokens.host_accessible() ? store_.targets : host_targets_;
  if (store_.tokens.host_accessible()) {
    data.fill(store_.tokens, store_.targets);
  } else {
    data.fill(host_tokens_, host_targets_);
    backend_.write(store_.tokens, host_tokens_.raw_data());
    backend_.write(store_.targets, host_targets_.raw_data());
  }
  const int64_t n = targets.numel();
  const int64_t valid = counted_targets(targets.data<int32_t>(), n);
  if (data.document_end() >= 0) {  // packed documents: their spans, from the host's tokens
    const Tensor& tokens = store_.tokens.host_accessible() ? store_.tokens : host_tokens_;
    store_.docs = document_spans(tokens.data<int32_t>(), tokens.dim(0), tokens.dim(1), data.document_end());
  }
  return valid;
}

const ActivationStore& Trainer::forward_only(BatchSource& data) {
  LOOM_CHECK(pipeline_ == nullptr, "Trainer::forward_only with pipeline stages is not supported");
  model_.sync_weight_copy();
  model_.set_recording(false);
  load_batch(data);
  store_.dropout_pass = 0;
  model_.forward(store_);
  model_.set_recording(true);
  return store_;
}

double Trainer::evaluate(BatchSource& data, int64_t batches) {
  model_.sync_weight_copy();
  model_.set_recording(false);
  if (pipeline_ != nullptr) {
    const double loss = pipeline_->evaluate(data, batches);
    model_.set_recording(true);
    return loss;
  }
  double sum = 0.0;
  int64_t valid = 0;
  const int64_t positions = store_.tokens.numel();
  store_.dropout_pass = 0;  // no dropout in evaluation
  RowObjective* objective = objective_ != nullptr && objective_->evaluates_own_loss() ? objective_ : nullptr;
  for (int64_t i = 0; i < batches; ++i) {
    valid += load_batch(data);
    if (objective != nullptr) objective->before_forward(backend_, store_);
    const double loss = model_.forward(store_);
    sum += objective != nullptr ? objective->weigh(backend_, store_, data) : loss;
  }
  model_.set_recording(true);
  if (batches == 0) return 0.0;
  if (objective != nullptr) return sum / static_cast<double>(batches);
  // Loss masks: the mean over the positions that count (forward's mean counts the others as 0).
  if (valid != batches * positions) return valid > 0 ? sum * static_cast<double>(positions) / static_cast<double>(valid) : NAN;
  return sum / static_cast<double>(batches);
}

}  // namespace loom
