// What `loom train` prints and records: the progress line, metrics records, the run header, the
// dry run's memory bill, the final sample and the summary. Every number is measured and labelled.
#pragma once
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <memory>
#include <string>
#include <vector>

#include "loom/comm/communicator.h"
#include "loom/core/memory.h"
#include "loom/data/shard.h"
#include "loom/train/config.h"
#include "loom/train/trainer.h"

namespace loom::cli {

// The one-line status of a step, and its JSON metrics record.
struct StepReport {
  StepStats stats;
  double tokens_per_s = 0.0;
  double mfu = 0.0;
  size_t memory_bytes = 0;
  double eta_seconds = 0.0;
};
void print_progress(const StepReport& r, int64_t total, bool terminal, bool force_line);

// metrics.jsonl: one JSON object per line, appended and flushed.
class MetricsLog {
 public:
  explicit MetricsLog(const std::string& path);
  void write(const nlohmann::json& record);

 private:
  std::ofstream out_;
};

nlohmann::json ledger_json(const ByteLedger& ledger);                // bytes per collective sent / received
nlohmann::json moe_json(const std::vector<MoeLayerStats>& stats);     // each MoE layer's routing this step
nlohmann::json memory_json(const MemoryTracker& mem);                 // current and peak bytes per category

// train.objective = dpo | grpo: data.tokenizer, which tokenizes data.input's pairs or prompts and
// pads and decodes their rows (model.vocab_size follows it when 0).
std::shared_ptr<Tokenizer> objective_tokenizer(LoomConfig& config);
// The means of a DPO objective's stats: loss, rewards, margin, accuracy.
nlohmann::json dpo_json(const DpoObjective::Stats& s);
void print_dpo(const char* what, int64_t step, const DpoObjective::Stats& s);
// data.document_mask: the splits' documents end at the tokenizer's end-of-text token (else nothing).
void set_document_end(const LoomConfig& config, TokenDataset& data);
// The run's token shards (the default corpus is prepared on the first run); model.vocab_size
// follows the data when 0, and data.tokenizer becomes the one the shards were made with.
TokenDataset open_training_data(LoomConfig& config);

void print_dry_run(const LoomConfig& config, const std::string& dir, const Trainer& trainer, const MemoryTracker& mem);
void print_run_header(const LoomConfig& config, const std::string& dir, const Transformer& model, const Trainer& trainer,
                      double peak_gflops, double flops_per_token);
// Samples config.sample from `model` (on the CPU when the model's memory is a device's); returns
// the printable text, after printing it.
std::string final_sample(const LoomConfig& config, Backend& backend, Transformer& model);
void print_summary(const LoomConfig& config, const Trainer& trainer, const Transformer& model, const MemoryTracker& mem,
                   double last_val, const ZeroSharding* zero, int64_t resident_params, int64_t resident_grads);

}  // namespace loom::cli
