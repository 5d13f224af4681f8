// loom report: metrics.jsonl (apps/loom/cmd_train.cpp writes it) as SVG charts and an HTML
// summary. The SVG is written by hand: no Debian C++ plotting library fits, and the CLI must not
// need Python. Only the standard library and nlohmann/json, so this file reads no engine header.
#include "report.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/file_io.h"

namespace loom::cli {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---------------------------------------------------------------- text

template <typename... Args>
std::string printf_str(const char* pattern, Args... args) {
  std::string out(static_cast<size_t>(std::snprintf(nullptr, 0, pattern, args...)), '\0');
  std::snprintf(out.data(), out.size() + 1, pattern, args...);
  return out;
}

// Run names come from folder names, which are bytes: invalid UTF-8 and the control characters
// XML 1.0 forbids would make the SVG unparsable, so they become U+FFFD.
std::string valid_utf8(const std::string& s) {
  std::string out;
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    bool ok = len > 0 && i + len <= n;
    for (size_t k = 1; ok && k < len; ++k) ok = (p[i + k] & 0xC0) == 0x80;
    // Refused as well: the XML-forbidden controls, overlong forms, surrogates and code points past U+10FFFF.
    if (ok && len == 1) ok = c >= 0x20 || c == '\t' || c == '\n' || c == '\r';
    if (ok && len == 2) ok = c >= 0xC2;
    if (ok && len == 3) ok = !(c == 0xE0 && p[i + 1] < 0xA0) && !(c == 0xED && p[i + 1] >= 0xA0);
    if (ok && len == 4) ok = !(c == 0xF0 && p[i + 1] < 0x90) && c <= 0xF4 && !(c == 0xF4 && p[i + 1] >= 0x90);
    if (ok) {
      out.append(s, i, len);
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      ++i;
    }
  }
  return out;
}

