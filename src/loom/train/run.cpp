#include "loom/train/run.h"

#include <cmath>
#include <filesystem>

#include "loom/checkpoint/peft.h"
#include "loom/checkpoint/weights.h"
#include "loom/core/error.h"
#include "loom/core/file_io.h"
#include "loom/core/pages.h"
#include "loom/core/utf8.h"
#include "loom/infer/generate.h"
#include "loom/train/model_source.h"

namespace loom {

namespace fs = std::filesystem;

namespace {

// Refuses, before anything is allocated, a run whose estimated memory (memory/estimate.h, what
// --dry-run and `loom memory` print) is more than the machine has available for all of its ranks
// here: the OOM killer would end it mid-run instead.
void check_memory_fits(const LoomConfig& config, const ParallelLayout& layout, int world) {
  const MemoryEstimate est = estimate_memory(memory_plan(config, layout.batch_group().size()));
  const int local = detect_launch().local_size;  // ranks on this machine (0: unknown, all of them)
  const int64_t here = local > 0 ? local : world;
  const int64_t need = est.total() * here, available = available_memory_bytes();
  LOOM_CHECK(available == 0 || need <= available, "the run needs an estimated ", format_bytes(static_cast<size_t>(need)),
             here > 1 ? str_cat(" (", here, " ranks here x ", format_bytes(static_cast<size_t>(est.total())), ")") : std::string(),
             " (parameters ", format_bytes(static_cast<size_t>(est.bytes[MEM_PARAMETERS])), ", optimizer state ",
             format_bytes(static_cast<size_t>(est.bytes[MEM_OPTIMIZER_STATE])), ", activations ",
             format_bytes(static_cast<size_t>(est.bytes[MEM_ACTIVATIONS])), ") but this machine has ",
             format_bytes(static_cast<size_t>(available)), " available: lower train.batch_size or train.seq_len, recompute "
             "activations (train.recompute), shard the state (parallel.zero_stage), or set train.memory_check = false");
}

// config.sample from `model`, on its backend (a GPU run samples on the GPU): the printable text.
std::string final_sample(const LoomConfig& config, Transformer& model) {
  if (config.sample.max_new_tokens == 0) return valid_utf8(config.sample.prompt);  // no sample (and no decoding)
  const auto tokenizer = load_tokenizer(config.data.tokenizer);
  std::vector<int32_t> prompt = tokenizer->encode(config.sample.prompt);
  if (prompt.empty()) prompt.push_back(tokenizer->eot_token());
  GenerateOptions options;
  options.max_new_tokens = config.sample.max_new_tokens;
  options.stop_token = tokenizer->eot_token();
  std::vector<int32_t> sample = generate(model, prompt, config.sample.sampling, options);
  if (!sample.empty() && sample.back() == tokenizer->eot_token()) sample.pop_back();
  return valid_utf8(config.sample.prompt + tokenizer->decode(sample));
}

// A held-out measure as its metrics.jsonl record (without the memory).
ValidationRecord validation_record(int64_t step, const Validation& v) {
  ValidationRecord r;
  r.step = step;
  (v.reward ? r.val_reward : r.val_loss) = v.value;
  return r;
}

}  // namespace

void resolve_run_config(LoomConfig& config) {
  config.train.optim = config.train.optim.resolved();  // the written config names every default
  if (!config.loop.init_from.empty()) {  // the model is the weights' (checked against the data later)
    config.loop.init_from = resolve_weights(config.loop.init_from);
    const ModelConfig weights = weights_model_config(config.loop.init_from);
    // The run's peft.* apply to weights without adapters (LoRA on an imported model).
    config.model = weights.lora() ? weights : with_peft_of(weights, config.model);
  }
  if (!config.loop.peft_adapter.empty()) config.model = peft_adapter_config(config.loop.peft_adapter, config.model);
}

// The objective's records go to metrics.jsonl, its lines to the observer.
class TrainingRun::Sink final : public ObjectiveSink {
 public:
  explicit Sink(TrainingRun& run) : run_(run) {}
  void record(const ObjectiveRecord& record) override { run_.metrics_->write(to_json(record)); }
  void line(const std::string& text) override { run_.observer_.line(text); }

