// loom report's reader (report_reader.h): metrics.jsonl's lines as a Run, through the schema.
#include "report_reader.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <utility>

#include "loom/core/error.h"
#include "loom/core/file_io.h"
#include "loom/train/objective.h"

namespace loom::cli {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A killed run leaves its last line cut short; `loom train --resume` then appends its start
// record to that partial line. The start record is recognised by its keys so that only this
// case, and not a corrupt record, is read past.
bool resumed_header_tail(const std::string& line, json& header) {
  for (size_t p = line.find('{', 1); p != std::string::npos; p = line.find('{', p + 1)) {
    header = json::parse(line.begin() + static_cast<std::ptrdiff_t>(p), line.end(), nullptr, false);
    if (!header.is_discarded() && metrics_record_kind(header) == MetricsRecordKind::start &&
        header.contains("parameters")) {
      return true;
    }
  }
  return false;
}

StepPoint step_point(const StepRecord& r) {
  StepPoint p;
  p.loss = r.loss;
  p.lr = r.lr.value_or(kNaN);
  p.grad_norm = r.grad_norm.value_or(kNaN);
  p.tokens_per_s = r.tokens_per_s.value_or(kNaN);
  p.mfu = r.mfu.value_or(kNaN);
  p.memory_bytes = r.memory_bytes ? static_cast<double>(*r.memory_bytes) : kNaN;
  p.seconds = r.seconds.value_or(kNaN);
  p.skipped = r.skipped.value_or(false);
  p.ranks = r.ranks.value_or(1);
  return p;
}

// What one record adds to a run: parsed whole (every check) before any of it is applied, so
// that a bad record changes nothing.
struct Parsed {
  std::optional<StartRecord> header;
  std::optional<int64_t> step;
  std::optional<StepPoint> point;
  std::optional<double> val_loss;
  std::optional<std::map<std::string, double>> memory_peaks;
  std::vector<std::pair<size_t, double>> objective;  // (row of objective_series(), value)
};

Parsed parse_record(const json& rec, const std::string& where) {
  Parsed p;
  const MetricsRecordKind kind = metrics_record_kind(rec);
  if (kind == MetricsRecordKind::start) p.header = parse_start_record(rec, where);
  if (!rec.contains("step")) return p;  // and no start record: a newer loom's kind, not an error
  p.step = record_step(rec, where);
  if (kind == MetricsRecordKind::step) p.point = step_point(parse_step_record(rec, where));
  if (kind == MetricsRecordKind::anomaly) {
    // The skipped step's loss stays on the training curve (a spike, or a gap where it was not
    // finite): what made the run skip it. A later record of the step (a rollback's) replaces it.
    if (const AnomalyRecord a = parse_anomaly_record(rec, where); a.loss) {
      p.point = StepPoint{};
      p.point->loss = *a.loss;
    }
  }
  if (kind == MetricsRecordKind::validation) {
    const ValidationRecord v = parse_validation_record(rec, where);
    p.val_loss = v.val_loss;
    if (v.memory) p.memory_peaks = v.memory_peaks();
  }
  if (kind == MetricsRecordKind::objective) parse_objective_record(rec, where);
  // The charted objective values, wherever a record carries them (a held-out reward is in the
  // validation records).
  const std::vector<ObjectiveSeries>& series = objective_series();
  for (size_t i = 0; i < series.size(); ++i) {
    if (const std::optional<double> v = objective_series_value(series[i], rec, where)) p.objective.emplace_back(i, *v);
  }
  return p;
}

void apply(Run& run, Parsed&& p) {
  if (p.header) run.header = std::move(p.header);
  if (!p.step) return;
  const int64_t step = *p.step;
  if (p.point) {
    run.repeated_steps += static_cast<int64_t>(run.steps.count(step));
    run.steps[step] = *p.point;
  }
  if (p.val_loss) run.val_loss[step] = *p.val_loss;
  for (const auto& [row, value] : p.objective) run.objective[row][step] = value;
  if (p.memory_peaks) run.memory_peaks[step] = std::move(*p.memory_peaks);
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  for (size_t begin = 0; begin < text.size();) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(begin, end - begin);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(std::move(line));
    begin = end + 1;
  }
  return lines;
}