// For XML text and attribute values alike (SVG and HTML).
std::string escape(const std::string& raw) {
  std::string out;
  for (const char c : valid_utf8(raw)) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// An excerpt of a bad line for an error message: short, printable, one line.
std::string excerpt(const std::string& s, size_t max = 60) {
  std::string out;
  for (const char c : s.substr(0, max)) out += (c >= 0x20 && c < 0x7F) ? c : '?';
  return s.size() > max ? out + "..." : out;
}

std::string bytes_text(double bytes) {
  if (bytes >= 1024.0 * 1024 * 1024) return printf_str("%.2f GiB", bytes / (1024.0 * 1024 * 1024));
  if (bytes >= 1024.0 * 1024) return printf_str("%.2f MiB", bytes / (1024.0 * 1024));
  if (bytes >= 1024.0) return printf_str("%.2f KiB", bytes / 1024.0);
  return printf_str("%.0f B", bytes);
}

// A byte unit that keeps a chart's largest value between 1 and 1024 of it.
std::pair<double, std::string> byte_unit(double max_bytes) {
  if (max_bytes >= 1024.0 * 1024 * 1024) return {1024.0 * 1024 * 1024, "GiB"};
  if (max_bytes >= 1024.0 * 1024) return {1024.0 * 1024, "MiB"};
  if (max_bytes >= 1024.0) return {1024.0, "KiB"};
  return {1.0, "B"};
}

std::string duration_text(double seconds) {
  if (seconds < 60) return printf_str("%.1f s", seconds);
  const auto s = static_cast<long long>(std::llround(seconds));
  if (s < 3600) return printf_str("%lldm%02llds", s / 60, s % 60);
  return printf_str("%lldh%02lldm", s / 3600, s / 60 % 60);
}

std::string count_text(double n) {
  if (n >= 1e9) return printf_str("%.2f B", n / 1e9);
  if (n >= 1e6) return printf_str("%.2f M", n / 1e6);
  if (n >= 1e3) return printf_str("%.1f K", n / 1e3);
  return printf_str("%.0f", n);
}

// ---------------------------------------------------------------- reading metrics.jsonl

struct StepRecord {
  double loss = kNaN, lr = kNaN, grad_norm = kNaN, tokens_per_s = kNaN, mfu = kNaN, memory_bytes = kNaN, seconds = kNaN;
  bool skipped = false;
  int64_t ranks = 1;
};

struct Run {
  std::string dir, metrics, name;
  json header;  // the last {"optimizer", "parameters", ...} record: a resumed run writes one per start
  // Keyed by step, so that a step a resumed run recorded again keeps its last record.
  std::map<int64_t, StepRecord> steps;
  std::map<int64_t, double> val_loss, val_reward, grpo_reward, dpo_accuracy, val_dpo_accuracy;
  std::map<int64_t, std::map<std::string, double>> memory_peaks;  // the "memory" records' peak bytes per category
  int64_t repeated_steps = 0;
  // Language modelling: the loss is nats per token and exp(loss) a perplexity, not so for DPO or GRPO.
  bool language_model() const {
    return dpo_accuracy.empty() && val_dpo_accuracy.empty() && grpo_reward.empty() && val_reward.empty();
  }
};

// The value of `key`: NaN when absent or null (nlohmann::json writes NaN and infinities as null,
// which is what a diverged step records).
double number(const json& rec, const char* key, const std::string& where) {
  const auto it = rec.find(key);
  if (it == rec.end() || it->is_null()) return kNaN;
  LOOM_CHECK(it->is_number(), where, ": \"", key, "\" is ", excerpt(it->dump(), 30), ", expected a number");
  return it->get<double>();
}

int64_t step_of(const json& rec, const std::string& where) {
  const json& s = rec.at("step");
  LOOM_CHECK(s.is_number_integer() && s.get<int64_t>() >= 0, where, ": \"step\" is ", excerpt(s.dump(), 30),
             ", expected a whole number >= 0");
  return s.get<int64_t>();
}

const json* object_at(const json& rec, const char* key, const std::string& where) {
  const auto it = rec.find(key);
  if (it == rec.end() || it->is_null()) return nullptr;
  LOOM_CHECK(it->is_object(), where, ": \"", key, "\" is ", excerpt(it->dump(), 30), ", expected an object");
  return &*it;
}

// A killed run leaves its last line cut short; `loom train --resume` then appends its header
// record to that partial line. The header is recognised by its keys so that only this case, and
// not a corrupt record, is read past.
bool resumed_header_tail(const std::string& line, json& header) {
  for (size_t p = line.find('{', 1); p != std::string::npos; p = line.find('{', p + 1)) {
    header = json::parse(line.begin() + static_cast<std::ptrdiff_t>(p), line.end(), nullptr, false);
    if (!header.is_discarded() && header.is_object() && header.contains("optimizer") && header.contains("parameters") &&
        !header.contains("step")) {
      return true;
    }
  }
  return false;
}

void add_record(Run& run, const json& rec, const std::string& where) {
  if (!rec.contains("step")) {
    if (rec.contains("optimizer")) run.header = rec;
    return;  // a record kind this report does not know: written by a newer loom, not an error
  }
  const int64_t step = step_of(rec, where);
  if (rec.contains("loss")) {
    StepRecord r;
    r.loss = number(rec, "loss", where);
    r.lr = number(rec, "lr", where);
    r.grad_norm = number(rec, "grad_norm", where);
    r.tokens_per_s = number(rec, "tokens_per_s", where);
    r.mfu = number(rec, "mfu", where);
    r.memory_bytes = number(rec, "memory_bytes", where);
    r.seconds = number(rec, "seconds", where);
    const double ranks = number(rec, "ranks", where);
    r.ranks = std::isfinite(ranks) ? static_cast<int64_t>(ranks) : 1;
    if (const auto it = rec.find("skipped"); it != rec.end()) {
      LOOM_CHECK(it->is_boolean(), where, ": \"skipped\" is ", excerpt(it->dump(), 30), ", expected true or false");
      r.skipped = it->get<bool>();
    }
    run.repeated_steps += run.steps.count(step);
    run.steps[step] = r;
  }
  if (rec.contains("val_loss")) run.val_loss[step] = number(rec, "val_loss", where);
  if (rec.contains("val_reward")) run.val_reward[step] = number(rec, "val_reward", where);
  if (const json* g = object_at(rec, "grpo", where)) run.grpo_reward[step] = number(*g, "reward", where);
  if (const json* d = object_at(rec, "dpo", where)) run.dpo_accuracy[step] = number(*d, "accuracy", where);
  if (const json* d = object_at(rec, "val_dpo", where)) run.val_dpo_accuracy[step] = number(*d, "accuracy", where);
  if (const json* mem = object_at(rec, "memory", where)) {
    std::map<std::string, double> peaks;
    for (const auto& [category, bytes] : mem->items()) {
      LOOM_CHECK(bytes.is_object(), where, ": \"memory\".\"", excerpt(category, 30), "\" is ",
                 excerpt(bytes.dump(), 30), ", expected {\"current\", \"peak\"}");
      peaks[category] = number(bytes, "peak", where);
    }
    run.memory_peaks[step] = std::move(peaks);
  }
}

constexpr uint64_t kMetricsReadLimit = uint64_t{1} << 30;

Run read_run(const std::string& dir, std::vector<std::string>& warnings) {
  Run run;
  run.dir = dir;
  run.metrics = (fs::path(dir) / "metrics.jsonl").string();
  fs::path name = fs::absolute(fs::path(dir)).lexically_normal();
  if (name.filename().empty()) name = name.parent_path();  // "runs/a/"
  run.name = name.filename().string();
  LOOM_CHECK(fs::is_directory(dir), dir, ": no such run folder");
  LOOM_CHECK(std::ifstream(run.metrics, std::ios::binary).good(), run.metrics, ": cannot open (is ", dir,
             " a run folder, runs/NAME?)");
  // Bounded like every input read whole (a metrics.jsonl linked to /dev/zero would never end):
  // 1 GiB is about three million steps' records.
  const std::string text = read_text_file(run.metrics, kMetricsReadLimit, "loom report reads at most 1 GiB of metrics");

  std::vector<std::string> lines;
  for (size_t begin = 0; begin < text.size();) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(begin, end - begin);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(std::move(line));
    begin = end + 1;
  }
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
        std::string detail;
        try {
          [[maybe_unused]] const json again = json::parse(lines[i]);
        } catch (const json::parse_error& e) {
          detail = e.what();
          if (const size_t at = detail.find("parse error"); at != std::string::npos) detail = detail.substr(at);
        }
        skip(str_cat(where, ": not valid JSON (", excerpt(detail, 160), ")"));
        continue;
      }
    }
    if (!rec.is_object()) {
      skip(str_cat(where, ": expected a JSON object per line, found ", excerpt(lines[i], 30)));
      continue;
    }
    try {
      Run scratch;
      add_record(scratch, rec, where);  // every check first, so that a bad record changes nothing
    } catch (const Error& e) {
      skip(e.what());
      continue;
    } catch (const json::exception& e) {
      skip(str_cat(where, ": ", e.what()));
      continue;
    }
    add_record(run, rec, where);
  }
  if (skipped > kNamedSkips) warnings.push_back(str_cat(run.metrics, ": ", skipped - kNamedSkips, " more unreadable lines skipped"));
  if (run.steps.empty()) warnings.push_back(run.metrics + ": no training step recorded");
  return run;
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

