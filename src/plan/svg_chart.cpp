#include "src/plan/svg_chart.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include <fmt/format.h>

#include "src/common/generator_mark.h"

namespace terrace::plan {
namespace {

constexpr int kLeft = 80, kRight = 200, kTop = 52, kBottom = 56;
constexpr const char* kPalette[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
                                    "#7f7f7f"};
constexpr int kPaletteSize = 8;

struct Axis {
  double lo = 0, hi = 1;
  double step = 0.2;  // linear axes: the tick spacing, a round number (1, 2, 2.5 or 5 times 10^k)
  bool log = false;
  double Map(double v, double px_lo, double px_hi) const {
    double t = log ? (std::log(v) - std::log(lo)) / (std::log(hi) - std::log(lo)) : (v - lo) / (hi - lo);
    if (!std::isfinite(t)) t = 0;
    return px_lo + t * (px_hi - px_lo);
  }
  std::vector<double> Ticks() const {
    std::vector<double> t;
    if (log) {
      // Powers of two, thinned to at most 8.
      const int a = static_cast<int>(std::floor(std::log2(lo))), b = static_cast<int>(std::ceil(std::log2(hi)));
      const int step = std::max(1, (b - a + 7) / 8);
      for (int e = a; e <= b; e += step) {
        const double v = std::ldexp(1.0, e);
        if (v >= lo * 0.999 && v <= hi * 1.001) t.push_back(v);
      }
    } else {
      for (int i = 0; lo + step * i <= hi * (1 + 1e-9) + 1e-300 && i <= 20; ++i) t.push_back(lo + step * i);
    }
    return t;
  }
};

Axis MakeAxis(double lo, double hi, bool log, AxisFormat f = AxisFormat::kPlain) {
  Axis a;
  // Byte and token axes tick at round numbers of their unit (100 KiB, not 97.7 KiB; 2k tokens, not
  // 1.95312k): the linear axis is made in that unit (KiB, MiB, ...; k = 1024 and M = 1048576 tokens,
  // as FormatAxisValue prints) and scaled back.
  if ((f == AxisFormat::kBytes || f == AxisFormat::kTokens) && !log && std::isfinite(hi) && std::fabs(hi) >= 1024) {
    double unit = 1;
    const double top = f == AxisFormat::kTokens ? 0x1p20 : 0x1p50;  // tokens: k and M only
    while (std::fabs(hi) / unit >= 1024 && unit < top) unit *= 1024;
    a = MakeAxis(lo / unit, hi / unit, false);
    if (a.step < 1) {  // under one unit: half units (512 KiB), not 0.2 MiB (204.8 KiB)
      a.step = a.step <= 0.5 ? 0.5 : 1;
      a.lo = std::floor(a.lo / a.step + 1e-9) * a.step;
      a.hi = std::ceil(a.hi / a.step - 1e-9) * a.step;
    }
    a.lo *= unit;
    a.hi *= unit;
    a.step *= unit;
    return a;
  }
  a.log = log;
  if (!(lo <= hi) || !std::isfinite(lo) || !std::isfinite(hi)) lo = hi = log ? 1 : 0;
  if (log) {
    if (lo == hi) {
      lo /= 2;
      hi *= 2;
    }
    a.lo = std::ldexp(1.0, static_cast<int>(std::floor(std::log2(lo))));
    a.hi = std::ldexp(1.0, static_cast<int>(std::ceil(std::log2(hi))));
  } else {
    if (lo > 0) lo = 0;
    if (lo == hi) hi = lo + 1;
    // About five ticks at a round spacing; the axis ends on a tick.
    const double raw = (hi - lo) / 5.0;
    const double mag = std::pow(10.0, std::floor(std::log10(raw)));
    double step = 10 * mag;
    for (double m : {1.0, 2.0, 2.5, 5.0}) {
      if (m * mag >= raw * (1 - 1e-9)) {
        step = m * mag;
        break;
      }
    }
    a.step = step;
    a.lo = std::floor(lo / step + 1e-9) * step;
    a.hi = std::ceil(hi / step - 1e-9) * step;
  }
  return a;
}

std::string Header(const std::string& title, const std::string& subtitle, int height = kChartHeight) {
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"12\" role=\"img\">{4}<title>{2}</title>"
      "<rect width=\"{0}\" height=\"{1}\" fill=\"#ffffff\"/>"
      "<text x=\"{3}\" y=\"20\" font-size=\"15\" font-weight=\"bold\">{2}</text>",
      kChartWidth, height, XmlEscape(title), kLeft, kSvgGeneratorComment);
  if (!subtitle.empty())
    s += fmt::format("<text x=\"{}\" y=\"38\" font-size=\"11\" fill=\"#555\">{}</text>", kLeft, XmlEscape(subtitle));
  return s;
}

// A linear axis over [lo, hi] with whole-number ticks (counts: turns, layers), at most ~10.
Axis IntegerAxis(double lo, double hi) {
  Axis a;
  if (!(lo <= hi) || !std::isfinite(lo) || !std::isfinite(hi)) lo = hi = 0;
  a.lo = std::floor(lo);
  a.hi = std::ceil(hi);
  if (a.hi == a.lo) {
    a.lo -= 1;
    a.hi += 1;
  }
  a.step = std::max(1.0, std::ceil((a.hi - a.lo) / 10.0));
  return a;
}

void Frame(std::string* s, const Axis& y, AxisFormat yf, const std::string& y_label, const std::string& x_label,
           int height = kChartHeight) {
  const int x0 = kLeft, x1 = kChartWidth - kRight, y0 = kChartHeight - kBottom, y1 = kTop;
  for (double t : y.Ticks()) {
    const double py = y.Map(t, y0, y1);
    *s += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#e5e5e5\"/>", x0, py, x1, py);
    *s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>", x0 - 6, py + 4,
                      XmlEscape(FormatAxisValue(t, yf)));
  }
  *s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#444\"/>", x0, y1,
                    x1 - x0, y0 - y1);
  *s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>", (x0 + x1) / 2, height - 12,
                    XmlEscape(x_label));
  *s += fmt::format("<text transform=\"translate(16 {}) rotate(-90)\" text-anchor=\"middle\">{}</text>", (y0 + y1) / 2,
                    XmlEscape(y_label));
}