// nlohmann/json's message for a line that is not JSON, from "parse error" on.
std::string parse_error_of(const std::string& line) {
  std::string detail;
  try {
    [[maybe_unused]] const json again = json::parse(line);
  } catch (const json::parse_error& e) {
    detail = e.what();
    if (const size_t at = detail.find("parse error"); at != std::string::npos) detail = detail.substr(at);
  }
  return detail;
}

constexpr uint64_t kMetricsReadLimit = uint64_t{1} << 30;

}  // namespace

bool Run::language_model() const {
  return std::all_of(objective.begin(), objective.end(), [](const auto& values) { return values.empty(); });
}

const std::map<std::string, double>* Run::latest_memory() const {
  return memory_peaks.empty() ? nullptr : &memory_peaks.rbegin()->second;
}

Run read_run(const std::string& dir, std::vector<std::string>& warnings) {
  Run run;
  run.dir = dir;
  run.metrics = (fs::path(dir) / "metrics.jsonl").string();
  run.objective.resize(objective_series().size());
  fs::path name = fs::absolute(fs::path(dir)).lexically_normal();
  if (name.filename().empty()) name = name.parent_path();  // "runs/a/"
  run.name = name.filename().string();
  LOOM_CHECK(fs::is_directory(dir), dir, ": no such run folder");
  LOOM_CHECK(std::ifstream(run.metrics, std::ios::binary).good(), run.metrics, ": cannot open (is ", dir,
             " a run folder, runs/NAME?)");
  // Bounded like every input read whole (a metrics.jsonl linked to /dev/zero would never end):
  // 1 GiB is about three million steps' records.
  const std::vector<std::string> lines =
      split_lines(read_text_file(run.metrics, kMetricsReadLimit, "loom report reads at most 1 GiB of metrics"));
  const auto blank = [](const std::string& s) { return s.find_first_not_of(" \t") == std::string::npos; };
  size_t last = lines.size();
  while (last > 0 && blank(lines[last - 1])) --last;
  // An unreadable line (a disk error, a hand edit, another program's write) costs its record, not
  // the report: skipped with a warning naming it, the first kNamedSkips of a file each.
  constexpr int64_t kNamedSkips = 10;
  int64_t skipped = 0;
  const auto skip = [&](const std::string& why) {
    if (++skipped <= kNamedSkips) warnings.push_back(why + "; skipped");
  };
  for (size_t i = 0; i < last; ++i) {
    if (blank(lines[i])) continue;
    const std::string where = run.metrics + ":" + std::to_string(i + 1);
    json rec = json::parse(lines[i], nullptr, false);
    if (rec.is_discarded()) {
      if (i + 1 == last) {  // the run was stopped mid-write: every complete record before it stands
        warnings.push_back(where + ": the last line is cut short (the run stopped mid-write?); skipped");
        continue;
      }
      if (json tail; resumed_header_tail(lines[i], tail)) {
        warnings.push_back(where +
                           ": a record cut short by a stopped run, then the resumed run's header; the cut record "
                           "is skipped");
        rec = std::move(tail);
      } else {
        skip(str_cat(where, ": not valid JSON (", record_excerpt(parse_error_of(lines[i]), 160), ")"));
        continue;
      }
    }
    if (!rec.is_object()) {
      skip(str_cat(where, ": expected a JSON object per line, found ", record_excerpt(lines[i], 30)));
      continue;
    }
    try {
      apply(run, parse_record(rec, where));
    } catch (const Error& e) {
      skip(e.what());
    } catch (const json::exception& e) {
      skip(str_cat(where, ": ", e.what()));
    }
  }
  if (skipped > kNamedSkips) {
    warnings.push_back(str_cat(run.metrics, ": ", skipped - kNamedSkips, " more unreadable lines skipped"));
  }
  if (run.steps.empty()) warnings.push_back(run.metrics + ": no training step recorded");
  return run;
}

}  // namespace loom::cli
