// loom report: metrics.jsonl (train/metrics_schema.h) as SVG charts and an HTML summary. The
// reading is report_reader.h's, the drawing report_chart.h's; this file chooses the charts and
// writes the page and the files.
#include "report.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/file_io.h"
#include "loom/core/str_printf.h"
#include "loom/train/metrics_schema.h"
#include "loom/train/objective.h"
#include "report_chart.h"
#include "report_reader.h"

namespace loom::cli {

namespace {

namespace fs = std::filesystem;

// ---------------------------------------------------------------- text

std::string duration_text(double seconds) {
  if (seconds < 60) return str_printf("%.1f s", seconds);
  const auto s = static_cast<long long>(std::llround(seconds));
  if (s < 3600) return str_printf("%lldm%02llds", s / 60, s % 60);
  return str_printf("%lldh%02lldm", s / 3600, s / 60 % 60);
}

std::string count_text(double n) {
  if (n >= 1e9) return str_printf("%.2f B", n / 1e9);
  if (n >= 1e6) return str_printf("%.2f M", n / 1e6);
  if (n >= 1e3) return str_printf("%.1f K", n / 1e3);
  return str_printf("%.0f", n);
}

// ---------------------------------------------------------------- statistics

double median(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return !std::isfinite(x); }), v.end());
  if (v.empty()) return kNaN;
  const size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid), v.end());
  const double upper = v[mid];
  if (v.size() % 2 == 1) return upper;
  return 0.5 * (upper + *std::max_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid)));
}

template <typename Get>
std::vector<double> step_values(const Run& run, Get get) {
  std::vector<double> out;
  for (const auto& [step, r] : run.steps) out.push_back(get(r));
  return out;
}

// The finite (step, value) pairs, in step order: a diverged step (null) is left out of a curve.
template <typename Get>
std::vector<std::pair<double, double>> step_series(const Run& run, Get get) {
  std::vector<std::pair<double, double>> out;
  for (const auto& [step, r] : run.steps) {
    const double v = get(r);
    if (std::isfinite(v)) out.emplace_back(static_cast<double>(step), v);
  }
  return out;
}

std::vector<std::pair<double, double>> map_series(const std::map<int64_t, double>& m, double scale = 1.0) {
  std::vector<std::pair<double, double>> out;
  for (const auto& [step, v] : m) {
    if (std::isfinite(v)) out.emplace_back(static_cast<double>(step), v * scale);
  }
  return out;
}

// ---------------------------------------------------------------- the page

struct Figure {
  std::string file, alt;
  double height = 0;
};

// The start record's precision, shortened when every part of the model runs in one format.
std::string precision_text(const std::optional<std::string>& precision) {
  if (!precision) return "";
  const std::string& full = *precision;
  std::istringstream parts(full);
  std::string part, common;
  bool same = true;
  while (parts >> part) {
    const std::string value = part.substr(part.find('=') + 1);
    if (common.empty()) common = value;
    same = same && value == common;
  }
  return same && !common.empty() ? common : full;
}

std::string cell(const std::string& html, bool num = true, const std::string& title = "") {
  std::string s = num ? "<td class=\"num\"" : "<td";
  if (!title.empty()) s += " title=\"" + escape(title) + "\"";
  return s + ">" + html + "</td>";
}

const char* const kNone = "&#8212;";  // an em dash: no such value in this run

std::string or_none(double v, const char* pattern, double scale = 1.0) {
  return std::isfinite(v) ? str_printf(pattern, v * scale) : kNone;
}