// Line swatches (line charts) or filled squares (bar charts), one per name, right of the plot.
void Legend(std::string* s, const std::vector<std::string>& names, const std::vector<bool>& dashed, bool squares,
            std::size_t first_row = 0) {
  const int x = kChartWidth - kRight + 12;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const int y = kTop + 14 + static_cast<int>(i + first_row) * 20;
    if (squares) {
      *s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"14\" height=\"14\" fill=\"{}\"/>", x + 4, y - 11,
                        kPalette[i % kPaletteSize]);
    } else {
      *s += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{}\" stroke-width=\"3\"{}/>", x, y - 4,
                        x + 22, y - 4, kPalette[i % kPaletteSize],
                        i < dashed.size() && dashed[i] ? " stroke-dasharray=\"6 4\"" : "");
    }
    *s += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>", x + 28, y, XmlEscape(names[i]));
  }
}

// A bar's value label: 3 significant digits (percentages with one decimal).
std::string ValueLabel(double v, AxisFormat f) {
  if (f == AxisFormat::kPercent) return fmt::format("{:.1f}%", v * 100);
  if (f == AxisFormat::kBytes) return FormatAxisValue(v, f);
  if (std::fabs(v) >= 1000) return fmt::format("{:.0f}", v);  // not 1.23e+03
  return fmt::format("{:.3g}", v);
}

}  // namespace