// The peaks of the memory record with the highest step (the run's latest state).
const std::map<std::string, double>* latest_memory(const Run& run) {
  return run.memory_peaks.empty() ? nullptr : &run.memory_peaks.rbegin()->second;
}

// ---------------------------------------------------------------- SVG charts

// Ten colours far apart in hue; an eleventh run reuses the first (the legend names every curve).
const char* const kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                               "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};

std::string run_color(size_t i) { return kColors[i % (sizeof kColors / sizeof kColors[0])]; }

constexpr double kWidth = 760, kTop = 44, kPlotHeight = 300, kLegendRow = 18;
const char* const kDashes = " stroke-dasharray=\"6 4\"";  // validation curves

struct Series {
  std::string label;  // the legend entry and the line's tooltip: "RUN: training loss"
  std::string color;
  bool dashed = false, markers = false;
  std::vector<std::pair<double, double>> points;  // (step, value), finite, in step order
};

struct Ticks {
  double lo = 0, hi = 1, step = 1;
  std::vector<double> values;
};

// Ticks at 1, 2 or 5 times a power of ten, about `target` of them, spanning [lo, hi].
Ticks nice_ticks(double lo, double hi, int target, bool whole) {
  if (!(hi > lo)) {  // one value: a band around it
    const double pad = lo == 0 ? 1.0 : std::abs(lo) * 0.1;
    hi += pad;
    lo = lo == 0 ? lo : lo - pad;
  }
  const double raw = (hi - lo) / target;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / magnitude;
  Ticks t;
  t.step = (f < 1.5 ? 1.0 : f < 3.0 ? 2.0 : f < 7.0 ? 5.0 : 10.0) * magnitude;
  if (whole) t.step = std::max(t.step, 1.0);
  t.lo = std::floor(lo / t.step + 1e-9) * t.step;
  t.hi = std::ceil(hi / t.step - 1e-9) * t.step;
  for (int i = 0;; ++i) {
    double v = t.lo + i * t.step;
    if (v > t.hi + t.step * 1e-6) break;
    if (std::abs(v) < t.step * 1e-6) v = 0;  // 0, not 1e-17
    t.values.push_back(v);
  }
  return t;
}