std::string summary_row(const Run& run, size_t index) {
  std::string row = "<tr>";
  int64_t ranks = run.steps.empty() ? 1 : run.steps.rbegin()->second.ranks;
  std::string name = "<span class=\"swatch\" style=\"background:" + run_color(index) + "\"></span>" + escape(run.name);
  if (ranks > 1) name += str_printf("<br><span class=\"small\">%lld ranks</span>", static_cast<long long>(ranks));
  row += cell(name, false, run.dir);
  const std::optional<StartRecord>& h = run.header;
  const double params = h && h->parameters ? static_cast<double>(*h->parameters) : kNaN;
  row += cell(std::isfinite(params) ? count_text(params) : kNone, true,
              std::isfinite(params) ? str_printf("%.0f parameters", params) : "");
  row += cell(h ? escape(h->optimizer) : std::string(kNone), false);
  std::string precision = h ? escape(precision_text(h->precision)) : std::string();
  if (h && h->loss_scaling == true) precision += precision.empty() ? "loss scaling" : ", loss scaling";
  row += cell(precision.empty() ? kNone : "<span class=\"small\">" + precision + "</span>", false);

  int64_t skipped = 0;
  for (const auto& [step, r] : run.steps) skipped += r.skipped ? 1 : 0;
  std::string steps = run.steps.empty() ? kNone : std::to_string(run.steps.rbegin()->first);
  if (skipped > 0)
    steps += str_printf("<br><span class=\"small\">%lld skipped</span>", static_cast<long long>(skipped));
  row += cell(steps);

  // The mean of the last 10 finite losses: one step's loss is too noisy to compare runs by.
  double sum = 0;
  int n = 0;
  for (auto it = run.steps.rbegin(); it != run.steps.rend() && n < 10; ++it) {
    if (std::isfinite(it->second.loss)) sum += it->second.loss, ++n;
  }
  row += cell(n > 0 ? str_printf("%.4f", sum / n) : kNone);

  double best = kNaN;
  int64_t best_step = -1;
  for (const auto& [step, v] : run.val_loss) {
    if (std::isfinite(v) && !(v >= best)) best = v, best_step = step;
  }
  const double final_val = run.val_loss.empty() ? kNaN : run.val_loss.rbegin()->second;
  row += cell(std::isfinite(best) ? str_printf("%.4f", best) + str_printf(" <span class=\"small\">(step %lld)</span>",
                                                                          static_cast<long long>(best_step))
                                  : kNone);
  row += cell(or_none(run.language_model() ? std::exp(best) : kNaN, "%.2f"));
  row += cell(or_none(final_val, "%.4f"));
  row += cell(or_none(run.language_model() ? std::exp(final_val) : kNaN, "%.2f"));
  row += cell(or_none(median(step_values(run, [](const StepPoint& r) { return r.tokens_per_s; })), "%.0f"));
  row += cell(or_none(median(step_values(run, [](const StepPoint& r) { return r.mfu; })), "%.1f%%", 100.0));
  double peak = kNaN;
  for (const auto& [step, r] : run.steps) {
    if (std::isfinite(r.memory_bytes) && !(r.memory_bytes <= peak)) peak = r.memory_bytes;
  }
  double category_peaks = 0;
  if (const auto* peaks = run.latest_memory()) {
    for (const auto& [category, bytes] : *peaks) category_peaks += std::isfinite(bytes) ? bytes : 0.0;
  }
  const std::string peak_title =
      category_peaks > 0 ? "the categories' peaks add up to " + bytes_text(category_peaks) : "";
  row += cell(std::isfinite(peak)  ? bytes_text(peak)
              : category_peaks > 0 ? bytes_text(category_peaks)
                                   : kNone,
              true, peak_title);
  double seconds = 0;
  bool timed = false;
  for (const auto& [step, r] : run.steps) {
    if (std::isfinite(r.seconds)) seconds += r.seconds, timed = true;
  }
  row += cell(timed ? duration_text(seconds) : kNone);
  return row + "</tr>\n";
}