std::string XmlEscape(std::string_view text) {
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD
  std::string out;
  out.reserve(text.size());
  std::size_t i = 0;
  while (i < text.size()) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x80) {
      switch (c) {
        case '&': out += "&amp;"; break;
        case '<': out += "&lt;"; break;
        case '>': out += "&gt;"; break;
        case '"': out += "&quot;"; break;
        case '\'': out += "&#39;"; break;
        case '\t': case '\n': case '\r': out += static_cast<char>(c); break;
        default:
          // XML 1.0 has no other control characters, not even as character references.
          if (c < 0x20) {
            out += kReplacement;
          } else {
            out += static_cast<char>(c);
          }
      }
      ++i;
      continue;
    }
    // A UTF-8 sequence: copied when well-formed (shortest form, no surrogate, at most U+10FFFF);
    // otherwise its first byte becomes U+FFFD and the next byte is looked at afresh.
    const std::size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 0;
    std::uint32_t cp = len == 4 ? c & 0x07u : len == 3 ? c & 0x0Fu : c & 0x1Fu;
    bool ok = len > 0 && c <= 0xF4 && i + len <= text.size();
    for (std::size_t k = 1; ok && k < len; ++k) {
      const auto cc = static_cast<unsigned char>(text[i + k]);
      ok = (cc & 0xC0) == 0x80;
      cp = (cp << 6) | (cc & 0x3Fu);
    }
    constexpr std::uint32_t kMinOfLength[5] = {0, 0, 0x80, 0x800, 0x10000};
    ok = ok && cp >= kMinOfLength[len] && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF);
    if (ok) {
      // U+FFFE and U+FFFF are well-formed UTF-8 but no XML characters: one U+FFFD for the sequence.
      if (cp == 0xFFFE || cp == 0xFFFF) {
        out += kReplacement;
      } else {
        out.append(text.substr(i, len));
      }
      i += len;
    } else {
      out += kReplacement;
      ++i;
    }
  }
  return out;
}

std::string FormatAxisValue(double v, AxisFormat f) {
  switch (f) {
    case AxisFormat::kPercent: return fmt::format("{:.0f}%", v * 100);
    case AxisFormat::kTokens:
      if (v >= 1048576) return fmt::format("{:g}M", v / 1048576);
      if (v >= 1024) return fmt::format("{:g}k", v / 1024);
      return fmt::format("{:g}", v);
    case AxisFormat::kBytes: {
      const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
      int u = 0;
      while (std::fabs(v) >= 1024 && u < 5) {
        v /= 1024;
        ++u;
      }
      return fmt::format("{:g} {}", std::round(v * 10) / 10, units[u]);
    }
    case AxisFormat::kPlain: break;
  }
  return fmt::format("{:g}", v);
}

std::string RenderSvg(const LineChart& c) {
  double xlo = std::numeric_limits<double>::infinity(), xhi = -xlo, ylo = xlo, yhi = -xlo;
  auto usable = [&](double x, double y) {
    return std::isfinite(x) && std::isfinite(y) && (!c.log_x || x > 0) && (!c.log_y || y > 0);
  };
  std::size_t dropped = 0;  // said in the subtitle: a point the axes cannot place is never dropped silently
  for (const Series& s : c.series) {
    for (auto [x, y] : s.points) {
      if (!usable(x, y)) {
        ++dropped;
        continue;
      }
      xlo = std::min(xlo, x);
      xhi = std::max(xhi, x);
      ylo = std::min(ylo, y);
      yhi = std::max(yhi, y);
    }
  }
  const Axis ax = c.integer_x && !c.log_x ? IntegerAxis(xlo, xhi) : MakeAxis(xlo, xhi, c.log_x, c.x_format);
  Axis ay = MakeAxis(ylo, yhi, c.log_y, c.y_format);
  if (c.y_format == AxisFormat::kPercent && !c.log_y) ay = MakeAxis(0, std::max(1.0, yhi), false);
  std::string subtitle = c.subtitle;
  if (dropped > 0) {
    subtitle += fmt::format("{}{} point{} not drawn (not a finite number{})", subtitle.empty() ? "" : "; ", dropped,
                            dropped == 1 ? "" : "s", c.log_x || c.log_y ? ", or not above 0 on a log axis" : "");
  }
  std::string s = Header(c.title, subtitle);
  Frame(&s, ay, c.y_format, c.y_label, c.x_label);
  const int x0 = kLeft, x1 = kChartWidth - kRight, y0 = kChartHeight - kBottom, y1 = kTop;
  for (double t : ax.Ticks()) {
    const double px = ax.Map(t, x0, x1);
    s += fmt::format("<line x1=\"{:.1f}\" y1=\"{}\" x2=\"{:.1f}\" y2=\"{}\" stroke=\"#444\"/>", px, y0, px, y0 + 5);
    s += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{}</text>", px, y0 + 18,
                     XmlEscape(FormatAxisValue(t, c.x_format)));
  }
  std::vector<std::string> names;
  std::vector<bool> dashed;
  for (std::size_t i = 0; i < c.series.size(); ++i) {
    const Series& se = c.series[i];
    std::string pts;
    for (auto [x, y] : se.points) {
      if (!usable(x, y)) continue;
      pts += fmt::format("{}{:.1f},{:.1f}", pts.empty() ? "" : " ", ax.Map(x, x0, x1), ay.Map(y, y0, y1));
    }
    s += fmt::format("<polyline class=\"series\" data-name=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"{} "
                     "points=\"{}\"/>",
                     XmlEscape(se.name), kPalette[i % kPaletteSize], se.dashed ? " stroke-dasharray=\"6 4\"" : "", pts);
    if (c.markers) {
      for (auto [x, y] : se.points) {
        if (!usable(x, y)) continue;
        s += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"{}\"/>", ax.Map(x, x0, x1), ay.Map(y, y0, y1),
                         kPalette[i % kPaletteSize]);
      }
    }
    names.push_back(se.name);
    dashed.push_back(se.dashed);
  }
  Legend(&s, names, dashed, /*squares=*/false);
  s += "</svg>";
  return s;
}

