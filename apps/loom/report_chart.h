// loom report's charts: SVG line charts and memory bars, written by hand (no Debian C++ plotting
// library fits, and the CLI must not need Python), and the text helpers the page shares.
#pragma once
#include <cstddef>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace loom::cli {

// For XML text and attribute values alike (SVG and HTML). Run names come from folder names,
// which are bytes: invalid UTF-8 and the control characters XML 1.0 forbids would make the SVG
// unparsable, so they become U+FFFD.
std::string escape(const std::string& raw);

// format_bytes (core/memory.h) of a byte count the schema read: whole and >= 0.
std::string bytes_text(double bytes);

// The colour of the i-th run: ten far apart in hue; an eleventh run reuses the first (the legend
// names every curve).
std::string run_color(size_t i);

inline constexpr double kChartWidth = 760;  // every chart's, and its <img> width on the page

struct Series {
  std::string label;  // the legend entry and the line's tooltip: "RUN: training loss"
  std::string color;
  bool dashed = false, markers = false;
  std::vector<std::pair<double, double>> points;  // (step, value), finite, in step order
};

struct LineChart {
  LineChart(std::string file_name, std::string chart_title, std::string y_axis, bool from_zero)
      : file(std::move(file_name)), title(std::move(chart_title)), y_label(std::move(y_axis)), y_from_zero(from_zero) {}
  std::string file, title, y_label;
  bool y_from_zero = false;  // rates, norms and sizes: their distance from zero is the information
  std::vector<Series> series;
};

// The SVG of a chart over steps; `height` is set to the drawing's height.
std::string render_line_chart(const LineChart& chart, double& height);

// A byte unit that keeps a chart's largest value between 1 and 1024 of it: {bytes per unit, name}.
std::pair<double, std::string> byte_unit(double max_bytes);

// One run's bars in the memory chart: peak bytes per category.
struct MemoryBars {
  std::string run, color;
  const std::map<std::string, double>* peaks = nullptr;
};

// Horizontal bars: each memory category's peak bytes, one bar per run, largest category first.
std::string render_memory_bars(const std::vector<MemoryBars>& runs, double& height);

}  // namespace loom::cli
