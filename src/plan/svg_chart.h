// Self-contained SVG charts (no scripts, no external references) for `terrace report`. Pure
// functions; thread-safe.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace terrace::plan {

enum class AxisFormat : unsigned char { kPlain, kBytes, kTokens, kPercent };

struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (x, y) in data units
  bool dashed = false;
};

// A horizontal reference line across the plot (dashed, labelled at its right end).
struct RefLine {
  std::string name;
  double y = 0;
};

struct LineChart {
  std::string title, subtitle, x_label, y_label;  // subtitle: a smaller second line under the title
  bool log_x = false, log_y = false;  // log axes need positive values; others are dropped, counted in the subtitle
  bool integer_x = false;             // x is a count (turns, layers): the axis spans the data, integer ticks
  bool markers = false;               // a dot at every point (series with few points, or gaps)
  AxisFormat x_format = AxisFormat::kPlain, y_format = AxisFormat::kPlain;
  std::vector<Series> series;
};

struct BarChart {
  std::string title, subtitle, x_label, y_label;
  AxisFormat y_format = AxisFormat::kPlain;
  std::vector<std::string> groups;       // x categories
  std::vector<std::string> bars;         // bars within a group (legend)
  std::vector<std::vector<double>> values;  // [group][bar]
  std::vector<bool> hot_groups;          // [group]: drawn red with class "bar hot" (e.g. hot experts)
  std::vector<bool> marked_groups;       // [group]: outlined, class "bar marked", label bold (e.g. the run's codec)
  std::string marked_label;              // the legend entry of the outline (when a group is marked)
  bool stacked = false;                  // a group's bars stacked in one column, bars[0] at the bottom
  std::vector<RefLine> ref_lines;        // e.g. the layer mean and the hot threshold
  bool value_labels = false;             // the value above each bar (stacked: the group's total)
};

inline constexpr int kChartWidth = 720, kChartHeight = 380;
std::string RenderSvg(const LineChart& chart);
std::string RenderSvg(const BarChart& chart);
std::string FormatAxisValue(double v, AxisFormat f);
// Text for XML text and attributes, always well-formed: escapes & < > " ', and writes U+FFFD for
// what XML 1.0 cannot hold (control characters other than tab, newline and carriage return; each
// byte of text that is not UTF-8; U+FFFE and U+FFFF).
std::string XmlEscape(std::string_view text);

}  // namespace terrace::plan
