// loom report's reading of a run folder's metrics.jsonl: each line parsed by the schema's parser
// of its kind (train/metrics_schema.h), kept as the series the page and the charts draw.
#pragma once
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "loom/train/metrics_schema.h"

namespace loom::cli {

inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// What the report uses of one step record; NaN where the record has no value.
struct StepPoint {
  double loss = kNaN, lr = kNaN, grad_norm = kNaN, tokens_per_s = kNaN, mfu = kNaN, memory_bytes = kNaN, seconds = kNaN;
  bool skipped = false;
  int64_t ranks = 1;
};

struct Run {
  std::string dir, metrics, name;
  std::optional<StartRecord> header;  // the last start record: a resumed run writes one per start
  // Keyed by step, so that a step a resumed run recorded again keeps its last record.
  std::map<int64_t, StepPoint> steps;
  std::map<int64_t, double> val_loss;
  std::vector<std::map<int64_t, double>> objective;  // per row of objective_series(), by step
  std::map<int64_t, std::map<std::string, double>> memory_peaks;  // the "memory" records' peak bytes per category
  int64_t repeated_steps = 0;

  // Language modelling: the loss is nats per token and exp(loss) a perplexity, not so for an
  // objective's own loss, whose records say which it is.
  bool language_model() const;
  // The peaks of the memory record with the highest step (the run's latest state); nullptr if none.
  const std::map<std::string, double>* latest_memory() const;
};

// RUN_DIR/metrics.jsonl. A line that is not a record (not JSON, not an object, a key of the wrong
// type) costs its record, with a warning naming the file and line; so does a cut-short last line.
Run read_run(const std::string& dir, std::vector<std::string>& warnings);

}  // namespace loom::cli
