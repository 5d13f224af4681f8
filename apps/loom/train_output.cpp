#include "train_output.h"

#include <omp.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "cli.h"
#include "loom/core/error.h"
#include "loom/core/file_io.h"
#include "loom/core/pages.h"
#include "loom/core/threads.h"
#include "loom/arch/config.h"
#include "loom/arch/param_layout.h"

namespace loom::cli {

namespace fs = std::filesystem;

namespace {

void print_progress(const StepReport& r, int64_t total, bool terminal, bool force_line) {
  char line[256];
  std::snprintf(line, sizeof line, "step %lld/%lld | loss %.4f | lr %.2e | %.0f tok/s | MFU %.1f%% | mem %s | ETA %s",
                static_cast<long long>(r.stats.step + 1), static_cast<long long>(total), r.stats.loss, r.stats.lr,
                r.tokens_per_s, 100.0 * r.mfu, format_bytes(r.memory_bytes).c_str(), format_duration(r.eta_seconds).c_str());
  if (terminal) std::printf("\r%-110s%s", line, force_line ? "\n" : "");
  else if (force_line) std::printf("%s\n", line);
  std::fflush(stdout);
}

void print_dry_run(const LoomConfig& config, const std::string& dir, const Trainer& trainer, const MemoryTracker& mem) {
  const int64_t n_params = param_count(config.model);
  const int64_t state_bytes = trainer.optimizer().state_bytes();
  const int64_t formula = optimizer_state_bytes(trainer.optim_params(), config.train.optim);
  int64_t decayed = 0;
  for (const OptimParam& q : trainer.optim_params()) decayed += q.weight_decay > 0.0f ? q.numel : 0;
  std::printf("dry run %s: %s, %lld parameters (%lld with weight decay %g), optimizer %s, schedule %s\n", dir.c_str(),
              std::string(arch_name(config.model.arch)).c_str(), static_cast<long long>(n_params),
              static_cast<long long>(decayed), config.train.optim.weight_decay, trainer.optimizer().name().c_str(),
              std::string(enum_name(config.train.schedule.kind)).c_str());
  std::printf("optimizer state: %lld bytes = %.3f bytes/parameter (formula: %lld bytes, %.3f bytes/parameter)\n",
              static_cast<long long>(state_bytes), static_cast<double>(state_bytes) / static_cast<double>(n_params),
              static_cast<long long>(formula), static_cast<double>(formula) / static_cast<double>(n_params));
  for (int c = 0; c < MEM_CATEGORY_COUNT; ++c) {
    const auto cat = static_cast<MemCategory>(c);
    std::printf("  %-18s %s\n", std::string(mem_category_name(cat)).c_str(), format_bytes(mem.current(cat)).c_str());
  }
  std::printf("  %-18s %s\n", "total", format_bytes(mem.current_total()).c_str());
}

void print_run_header(const LoomConfig& config, const std::string& dir, const Transformer& model, const Trainer& trainer,
                      const GemmPeak& peak, double flops_per_token) {
  const int64_t n_params = param_count(config.model);
  const int64_t state_bytes = trainer.optimizer().state_bytes();
  std::printf("run %s: %s, %lld parameters, %.1f MFLOP/token\n", dir.c_str(),
              std::string(arch_name(config.model.arch)).c_str(), static_cast<long long>(n_params), flops_per_token / 1e6);
  std::printf("%s; MFU is against the measured one, per rank\n", peak.describe().c_str());
  std::printf("threads: %d per rank, OpenMP waits %s (core/threads.h)\n", omp_get_max_threads(), omp_wait_policy().c_str());
  std::printf("optimizer %s: state %s (%.2f bytes/parameter); schedule %s, lr %.2e\n", trainer.optimizer().name().c_str(),
              format_bytes(static_cast<size_t>(state_bytes)).c_str(),
              static_cast<double>(state_bytes) / static_cast<double>(n_params), std::string(enum_name(config.train.schedule.kind)).c_str(),
              config.train.schedule.max_lr);
  std::printf("precision: %s%s\n", model.precision().describe().c_str(), config.train.loss_scaling ? ", dynamic loss scaling" : "");
  std::printf("layers: %s\n", describe_plans(model.layer_plans()).c_str());
  if (config.model.lora()) {  // docs/finetune.md
    const int64_t base = lora_begin(config.model, model.layout()), adapters = model.layout().total - base;
    std::printf("%s: rank %lld, alpha %g (scale %g%s), targets %s: %lld adapter parameters (%.3f%% of %lld); the base "
                "is frozen (no gradients, no optimizer state)\n",
                config.model.lora_dora ? "DoRA (LoRA with trained magnitudes)" : "LoRA",
                static_cast<long long>(config.model.lora_rank), static_cast<double>(config.model.lora_alpha),
                static_cast<double>(config.model.lora_scale()), config.model.lora_rslora ? ", rsLoRA" : "",
                config.model.lora_targets.c_str(), static_cast<long long>(adapters),
                100.0 * static_cast<double>(adapters) / static_cast<double>(n_params), static_cast<long long>(n_params));
  }
  if (config.model.lora_quantize_base) {  // QLoRA (docs/finetune.md)
    const int64_t n = model.quantized_params(), bytes = model.quantized_bytes();
    std::printf("QLoRA: the base's %lld block-matrix parameters in NF4 with double-quantized scales: %s = %.4f bits per "
                "parameter (fp32: %s%s); parameters resident now %s\n",
                static_cast<long long>(n), format_bytes(static_cast<size_t>(bytes)).c_str(),
                8.0 * static_cast<double>(bytes) / static_cast<double>(n), format_bytes(static_cast<size_t>(4 * n)).c_str(),
                model.base_streamed() ? ", never held: quantized one matrix at a time while reading the folder" : "",
                format_bytes(static_cast<size_t>(resident_bytes(model.params()))).c_str());
  }
  if (model.frozen_base().bf16()) {  // LoRA's base in bf16 only (model/frozen_base.h)
    const FrozenBase& base = model.frozen_base();
    std::printf("LoRA base in bf16 only: %lld frozen block-matrix%s parameters are kept as the bf16 copy the layers "
                "read, %s (their fp32, %s, %s); parameters resident now %s\n",
                static_cast<long long>(base.params()), config.model.tied_head() ? "" : " and head",
                format_bytes(static_cast<size_t>(base.bytes())).c_str(),
                format_bytes(static_cast<size_t>(4 * base.params())).c_str(),
                base.streamed() ? "never held: read one matrix at a time from the folder" : "released",
                format_bytes(static_cast<size_t>(resident_bytes(model.params()))).c_str());
  }
  if (config.train.recompute != "none") {  // activation checkpointing (memory/recompute.h)
    const Trainer::RecomputeReport& rc = trainer.recompute();
    std::string plan;
    for (RecomputePolicy p : rc.plan) plan += std::string(plan.empty() ? "" : " ") + std::string(recompute_name(p));
    std::printf("recompute %s: blocks %s; kept activations %s of %s per micro-batch%s\n", config.train.recompute.c_str(),
                plan.c_str(), format_bytes(static_cast<size_t>(rc.kept_bytes)).c_str(),
                format_bytes(static_cast<size_t>(rc.no_recompute_bytes)).c_str(),
                rc.seconds > 0 ? str_cat(", measured recompute ", rc.seconds * 1e3, " ms per micro-batch").c_str() : "");
  }
}

void print_summary(const TrainingRun& run) {
  const LoomConfig& config = run.config();
  const Trainer& trainer = run.trainer();
  const Transformer& model = run.model();
  const MemoryTracker& mem = run.memory();
  const ZeroSharding* zero = trainer.zero();
  const int64_t resident_params = run.resident_params(), resident_grads = run.resident_grads();
  const std::string what = run.validation_name();
  const double last_val = run.last_validation();
  std::printf("done: %lld steps, final validation %s %.4f; peak memory %s (parameters %s, gradients %s, optimizer %s, "
              "activations %s%s)\n",
              static_cast<long long>(trainer.step()), what.c_str(), last_val, format_bytes(mem.peak_total()).c_str(),
              format_bytes(mem.peak(MEM_PARAMETERS)).c_str(), format_bytes(mem.peak(MEM_GRADIENTS)).c_str(),
              format_bytes(mem.peak(MEM_OPTIMIZER_STATE)).c_str(), format_bytes(mem.peak(MEM_ACTIVATIONS)).c_str(),
              mem.peak(MEM_OFFLOADED) > 0 ? (", offloaded optimizer state " + format_bytes(mem.peak(MEM_OFFLOADED))).c_str() : "");
  for (const MoeLayerStats& st : model.moe_stats()) {  // the last step's routing
    std::printf("MoE layer %lld, last step: max violation %.3f, router entropy %.3f nats, %lld of %lld assignments dropped, "
                "aux %.3g, seq aux %.3g, z %.3g\n", static_cast<long long>(st.layer), st.max_violation, st.entropy,
                static_cast<long long>(st.dropped), static_cast<long long>(st.tokens * config.model.moe_top_k), st.aux,
                st.seq_aux, st.z);
  }
  if (config.model.lora()) {  // the gradient buffer's pages of the frozen base were returned to the OS
    std::printf("LoRA: gradients resident after the last step %s of the %s buffer (the frozen base has none)\n",
                format_bytes(static_cast<size_t>(resident_grads)).c_str(), format_bytes(mem.peak(MEM_GRADIENTS)).c_str());
  }
  if (zero != nullptr) {
    std::printf("ZeRO-%d: this rank owns %lld of %lld parameters; resident after the last step: parameters %s, "
                "gradients %s (the buffers above are address space; the rest was returned to the OS)\n",
                zero->stage(), static_cast<long long>(zero->range().end - zero->range().begin),
                static_cast<long long>(model.layout().total), format_bytes(static_cast<size_t>(resident_params)).c_str(),
                format_bytes(static_cast<size_t>(resident_grads)).c_str());
  }
}

}  // namespace

// ---- TrainPrinter ---------------------------------------------------------------------------

TrainPrinter::TrainPrinter(bool quiet, bool verbose) : quiet_(quiet), verbose_(verbose), terminal_(stdout_is_terminal()) {}

TrainPrinter::~TrainPrinter() { restore_stdout(); }

void TrainPrinter::starting(int rank) {
  if (!quiet_ || rank != 0) return;
  // --quiet: standard output goes to /dev/null until the final summary (stderr stays).
  std::fflush(stdout);
  saved_stdout_ = ::dup(1);
  const int null = ::open("/dev/null", O_WRONLY);
  LOOM_CHECK(saved_stdout_ >= 0 && null >= 0 && ::dup2(null, 1) >= 0, "--quiet: cannot redirect standard output");
  ::close(null);
}

void TrainPrinter::restore_stdout() {
  if (saved_stdout_ < 0) return;
  std::fflush(stdout);
  ::dup2(saved_stdout_, 1);
  ::close(saved_stdout_);
  saved_stdout_ = -1;
}

// The other ranks print into <run>/logs/rank<N>.log.
void TrainPrinter::folder_ready(const std::string& dir, int rank) {
  if (rank == 0) return;
  const std::string log = (fs::path(dir) / "logs" / ("rank" + std::to_string(rank) + ".log")).string();
  LOOM_CHECK(std::freopen(log.c_str(), "w", stdout) != nullptr, "rank ", rank, ": cannot write ", log);
}

void TrainPrinter::line(const std::string& text) { std::printf("%s\n", text.c_str()); }

void TrainPrinter::warning(const std::string& text) { std::fprintf(stderr, "loom train: warning: %s\n", text.c_str()); }

void TrainPrinter::dry_run(const TrainingRun& run) {
  print_dry_run(run.config(), run.dir(), run.trainer(), run.memory());
}

void TrainPrinter::started(const TrainingRun& run) {
  print_run_header(run.config(), run.dir(), run.model(), run.trainer(), run.peak(), run.flops_per_token());
}

void TrainPrinter::step(const StepReport& r) {
  print_progress(r, r.total_steps, terminal_, r.logged);
  if (!verbose_) return;
  std::printf("  step %lld: grad norm %.4g, %lld tokens in %.3f s, sent %s%s%s\n", static_cast<long long>(r.stats.step + 1),
              r.stats.grad_norm, static_cast<long long>(r.tokens), r.stats.seconds,
              format_bytes(static_cast<size_t>(r.bytes_sent)).c_str(), r.sent_by_group.empty() ? "" : " (",
              r.sent_by_group.empty() ? "" : (r.sent_by_group + ")").c_str());
}

void TrainPrinter::sample(const TrainingRun& run, const std::string& text) {
  const SamplingConfig& s = run.config().sample.sampling;
  std::printf("\nsample (temperature %.2f, top-k %lld, top-p %.2f):\n%s\n\n", s.temperature, static_cast<long long>(s.top_k),
              s.top_p, text.c_str());
}

void TrainPrinter::finished(const TrainingRun& run) {
  restore_stdout();  // --quiet: the summary line is printed
  print_summary(run);
}

}  // namespace loom::cli