// As many digits as the tick spacing needs: k/M/G for large values (steps, tokens/s), the
// exponent form for very small ones (learning rates).
std::string tick_label(double v, const Ticks& t) {
  if (v == 0) return "0";
  const double max_abs = std::max(std::abs(t.lo), std::abs(t.hi));
  if (max_abs >= 1e4 && max_abs < 1e12 && t.step >= 1) {
    const double scale = max_abs >= 1e9 ? 1e9 : max_abs >= 1e6 ? 1e6 : 1e3;
    const char* suffix = max_abs >= 1e9 ? "G" : max_abs >= 1e6 ? "M" : "k";
    return printf_str("%.*f%s", std::max(0, -static_cast<int>(std::floor(std::log10(t.step / scale) + 1e-9))),
                      v / scale, suffix);
  }
  if (t.step < 1e-3 || max_abs >= 1e12) {
    const int digits =
        std::max(0, static_cast<int>(std::floor(std::log10(max_abs)) - std::floor(std::log10(t.step) + 1e-9)));
    return printf_str("%.*e", digits, v);
  }
  return printf_str("%.*f", std::max(0, -static_cast<int>(std::floor(std::log10(t.step) + 1e-9))), v);
}

// Legend entries in one column, or two when there are more than four.
struct Legend {
  size_t columns = 1, rows = 0;
  explicit Legend(size_t entries) : columns(entries > 4 ? 2 : 1), rows((entries + columns - 1) / columns) {}
  double height() const { return rows == 0 ? 0 : rows * kLegendRow + 10; }
};