std::string render_index(const std::vector<Run>& runs, const std::vector<Figure>& figures,
                         const std::vector<std::string>& notes) {
  std::string names;
  for (const Run& run : runs) names += (names.empty() ? "" : ", ") + run.name;
  std::string s =
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
      "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n";
  s += "<title>Loom report: " + escape(names) + "</title>\n";
  s += "<style>\n"
       "body { font-family: \"DejaVu Sans\", Arial, Helvetica, sans-serif; margin: 24px; color: #222; }\n"
       "table { border-collapse: collapse; font-size: 14px; }\n"
       "th, td { border: 1px solid #ccc; padding: 4px 8px; vertical-align: top; }\n"
       "th { background: #f2f2f2; text-align: left; }\n"
       "td.num { text-align: right; font-variant-numeric: tabular-nums; }\n"
       ".swatch { display: inline-block; width: 10px; height: 10px; margin-right: 6px; }\n"
       ".small { font-size: 12px; color: #555; }\n"
       "figure { margin: 16px 0; } img { max-width: 100%; height: auto; }\n"
       "</style>\n</head>\n<body>\n";
  s += "<h1>Loom report: " + escape(names) + "</h1>\n";
  s += "<h2>Summary</h2>\n<table>\n<thead><tr>";
  for (const char* column : {"Run", "Parameters", "Optimizer", "Precision", "Steps", "Final train loss",
                             "Best val loss", "Best val perplexity", "Final val loss", "Final val perplexity",
                             "Median tokens/s", "Median MFU", "Peak memory", "Training time"}) {
    s += std::string("<th>") + column + "</th>";
  }
  s += "</tr></thead>\n<tbody>\n";
  for (size_t i = 0; i < runs.size(); ++i) s += summary_row(runs[i], i);
  s += "</tbody>\n</table>\n<ul class=\"small\">\n"
       "<li>Final train loss: the mean training loss of the last 10 steps. Perplexity: exp(validation loss), for "
       "language modelling (not a preference or reward objective).</li>\n"
       "<li>Tokens/s: over all data-parallel ranks. MFU: model FLOPs per second over the fp32 GEMM peak loom train "
       "measured at start-up, per rank. Both are medians over the steps.</li>\n"
       "<li>Peak memory: the largest total in use at a step's end; the memory chart shows each category's peak, "
       "transient buffers included.</li>\n"
       "<li>Training time: the sum of the steps' seconds (validation and checkpoints not included). A step recorded "
       "more than once (a resumed run) counts once, with its last record.</li>\n"
       "<li>Data: ";
  for (size_t i = 0; i < runs.size(); ++i)
    s += (i == 0 ? "" : ", ") + std::string("<code>") + escape(runs[i].metrics) + "</code>";
  s += "</li>\n</ul>\n";
  if (!notes.empty()) {
    s += "<h2>Notes</h2>\n<ul>\n";
    for (const std::string& note : notes) s += "<li>" + escape(note) + "</li>\n";
    s += "</ul>\n";
  }
  s += "<h2>Charts</h2>\n";
  for (const Figure& f : figures) {
    s += str_printf("<figure><img src=\"%s\" alt=\"%s\" width=\"%.0f\" height=\"%.0f\"></figure>\n",
                    escape(f.file).c_str(), escape(f.alt).c_str(), kChartWidth, f.height);
  }
  if (figures.empty()) s += "<p>No step was recorded: nothing to chart.</p>\n";
  return s + "</body>\n</html>\n";
}

// ---------------------------------------------------------------- the charts

// Per run, each objective series of every chart the table names (objective_series()): its
// training curves, then, dashed and marked in the same colour, its validation ones.
void add_objective_charts(const std::vector<Run>& runs, std::vector<LineChart>& charts) {
  const std::vector<ObjectiveSeries>& rows = objective_series();
  for (size_t first = 0; first < rows.size(); ++first) {
    const std::string& file = rows[first].chart_file;
    const auto earlier = [&](const ObjectiveSeries& row) { return row.chart_file == file; };
    if (std::any_of(rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(first), earlier)) continue;
    std::vector<size_t> members;
    for (const bool validation : {false, true}) {
      for (size_t i = first; i < rows.size(); ++i) {
        if (rows[i].chart_file == file && rows[i].validation == validation) members.push_back(i);
      }
    }
    LineChart chart(file, rows[first].title, rows[first].axis_label, rows[first].from_zero);
    for (size_t r = 0; r < runs.size(); ++r) {
      for (const size_t i : members) {
        Series s{runs[r].name + ": " + rows[i].label, run_color(r), rows[i].validation, rows[i].validation,
                 map_series(runs[r].objective[i], rows[i].scale)};
        if (!s.points.empty()) chart.series.push_back(std::move(s));
      }
    }
    charts.push_back(std::move(chart));
  }
}

