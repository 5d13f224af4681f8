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
#include "loom/infer/generate.h"
#include "loom/arch/config.h"
#include "loom/arch/param_layout.h"

namespace loom::cli {

namespace fs = std::filesystem;

void print_progress(const StepReport& r, int64_t total, bool terminal, bool force_line) {
  char line[256];
  std::snprintf(line, sizeof line, "step %lld/%lld | loss %.4f | lr %.2e | %.0f tok/s | MFU %.1f%% | mem %s | ETA %s",
                static_cast<long long>(r.stats.step + 1), static_cast<long long>(total), r.stats.loss, r.stats.lr,
                r.tokens_per_s, 100.0 * r.mfu, format_bytes(r.memory_bytes).c_str(), format_duration(r.eta_seconds).c_str());
  if (terminal) std::printf("\r%-110s%s", line, force_line ? "\n" : "");
  else if (force_line) std::printf("%s\n", line);
  std::fflush(stdout);
}

MetricsLog::MetricsLog(const std::string& path, int64_t resume_step) : path_(path) {
  std::error_code ec;
  if (std::filesystem::exists(path, ec)) {
    // Keep every complete line that parses and is not a later step's; a torn last line goes.
    const std::string text = read_text_file(path, uint64_t{4} << 30, "metrics.jsonl's limit");
    std::string kept;
    size_t begin = 0;
    bool changed = false;
    while (begin < text.size()) {
      const size_t end = text.find('\n', begin);
      if (end == std::string::npos) {  // no newline: a record cut short
        changed = true;
        ++dropped_;
        break;
      }
      const std::string line = text.substr(begin, end - begin);
      begin = end + 1;
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      const bool later = resume_step >= 0 && j.is_object() && j.contains("step") && j["step"].is_number() &&
                         j["step"].get<int64_t>() > resume_step;
      if (j.is_discarded() || later) {
        changed = true;
        ++dropped_;
        continue;
      }
      kept += line + "\n";
    }
    if (changed) write_file_atomic(path, kept);
  }
  fd_ = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  LOOM_CHECK(fd_ >= 0, path, ": cannot open for appending: ", std::strerror(errno));
  size_ = static_cast<int64_t>(::lseek(fd_, 0, SEEK_END));
}

MetricsLog::~MetricsLog() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsLog::write(const nlohmann::json& record) {
  const std::string line = record.dump() + "\n";
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  if (done == line.size()) {
    size_ += static_cast<int64_t>(done);
    return;
  }
  const int error = errno;
  // What part of the line reached the file is cut off again: the file ends with a whole record.
  const bool cut = ::ftruncate(fd_, size_) == 0;
  if (lost_++ == 0) {
    std::fprintf(stderr, "loom train: warning: %s: cannot append a metrics record (%s); %s, later records are tried "
                 "again and the records lost are counted at the end\n", path_.c_str(), std::strerror(error),
                 cut ? "the file keeps its complete records" : "cannot cut the partial record off either");
  }
}

// Bytes per collective this rank sent and received so far (comm/communicator.h's ring volumes).
nlohmann::json ledger_json(const ByteLedger& ledger) {
  nlohmann::json j = nlohmann::json::object();
  for (int c = 0; c < COLL_COUNT; ++c) {
    if (ledger.calls[c] == 0) continue;
    j[collective_name(static_cast<Collective>(c))] = {{"calls", ledger.calls[c]}, {"sent", ledger.sent[c]},
                                                      {"received", ledger.received[c]}};
  }
  return j;
}

// Each MoE layer's routing over the step (nn/moe.h): the expert load histogram, its max
// violation (max / mean - 1), the router entropy, dropped assignments and the auxiliary losses.
nlohmann::json moe_json(const std::vector<MoeLayerStats>& stats) {
  nlohmann::json j = nlohmann::json::array();
  for (const MoeLayerStats& s : stats) {
    j.push_back({{"layer", s.layer}, {"load", s.load}, {"max_violation", s.max_violation}, {"entropy", s.entropy},
                 {"tokens", s.tokens}, {"dropped", s.dropped}, {"aux", s.aux}, {"seq_aux", s.seq_aux}, {"z", s.z}});
  }
  return j;
}

nlohmann::json memory_json(const MemoryTracker& mem) {
  nlohmann::json j;
  for (int c = 0; c < MEM_CATEGORY_COUNT; ++c) {
    const auto cat = static_cast<MemCategory>(c);
    j[std::string(mem_category_name(cat))] = {{"current", mem.current(cat)}, {"peak", mem.peak(cat)}};
  }
  return j;
}


std::shared_ptr<Tokenizer> objective_tokenizer(LoomConfig& config) {
  std::shared_ptr<Tokenizer> tokenizer = load_tokenizer(config.data.tokenizer);
  if (config.model.vocab_size == 0) config.model.vocab_size = tokenizer->vocab_size();
  LOOM_CHECK(tokenizer->vocab_size() <= config.model.vocab_size, "data.tokenizer ", config.data.tokenizer, " has ",
             tokenizer->vocab_size(), " tokens, more than model.vocab_size = ", config.model.vocab_size);
  return tokenizer;
}

nlohmann::json dpo_json(const DpoObjective::Stats& s) {
  const double n = std::max<double>(1.0, static_cast<double>(s.pairs));
  return {{"pairs", s.pairs}, {"loss", s.loss / n}, {"reward_chosen", s.reward_chosen / n},
          {"reward_rejected", s.reward_rejected / n}, {"margin", (s.reward_chosen - s.reward_rejected) / n},
          {"accuracy", s.correct / n}};
}

void print_dpo(const char* what, int64_t step, const DpoObjective::Stats& s) {
  const nlohmann::json j = dpo_json(s);
  std::printf("step %lld: %s loss %.4f, rewards chosen %.4f rejected %.4f, margin %.4f, accuracy %.3f (%lld pairs)\n",
              static_cast<long long>(step), what, j["loss"].get<double>(), j["reward_chosen"].get<double>(),
              j["reward_rejected"].get<double>(), j["margin"].get<double>(), j["accuracy"].get<double>(),
              static_cast<long long>(s.pairs));
}

void set_document_end(const LoomConfig& config, TokenDataset& data) {
  if (!config.data.document_mask) return;
  // Documents end at the end-of-text token the dataset's tokenizer appends (loom prepare).
  const int32_t end = load_tokenizer(config.data.tokenizer)->eot_token();
  LOOM_CHECK(end >= 0 && end < static_cast<int64_t>(data.vocab_size), "data.document_mask: the tokenizer ",
             config.data.tokenizer, " has no end-of-text token in the dataset's vocabulary (", data.vocab_size, ")");
  data.train.document_end = data.val.document_end = end;
}

TokenDataset open_training_data(LoomConfig& config) {
  const bool default_data = config.data.input.empty() && config.data.dir == DataConfig{}.dir;
  if (!fs::exists(config.data.dir) && default_data) {
    std::printf("preparing the default corpus into %s (first run)\n", config.data.dir.c_str());
    const std::vector<std::string> documents = default_corpus_documents();
    prepare_dataset(documents, *prepare_tokenizer(config.data.tokenizer, documents, config.data.dir), config.data.dir,
                    config.data.val_fraction);
  }
  TokenDataset data = open_dataset(config.data.dir);
  config.data.tokenizer = data.tokenizer;  // the tokenizer the shards were made with (e.g. DIR/tokenizer for bpe:N)
  if (config.model.vocab_size == 0) config.model.vocab_size = static_cast<int64_t>(data.vocab_size);
  LOOM_CHECK(config.model.vocab_size == static_cast<int64_t>(data.vocab_size), "model.vocab_size (", config.model.vocab_size,
             ") differs from the dataset's vocabulary (", data.vocab_size, ", ", config.data.dir,
             "/meta.json); set model.vocab_size = 0 to follow the data");
  set_document_end(config, data);
  // Each split needs one window of seq_len + 1 tokens; a dataset prepared without a held-out
  // split (or a tiny one) is named here rather than by the loader deep inside the run.
  for (const TokenSplit* split : {&data.train, &data.val}) {
    LOOM_CHECK(split->tokens.size() >= static_cast<size_t>(config.train.seq_len) + 1, config.data.dir, ": the ",
               split->name, " split has ", split->tokens.size(), " tokens, fewer than train.seq_len + 1 = ",
               config.train.seq_len + 1, split->name == "val" ? "; prepare it again with a larger --val-fraction" : "");
  }
  return data;
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
                "parameter (fp32: %s); parameters resident now %s\n",
                static_cast<long long>(n), format_bytes(static_cast<size_t>(bytes)).c_str(),
                8.0 * static_cast<double>(bytes) / static_cast<double>(n), format_bytes(static_cast<size_t>(4 * n)).c_str(),
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

std::string final_sample(const LoomConfig& config, Backend& backend, Transformer& model) {
  const auto tokenizer = load_tokenizer(config.data.tokenizer);
  std::vector<int32_t> prompt = tokenizer->encode(config.sample.prompt);
  if (prompt.empty()) prompt.push_back(tokenizer->eot_token());
  GenerateOptions options;
  options.max_new_tokens = config.sample.max_new_tokens;
  options.stop_token = tokenizer->eot_token();
  std::unique_ptr<Backend> host_backend;  // a GPU run samples on the CPU (the KV cache is host code)
  std::unique_ptr<Transformer> host_model;
  if (!model.params().host_accessible()) {
    host_backend = make_cpu_backend();
    host_model = std::make_unique<Transformer>(*host_backend, config.model);
    backend.read(model.params(), host_model->params().raw_data());
  }
  std::vector<int32_t> sample = generate(host_model ? *host_model : model, prompt, config.sample.sampling, options);
  if (!sample.empty() && sample.back() == tokenizer->eot_token()) sample.pop_back();
  const std::string text = printable_utf8(config.sample.prompt + tokenizer->decode(sample));
  std::printf("\nsample (temperature %.2f, top-k %lld, top-p %.2f):\n%s\n\n", config.sample.sampling.temperature,
              static_cast<long long>(config.sample.sampling.top_k), config.sample.sampling.top_p, text.c_str());
  return text;
}

void print_summary(const LoomConfig& config, const Trainer& trainer, const Transformer& model, const MemoryTracker& mem,
                   double last_val, const ZeroSharding* zero, int64_t resident_params, int64_t resident_grads) {
  const char* what = config.loop.objective == TrainObjective::grpo  ? "greedy reward"
                     : config.loop.objective == TrainObjective::dpo ? "DPO loss"
                                                                    : "loss";
  std::printf("done: %lld steps, final validation %s %.4f; peak memory %s (parameters %s, gradients %s, optimizer %s, "
              "activations %s%s)\n",
              static_cast<long long>(trainer.step()), what, last_val, format_bytes(mem.peak_total()).c_str(),
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

}  // namespace loom::cli