// The few SVG elements the charts use; `text` is escaped here, attrs are the caller's literal.
std::string svg_line(double x1, double y1, double x2, double y2, const char* attrs = "") {
  return printf_str("<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"%s/>", x1, y1, x2, y2, attrs);
}

std::string svg_text(double x, double y, const char* anchor, const std::string& text, const char* attrs = "") {
  return printf_str("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"%s\"%s>", x, y, anchor, attrs) + escape(text) +
         "</text>";
}

std::string svg_open(double height, const std::string& title) {
  std::string s = printf_str(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
      "viewBox=\"0 0 %.0f %.0f\" font-family=\"DejaVu Sans, Arial, Helvetica, sans-serif\" "
      "font-size=\"12\">\n",
      kWidth, height, kWidth, height);
  s += "<title>" + escape(title) + "</title>\n";
  s += printf_str("<rect x=\"0\" y=\"0\" width=\"%.0f\" height=\"%.0f\" fill=\"#ffffff\"/>\n", kWidth, height);
  return s + svg_text(kWidth / 2, 26, "middle", title, " font-size=\"16\" font-weight=\"bold\"") + "\n";
}

// One legend entry per series: a line sample (dashed, with a marker, as the series draws) or a
// bar's colour, and its label.
std::string svg_legend(const std::vector<Series>& series, double x0, double x1, double y, bool bars = false) {
  const Legend legend(series.size());
  const double column_width = (x1 - x0) / static_cast<double>(legend.columns);
  std::string s = "<g font-size=\"12\">\n";
  for (size_t i = 0; i < series.size(); ++i) {
    const Series& e = series[i];
    const double x = x0 + static_cast<double>(i / legend.rows) * column_width;
    const double row_y = y + static_cast<double>(i % legend.rows) * kLegendRow + 12;
    if (bars) {
      s += printf_str("<rect x=\"%.1f\" y=\"%.1f\" width=\"28\" height=\"10\" fill=\"%s\"/>", x, row_y - 9,
                      e.color.c_str());
    } else {
      const std::string attrs = " stroke=\"" + e.color + "\" stroke-width=\"2\"" + (e.dashed ? kDashes : "");
      s += svg_line(x, row_y - 4, x + 28, row_y - 4, attrs.c_str());
    }
    if (e.markers) {
      s += printf_str("<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>", x + 14, row_y - 4, e.color.c_str());
    }
    s += svg_text(x + 36, row_y, "start", e.label) + "\n";
  }
  return s + "</g>\n";
}

struct LineChart {
  LineChart(std::string file_name, std::string chart_title, std::string y_axis, bool from_zero)
      : file(std::move(file_name)), title(std::move(chart_title)), y_label(std::move(y_axis)), y_from_zero(from_zero) {}
  std::string file, title, y_label;
  bool y_from_zero = false;  // rates, norms and sizes: their distance from zero is the information
  std::vector<Series> series;
};

// More points than twice the plot's pixel columns draw nothing more: each column keeps its first,
// lowest, highest and last point, so spikes survive and a 100k-step run stays a small file.
std::vector<std::pair<double, double>> thin(const std::vector<std::pair<double, double>>& points,
                                            const std::pair<double, double>& x_range, double pixels) {
  if (points.size() <= 2 * static_cast<size_t>(pixels)) return points;
  std::vector<std::pair<double, double>> out;
  const double span = x_range.second - x_range.first;
  size_t i = 0;
  while (i < points.size()) {
    const auto column = static_cast<int64_t>((points[i].first - x_range.first) / span * pixels);
    size_t j = i, lo = i, hi = i;
    while (j < points.size() && static_cast<int64_t>((points[j].first - x_range.first) / span * pixels) == column) {
      if (points[j].second < points[lo].second) lo = j;
      if (points[j].second > points[hi].second) hi = j;
      ++j;
    }
    std::vector<size_t> keep = {i, lo, hi, j - 1};
    std::sort(keep.begin(), keep.end());
    keep.erase(std::unique(keep.begin(), keep.end()), keep.end());
    for (const size_t k : keep) out.push_back(points[k]);
    i = j;
  }
  return out;
}

std::string render_line_chart(const LineChart& chart, double& height) {
  double x_min = INFINITY, x_max = -INFINITY, y_min = INFINITY, y_max = -INFINITY;
  for (const Series& s : chart.series) {
    for (const auto& [x, y] : s.points) {
      x_min = std::min(x_min, x), x_max = std::max(x_max, x);
      y_min = std::min(y_min, y), y_max = std::max(y_max, y);
    }
  }
  // A little room, so that no point sits on the frame; none below zero for a quantity that cannot be.
  const double pad = 0.02 * (y_max - y_min);
  y_min = chart.y_from_zero && y_min >= 0 && y_min - pad < 0 ? 0.0 : y_min - pad;
  y_max += pad;
  if (chart.y_from_zero) y_min = std::min(y_min, 0.0), y_max = std::max(y_max, 0.0);
  const Ticks xt = nice_ticks(x_min, x_max, 8, true), yt = nice_ticks(y_min, y_max, 6, false);
  size_t label_chars = 0;
  for (const double v : yt.values) label_chars = std::max(label_chars, tick_label(v, yt).size());
  const double x0 = std::max(70.0, 36.0 + 7.0 * static_cast<double>(label_chars)), x1 = kWidth - 24;
  const double y0 = kTop, y1 = kTop + kPlotHeight;
  const auto px = [&](double x) { return x0 + (x - xt.lo) / (xt.hi - xt.lo) * (x1 - x0); };
  const auto py = [&](double y) { return y1 - (y - yt.lo) / (yt.hi - yt.lo) * (y1 - y0); };
  height = y1 + 50 + Legend(chart.series.size()).height();

  std::string s = svg_open(height, chart.title);
  s += "<g stroke=\"#e4e4e4\" stroke-width=\"1\">\n";  // the grid, under everything
  for (const double v : xt.values) s += svg_line(px(v), y0, px(v), y1);
  for (const double v : yt.values) s += svg_line(x0, py(v), x1, py(v));
  s += "\n</g>\n<g stroke=\"#333333\" stroke-width=\"1\">\n";  // tick marks outside the frame
  for (const double v : xt.values) s += svg_line(px(v), y1, px(v), y1 + 5);
  for (const double v : yt.values) s += svg_line(x0 - 5, py(v), x0, py(v));
  s += "\n</g>\n<g font-size=\"11\" fill=\"#333333\">\n";
  for (const double v : xt.values) s += svg_text(px(v), y1 + 18, "middle", tick_label(v, xt));
  for (const double v : yt.values) s += svg_text(x0 - 8, py(v) + 4, "end", tick_label(v, yt));
  s += "\n</g>\n" + svg_text((x0 + x1) / 2, y1 + 38, "middle", "step") + "\n";
  s += printf_str("<text transform=\"translate(16 %.1f) rotate(-90)\" text-anchor=\"middle\">", (y0 + y1) / 2) +
       escape(chart.y_label) + "</text>\n";
  // Validation curves (the marked ones) last, so that the noisier training curves do not hide them.
  std::vector<const Series*> order;
  for (const Series& e : chart.series) order.push_back(&e);
  const auto first_marked =
      std::stable_partition(order.begin(), order.end(), [](const Series* e) { return !e->markers; });
  const bool fade = first_marked != order.end();  // and fainter, for the same reason
  for (const Series* series : order) {
    const Series& e = *series;
    const std::vector<std::pair<double, double>> points = thin(e.points, {xt.lo, xt.hi}, x1 - x0);
    s += "<polyline fill=\"none\" stroke=\"" + e.color + "\" stroke-width=\"" + (e.markers ? "2" : "1.5") +
         "\" stroke-linejoin=\"round\"" + (e.dashed ? kDashes : "") +
         (fade && !e.markers ? " stroke-opacity=\"0.45\"" : "") + " points=\"";
    for (size_t i = 0; i < points.size(); ++i) {
      s += printf_str(i == 0 ? "%.1f,%.1f" : " %.1f,%.1f", px(points[i].first), py(points[i].second));
    }
    s += "\"><title>" + escape(e.label) + "</title></polyline>\n";
    if (e.markers || points.size() == 1) {  // a single point draws no line
      s += "<g fill=\"" + e.color + "\" stroke=\"#ffffff\" stroke-width=\"1\">";
      for (const auto& [x, y] : points) s += printf_str("<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\"/>", px(x), py(y));
      s += "</g>\n";
    }
  }
  s += printf_str("<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"#333333\"/>\n", x0,
                  y0, x1 - x0, y1 - y0);
  return s + svg_legend(chart.series, x0, x1, y1 + 48) + "</svg>\n";
}

// Horizontal bars: each memory category's peak bytes, one bar per run, largest category first.
std::string render_memory_bars(const std::vector<Run>& runs, double& height) {
  std::map<std::string, double> largest;
  for (const Run& run : runs) {
    if (const auto* peaks = latest_memory(run)) {
      for (const auto& [category, bytes] : *peaks) {
        if (std::isfinite(bytes) && bytes > 0) largest[category] = std::max(largest[category], bytes);
      }
    }
  }
  std::vector<std::pair<std::string, double>> categories(largest.begin(), largest.end());
  std::stable_sort(categories.begin(), categories.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  std::vector<size_t> shown;  // the runs with a memory record
  std::vector<Series> legend;
  for (size_t r = 0; r < runs.size(); ++r) {
    if (latest_memory(runs[r]) == nullptr) continue;
    shown.push_back(r);
    legend.push_back({runs[r].name, run_color(r), false, false, {}});
  }
  const double max_bytes = categories.empty() ? 1.0 : categories.front().second;
  const auto [unit, unit_name] = byte_unit(max_bytes);
  const Ticks xt = nice_ticks(0, max_bytes / unit, 6, false);
  size_t name_chars = 0;
  for (const auto& c : categories) name_chars = std::max(name_chars, c.first.size());
  const double x0 = std::max(90.0, 20.0 + 7.0 * static_cast<double>(name_chars)), x1 = kWidth - 90;
  const double bar = 14, gap = 12, group = static_cast<double>(shown.size()) * (bar + 2) + gap;
  const double y0 = kTop, y1 = y0 + std::max(group * static_cast<double>(categories.size()), 40.0);
  const auto px = [&](double v) { return x0 + (v - xt.lo) / (xt.hi - xt.lo) * (x1 - x0); };
  height = y1 + 50 + Legend(legend.size()).height();

  std::string s = svg_open(height, "Peak memory by category");
  s += "<g stroke=\"#e4e4e4\" stroke-width=\"1\">\n";
  for (const double v : xt.values) s += svg_line(px(v), y0, px(v), y1);
  s += "\n</g>\n<g font-size=\"11\" fill=\"#333333\">\n";
  for (const double v : xt.values) {
    s += svg_line(px(v), y1, px(v), y1 + 5, " stroke=\"#333333\"") +
         svg_text(px(v), y1 + 18, "middle", tick_label(v, xt));
  }
  s += "\n</g>\n";
  for (size_t c = 0; c < categories.size(); ++c) {
    const double top = y0 + gap / 2 + static_cast<double>(c) * group;
    s += svg_text(x0 - 8, top + (group - gap) / 2 + 4, "end", categories[c].first) + "\n";
    for (size_t k = 0; k < shown.size(); ++k) {
      const auto& peaks = *latest_memory(runs[shown[k]]);
      const auto it = peaks.find(categories[c].first);
      const double bytes = it != peaks.end() && std::isfinite(it->second) ? it->second : 0.0;
      const double y = top + static_cast<double>(k) * (bar + 2);
      s += printf_str("<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.0f\" fill=\"%s\">", x0, y,
                      px(bytes / unit) - x0, bar, run_color(shown[k]).c_str());
      s += "<title>" + escape(runs[shown[k]].name + ": " + categories[c].first + " " + bytes_text(bytes)) +
           "</title></rect>";
      s += svg_text(px(bytes / unit) + 4, y + bar - 3, "start", bytes_text(bytes), " font-size=\"11\"") + "\n";
    }
  }
  s += svg_line(x0, y0, x0, y1, " stroke=\"#333333\"") + svg_line(x0, y1, x1, y1, " stroke=\"#333333\"") + "\n";
  s += svg_text((x0 + x1) / 2, y1 + 38, "middle", "peak bytes (" + unit_name + ") at the latest validation") + "\n";
  return s + svg_legend(legend, x0, x1, y1 + 48, true) + "</svg>\n";
}

// ---------------------------------------------------------------- files

// Through a temporary name and a rename, so that a reader (a browser refreshing the report) never
// sees half a file.
void write_atomic(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.parent_path() / ("." + path.filename().string() + ".tmp");
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    LOOM_CHECK(out, tmp.string(), ": cannot write");
    out << text;
    out.flush();
    if (!out) {
      std::error_code ignored;
      fs::remove(tmp, ignored);
      throw Error(str_cat(tmp.string(), ": write failed (disk full?)"));
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    throw Error(str_cat(path.string(), ": cannot rename ", tmp.string(), " over it: ", ec.message()));
  }
}

struct Figure {
  std::string file, alt;
  double height = 0;
};

// The header's precision, shortened when every part of the model runs in one format.
std::string precision_text(const json& header) {
  const auto it = header.find("precision");
  if (it == header.end() || !it->is_string()) return "";
  const std::string full = it->get<std::string>();
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
  return std::isfinite(v) ? printf_str(pattern, v * scale) : kNone;
}

std::string summary_row(const Run& run, size_t index) {
  std::string row = "<tr>";
  int64_t ranks = run.steps.empty() ? 1 : run.steps.rbegin()->second.ranks;
  std::string name = "<span class=\"swatch\" style=\"background:" + run_color(index) + "\"></span>" + escape(run.name);
  if (ranks > 1) name += printf_str("<br><span class=\"small\">%lld ranks</span>", static_cast<long long>(ranks));
  row += cell(name, false, run.dir);
  const json& h = run.header;
  const auto header_number = [&](const char* key) {
    const auto it = h.is_object() ? h.find(key) : h.end();
    return h.is_object() && it != h.end() && it->is_number() ? it->get<double>() : kNaN;
  };
  const auto header_text = [&](const char* key) {
    const auto it = h.is_object() ? h.find(key) : h.end();
    return h.is_object() && it != h.end() && it->is_string() ? escape(it->get<std::string>()) : std::string(kNone);
  };
  const double params = header_number("parameters");
  row += cell(std::isfinite(params) ? count_text(params) : kNone, true,
              std::isfinite(params) ? printf_str("%.0f parameters", params) : "");
  row += cell(header_text("optimizer"), false);
  std::string precision = h.is_object() ? escape(precision_text(h)) : std::string();
  if (h.is_object() && h.contains("loss_scaling") && h["loss_scaling"] == true)
    precision += precision.empty() ? "loss scaling" : ", loss scaling";
  row += cell(precision.empty() ? kNone : "<span class=\"small\">" + precision + "</span>", false);

  int64_t skipped = 0;
  for (const auto& [step, r] : run.steps) skipped += r.skipped ? 1 : 0;
  std::string steps = run.steps.empty() ? kNone : std::to_string(run.steps.rbegin()->first);
  if (skipped > 0)
    steps += printf_str("<br><span class=\"small\">%lld skipped</span>", static_cast<long long>(skipped));
  row += cell(steps);

  // The mean of the last 10 finite losses: one step's loss is too noisy to compare runs by.
  double sum = 0;
  int n = 0;
  for (auto it = run.steps.rbegin(); it != run.steps.rend() && n < 10; ++it) {
    if (std::isfinite(it->second.loss)) sum += it->second.loss, ++n;
  }
  row += cell(n > 0 ? printf_str("%.4f", sum / n) : kNone);

  double best = kNaN;
  int64_t best_step = -1;
  for (const auto& [step, v] : run.val_loss) {
    if (std::isfinite(v) && !(v >= best)) best = v, best_step = step;
  }
  const double final_val = run.val_loss.empty() ? kNaN : run.val_loss.rbegin()->second;
  row += cell(std::isfinite(best) ? printf_str("%.4f", best) + printf_str(" <span class=\"small\">(step %lld)</span>",
                                                                          static_cast<long long>(best_step))
                                  : kNone);
  row += cell(or_none(run.language_model() ? std::exp(best) : kNaN, "%.2f"));
  row += cell(or_none(final_val, "%.4f"));
  row += cell(or_none(run.language_model() ? std::exp(final_val) : kNaN, "%.2f"));
  row += cell(or_none(median(step_values(run, [](const StepRecord& r) { return r.tokens_per_s; })), "%.0f"));
  row += cell(or_none(median(step_values(run, [](const StepRecord& r) { return r.mfu; })), "%.1f%%", 100.0));
  double peak = kNaN;
  for (const auto& [step, r] : run.steps) {
    if (std::isfinite(r.memory_bytes) && !(r.memory_bytes <= peak)) peak = r.memory_bytes;
  }
  double category_peaks = 0;
  if (const auto* peaks = latest_memory(run)) {
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
       "language modelling (not DPO or GRPO).</li>\n"
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
    s += printf_str("<figure><img src=\"%s\" alt=\"%s\" width=\"%.0f\" height=\"%.0f\"></figure>\n",
                    escape(f.file).c_str(), escape(f.alt).c_str(), kWidth, f.height);
  }
  if (figures.empty()) s += "<p>No step was recorded: nothing to chart.</p>\n";
  return s + "</body>\n</html>\n";
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

  std::vector<LineChart> charts;
  const auto per_run = [&](LineChart chart, const char* what, auto get) {
    for (size_t i = 0; i < runs.size(); ++i) {
      Series s{runs[i].name + ": " + what, run_color(i), false, false, step_series(runs[i], get)};
      if (!s.points.empty()) chart.series.push_back(std::move(s));
    }
    charts.push_back(std::move(chart));
  };
  // Per run, a training curve and, dashed and marked in the same colour, its validation curve.
  const auto train_and_val = [&](LineChart chart, const char* train_what, auto train_points, const char* val_what,
                                 auto val_points) {
    for (size_t i = 0; i < runs.size(); ++i) {
      Series train{runs[i].name + ": " + train_what, run_color(i), false, false, train_points(runs[i])};
      Series val{runs[i].name + ": " + val_what, run_color(i), true, true, val_points(runs[i])};
      if (!train.points.empty()) chart.series.push_back(std::move(train));
      if (!val.points.empty()) chart.series.push_back(std::move(val));
    }
    charts.push_back(std::move(chart));
  };
  const bool nats = std::all_of(runs.begin(), runs.end(), [](const Run& run) { return run.language_model(); });
  train_and_val(
      {"loss.svg", "Training and validation loss", nats ? "loss (nats per token)" : "loss", false}, "training loss",
      [](const Run& run) { return step_series(run, [](const StepRecord& r) { return r.loss; }); }, "validation loss",
      [](const Run& run) { return map_series(run.val_loss); });
  // train.objective = grpo: the rollouts' mean reward and the held-out greedy reward.
  train_and_val(
      {"reward.svg", "Reward (GRPO)", "mean reward", false}, "rollout reward",
      [](const Run& run) { return map_series(run.grpo_reward); }, "validation greedy reward",
      [](const Run& run) { return map_series(run.val_reward); });
  // train.objective = dpo: how often the chosen completion out-scores the rejected one.
  train_and_val(
      {"dpo_accuracy.svg", "Preference accuracy (DPO)", "accuracy (%)", true}, "training accuracy",
      [](const Run& run) { return map_series(run.dpo_accuracy, 100.0); }, "validation accuracy",
      [](const Run& run) { return map_series(run.val_dpo_accuracy, 100.0); });
  per_run({"lr.svg", "Learning rate", "learning rate", true}, "learning rate",
          [](const StepRecord& r) { return r.lr; });
  per_run({"grad_norm.svg", "Gradient norm", "gradient norm (L2)", true}, "gradient norm",
          [](const StepRecord& r) { return r.grad_norm; });
  per_run({"tokens_per_s.svg", "Throughput", "tokens/s (all data-parallel ranks)", true}, "tokens/s",
          [](const StepRecord& r) { return r.tokens_per_s; });
  per_run({"mfu.svg", "Model FLOPs utilization", "MFU (% of the measured fp32 GEMM peak)", true}, "MFU",
          [](const StepRecord& r) { return 100.0 * r.mfu; });
  double max_bytes = 0;  // one unit for all runs: the one that fits the largest value
  for (const Run& run : runs) {
    for (const auto& [step, r] : run.steps) {
      if (std::isfinite(r.memory_bytes)) max_bytes = std::max(max_bytes, r.memory_bytes);
    }
  }
  const auto [unit, unit_name] = byte_unit(max_bytes);
  per_run({"memory_total.svg", "Memory in use at each step's end", "memory (" + unit_name + ")", true}, "memory",
          [unit = unit](const StepRecord& r) { return r.memory_bytes / unit; });

  fs::create_directories(out_dir);
  std::vector<Figure> figures;
  for (const LineChart& chart : charts) {
    if (chart.series.empty()) continue;  // a series no run recorded is left out, not drawn empty
    double height = 0;
    const std::string svg = render_line_chart(chart, height);
    const fs::path path = fs::path(out_dir) / chart.file;
    write_atomic(path, svg);
    result.files.push_back(path.string());
    figures.push_back({chart.file, chart.title, height});
  }
  bool any_memory = false;
  for (const Run& run : runs) any_memory = any_memory || latest_memory(run) != nullptr;
  if (any_memory) {
    double height = 0;
    const std::string svg = render_memory_bars(runs, height);
    const fs::path path = fs::path(out_dir) / "memory.svg";
    write_atomic(path, svg);
    result.files.push_back(path.string());
    figures.push_back({"memory.svg", "Peak memory by category", height});
  }
  // Last, so that the page never shows a chart that is not there yet.
  const fs::path index = fs::path(out_dir) / "index.html";
  write_atomic(index, render_index(runs, figures, notes));
  result.files.push_back(index.string());
  return result;
}

}  // namespace loom::cli