std::string RenderSvg(const BarChart& c) {
  // A bar's drawn value: finite, and not below zero when stacked (a segment never hangs under its base).
  auto value = [&](double v) { return !std::isfinite(v) ? 0 : c.stacked ? std::max(v, 0.0) : v; };
  double ylo = 0, yhi = 0;  // a negative bar (not stacked) hangs below zero, inside the plot
  for (const auto& g : c.values) {
    double total = 0;
    for (double v : g) {
      total += value(v);
      yhi = std::max(yhi, c.stacked ? total : value(v));
      ylo = std::min(ylo, value(v));
    }
  }
  for (const RefLine& r : c.ref_lines)
    if (std::isfinite(r.y)) yhi = std::max(yhi, r.y);
  const Axis ay = MakeAxis(ylo, c.y_format == AxisFormat::kPercent ? std::max(yhi, 1.0) : yhi, false, c.y_format);
  const int x0 = kLeft, x1 = kChartWidth - kRight, y0 = kChartHeight - kBottom, y1 = kTop;
  const double gw = static_cast<double>(x1 - x0) / std::max<std::size_t>(c.groups.size(), 1);
  const double bw = c.stacked ? gw * 0.8 : gw * 0.8 / std::max<std::size_t>(c.bars.size(), 1);
  // Labels wider than their group (about 6.5 px a character at 12 px) are drawn slanted down to the
  // right, and the canvas grows below the plot to hold them (the plot keeps its place and size).
  std::size_t longest = 0;
  for (const auto& g : c.groups) longest = std::max(longest, g.size());
  const std::size_t label_every = c.groups.size() / 24 + 1;  // keep many group labels from overlapping
  const bool slanted = static_cast<double>(longest) * 6.5 > gw * static_cast<double>(label_every) * 0.95;
  const int height =
      slanted ? std::max(kChartHeight, y0 + 24 + static_cast<int>(static_cast<double>(longest) * 6.5 * 0.574) + 8 +
                                           (c.x_label.empty() ? 0 : 18))
              : kChartHeight;
  std::string s = Header(c.title, c.subtitle, height);
  Frame(&s, ay, c.y_format, c.y_label, c.x_label, height);
  // A value label centred above the bar at x whose top is at py.
  auto label_above = [&](double x, double py, double v) {
    s += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" font-size=\"11\">{}</text>",
                     x + bw * 0.46, py - 4, XmlEscape(ValueLabel(v, c.y_format)));
  };
  for (std::size_t g = 0; g < c.groups.size(); ++g) {
    const double gx = x0 + g * gw + gw * 0.1;
    const bool hot = g < c.hot_groups.size() && c.hot_groups[g];
    const bool marked = g < c.marked_groups.size() && c.marked_groups[g];
    double base = 0;  // stacked: the top of the group's bars so far
    for (std::size_t b = 0; b < c.bars.size() && g < c.values.size() && b < c.values[g].size(); ++b) {
      const double v = value(c.values[g][b]);
      const double x = c.stacked ? gx : gx + b * bw, end = ay.Map(base + v, y0, y1), start = ay.Map(base, y0, y1);
      const double top = std::min(end, start), bottom = std::max(end, start);
      s += fmt::format("<rect class=\"bar{}{}\" x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"{}\"{}>"
                       "<title>{} {}: {}</title></rect>",
                       hot ? " hot" : "", marked ? " marked" : "", x, top, bw * 0.92, bottom - top,
                       hot ? "#c0392b" : kPalette[b % kPaletteSize], marked ? " stroke=\"#111\" stroke-width=\"2\"" : "",
                       XmlEscape(c.groups[g]), XmlEscape(c.bars[b]), XmlEscape(FormatAxisValue(v, c.y_format)));
      if (c.value_labels && !c.stacked) label_above(x, top, v);
      if (c.stacked) base += v;
    }
    if (c.value_labels && c.stacked) label_above(gx, ay.Map(base, y0, y1), base);
    const char* weight = marked ? " font-weight=\"bold\"" : "";
    if (g % label_every == 0 && slanted) {
      const double lx = x0 + g * gw + gw / 2 - 4;
      s += fmt::format("<text x=\"{0:.1f}\" y=\"{1}\" transform=\"rotate(35 {0:.1f} {1})\"{3}>{2}</text>", lx, y0 + 14,
                       XmlEscape(c.groups[g]), weight);
    } else if (g % label_every == 0) {
      s += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\"{}>{}</text>", x0 + g * gw + gw / 2, y0 + 18,
                       weight, XmlEscape(c.groups[g]));
    }
  }
  for (std::size_t i = 0; i < c.ref_lines.size(); ++i) {
    const RefLine& r = c.ref_lines[i];
    if (!std::isfinite(r.y)) continue;
    const double py = ay.Map(r.y, y0, y1);
    s += fmt::format("<line class=\"ref\" data-name=\"{}\" x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#333\" "
                     "stroke-width=\"1.5\" stroke-dasharray=\"{}\"/>",
                     XmlEscape(r.name), x0, py, x1, py, i == 0 ? "2 3" : "7 4");
  }
  Legend(&s, c.bars, {}, /*squares=*/true);
  if (!c.hot_groups.empty() && std::find(c.hot_groups.begin(), c.hot_groups.end(), true) != c.hot_groups.end()) {
    const int y = kTop + 14 + static_cast<int>(c.bars.size()) * 20;
    s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"14\" height=\"14\" fill=\"#c0392b\"/><text x=\"{}\" y=\"{}\">hot</text>",
                     kChartWidth - kRight + 16, y - 11, kChartWidth - kRight + 40, y);
  }
  for (std::size_t i = 0; i < c.ref_lines.size(); ++i) {
    const int y = kTop + 14 + static_cast<int>(c.bars.size() + 1 + i) * 20;
    s += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#333\" stroke-width=\"1.5\" "
                     "stroke-dasharray=\"{}\"/><text x=\"{}\" y=\"{}\">{}</text>",
                     kChartWidth - kRight + 12, y - 4, kChartWidth - kRight + 34, y - 4, i == 0 ? "2 3" : "7 4",
                     kChartWidth - kRight + 40, y, XmlEscape(c.ref_lines[i].name));
  }
  if (std::find(c.marked_groups.begin(), c.marked_groups.end(), true) != c.marked_groups.end()) {
    const int y = kTop + 14 + static_cast<int>(c.bars.size() + 1 + c.ref_lines.size()) * 20;
    s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"14\" height=\"14\" fill=\"none\" stroke=\"#111\" stroke-width=\"2\"/>"
                     "<text x=\"{}\" y=\"{}\">{}</text>",
                     kChartWidth - kRight + 16, y - 11, kChartWidth - kRight + 40, y, XmlEscape(c.marked_label));
  }
  s += "</svg>";
  return s;
}

}  // namespace terrace::plan
