// loom report: plots and a one-page summary of one or several runs (report.h).
#include <cstdio>
#include <filesystem>

#include "cli.h"
#include "commands.h"
#include "loom/core/error.h"
#include "report.h"

namespace loom::cli {

namespace {

const char* kHelp =
    "usage: loom report RUN_DIR... [--out DIR]\n"
    "\n"
    "Reads each run folder's metrics.jsonl and writes SVG charts (training and validation loss,\n"
    "learning rate, gradient norm, tokens/s, MFU, memory by category) and index.html, a one-page\n"
    "summary comparing the runs, into DIR (default: RUN_DIR/report for one run, report/ for\n"
    "several). A step recorded twice (a resumed or rolled-back run) keeps its last record.\n";

}  // namespace

int report_main(int argc, char** argv) {
  const std::vector<Option> options = {{"out", "DIR", "where the charts and index.html go"}};
  std::vector<char*> rest;
  const std::vector<std::string> runs = split_positionals(argc, argv, options, rest);
  const Args args(static_cast<int>(rest.size()), rest.data(), "report", kHelp, options);
  LOOM_CHECK(!runs.empty(), "loom report needs at least one run folder (RUN_DIR with a metrics.jsonl)");
  const std::string out =
      args.get("out", runs.size() == 1 ? (std::filesystem::path(runs[0]) / "report").string() : std::string("report"));
  const ReportResult result = write_report(runs, out);
  for (const std::string& w : result.warnings) std::fprintf(stderr, "loom report: warning: %s\n", w.c_str());
  std::printf("report of %zu run%s: %s/index.html (%zu files)\n", runs.size(), runs.size() == 1 ? "" : "s", out.c_str(),
              result.files.size());
  return 0;
}

}  // namespace loom::cli
