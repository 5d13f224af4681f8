// loom train: the training loop a user runs. Arguments, the loop, progress and metrics; the
// layout (train/layout.h), its passes (train/parallelize.h) and the checkpoint state
// (train/state_gather.h) are built below it, the printed reports are in train_output.h.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "cli.h"
#include "commands.h"
#include "loom/checkpoint/peft.h"
#include "loom/checkpoint/weights.h"
#include "loom/comm/communicator.h"
#include "loom/core/error.h"
#include "loom/core/file_io.h"
#include "loom/core/pages.h"
#include "loom/train/layout.h"
#include "loom/train/parallelize.h"
#include "loom/train/distill.h"
#include "loom/train/state_gather.h"
#include "loom/train/throughput.h"
#include "run_control.h"
#include "train_output.h"

namespace loom::cli {

namespace fs = std::filesystem;

namespace {

const char* kHelp =
    "usage: loom train [--config FILE] [--set key=value,...] [--resume [PATH]] [--overwrite] [--restarts N]\n"
    "                  [--stop-at-step N] [--dry-run]\n"
    "\n"
    "Trains the model described by configs/default.toml, then FILE, then the --set overrides\n"
    "(comma-separated or repeated). With no arguments it trains the default small GPT-2 on the\n"
    "default corpus (preparing it first if data/fortunes is missing). Writes runs/<run.name>/:\n"
    "config.toml (resolved), metrics.jsonl, checkpoints/step_N/, samples.txt.\n"
    "--resume continues from the newest valid checkpoint of the run (corrupt ones are skipped with\n"
    "a message), or from the checkpoint PATH names, bitwise identical to an uninterrupted run;\n"
    "metrics.jsonl is cut back to the resumed step. A run folder that already holds checkpoints or\n"
    "metrics is refused without --resume or --overwrite. SIGTERM or SIGINT finishes the step,\n"
    "writes a checkpoint and exits with status 75 (a second signal exits at once). --dry-run builds\n"
    "the model, data and optimizer, prints the memory by category and the optimizer state per\n"
    "parameter (measured and by formula), and takes no step. docs/operations.md.\n";

// What ends a rollout's completion: the end-of-text token and the end-of-sequence one.
std::vector<int32_t> stop_tokens(const Tokenizer& tokenizer) {
  std::vector<int32_t> stop = {tokenizer.eot_token()};
  if (tokenizer.eos_token() && *tokenizer.eos_token() != tokenizer.eot_token()) stop.push_back(*tokenizer.eos_token());
  return stop;
}

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

}  // namespace

int train_main(int argc, char** argv) {
  const Args args(argc, argv, "train", kHelp,
                  {{"config", "FILE", "a TOML config applied after configs/default.toml"},
                   {"set", "KEY=VALUE,...", "config overrides, applied last (comma-separated; repeatable)"},
                   {"resume", "[PATH]", "continue from the newest valid checkpoint of the run, or from PATH (a step folder)"},
                   {"overwrite", "", "start over in a run folder that holds checkpoints or metrics (deletes them)"},
                   {"restarts", "N", "relaunch the training when it dies, resuming, up to N times (loom supervise)"},
                   {"quiet", "", "print only warnings, errors and the final summary line"},
                   {"verbose", "", "a progress line every step, with its gradient norm and bytes per communicator"},
                   {"stop-at-step", "N", "checkpoint and stop after step N, as an interrupted run would"},
                   {"dry-run", "", "build everything, print the memory and optimizer state, take no step"}},
                  config_keys_help());
  if (args.has("restarts")) {  // this same command line without it, under `loom supervise` (cmd_supervise.cpp)
    LOOM_CHECK(!launched_by_mpirun(), "--restarts restarts one process; under mpirun supervise the whole job: "
               "loom supervise --restarts N -- mpirun ... loom train ...");
    std::vector<std::string> command = {fs::read_symlink("/proc/self/exe").string(), "train"};
    for (int i = 0; i < argc; ++i) {
      if (std::strcmp(argv[i], "--restarts") == 0) ++i;  // (and its value)
      else if (std::strncmp(argv[i], "--restarts=", 11) != 0) command.emplace_back(argv[i]);
    }
    return supervise(command, args.get_int("restarts", 0), 1.0);
  }
  LoomConfig config = load_config(args);
  config.train.optim = config.train.optim.resolved();  // the written config names every default
  const int64_t stop_at = args.get_int("stop-at-step", -1);
  if (!config.loop.init_from.empty()) {  // the model is the weights' (checked against the data below)
    config.loop.init_from = resolve_weights(config.loop.init_from);
    const ModelConfig weights = weights_model_config(config.loop.init_from);
    // The run's peft.* apply to weights without adapters (LoRA on an imported model).
    config.model = weights.lora() ? weights : with_peft_of(weights, config.model);
  }
  if (!config.loop.peft_adapter.empty()) config.model = peft_adapter_config(config.loop.peft_adapter, config.model);
  config.validate_objective();  // a wrong data.format is named before any data is opened
  const bool dpo = config.loop.objective == TrainObjective::dpo, grpo = config.loop.objective == TrainObjective::grpo;
  std::vector<PreferencePair> pairs;  // train.objective = dpo: read here, tokenized once
  std::vector<PromptExample> prompts;  // train.objective = grpo
  TokenDataset data;
  const std::shared_ptr<Tokenizer> tokenizer = dpo || grpo ? objective_tokenizer(config) : nullptr;
  if (dpo) {
    pairs = read_preference_file(config.data.input, *tokenizer);
  } else if (grpo) {
    prompts = read_prompt_file(config.data.input, *tokenizer);
  } else {
    data = open_training_data(config);
  }
  config.validate();

  // Under mpirun every rank trains its part of the layout. Rank 0 writes the run folder and
  // prints; the other ranks print into <run>/logs/rank<N>.log and keep their metrics beside it.
  const std::unique_ptr<Communicator> comm = launched_by_mpirun() ? make_mpi_communicator() : make_local_communicator();
  const bool lead = comm->rank() == 0;
  const std::unique_ptr<Backend> backend = make_backend(config.device);
  ParallelLayout layout(config, *comm, *backend);  // refuses an unsupported combination before allocating
  const std::string dir = run_dir(config);
  fs::create_directories(dir);
  const bool resume = args.has("resume"), dry_run = args.has("dry-run"), verbose = args.has("verbose");
  LOOM_CHECK(!verbose || !args.has("quiet"), "--quiet and --verbose exclude each other");
  // --quiet: standard output goes to /dev/null until the final summary (stderr stays).
  int saved_stdout = -1;
  if (args.has("quiet") && lead) {
    std::fflush(stdout);
    saved_stdout = ::dup(1);
    const int null = ::open("/dev/null", O_WRONLY);
    LOOM_CHECK(saved_stdout >= 0 && null >= 0 && ::dup2(null, 1) >= 0, "--quiet: cannot redirect standard output");
    ::close(null);
  }
  std::unique_ptr<RunFolderLock> lock;  // rank 0 holds the run folder (docs/operations.md)
  if (lead && !dry_run) {
    lock = std::make_unique<RunFolderLock>(dir);
    const std::string removed = prepare_run_folder(dir, resume, args.has("overwrite"));
    if (!removed.empty()) std::printf("--overwrite: deleted %s of %s\n", removed.c_str(), dir.c_str());
  }
  comm->barrier();  // the folder is ready before the other ranks write their logs into it
  if (lead && !dry_run && config.loop.memory_check && config.device == DEVICE_CPU) {
    check_memory_fits(config, layout, comm->size());
  }
  if (!lead) {
    fs::create_directories(fs::path(dir) / "logs");
    const std::string log = (fs::path(dir) / "logs" / ("rank" + std::to_string(comm->rank()) + ".log")).string();
    LOOM_CHECK(std::freopen(log.c_str(), "w", stdout) != nullptr, "rank ", comm->rank(), ": cannot write ", log);
  }
  for (const std::string& note : layout.notes()) std::printf("note: %s\n", note.c_str());
  if (!config.loop.init_from.empty()) {
    std::printf("weights from %s (train.init_from: its model config replaces model.*)\n", config.loop.init_from.c_str());
  }
  const std::string config_text = config_to_toml(config);
  if (lead) write_file_atomic((fs::path(dir) / "config.toml").string(), config_text);

  TrainingModel parts = parallelize(*backend, config, layout);
  Transformer& model = *parts.model;
  Trainer& trainer = *parts.trainer;
  TrainingData batches =
      dpo    ? TrainingData(std::move(pairs), tokenizer->eot_token(), config, layout, backend->allocator())
      : grpo ? TrainingData(std::move(prompts), model, [tokenizer](const std::vector<int32_t>& t) { return tokenizer->decode(t); },
                            stop_tokens(*tokenizer), tokenizer->eot_token(), config, layout, backend->allocator())
             : TrainingData(std::move(data), config, layout, backend->allocator());
  TrainingState state(*backend, config, layout, parts, (fs::path(dir) / "checkpoints").string(), config_text);
  DpoObjective objective(config.dpo);
  std::unique_ptr<GrpoObjective> grpo_objective;
  if (grpo) {
    grpo_objective = std::make_unique<GrpoObjective>(config.grpo, *batches.grpo_splits()[0]);
    trainer.set_objective(grpo_objective.get());
    std::printf("grpo: %lld training prompts, %lld held out; %lld completions per prompt, up to %lld tokens, temperature "
                "%g; beta %g, epsilon %g; reward: %s\n",
                static_cast<long long>(batches.grpo_splits()[0]->prompts()), static_cast<long long>(batches.grpo_splits()[1]->prompts()),
                static_cast<long long>(config.grpo.group), static_cast<long long>(config.grpo.max_new_tokens),
                config.grpo.temperature, config.grpo.beta, config.grpo.epsilon,
                config.grpo.reward_command.empty() ? "exact answer (built in)" : config.grpo.reward_command.c_str());
  }
  std::unique_ptr<Transformer> teacher;  // train.objective = distill
  std::unique_ptr<DistillObjective> distill_objective;
  if (config.loop.objective == TrainObjective::distill) {
    LOOM_CHECK(config.parallel.tp == 1 && config.parallel.pp == 1 && config.parallel.cp == 1, "train.objective = distill "
               "runs with data parallelism only (parallel.tp, pp and cp = 1)");
    const ModelSource source = model_source(config.distill.teacher);
    teacher = std::make_unique<Transformer>(*backend, source.config.model);
    load_model(source, *teacher);
    LOOM_CHECK(source.config.model.vocab_size == config.model.vocab_size, "distill.teacher = ", config.distill.teacher,
               " has ", source.config.model.vocab_size, " tokens, the student ", config.model.vocab_size,
               ": the teacher must use the student's tokenizer");
    distill_objective = std::make_unique<DistillObjective>(config.distill, *teacher);
    trainer.set_objective(distill_objective.get());
    std::printf("distill: teacher %s (%lld parameters), temperature %g, alpha %g\n", source.path.c_str(),
                static_cast<long long>(teacher->params().numel()), config.distill.temperature, config.distill.alpha);
  }
  if (dpo) {  // the reference: the initial weights (before a resume loads later ones)
    trainer.set_objective(&objective);
    const auto start = std::chrono::steady_clock::now();
    for (PreferenceBatches* split : batches.preference_splits()) objective.compute_reference(trainer, *split, config.train.batch_size);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const std::vector<PreferenceBatches*> splits = batches.preference_splits();
    std::string reference = config.dpo.reference_free()
                                ? "no reference model"
                                : str_cat("reference log-probabilities of the initial weights: ", seconds, " s");
    if (config.dpo.reference == DpoReference::live && !config.dpo.reference_free()) {
      LOOM_CHECK(config.model.lora() || config.parallel.zero_stage < 3, "dpo.reference = live copies the initial "
                 "weights, which parallel.zero_stage = 3 has sharded: use zero_stage <= 2, dpo.reference = once or LoRA");
      reference = "reference " + objective.set_live_reference(*parts.model);
    }
    std::printf("dpo (%s, beta %g): %lld training pairs, %lld held out; %s\n", std::string(enum_name(config.dpo.loss)).c_str(),
                config.dpo.beta, static_cast<long long>(splits[0]->pairs()), static_cast<long long>(splits[1]->pairs()),
                reference.c_str());
  }
  const CheckpointWarning warn = [](const std::string& line) { std::fprintf(stderr, "loom train: %s\n", line.c_str()); };
  int64_t resumed_step = -1;
  if (resume) {
    const std::string from_arg = args.get("resume");
    LOOM_CHECK(from_arg.empty() || fs::exists(from_arg), "--resume ", from_arg, ": no such checkpoint, run or checkpoints folder");
    const std::string from = from_arg.empty() ? "" : resolve_checkpoint(from_arg);
    const auto loaded = state.resume(warn, from);
    resumed_step = loaded ? loaded->step : 0;
    if (loaded) {
      batches.loader().restore(loaded->data_state.get<LoaderState>());
      model.release_base();  // QLoRA: the checkpoint wrote the quantized base's fp32 elements
      std::printf("resumed from %s (step %lld)\n", loaded->path.c_str(), static_cast<long long>(loaded->step));
      const std::vector<std::string> changed = config_differences(loaded->config_text, config_text);
      if (!changed.empty() && lead) {
        std::string list;
        for (const std::string& c : changed) list += (list.empty() ? "" : "; ") + c;
        std::fprintf(stderr, "loom train: warning: the config differs from the checkpoint's in %zu key%s: %s\n",
                     changed.size(), changed.size() == 1 ? "" : "s", list.c_str());
      }
    } else {
      std::printf("no checkpoint in %s/checkpoints; starting from scratch\n", dir.c_str());
    }
  }
  if (args.has("dry-run")) {
    print_dry_run(config, dir, trainer, backend->allocator().tracker());
    return 0;
  }

  const MemoryTracker& mem = backend->allocator().tracker();
  // Traces (docs/operations.md) start before the first collective below, so that the trace's
  // bytes add up to the ledgers'.
  std::unique_ptr<Tracer> tracer;
  if (config.loop.trace) {
    tracer = std::make_unique<Tracer>(comm->rank());
    trainer.set_tracer(tracer.get());
    state.set_tracer(tracer.get());
    for (const auto& [name, group] : layout.communicators()) group->set_tracer(tracer.get(), name);
  }
  // One number MAX-reduced over the world: the GEMM peak below, the stop signal after each step.
  CpuAllocator scalar_host;
  const Tensor scalar = Tensor::zeros(scalar_host, {1}, DTYPE_F64, MEM_WORKSPACE);
  auto world_max = [&](double value) {
    if (comm->size() == 1) return value;
    scalar.data<double>()[0] = value;
    comm->all_reduce(scalar, REDUCE_MAX);
    return scalar.data<double>()[0];
  };
  // MFU is stated against the GEMM peak of the run's compute dtype (train/throughput.h). Rank 0
  // reads it from the machine's cache or measures it and sends it to the others, so that ranks
  // sharing cores do not measure it against each other.
  GemmPeak peak;
  peak.dtype = mfu_dtype(model.precision());
  if (comm->rank() == 0) peak = gemm_peak(*backend, peak.dtype, default_peak_cache_dir());
  peak.measured_gflops = world_max(peak.measured_gflops);
  const double flops_per_token = train_flops_per_token(config.model, config.train.seq_len);
  print_run_header(config, dir, model, trainer, peak, flops_per_token);
  MetricsLog metrics(lead ? (fs::path(dir) / "metrics.jsonl").string()
                          : (fs::path(dir) / "logs" / ("metrics.rank" + std::to_string(comm->rank()) + ".jsonl")).string(),
                     resumed_step);
  if (metrics.dropped() > 0 && lead) {
    std::fprintf(stderr, "loom train: warning: metrics.jsonl: dropped %lld record%s after step %lld (the run resumes "
                 "from there and writes them again)\n", static_cast<long long>(metrics.dropped()),
                 metrics.dropped() == 1 ? "" : "s", static_cast<long long>(resumed_step));
  }
  const Communicator& dp = layout.batch_group();
  if (comm->size() > 1) std::printf("%s\n", layout.describe(config.train.batch_size, config.train.grad_accum, config.train.seq_len).c_str());
  const ZeroSharding* zero = trainer.zero();
  if (zero != nullptr) {
    std::printf("ZeRO-%d over %d ranks: this rank keeps the optimizer state of %lld of the %lld parameters it %s\n",
                zero->stage(), layout.reduce_group().size(), static_cast<long long>(zero->range().end - zero->range().begin),
                static_cast<long long>(zero->domain_size()), parts.pipeline ? "updates (its pipeline stages)" : "holds");
  }
  const int64_t n_params = param_count(config.model);
  const int64_t state_bytes = trainer.optimizer().state_bytes();
  metrics.write({{"schema_version", kMetricsSchemaVersion}, {"event", resume ? "resume" : "start"},
                 {"start_step", trainer.step()}, {"optimizer", trainer.optimizer().name()}, {"parameters", n_params}, {"optimizer_state_bytes", state_bytes},
                 {"state_bytes_per_param", static_cast<double>(state_bytes) / static_cast<double>(n_params)},
                 {"schedule", std::string(enum_name(config.train.schedule.kind))}, {"precision", model.precision().describe()},
                 {"loss_scaling", config.train.loss_scaling}, {"mfu_peak_dtype", std::string(dtype_name(peak.dtype))},
                 {"mfu_peak_gflops", peak.measured_gflops}, {"datasheet_peak_gflops", peak.datasheet_gflops}});
  if (grpo && trainer.step() == 0) {  // the curve's start: the initial weights' greedy reward
    const double start = batches.grpo_splits()[1]->greedy_reward(0);
    metrics.write({{"step", 0}, {"val_reward", start}});
    std::printf("step 0: validation greedy reward %.4f (%lld prompts)\n", start,
                static_cast<long long>(batches.grpo_splits()[1]->prompts()));
  }
  const bool terminal = stdout_is_terminal();
  GrpoBatches::Stats window;  // GRPO's rollouts since the last progress line
  double window_seconds = 0.0;
  double seconds_sum = 0.0;
  int64_t steps_timed = 0;
  bool warned_above_peak = false;  // the cached-peak warning is said once per run
  double last_val = NAN;
  int64_t last_resident_params = 0, last_resident_grads = 0;

  // Operations (docs/operations.md): preemption signals, the collective watchdog, anomalies, traces.
  const StopSignals signals;
  auto write_trace = [&] {
    if (!tracer) return;
    const fs::path path = fs::path(dir) / "trace" / ("rank" + std::to_string(comm->rank()) + ".json");
    fs::create_directories(path.parent_path());
    tracer->write(path.string());
    std::printf("trace: %s (%zu events; open it in ui.perfetto.dev)\n", path.string().c_str(), tracer->size());
  };
  Watchdog watchdog(config.loop.watchdog_seconds, dir, comm->rank(), comm->size());
  // Every rank stops at the same step: the first to see a signal decides.
  auto stop_signal = [&] { return static_cast<int>(world_max(signals.requested())); };
  std::string last_saved;  // the newest checkpoint's path, "" until one is written
  int64_t last_saved_step = -1;
  auto save_checkpoint = [&](bool async) {
    model.materialize_base();  // QLoRA: the checkpoint holds the dequantized base
    const TraceSpan span(tracer.get(), async ? "checkpoint snapshot" : "checkpoint", "checkpoint");
    try {
      last_saved = state.save(batches.loader().state(), async);
      last_saved_step = trainer.step();
    } catch (const Error& e) {
      if (config.loop.stop_on_save_error) throw;
      std::fprintf(stderr, "loom train: warning: step %lld: checkpoint not saved: %s; training goes on "
                   "(train.stop_on_save_error = false), the previous checkpoint stays valid\n",
                   static_cast<long long>(trainer.step()), e.what());
    }
    model.release_base();
  };
  // A save in flight (async) reports its error at the next save or here.
  auto finish_save = [&] {
    try {
      state.wait_for_save();
    } catch (const Error& e) {
      if (config.loop.stop_on_save_error) throw;
      std::fprintf(stderr, "loom train: warning: checkpoint not saved: %s\n", e.what());
    }
  };

  // SIGTERM / SIGINT at a step's end: a checkpoint of this step (unless one was just written), then
  // exit kPreemptedExit for the scheduler or supervisor to resume.
  auto preempted = [&](int sig) {
    finish_save();
    if (last_saved_step != trainer.step()) save_checkpoint(false);
    std::printf("stopped by %s after step %lld; checkpoint %s; continue with --resume\n", StopSignals::name(sig),
                static_cast<long long>(trainer.step()), last_saved_step == trainer.step() ? last_saved.c_str() : "(not saved)");
    write_trace();
    std::fflush(stdout);
    return kPreemptedExit;
  };

  while (trainer.step() < config.train.steps) {
    const nlohmann::json position = batches.loader().state();  // names the batch if it proves bad
    const int64_t step_start = tracer ? Tracer::now_ns() : 0;
    const StepStats stats = trainer.train_step(batches.train());
    if (tracer) tracer->complete("step", "step", step_start);
    watchdog.beat(stats.step);
    if (stats.anomaly != Anomaly::none) {
      const bool spike = stats.anomaly == Anomaly::spike;
      const std::string what = spike ? str_cat("loss ", stats.loss, " is a spike (z-score ", stats.spike_z, ")")
                                     : std::isfinite(stats.loss) ? str_cat("gradient norm ", stats.grad_norm, " is not finite")
                                                                 : str_cat("loss ", stats.loss, " is not finite");
      const std::string batch = str_cat("epoch ", position.value("epoch", 0), ", window ", position.value("index", 0));
      std::string action = "skipped (no update)";
      if (config.train.anomaly.policy == AnomalyPolicy::rollback) {
        finish_save();
        const auto loaded = state.resume(warn);  // the newest valid checkpoint; the data loader keeps its place
        if (loaded) model.release_base();
        action = loaded ? str_cat("skipped; rolled back to the checkpoint of step ", loaded->step)
                        : std::string("skipped (no checkpoint to roll back to yet)");
      }
      std::fprintf(stderr, "loom train: warning: step %lld: %s; the batch at data position %s %s%s\n",
                   static_cast<long long>(stats.step + 1), what.c_str(), batch.c_str(), action.c_str(),
                   action.find("rolled back") != std::string::npos ? " (the batches since it are not replayed)" : "");
      metrics.write({{"step", stats.step + 1}, {"anomaly", spike ? "spike" : "nonfinite"}, {"loss", stats.loss},
                     {"spike_z", stats.spike_z}, {"batch", position}, {"action", action}, {"next_step", trainer.step() + 1}});
      if (const int sig = stop_signal(); sig != 0) return preempted(sig);
      continue;
    }
    const DpoObjective::Stats pref = objective.take_stats();
    last_resident_params = resident_bytes(model.params());
    last_resident_grads = resident_bytes(model.grads());
    seconds_sum += stats.seconds;
    ++steps_timed;
    StepReport r{stats};
    r.tokens_per_s = static_cast<double>(stats.tokens * dp.size()) / stats.seconds;  // all data-parallel ranks
    r.mfu = r.tokens_per_s * flops_per_token / (peak.measured_gflops * 1e9 * comm->size());  // peak measured per rank
    if (!warned_above_peak) {  // rank 0 holds the cached peak (the others only its value)
      const std::string w = peak.above_peak_warning(r.mfu);
      if (!w.empty()) std::fprintf(stderr, "loom train: warning: step %lld: %s\n", static_cast<long long>(stats.step + 1), w.c_str());
      warned_above_peak = !w.empty();
    }
    r.memory_bytes = mem.current_total();
    r.eta_seconds = seconds_sum / static_cast<double>(steps_timed) * static_cast<double>(config.train.steps - trainer.step());
    // This rank's traffic over every communicator of the layout (world, tp, pp, cp, ep, dp, ...).
    int64_t sent = 0, received = 0;
    nlohmann::json comm_json = nlohmann::json::object();
    std::string groups;  // --verbose: bytes sent per communicator
    for (const auto& [name, group] : layout.communicators()) {
      const ByteLedger& ledger = group->ledger();
      sent += ledger.total_sent(), received += ledger.total_received();
      if (ledger.total_sent() + ledger.total_received() == 0) continue;
      comm_json[name] = ledger_json(ledger);
      groups += str_cat(groups.empty() ? "" : ", ", name, " ", format_bytes(static_cast<size_t>(ledger.total_sent())));
    }
    metrics.write({{"step", stats.step + 1}, {"loss", stats.loss}, {"lr", stats.lr}, {"grad_norm", stats.grad_norm},
                   {"tokens", stats.tokens * dp.size()}, {"seconds", stats.seconds}, {"loss_scale", stats.loss_scale}, {"skipped", stats.skipped}, {"tokens_per_s", r.tokens_per_s}, {"mfu", r.mfu},
                   {"memory_bytes", r.memory_bytes}, {"ranks", comm->size()},
                   {"comm_bytes_sent", sent}, {"comm_bytes_received", received}, {"comm", comm_json},
                   // Measured residency (core/pages.h): under ZeRO-2/3 less than the buffers' size.
                   {"resident_bytes", {{"parameters", last_resident_params}, {"gradients", last_resident_grads}}},
                   {"moe", moe_json(model.moe_stats())}});
    if (dpo) metrics.write({{"step", stats.step + 1}, {"dpo", dpo_json(pref)}});
    nlohmann::json rollout;
    if (grpo) {
      const GrpoBatches::Stats g = batches.grpo_splits()[0]->take_stats();
      window.completions += g.completions, window.reward += g.reward, window.tokens += g.tokens;
      window.rollout_seconds += g.rollout_seconds, window_seconds += stats.seconds;
      const double n = std::max<double>(1.0, static_cast<double>(g.completions));
      rollout = {{"reward", g.reward / n}, {"completions", g.completions}, {"mean_length", static_cast<double>(g.tokens) / n},
                 {"kl", grpo_objective->take_kl()}, {"rollout_seconds", g.rollout_seconds},
                 {"train_seconds", stats.seconds - g.rollout_seconds}};
      metrics.write({{"step", stats.step + 1}, {"grpo", rollout}});
    }
    const int64_t done = trainer.step();
    const bool eval_now = config.loop.eval_every > 0 && done % config.loop.eval_every == 0;
    const bool log_now = verbose || eval_now || done % config.loop.log_every == 0 || done == config.train.steps;
    print_progress(r, config.train.steps, terminal, log_now);
    if (verbose) {
      std::printf("  step %lld: grad norm %.4g, %lld tokens in %.3f s, sent %s%s%s\n", static_cast<long long>(done),
                  stats.grad_norm, static_cast<long long>(stats.tokens * dp.size()), stats.seconds,
                  format_bytes(static_cast<size_t>(sent)).c_str(), groups.empty() ? "" : " (", groups.empty() ? "" : (groups + ")").c_str());
    }
    if (dpo && log_now) print_dpo("dpo", done, pref);
    if (grpo && log_now) {  // the means since the last line
      const double n = std::max<double>(1.0, static_cast<double>(window.completions));
      std::printf("step %lld: grpo reward %.3f over the last %lld completions (mean length %.1f), KL %.4f (this step); "
                  "rollouts %.2f s, training %.2f s\n", static_cast<long long>(done), window.reward / n,
                  static_cast<long long>(window.completions), static_cast<double>(window.tokens) / n,
                  rollout["kl"].get<double>(), window.rollout_seconds, window_seconds - window.rollout_seconds);
      window = GrpoBatches::Stats{};
      window_seconds = 0.0;
    }
    if (grpo && (eval_now || done == config.train.steps)) {  // the greedy reward on the held-out prompts
      last_val = batches.grpo_splits()[1]->greedy_reward(0);
      metrics.write({{"step", done}, {"val_reward", last_val}, {"memory", memory_json(mem)}});
      std::printf("step %lld: validation greedy reward %.4f (%lld prompts)\n", static_cast<long long>(done), last_val,
                  static_cast<long long>(batches.grpo_splits()[1]->prompts()));
    } else if (eval_now || done == config.train.steps) {
      const TraceSpan span(tracer.get(), "validation", "eval");
      last_val = batches.validation_loss(trainer, config.loop.eval_batches, backend->allocator());
      metrics.write({{"step", done}, {"val_loss", last_val}, {"memory", memory_json(mem)}});
      if (dpo) {
        const DpoObjective::Stats held = objective.take_stats();
        metrics.write({{"step", done}, {"val_dpo", dpo_json(held)}});
        print_dpo("validation dpo", done, held);
      } else {
        std::printf("step %lld: validation loss %.4f (perplexity %.1f)\n", static_cast<long long>(done), last_val, std::exp(last_val));
      }
    }
    const int sig = stop_signal();
    const bool stopping = done == stop_at && done < config.train.steps;  // --stop-at-step
    if ((config.loop.checkpoint_every > 0 && done % config.loop.checkpoint_every == 0) || stopping ||
        done == config.train.steps) {
      // The last checkpoint and a stopping one are written in the step (the process ends next).
      save_checkpoint(config.loop.async_checkpoint && !stopping && sig == 0 && done < config.train.steps);
      watchdog.beat(stats.step);
    }
    if (sig != 0) return preempted(sig);  // (its checkpoint: the one above, or its own)
    if (stopping) {
      finish_save();
      std::printf("stopped after step %lld (--stop-at-step); checkpoint %s; continue with --resume\n",
                  static_cast<long long>(done), last_saved_step == done ? last_saved.c_str() : "(not saved)");
      write_trace();
      return 0;
    }
  }
  finish_save();
  write_trace();
  if (metrics.lost() > 0) {
    std::fprintf(stderr, "loom train: warning: %lld metrics record%s could not be written to metrics.jsonl\n",
                 static_cast<long long>(metrics.lost()), metrics.lost() == 1 ? "" : "s");
  }

  model.materialize_base();  // QLoRA: decoding reads the fp32 weights
  const std::string text = final_sample(config, *backend, state.gather_for_sampling());
  if (lead) write_file_atomic((fs::path(dir) / "samples.txt").string(), text + "\n");
  if (saved_stdout >= 0) {  // --quiet: the summary line is printed
    std::fflush(stdout);
    ::dup2(saved_stdout, 1);
    ::close(saved_stdout);
  }
  print_summary(config, trainer, model, mem, last_val, zero, last_resident_params, last_resident_grads);
  return 0;
}

}  // namespace loom::cli
