// metrics.jsonl's schema (docs/operations.md "metrics.jsonl"): the records `loom train` writes,
// one JSON object per line, and the one reading of them that `loom report` uses. The writer
// builds a record's struct and writes to_json(record); a reader classifies each line
// (metrics_record_kind) and parses it with that kind's parse_*, which checks every key's JSON
// type and throws a loom::Error naming `where` (the file and line) and the key.
//
// Readers are tolerant in the ways files in the wild need (tests/report_check.py):
//   - a key missing from a record is an absent optional (older files lack later keys); only the
//     keys that tell a kind are required: "optimizer" (start), "step" and "anomaly" (anomaly),
//     "step" and "loss" (step), "step" (validation), "step" and the report key's object
//     (objective), and "parameters" and "gradients" in a step's "resident_bytes";
//   - keys no struct names are ignored (a newer loom's), and so is a record of no known kind;
//   - a null number is NaN (nlohmann/json writes NaN and infinities as null: a diverged step's
//     loss), any other null an absent key;
//   - an integer is a JSON integer or a number with a whole value (1e+08, which a tool that
//     rewrote the file through doubles writes), and >= 0: every integer here counts something.
// nlohmann::json objects keep their keys sorted, so a record's text depends only on its content:
// to_json of a parsed record dumps to the same line as the record written (when every key it
// holds is one the struct names).
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace loom {

// In each start record; a change to a key's meaning or type raises it.
inline constexpr int kMetricsSchemaVersion = 1;

enum class MetricsRecordKind : uint8_t { start, step, validation, anomaly, objective, other };

// By the keys each kind is written with, in this order: no "step" and an "optimizer": start; with
// a "step": "anomaly" present: anomaly; "loss": step; "val_loss", "val_reward" or "memory":
// validation; one other key whose value is an object: objective. Anything else (not an object,
// a newer loom's kind): other, which readers skip.
MetricsRecordKind metrics_record_kind(const nlohmann::json& record);

// The first record of every start or resume of `loom train`.
struct StartRecord {
  std::optional<int64_t> schema_version = kMetricsSchemaVersion;  // absent in files older than it
  std::optional<std::string> event;                                // "start" or "resume"
  std::optional<int64_t> start_step;                               // the step the process starts at
  std::string optimizer;                                           // its registry name
  std::optional<int64_t> parameters, optimizer_state_bytes;
  std::optional<double> state_bytes_per_param;
  std::optional<std::string> schedule;   // the LR schedule's kind
  std::optional<std::string> precision;  // PrecisionPolicy::describe(): "attn_qkv=f32 ... master=f32"
  std::optional<bool> loss_scaling;
  std::optional<std::string> mfu_peak_dtype;                     // "f32" or "bf16"
  std::optional<double> mfu_peak_gflops, datasheet_peak_gflops;  // train/throughput.h GemmPeak
};

// Measured resident pages (core/pages.h) of the parameter and gradient buffers.
struct ResidentBytes {
  int64_t parameters = 0, gradients = 0;
};

// One per training step; `step` counts the steps done (1-based).
struct StepRecord {
  int64_t step = 0;
  double loss = 0.0;  // NaN (null in the file) on a diverged step
  std::optional<double> lr, grad_norm;
  std::optional<int64_t> tokens;  // of the whole job: every data-parallel rank's rows
  std::optional<double> seconds, loss_scale;
  std::optional<bool> skipped;  // no update (loss scaling, or an anomaly skipped); absent in older files
  std::optional<double> tokens_per_s, mfu;
  std::optional<uint64_t> memory_bytes;  // this rank's tracked memory at the step's end
  std::optional<int64_t> ranks;          // the world size
  std::optional<int64_t> comm_bytes_sent, comm_bytes_received;  // cumulative, every communicator
  std::optional<nlohmann::json> comm;  // an object: communicator -> collective -> {calls, sent, received}
  std::optional<ResidentBytes> resident_bytes;
  std::optional<nlohmann::json> moe;  // an array: each MoE layer's routing statistics
};

// At each evaluation: the held-out loss (or GRPO's greedy reward) and the memory by category.
// GRPO's first record, {"step": 0, "val_reward": R}, is one without memory.
struct ValidationRecord {
  int64_t step = 0;
  std::optional<double> val_loss, val_reward;
  std::optional<nlohmann::json> memory;  // category -> {"current": bytes, "peak": bytes}
  // The peak bytes per category (NaN where null or absent); empty without memory.
  std::map<std::string, double> memory_peaks() const;
};

// A step train.on_anomaly skipped: `step` is the step's number, `next_step` the one the run
// takes next (after a rollback, the checkpoint's step + 1).
struct AnomalyRecord {
  int64_t step = 0;
  std::string anomaly;  // "spike" or "nonfinite"
  std::optional<double> loss, spike_z;
  std::optional<nlohmann::json> batch;  // the data loader's position: {"epoch", "index", ...}
  std::optional<std::string> action;    // what was done: "skipped (no update)", "skipped; rolled back to ..."
  std::optional<int64_t> next_step;
};

// A training objective's statistics: {"step": N, "<key>": {...fields}}, key being the
// objective's report key ("dpo", "val_dpo", "grpo" today).
struct ObjectiveRecord {
  int64_t step = 0;
  std::string key;
  nlohmann::json fields = nlohmann::json::object();
};

nlohmann::json to_json(const StartRecord& record);
nlohmann::json to_json(const StepRecord& record);
nlohmann::json to_json(const ValidationRecord& record);
nlohmann::json to_json(const AnomalyRecord& record);
nlohmann::json to_json(const ObjectiveRecord& record);

// Each parses a record of its kind (as metrics_record_kind says), checking every key it names.
StartRecord parse_start_record(const nlohmann::json& record, const std::string& where);
StepRecord parse_step_record(const nlohmann::json& record, const std::string& where);
ValidationRecord parse_validation_record(const nlohmann::json& record, const std::string& where);
AnomalyRecord parse_anomaly_record(const nlohmann::json& record, const std::string& where);
ObjectiveRecord parse_objective_record(const nlohmann::json& record, const std::string& where);

// A record's "step", checked: a whole number >= 0.
int64_t record_step(const nlohmann::json& record, const std::string& where);

// A number `loom report` charts from objective records, with how it is charted. Series of one
// chart_file share a chart; the first one's title, axis label and from_zero are the chart's.
struct ObjectiveSeries {
  std::string record_key;  // "grpo"; or "val_reward", a number at the record's top level
  std::string field;       // "reward" in the record key's object; "" for a top-level number
  std::string chart_file;  // "reward.svg"
  std::string title;       // "Reward (GRPO)"
  std::string axis_label;  // "mean reward"
  std::string label;       // the legend's "RUN: <label>"
  bool validation = false;  // dashed and marked, drawn over the training curves
  double scale = 1.0;       // charted value = recorded value x scale (100: a fraction as percent)
  bool from_zero = false;   // the y axis includes 0
};

// (Each objective's series are its registry row's: objective_series() in train/objective.h.)

// The series' value in `record`: nullopt when the record does not carry it (no such key, or a
// null object), NaN for a null or absent field; a loom::Error when the key's value is not an
// object (or, top-level, not a number) or the field not a number.
std::optional<double> objective_series_value(const ObjectiveSeries& series, const nlohmann::json& record,
                                             const std::string& where);

// A value or line quoted in an error message: at most `max` characters, printable ASCII ('?' for
// anything else), "..." when cut.
std::string record_excerpt(std::string_view text, size_t max = 60);

}  // namespace loom
