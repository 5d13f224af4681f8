// loom report: a run's (or several runs') metrics.jsonl as hand-written SVG charts and one
// index.html comparing the runs. The records are read through their schema
// (train/metrics_schema.h: nlohmann/json and core/ only, no engine code), the SVG is drawn by
// report_chart.h: the report needs no plotting library and no Python.
#pragma once
#include <string>
#include <vector>

namespace loom::cli {

struct ReportResult {
  std::vector<std::string> files;     // the files written, in order; index.html last
  std::vector<std::string> warnings;  // one line each, e.g. "RUN/metrics.jsonl:812: the last line is cut short ..."
};

// Reads RUN_DIR/metrics.jsonl of each run and writes into out_dir (created if missing) one SVG
// per chart that has data (loss, learning rate, gradient norm, tokens/s, MFU, memory, and the
// the series each objective's registry row names: a reward, a preference accuracy) and index.html, each through a temporary name and a rename.
// A step recorded twice (a resumed run) keeps its last record; a cut-short last line (a run
// killed mid-write) is skipped with a warning, and so is any other line that is not a record
// (not JSON, not an object, a field of the wrong type): a warning naming the file and line
// ("RUN/metrics.jsonl:7: not valid JSON (...); skipped"), the first 10 of a file each.
ReportResult write_report(const std::vector<std::string>& run_dirs, const std::string& out_dir);

}  // namespace loom::cli
