// loom report's charts (report_chart.h): line charts over steps, memory bars, their ticks and legends.
#include "report_chart.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>

#include "loom/core/memory.h"
#include "loom/core/str_printf.h"
#include "loom/core/utf8.h"

namespace loom::cli {

namespace {

const char* const kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                               "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};

constexpr double kWidth = kChartWidth, kTop = 44, kPlotHeight = 300, kLegendRow = 18;
const char* const kDashes = " stroke-dasharray=\"6 4\"";  // validation curves

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
    return str_printf("%.*f%s", std::max(0, -static_cast<int>(std::floor(std::log10(t.step / scale) + 1e-9))),
                      v / scale, suffix);
  }
  if (t.step < 1e-3 || max_abs >= 1e12) {
    const int digits =
        std::max(0, static_cast<int>(std::floor(std::log10(max_abs)) - std::floor(std::log10(t.step) + 1e-9)));
    return str_printf("%.*e", digits, v);
  }
  return str_printf("%.*f", std::max(0, -static_cast<int>(std::floor(std::log10(t.step) + 1e-9))), v);
}

// Legend entries in one column, or two when there are more than four.
struct Legend {
  size_t columns = 1, rows = 0;
  explicit Legend(size_t entries) : columns(entries > 4 ? 2 : 1), rows((entries + columns - 1) / columns) {}
  double height() const { return rows == 0 ? 0 : rows * kLegendRow + 10; }
};

// The few SVG elements the charts use; `text` is escaped here, attrs are the caller's literal.
std::string svg_line(double x1, double y1, double x2, double y2, const char* attrs = "") {
  return str_printf("<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"%s/>", x1, y1, x2, y2, attrs);
}

std::string svg_text(double x, double y, const char* anchor, const std::string& text, const char* attrs = "") {
  return str_printf("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"%s\"%s>", x, y, anchor, attrs) + escape(text) +
         "</text>";
}

std::string svg_open(double height, const std::string& title) {
  std::string s = str_printf(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
      "viewBox=\"0 0 %.0f %.0f\" font-family=\"DejaVu Sans, Arial, Helvetica, sans-serif\" "
      "font-size=\"12\">\n",
      kWidth, height, kWidth, height);
  s += "<title>" + escape(title) + "</title>\n";
  s += str_printf("<rect x=\"0\" y=\"0\" width=\"%.0f\" height=\"%.0f\" fill=\"#ffffff\"/>\n", kWidth, height);
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
      s += str_printf("<rect x=\"%.1f\" y=\"%.1f\" width=\"28\" height=\"10\" fill=\"%s\"/>", x, row_y - 9,
                      e.color.c_str());
    } else {
      const std::string attrs = " stroke=\"" + e.color + "\" stroke-width=\"2\"" + (e.dashed ? kDashes : "");
      s += svg_line(x, row_y - 4, x + 28, row_y - 4, attrs.c_str());
    }
    if (e.markers) {
      s += str_printf("<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>", x + 14, row_y - 4, e.color.c_str());
    }
    s += svg_text(x + 36, row_y, "start", e.label) + "\n";
  }
  return s + "</g>\n";
}

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

}  // namespace

std::string escape(const std::string& raw) {
  std::string out;
  for (const char c : valid_utf8(raw)) {
    // The C0 controls but tab, newline and carriage return: XML 1.0 has no way to write them.
    if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n' && c != '\r') {
      out += "\xEF\xBF\xBD";
      continue;
    }
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

std::string bytes_text(double bytes) {
  constexpr double kPastLargest = 18446744073709551616.0;  // 2^64
  return format_bytes(!(bytes > 0) ? 0 : bytes < kPastLargest ? static_cast<size_t>(bytes) : SIZE_MAX);
}

std::string run_color(size_t i) { return kColors[i % (sizeof kColors / sizeof kColors[0])]; }

std::pair<double, std::string> byte_unit(double max_bytes) {
  if (max_bytes >= 1024.0 * 1024 * 1024) return {1024.0 * 1024 * 1024, "GiB"};
  if (max_bytes >= 1024.0 * 1024) return {1024.0 * 1024, "MiB"};
  if (max_bytes >= 1024.0) return {1024.0, "KiB"};
  return {1.0, "B"};
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
  s += str_printf("<text transform=\"translate(16 %.1f) rotate(-90)\" text-anchor=\"middle\">", (y0 + y1) / 2) +
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
      s += str_printf(i == 0 ? "%.1f,%.1f" : " %.1f,%.1f", px(points[i].first), py(points[i].second));
    }
    s += "\"><title>" + escape(e.label) + "</title></polyline>\n";
    if (e.markers || points.size() == 1) {  // a single point draws no line
      s += "<g fill=\"" + e.color + "\" stroke=\"#ffffff\" stroke-width=\"1\">";
      for (const auto& [x, y] : points) s += str_printf("<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\"/>", px(x), py(y));
      s += "</g>\n";
    }
  }
  s += str_printf("<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"#333333\"/>\n", x0,
                  y0, x1 - x0, y1 - y0);
  return s + svg_legend(chart.series, x0, x1, y1 + 48) + "</svg>\n";
}

// Horizontal bars: each memory category's peak bytes, one bar per run, largest category first.
std::string render_memory_bars(const std::vector<MemoryBars>& runs, double& height) {
  std::map<std::string, double> largest;
  for (const MemoryBars& run : runs) {
    for (const auto& [category, bytes] : *run.peaks) {
      if (std::isfinite(bytes) && bytes > 0) largest[category] = std::max(largest[category], bytes);
    }
  }
  std::vector<std::pair<std::string, double>> categories(largest.begin(), largest.end());
  std::stable_sort(categories.begin(), categories.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  std::vector<Series> legend;
  for (const MemoryBars& run : runs) legend.push_back({run.run, run.color, false, false, {}});
  const double max_bytes = categories.empty() ? 1.0 : categories.front().second;
  const auto [unit, unit_name] = byte_unit(max_bytes);
  const Ticks xt = nice_ticks(0, max_bytes / unit, 6, false);
  size_t name_chars = 0;
  for (const auto& c : categories) name_chars = std::max(name_chars, c.first.size());
  const double x0 = std::max(90.0, 20.0 + 7.0 * static_cast<double>(name_chars)), x1 = kWidth - 90;
  const double bar = 14, gap = 12, group = static_cast<double>(runs.size()) * (bar + 2) + gap;
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
    for (size_t k = 0; k < runs.size(); ++k) {
      const std::map<std::string, double>& peaks = *runs[k].peaks;
      const auto it = peaks.find(categories[c].first);
      const double bytes = it != peaks.end() && std::isfinite(it->second) ? it->second : 0.0;
      const double y = top + static_cast<double>(k) * (bar + 2);
      s += str_printf("<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.0f\" fill=\"%s\">", x0, y,
                      px(bytes / unit) - x0, bar, runs[k].color.c_str());
      s += "<title>" + escape(runs[k].run + ": " + categories[c].first + " " + bytes_text(bytes)) +
           "</title></rect>";
      s += svg_text(px(bytes / unit) + 4, y + bar - 3, "start", bytes_text(bytes), " font-size=\"11\"") + "\n";
    }
  }
  s += svg_line(x0, y0, x0, y1, " stroke=\"#333333\"") + svg_line(x0, y1, x1, y1, " stroke=\"#333333\"") + "\n";
  s += svg_text((x0 + x1) / 2, y1 + 38, "middle", "peak bytes (" + unit_name + ") at the latest validation") + "\n";
  return s + svg_legend(legend, x0, x1, y1 + 48, true) + "</svg>\n";
}

}  // namespace loom::cli