std::vector<LineChart> line_charts(const std::vector<Run>& runs) {
  std::vector<LineChart> charts;
  const auto per_run = [&](LineChart chart, const char* what, auto get) {
    for (size_t i = 0; i < runs.size(); ++i) {
      Series s{runs[i].name + ": " + what, run_color(i), false, false, step_series(runs[i], get)};
      if (!s.points.empty()) chart.series.push_back(std::move(s));
    }
    charts.push_back(std::move(chart));
  };
  // Per run, the training loss and, dashed and marked in the same colour, the validation loss.
  const bool nats = std::all_of(runs.begin(), runs.end(), [](const Run& run) { return run.language_model(); });
  LineChart loss("loss.svg", "Training and validation loss", nats ? "loss (nats per token)" : "loss", false);
  for (size_t i = 0; i < runs.size(); ++i) {
    Series train{runs[i].name + ": training loss", run_color(i), false, false,
                 step_series(runs[i], [](const StepPoint& r) { return r.loss; })};
    Series val{runs[i].name + ": validation loss", run_color(i), true, true, map_series(runs[i].val_loss)};
    if (!train.points.empty()) loss.series.push_back(std::move(train));
    if (!val.points.empty()) loss.series.push_back(std::move(val));
  }
  charts.push_back(std::move(loss));
  add_objective_charts(runs, charts);
  per_run({"lr.svg", "Learning rate", "learning rate", true}, "learning rate",
          [](const StepPoint& r) { return r.lr; });
  per_run({"grad_norm.svg", "Gradient norm", "gradient norm (L2)", true}, "gradient norm",
          [](const StepPoint& r) { return r.grad_norm; });
  per_run({"tokens_per_s.svg", "Throughput", "tokens/s (all data-parallel ranks)", true}, "tokens/s",
          [](const StepPoint& r) { return r.tokens_per_s; });
  per_run({"mfu.svg", "Model FLOPs utilization", "MFU (% of the measured fp32 GEMM peak)", true}, "MFU",
          [](const StepPoint& r) { return 100.0 * r.mfu; });
  double max_bytes = 0;  // one unit for all runs: the one that fits the largest value
  for (const Run& run : runs) {
    for (const auto& [step, r] : run.steps) {
      if (std::isfinite(r.memory_bytes)) max_bytes = std::max(max_bytes, r.memory_bytes);
    }
  }
  const auto [unit, unit_name] = byte_unit(max_bytes);
  per_run({"memory_total.svg", "Memory in use at each step's end", "memory (" + unit_name + ")", true}, "memory",
          [unit = unit](const StepPoint& r) { return r.memory_bytes / unit; });
  return charts;
}

}  // namespace

ReportResult write_report(const std::vector<std::string>& run_dirs, const std::string& out_dir) {
  LOOM_CHECK(!run_dirs.empty(), "no run folder given");
  ReportResult result;
  std::vector<Run> runs;
  for (const std::string& dir : run_dirs) runs.push_back(read_run(dir, result.warnings));
  // Two runs/NAME folders from different places would share a legend entry: name them by path.
  std::map<std::string, int> uses;
  for (const Run& run : runs) ++uses[run.name];
  for (Run& run : runs) run.name = uses[run.name] > 1 ? run.dir : run.name;
  std::vector<std::string> notes = result.warnings;
  for (const Run& run : runs) {
    if (run.repeated_steps > 0) {
      notes.push_back(str_cat(run.metrics, ": ", run.repeated_steps,
                              " step(s) recorded more than once (a resumed run); "
                              "the last record of each is used"));
    }
  }

  fs::create_directories(out_dir);
  std::vector<Figure> figures;
  const auto write = [&](const std::string& file, const std::string& text) {
    const std::string path = (fs::path(out_dir) / file).string();
    write_file_atomic(path, text);  // a browser refreshing the report never sees half a file
    result.files.push_back(path);
  };
  for (const LineChart& chart : line_charts(runs)) {
    if (chart.series.empty()) continue;  // a series no run recorded is left out, not drawn empty
    double height = 0;
    write(chart.file, render_line_chart(chart, height));
    figures.push_back({chart.file, chart.title, height});
  }
  std::vector<MemoryBars> bars;  // the runs with a memory record
  for (size_t i = 0; i < runs.size(); ++i) {
    if (const auto* peaks = runs[i].latest_memory()) bars.push_back({runs[i].name, run_color(i), peaks});
  }
  if (!bars.empty()) {
    double height = 0;
    write("memory.svg", render_memory_bars(bars, height));
    figures.push_back({"memory.svg", "Peak memory by category", height});
  }
  // Last, so that the page never shows a chart that is not there yet.
  write("index.html", render_index(runs, figures, notes));
  return result;
}

}  // namespace loom::cli
