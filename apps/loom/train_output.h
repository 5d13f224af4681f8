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
#include "loom/train/throughput.h"
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

// metrics.jsonl's schema version (docs/operations.md "metrics.jsonl"), in each run's first record.
inline constexpr int kMetricsSchemaVersion = 1;

// metrics.jsonl: one JSON object per line, each written whole with one write(2). A write that
// fails (a full disk) is cut back off the file, so it stays valid JSON lines, reported once on
// stderr and counted; later records are tried again.
class MetricsLog {
 public:
  // resume_step >= 0 (a resumed run): the records of later steps, which the resumed run writes
  // again, and a torn last line (a kill mid-write) are dropped first (rewritten atomically).
  explicit MetricsLog(const std::string& path, int64_t resume_step = -1);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  void write(const nlohmann::json& record);
  int64_t dropped() const { return dropped_; }  // records removed by the resume's truncation
  int64_t lost() const { return lost_; }        // records that could not be written

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;  // bytes of complete records
  int64_t dropped_ = 0, lost_ = 0;
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
                      const GemmPeak& peak, double flops_per_token);
// Samples config.sample from `model` (on the CPU when the model's memory is a device's); returns
// the printable text, after printing it.
std::string final_sample(const LoomConfig& config, Backend& backend, Transformer& model);
void print_summary(const LoomConfig& config, const Trainer& trainer, const Transformer& model, const MemoryTracker& mem,
                   double last_val, const ZeroSharding* zero, int64_t resident_params, int64_t resident_grads);

}  // namespace loom::cli
