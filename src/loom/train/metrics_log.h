// metrics.jsonl, the run's record of every step (docs/operations.md "metrics.jsonl"): the file
// written whole record by record, and the JSON of the parts a step record carries.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/comm/communicator.h"
#include "loom/core/memory.h"
#include "loom/model/transformer.h"
#include "loom/train/metrics_schema.h"

namespace loom {

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

}  // namespace loom