 private:
  TrainingRun& run_;
};

TrainingRun::TrainingRun(LoomConfig config, RunOptions options, RunObserver& observer, std::unique_ptr<Communicator> world)
    : config_(std::move(config)), options_(std::move(options)), observer_(observer), comm_(std::move(world)) {
  config_.validate_objective();  // a wrong data.format is named before any data is opened
  objective_ = objective_row(config_.loop.objective).make(config_);
  objective_->read_data(config_);
  config_.validate();
  set_up_folder();
  set_up_training();
  if (options_.resume) resume();
}

TrainingRun::~TrainingRun() = default;

// Every rank of the world trains its part of the layout. Rank 0 writes the run folder; the other
// ranks keep their logs and metrics in <run>/logs.
void TrainingRun::set_up_folder() {
  lead_ = comm_->rank() == 0;
  backend_ = make_backend(config_.device);
  layout_ = std::make_unique<ParallelLayout>(config_, *comm_, *backend_);  // refuses an unsupported combination
  dir_ = run_dir(config_);
  fs::create_directories(dir_);
  observer_.starting(comm_->rank());
  if (lead_ && !options_.dry_run) {  // rank 0 holds the run folder (docs/operations.md)
    lock_ = std::make_unique<RunFolderLock>(dir_);
    const std::string removed = prepare_run_folder(dir_, options_.resume, options_.overwrite);
    if (!removed.empty()) observer_.line(str_cat("--overwrite: deleted ", removed, " of ", dir_));
  }
  comm_->barrier();  // the folder is ready before the other ranks write their logs into it
  if (lead_ && !options_.dry_run && config_.loop.memory_check && config_.device == DEVICE_CPU) {
    check_memory_fits(config_, *layout_, comm_->size());
  }
  if (!lead_) fs::create_directories(fs::path(dir_) / "logs");
  observer_.folder_ready(dir_, comm_->rank());
  for (const std::string& note : layout_->notes()) observer_.line("note: " + note);
  if (!config_.loop.init_from.empty()) {
    observer_.line(str_cat("weights from ", config_.loop.init_from, " (train.init_from: its model config replaces model.*)"));
  }
  config_text_ = config_to_toml(config_);
  if (lead_) write_file_atomic((fs::path(dir_) / "config.toml").string(), config_text_);
}

// The model and trainer, the objective's batches and set-up (its reference: the initial weights,
// before a resume loads later ones), the checkpoint state.
void TrainingRun::set_up_training() {
  parts_ = parallelize(*backend_, config_, *layout_);
  data_ = std::make_unique<TrainingData>(objective_->make_splits(config_, *parts_.model), config_, *layout_,
                                         backend_->allocator());
  state_ = std::make_unique<TrainingState>(*backend_, config_, *layout_, parts_, (fs::path(dir_) / "checkpoints").string(),
                                           config_text_);
  sink_ = std::make_unique<Sink>(*this);
  ctx_ = std::make_unique<ObjectiveContext>(ObjectiveContext{*backend_, config_, parts_, *data_, *sink_});
  objective_->set_up(*ctx_);
}

void TrainingRun::resume() {
  LOOM_CHECK(options_.resume_from.empty() || fs::exists(options_.resume_from), "--resume ", options_.resume_from,
             ": no such checkpoint, run or checkpoints folder");
  const std::string from = options_.resume_from.empty() ? "" : resolve_checkpoint(options_.resume_from);
  const auto loaded = state_->resume([this](const std::string& line) { observer_.warning(line); }, from);
  resumed_step_ = loaded ? loaded->step : 0;
  if (!loaded) {
    observer_.line(str_cat("no checkpoint in ", dir_, "/checkpoints; starting from scratch"));
    return;
  }
  data_->loader().restore(loaded->data_state.get<LoaderState>());
  parts_.model->release_base();  // QLoRA: the checkpoint wrote the quantized base's fp32 elements
  observer_.line(str_cat("resumed from ", loaded->path, " (step ", loaded->step, ")"));
  const std::vector<std::string> changed = config_differences(loaded->config_text, config_text_);
  if (!changed.empty() && lead_) {
    std::string list;
    for (const std::string& c : changed) list += (list.empty() ? "" : "; ") + c;
    observer_.warning(str_cat("the config differs from the checkpoint's in ", changed.size(), " key",
                              changed.size() == 1 ? "" : "s", ": ", list));
  }
}

// The trace, the GEMM peak MFU is stated against, the header, metrics.jsonl and its start record.
void TrainingRun::start_reporting() {
  Trainer& trainer = *parts_.trainer;
  // Traces (docs/operations.md) start before the first collective below, so that the trace's
  // bytes add up to the ledgers'.
  if (config_.loop.trace) {
    tracer_ = std::make_unique<Tracer>(comm_->rank());
    trainer.set_tracer(tracer_.get());
    state_->set_tracer(tracer_.get());
    for (const auto& [name, group] : layout_->communicators()) group->set_tracer(tracer_.get(), name);
  }
  scalar_ = Tensor::zeros(scalar_host_, {1}, DTYPE_F64, MEM_WORKSPACE);
  // MFU is stated against the GEMM peak of the run's compute dtype (train/throughput.h). Rank 0
  // reads it from the machine's cache or measures it and sends it to the others, so that ranks
  // sharing cores do not measure it against each other.
  peak_.dtype = mfu_dtype(parts_.model->precision());
  if (comm_->rank() == 0) peak_ = gemm_peak(*backend_, peak_.dtype, default_peak_cache_dir());
  peak_.measured_gflops = world_max(peak_.measured_gflops);
  flops_per_token_ = train_flops_per_token(config_.model, config_.train.seq_len);
  observer_.started(*this);
  metrics_ = std::make_unique<MetricsLog>(
      lead_ ? (fs::path(dir_) / "metrics.jsonl").string()
            : (fs::path(dir_) / "logs" / ("metrics.rank" + std::to_string(comm_->rank()) + ".jsonl")).string(),
      resumed_step_);
  if (metrics_->dropped() > 0 && lead_) {
    observer_.warning(str_cat("metrics.jsonl: dropped ", metrics_->dropped(), " record", metrics_->dropped() == 1 ? "" : "s",
                              " after step ", resumed_step_, " (the run resumes from there and writes them again)"));
  }
  if (comm_->size() > 1) {
    observer_.line(layout_->describe(config_.train.batch_size, config_.train.grad_accum, config_.train.seq_len));
  }
  if (const ZeroSharding* zero = parts_.trainer->zero()) {
    observer_.line(str_cat("ZeRO-", zero->stage(), " over ", layout_->reduce_group().size(),
                           " ranks: this rank keeps the optimizer state of ", zero->range().end - zero->range().begin,
                           " of the ", zero->domain_size(), " parameters it ",
                           parts_.pipeline ? "updates (its pipeline stages)" : "holds"));
  }
  const int64_t n_params = param_count(config_.model), state_bytes = trainer.optimizer().state_bytes();
  StartRecord start;
  start.event = options_.resume ? "resume" : "start";
  start.start_step = trainer.step(), start.optimizer = trainer.optimizer().name(), start.parameters = n_params;
  start.optimizer_state_bytes = state_bytes;
  start.state_bytes_per_param = static_cast<double>(state_bytes) / static_cast<double>(n_params);
  start.schedule = std::string(enum_name(config_.train.schedule.kind));
  start.precision = parts_.model->precision().describe(), start.loss_scaling = config_.train.loss_scaling;
  start.mfu_peak_dtype = std::string(dtype_name(peak_.dtype));
  start.mfu_peak_gflops = peak_.measured_gflops, start.datasheet_peak_gflops = peak_.datasheet_gflops;
  metrics_->write(to_json(start));
  if (trainer.step() > 0) return;
  if (const std::optional<Validation> v = objective_->at_start(*ctx_)) {  // the curve's start
    metrics_->write(to_json(validation_record(0, *v)));
    objective_->after_validation(*ctx_, 0, *v);
  }
}

int TrainingRun::run() {
  if (options_.dry_run) {
    observer_.dry_run(*this);
    return 0;
  }
  start_reporting();
  // Operations (docs/operations.md): preemption signals and the collective watchdog.
  signals_ = std::make_unique<StopSignals>();
  watchdog_ = std::make_unique<Watchdog>(config_.loop.watchdog_seconds, dir_, *comm_);
  return finish(loop());
}

TrainingRun::End TrainingRun::loop() {
  Trainer& trainer = *parts_.trainer;
  while (trainer.step() < config_.train.steps) {
    const nlohmann::json position = data_->loader().state();  // names the batch if it proves bad
    const int64_t step_start = tracer_ ? Tracer::now_ns() : 0;
    const StepStats stats = trainer.train_step(data_->train());
    if (tracer_) tracer_->complete("step", "step", step_start);
    watchdog_->beat(stats.step);
    if (stats.anomaly != Anomaly::none) {  // no update: reported, not recorded as a step
      report_anomaly(stats, position);
      if (agree_on_stop()) return End::preempted;
      continue;
    }
    const int64_t done = trainer.step();
    const bool last = done == config_.train.steps;
    const bool eval_now = config_.loop.eval_every > 0 && done % config_.loop.eval_every == 0;
    record_step(stats, options_.verbose || eval_now || done % config_.loop.log_every == 0 || last);
    if (eval_now || last) validate(done);
    const bool signalled = agree_on_stop();
    const bool stopping = done == options_.stop_at && done < config_.train.steps;  // --stop-at-step
    const bool due = (config_.loop.checkpoint_every > 0 && done % config_.loop.checkpoint_every == 0) || stopping || last;
    if (due && config_.loop.save_checkpoints) {
      // The last checkpoint and a stopping one are written in the step (the process ends next).
      save_checkpoint(config_.loop.async_checkpoint && !stopping && !signalled && !last);
      watchdog_->beat(stats.step);
    }
    if (signalled) return End::preempted;  // (its checkpoint: the one above, or its own)
    if (stopping) return End::stopped;
  }
  return End::finished;
}

// Every rank stops at the same step: the first to see a signal decides (one MAX all-reduce).
bool TrainingRun::agree_on_stop() {
  stop_signal_ = static_cast<int>(world_max(signals_->requested()));
  return stop_signal_ != 0;
}

// A step whose loss or gradients train.on_anomaly let through without an update: a warning and a
// record; under rollback the newest valid checkpoint is loaded (the data loader keeps its place).
void TrainingRun::report_anomaly(const StepStats& stats, const nlohmann::json& position) {
  const bool spike = stats.anomaly == Anomaly::spike;
  const std::string what = spike ? str_cat("loss ", stats.loss, " is a spike (z-score ", stats.spike_z, ")")
                           : std::isfinite(stats.loss) ? str_cat("gradient norm ", stats.grad_norm, " is not finite")
                                                       : str_cat("loss ", stats.loss, " is not finite");
  const std::string batch = str_cat("epoch ", position.value("epoch", 0), ", window ", position.value("index", 0));
  std::string action = "skipped (no update)";
  if (config_.train.anomaly.policy == AnomalyPolicy::rollback) {
    finish_save();
    const auto loaded = state_->resume([this](const std::string& line) { observer_.warning(line); });
    if (loaded) parts_.model->release_base();
    action = loaded ? str_cat("skipped; rolled back to the checkpoint of step ", loaded->step)
                    : std::string("skipped (no checkpoint to roll back to yet)");
  }
  observer_.warning(str_cat("step ", stats.step + 1, ": ", what, "; the batch at data position ", batch, " ", action,
                            action.find("rolled back") != std::string::npos ? " (the batches since it are not replayed)" : ""));
  metrics_->write(to_json(AnomalyRecord{stats.step + 1, spike ? "spike" : "nonfinite", stats.loss, stats.spike_z, position,
                                        action, parts_.trainer->step() + 1}));
}

// The step record (metrics.jsonl), the progress line, then the objective's records and lines.
void TrainingRun::record_step(const StepStats& stats, bool logged) {
  const Communicator& dp = layout_->batch_group();
  resident_params_ = resident_bytes(parts_.model->params());
  resident_grads_ = resident_bytes(parts_.model->grads());
  seconds_sum_ += stats.seconds;
  ++steps_timed_;
  StepReport r;
  r.stats = stats;
  r.total_steps = config_.train.steps;
  r.tokens = stats.tokens * dp.size();
  r.tokens_per_s = static_cast<double>(r.tokens) / stats.seconds;  // all data-parallel ranks
  r.mfu = r.tokens_per_s * flops_per_token_ / (peak_.measured_gflops * 1e9 * comm_->size());  // peak measured per rank
  if (!warned_above_peak_) {  // rank 0 holds the cached peak (the others only its value)
    const std::string w = peak_.above_peak_warning(r.mfu);
    if (!w.empty()) observer_.warning(str_cat("step ", stats.step + 1, ": ", w));
    warned_above_peak_ = !w.empty();
  }
  r.memory_bytes = memory().current_total();
  r.eta_seconds = seconds_sum_ / static_cast<double>(steps_timed_) *
                  static_cast<double>(config_.train.steps - parts_.trainer->step());
  // This rank's traffic over every communicator of the layout (world, tp, pp, cp, ep, dp, ...).
  int64_t received = 0;
  nlohmann::json comm_json = nlohmann::json::object();
  for (const auto& [name, group] : layout_->communicators()) {
    const ByteLedger& ledger = group->ledger();
    r.bytes_sent += ledger.total_sent(), received += ledger.total_received();
    if (ledger.total_sent() + ledger.total_received() == 0) continue;
    comm_json[name] = ledger_json(ledger);
    r.sent_by_group += str_cat(r.sent_by_group.empty() ? "" : ", ", name, " ",
                               format_bytes(static_cast<size_t>(ledger.total_sent())));
  }
  StepRecord record;
  record.step = stats.step + 1, record.loss = stats.loss, record.lr = stats.lr, record.grad_norm = stats.grad_norm;
  record.tokens = r.tokens, record.seconds = stats.seconds, record.loss_scale = stats.loss_scale;
  record.skipped = stats.skipped, record.tokens_per_s = r.tokens_per_s, record.mfu = r.mfu;
  record.memory_bytes = r.memory_bytes, record.ranks = comm_->size();
  record.comm_bytes_sent = r.bytes_sent, record.comm_bytes_received = received, record.comm = comm_json;
  // Measured residency (core/pages.h): under ZeRO-2/3 less than the buffers' size.
  record.resident_bytes = ResidentBytes{resident_params_, resident_grads_};
  record.moe = moe_json(parts_.model->moe_stats());
  metrics_->write(to_json(record));
  r.logged = logged;
  observer_.step(r);
  objective_->after_step(*ctx_, stats, logged);
}

// The objective's held-out measure ({"step", key, "memory"}), then its records and line.
void TrainingRun::validate(int64_t step) {
  const TraceSpan span(tracer_.get(), "validation", "eval");
  const Validation v = objective_->validate(*ctx_);
  last_val_ = v.value;
  ValidationRecord record = validation_record(step, v);
  record.memory = memory_json(memory());
  metrics_->write(to_json(record));
  objective_->after_validation(*ctx_, step, v);
}

void TrainingRun::save_checkpoint(bool async) {
  Transformer& model = *parts_.model;
  const bool whole_base = !state_->pages_base();  // else the save pages it in one matrix at a time
  if (whole_base) model.materialize_base();  // QLoRA: the checkpoint holds the dequantized base
  const TraceSpan span(tracer_.get(), async ? "checkpoint snapshot" : "checkpoint", "checkpoint");
  try {
    last_saved_ = state_->save(data_->loader().state(), async);
    last_saved_step_ = parts_.trainer->step();
  } catch (const Error& e) {
    if (config_.loop.stop_on_save_error) throw;
    observer_.warning(str_cat("step ", parts_.trainer->step(), ": checkpoint not saved: ", e.what(),
                              "; training goes on (train.stop_on_save_error = false), the previous checkpoint stays valid"));
  }
  if (whole_base) model.release_base();
}

// A save in flight (async) reports its error at the next save or here.
void TrainingRun::finish_save() {
  try {
    state_->wait_for_save();
  } catch (const Error& e) {
    if (config_.loop.stop_on_save_error) throw;
    observer_.warning(str_cat("checkpoint not saved: ", e.what()));
  }
}

// The one way out: the save in flight finished, the trace written; a preempted run checkpoints
// its step (unless one was just written) and exits kPreemptedExit for a scheduler or supervisor
// to resume; a finished one samples and reports.
int TrainingRun::finish(End end) {
  const int64_t step = parts_.trainer->step();
  finish_save();
  if (end == End::preempted && last_saved_step_ != step && config_.loop.save_checkpoints) save_checkpoint(false);
  const std::string saved = last_saved_step_ == step ? last_saved_ : "(not saved)";
  if (end == End::preempted) {
    observer_.line(str_cat("stopped by ", StopSignals::name(stop_signal_), " after step ", step, "; checkpoint ", saved,
                           "; continue with --resume"));
  } else if (end == End::stopped) {
    observer_.line(str_cat("stopped after step ", step, " (--stop-at-step); checkpoint ", saved, "; continue with --resume"));
  }
  write_trace();
  if (end != End::finished) return end == End::preempted ? kPreemptedExit : 0;
  if (metrics_->lost() > 0) {
    observer_.warning(str_cat(metrics_->lost(), " metrics record", metrics_->lost() == 1 ? "" : "s",
                              " could not be written to metrics.jsonl"));
  }
  if (config_.sample.max_new_tokens > 0) parts_.model->materialize_base();  // QLoRA: decoding reads the fp32 weights
  const std::string text = final_sample(config_, state_->gather_for_sampling());
  observer_.sample(*this, text);
  if (lead_) write_file_atomic((fs::path(dir_) / "samples.txt").string(), text + "\n");
  observer_.finished(*this);
  return 0;
}

// One number MAX-reduced over the world: the GEMM peak, the stop signal after each step.
double TrainingRun::world_max(double value) {
  if (comm_->size() == 1) return value;
  scalar_.data<double>()[0] = value;
  comm_->all_reduce(scalar_, REDUCE_MAX);
  return scalar_.data<double>()[0];
}

void TrainingRun::write_trace() {
  if (!tracer_) return;
  const fs::path path = fs::path(dir_) / "trace" / ("rank" + std::to_string(comm_->rank()) + ".json");
  fs::create_directories(path.parent_path());
  tracer_->write(path.string());
  observer_.line(str_cat("trace: ", path.string(), " (", tracer_->size(), " events; open it in ui.perfetto.dev)"));
}

}  // namespace loom
