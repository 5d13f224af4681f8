// A training run: what `loom train` does between its arguments and its exit status, as one
// component (torchtitan's Trainer: set-up from a config, then the loop; llm.c: the loop reads
// straight through). Set-up builds the communicator, backend and layout, the run folder (its lock,
// config.toml, the memory check), the model and trainer (parallelize.h), the objective's batches
// and set-up (objective.h), the checkpoint state, and resumes. The loop takes steps and applies
// the run's policies in one place: anomalies (skip, roll back), the step record, the objective's
// metrics, validation and checkpoint cadence (synchronous or asynchronous), --stop-at-step,
// preemption signals, the watchdog and the trace. Every way out ends in one finish().
//
// What is printed goes through a RunObserver that apps/ implements (the progress line, --quiet,
// --verbose); what is recorded goes to metrics.jsonl (metrics_log.h).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "loom/backend/backend.h"
#include "loom/comm/communicator.h"
#include "loom/core/trace.h"
#include "loom/train/config.h"
#include "loom/train/metrics_log.h"
#include "loom/train/objective.h"
#include "loom/train/parallelize.h"
#include "loom/train/run_control.h"
#include "loom/train/state_gather.h"
#include "loom/train/throughput.h"

namespace loom {

// How a run was asked to go (loom train's flags); everything else is the config.
struct RunOptions {
  bool resume = false;
  std::string resume_from;  // --resume PATH: a checkpoint, run or checkpoints folder ("": the run's newest)
  bool overwrite = false;   // --overwrite: a fresh run over a folder that holds checkpoints or metrics
  bool dry_run = false;     // build everything, take no step
  bool verbose = false;     // every step is a logged step
  int64_t stop_at = -1;     // --stop-at-step: checkpoint and stop after this step
};

// One step as the progress line and --verbose show it. Every number is measured.
struct StepReport {
  StepStats stats;
  int64_t total_steps = 0;
  int64_t tokens = 0;  // all data-parallel ranks'
  double tokens_per_s = 0.0;
  double mfu = 0.0;  // against the measured GEMM peak of the compute dtype, per rank
  size_t memory_bytes = 0;
  double eta_seconds = 0.0;
  int64_t bytes_sent = 0;     // this rank, over every communicator of the layout
  std::string sent_by_group;  // "tp 1.2 MiB, dp 3.4 MiB"
  bool logged = false;        // a line of its own (else only the terminal's rewritten status)
};

class TrainingRun;

// What a run reports; apps/ prints it. The run calls these on every rank (other ranks print into
// their log files once folder_ready has redirected them).
class RunObserver {
 public:
  virtual ~RunObserver() = default;
  virtual void starting(int rank) { (void)rank; }  // the layout is built; nothing is written yet
  virtual void folder_ready(const std::string& dir, int rank) { (void)dir, (void)rank; }
  virtual void line(const std::string& text) = 0;     // one informational line
  virtual void warning(const std::string& text) = 0;  // one warning; the run goes on
  virtual void dry_run(const TrainingRun& run) = 0;   // --dry-run: what was built
  virtual void started(const TrainingRun& run) = 0;   // the header, before the first step
  virtual void step(const StepReport& report) = 0;
  virtual void sample(const TrainingRun& run, const std::string& text) = 0;  // the final sample
  virtual void finished(const TrainingRun& run) = 0;  // the summary
};

class TrainingRun {
 public:
  // `config`: the resolved config (resolve_run_config); `world`: every rank of the job (the MPI
  // communicator under mpirun, make_local_communicator() for one process). Reads the objective's
  // data, validates, and sets the whole run up (resuming under options.resume). Throws naming the
  // key, file or rank on bad input, before the first step.
  TrainingRun(LoomConfig config, RunOptions options, RunObserver& observer, std::unique_ptr<Communicator> world);
  ~TrainingRun();
  TrainingRun(const TrainingRun&) = delete;
  TrainingRun& operator=(const TrainingRun&) = delete;

  // Trains to train.steps (or --stop-at-step, or a stop signal): the exit status, 0 or
  // kPreemptedExit. A dry run returns 0 at once.
  int run();

  // For the observer.
  const LoomConfig& config() const { return config_; }
  const std::string& dir() const { return dir_; }
  const Transformer& model() const { return *parts_.model; }
  const Trainer& trainer() const { return *parts_.trainer; }
  const ParallelLayout& layout() const { return *layout_; }
  const MemoryTracker& memory() const { return backend_->allocator().tracker(); }
  const GemmPeak& peak() const { return peak_; }
  double flops_per_token() const { return flops_per_token_; }
  double last_validation() const { return last_val_; }
  std::string validation_name() const { return objective_->validation_name(); }
  int64_t resident_params() const { return resident_params_; }  // after the last step (core/pages.h)
  int64_t resident_grads() const { return resident_grads_; }

 private:
  class Sink;
  enum class End { finished, stopped, preempted };

  void set_up_folder();
  void set_up_training();
  void resume();
  void start_reporting();
  End loop();
  void report_anomaly(const StepStats& stats, const nlohmann::json& position);
  bool agree_on_stop();
  void record_step(const StepStats& stats, bool logged);
  void validate(int64_t step);
  void save_checkpoint(bool async);
  void finish_save();
  int finish(End end);
  double world_max(double value);
  void write_trace();

  LoomConfig config_;
  RunOptions options_;
  RunObserver& observer_;
  std::unique_ptr<Communicator> comm_;
  bool lead_ = false;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<ParallelLayout> layout_;
  std::string dir_, config_text_;
  std::unique_ptr<RunFolderLock> lock_;
  TrainingModel parts_;
  std::unique_ptr<TrainingData> data_;
  std::unique_ptr<TrainingState> state_;
  std::unique_ptr<Sink> sink_;
  std::unique_ptr<ObjectiveContext> ctx_;
  // (Declared after the backend and the model: its reference or teacher is released before them.)
  std::unique_ptr<Objective> objective_;
  int64_t resumed_step_ = -1;
  std::unique_ptr<Tracer> tracer_;
  CpuAllocator scalar_host_;
  Tensor scalar_;  // (1) f64: world_max's all-reduce
  GemmPeak peak_;
  double flops_per_token_ = 0.0;
  std::unique_ptr<MetricsLog> metrics_;
  std::unique_ptr<StopSignals> signals_;
  std::unique_ptr<Watchdog> watchdog_;
  int stop_signal_ = 0;  // the signal the ranks agreed to stop on (0: none)
  // The loop's state.
  double seconds_sum_ = 0.0;
  int64_t steps_timed_ = 0;
  bool warned_above_peak_ = false;  // the cached-peak warning is said once per run
  double last_val_ = NAN;
  int64_t resident_params_ = 0, resident_grads_ = 0;
  std::string last_saved_;  // the newest checkpoint's path, "" until one is written
  int64_t last_saved_step_ = -1;
};

// The config `loom train` runs: the resolved optimizer (the written config names every default),
// train.init_from's model (its weights' config replaces model.*; the run's peft.* apply to
// weights without adapters), peft.adapter's config.
void resolve_run_config(LoomConfig& config);

}  // namespace loom
