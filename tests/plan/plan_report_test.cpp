// `terrace report`: self-contained HTML with inline SVG whose polylines follow the data.
#include <cstring>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <catch2/catch.hpp>

#include "src/plan/report.h"
#include "src/plan/svg_chart.h"

using namespace terrace;
using namespace terrace::plan;

namespace {
const char* kRun = R"({
  "kind": "plan", "model": "<b>&model", "hardware": {"name": "hw"}, "kv_codec": "bf16", "state_codec": "f32",
  "memory": {"mla_bytes_per_token": 100, "curve": [
    {"tokens": 1024, "mla_bytes": 1000, "kda_bytes": 50, "total_bytes": 1050, "mha_bytes": 9000, "gqa_bytes": 3000},
    {"tokens": 2048, "mla_bytes": 2000, "kda_bytes": 50, "total_bytes": 2050, "mha_bytes": 18000, "gqa_bytes": 6000},
    {"tokens": 4096, "mla_bytes": 4000, "kda_bytes": 50, "total_bytes": 4050, "mha_bytes": 36000, "gqa_bytes": 12000}]},
  "trace": {"file": "t.jsonl", "requests": 3, "prefix_hit_ceiling": 0.6,
    "sweep": [{"policy": "lru", "capacity_bytes": 1024, "hit_rate": 0.1},
              {"policy": "lru", "capacity_bytes": 2048, "hit_rate": 0.3},
              {"policy": "lru", "capacity_bytes": 4096, "hit_rate": 0.6},
              {"policy": "s3fifo", "capacity_bytes": 1024, "hit_rate": 0.2},
              {"policy": "s3fifo", "capacity_bytes": 4096, "hit_rate": 0.6}],
    "policies": [{"policy": "lru", "hit_rate": 0.5, "tiers": [{"name": "hbm", "hit_rate": 0.3}, {"name": "host", "hit_rate": 0.2}]}]}
})";

// The (x, y) pairs of the polyline whose data-name is `name`.
std::vector<std::pair<double, double>> Points(const std::string& svg, const std::string& name) {
  // (String search, not <regex>: GCC 12's regex trips -Wmaybe-uninitialized under ASan.)
  const std::string attr = "data-name=\"" + name + "\"";
  std::size_t begin = std::string::npos, end = std::string::npos;
  for (std::size_t at = svg.find(attr); at != std::string::npos; at = svg.find(attr, at + 1)) {
    const std::size_t tag_end = svg.find('>', at), p = svg.find("points=\"", at);
    if (p == std::string::npos || p > tag_end) continue;  // not the polyline (a legend swatch, say)
    begin = p + 8;
    end = svg.find('"', begin);
    break;
  }
  if (begin == std::string::npos || end == std::string::npos) return {};
  std::vector<std::pair<double, double>> out;
  std::stringstream ss(svg.substr(begin, end - begin));
  double x, y;
  char comma;
  while (ss >> x >> comma >> y) out.emplace_back(x, y);
  return out;
}
}  // namespace

TEST_CASE("Report: self-contained HTML, escaped text, one chart per plot") {
  auto r = RenderReport(kRun, "run.json");
  REQUIRE(r.ok());
  const std::string& h = r->html;
  CHECK(h.find("<!DOCTYPE html>") == 0);
  CHECK(h.find("<script") == std::string::npos);
  CHECK(h.find("href=") == std::string::npos);
  CHECK(h.find("src=") == std::string::npos);
  // The only URL is the SVG namespace name (never fetched).
  std::string rest = h;
  for (std::size_t p; (p = rest.find("http://www.w3.org/2000/svg")) != std::string::npos;) rest.erase(p, 26);
  CHECK(rest.find("http") == std::string::npos);
  CHECK(h.find("&lt;b&gt;&amp;model") != std::string::npos);
  CHECK(h.find("<b>&model") == std::string::npos);
  REQUIRE(r->charts.size() == 3);
  CHECK(r->charts[0].name == "memory-vs-context");
  CHECK(r->charts[1].name == "hit-rate-vs-capacity");
  CHECK(r->charts[2].name == "tier-hit-rates");
  for (const auto& c : r->charts) CHECK(h.find(c.svg) != std::string::npos);
}

TEST_CASE("Report: polylines follow the data (x grows with capacity, y rises with the hit rate)") {
  auto r = RenderReport(kRun, "run.json");
  REQUIRE(r.ok());
  const auto mem = Points(r->charts[0].svg, "MHA comparison");
  REQUIRE(mem.size() == 3);
  // Log-log, doubling: equal steps in x and in y.
  CHECK(mem[1].first - mem[0].first == Approx(mem[2].first - mem[1].first).epsilon(0.01));
  CHECK(mem[0].second - mem[1].second == Approx(mem[1].second - mem[2].second).epsilon(0.01));
  const auto lru = Points(r->charts[1].svg, "lru");
  REQUIRE(lru.size() == 3);
  CHECK(lru[0].first < lru[1].first);
  CHECK(lru[1].first < lru[2].first);
  CHECK(lru[0].second > lru[1].second);  // SVG y grows downwards
  CHECK(lru[1].second > lru[2].second);
  CHECK(Points(r->charts[1].svg, "s3fifo").size() == 2);
  const auto ceiling = Points(r->charts[1].svg, "ceiling (infinite cache)");
  REQUIRE(ceiling.size() == 2);
  CHECK(ceiling[0].second == Approx(lru[2].second));  // 0.6 both
  // Two bars for the one policy.
  std::size_t bars = 0;
  for (std::size_t p = 0; (p = r->charts[2].svg.find("class=\"bar\"", p)) != std::string::npos; ++p) ++bars;
  CHECK(bars == 2);
}

TEST_CASE("Report: other JSON becomes a table of values; non-objects are refused") {
  auto r = RenderReport(R"({"bench": {"gib_per_s": 12.5, "ops": [1, 2]}})", "b.json");
  REQUIRE(r.ok());
  CHECK(r->charts.empty());
  CHECK(r->html.find("bench.gib_per_s") != std::string::npos);
  auto bad = RenderReport("[1, 2]", "x.json");
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(bad.status().message(), Catch::Contains("x.json"));
  CHECK(XmlEscape("a<'\">&") == "a&lt;&#39;&quot;&gt;&amp;");
  CHECK(FormatAxisValue(1536, AxisFormat::kBytes) == "1.5 KiB");
  CHECK(FormatAxisValue(0.25, AxisFormat::kPercent) == "25%");
  CHECK(FormatAxisValue(2048, AxisFormat::kTokens) == "2k");
}

TEST_CASE("Report: a plan's expected stall per token is drawn; lifecycle and workload read as words with units") {
  auto r = RenderReport(R"({"kind": "plan", "model": "m", "hardware": {"name": "hw"},
    "workload": {"rate_rps": 2, "context_tokens": 4096, "decode_tokens": 64, "concurrency": 8, "prefix_reuse": 0.25},
    "experts": {"hit_target": 0.9, "bytes_for_target": 1, "budget_bytes": 2048, "hit_rate": 0.5,
                "stall_s_per_token_batch1": 0.004, "stall_s_per_token_batched": 0.001},
    "lifecycle": {"weight_load_s": 15.25, "decode_step_s": 0.0125, "offload_bytes_per_request": 3221225472,
                  "routing_flops_share": 0.03}})",
                        "p.json");
  REQUIRE(r.ok());
  const ReportChart* stall = nullptr;
  for (const auto& c : r->charts)
    if (c.name == "stall-per-token") stall = &c;
  REQUIRE(stall != nullptr);
  // Two bars, the batch-1 one (4 ms) four times the batched one (1 ms).
  std::vector<double> heights;
  for (std::size_t p = 0; (p = stall->svg.find("class=\"bar\"", p)) != std::string::npos; ++p) {
    const std::size_t h = stall->svg.find("height=\"", p) + 8;
    heights.push_back(std::stod(stall->svg.substr(h)));
  }
  REQUIRE(heights.size() == 2);
  CHECK(heights[0] == Approx(4 * heights[1]).epsilon(0.02));
  CHECK(r->html.find("weight load s</th><td>15.2 s") != std::string::npos);
  CHECK(r->html.find("decode step s</th><td>12.5 ms") != std::string::npos);
  CHECK(r->html.find("offload bytes per request</th><td>3 GiB") != std::string::npos);
  CHECK(r->html.find("routing flops share</th><td>3.0%") != std::string::npos);
  CHECK(r->html.find("2 requests/s, 4096 tokens of context") != std::string::npos);
  CHECK(r->html.find("25.0% of the prompt a reused prefix") != std::string::npos);
}

TEST_CASE("Charts: counts on x get whole-number ticks over the data's range") {
  LineChart c;
  c.integer_x = true;
  c.series.push_back({"s", {{1, 1}, {2, 2}, {9, 3}}, false});
  const std::string svg = RenderSvg(c);
  // The x tick labels: centred text 18 px below the plot (whose bottom is 56 px above the chart's).
  const std::string at = fmt::format("y=\"{}\" text-anchor=\"middle\">", kChartHeight - 56 + 18);
  std::vector<std::string> labels;
  for (std::size_t p = svg.find(at); p != std::string::npos; p = svg.find(at, p + 1)) {
    const std::size_t b = p + at.size();
    labels.push_back(svg.substr(b, svg.find('<', b) - b));
  }
  CHECK(labels == std::vector<std::string>{"1", "2", "3", "4", "5", "6", "7", "8", "9"});
}

TEST_CASE("Charts: bar labels wider than their bar are slanted and the canvas grows to hold them") {
  BarChart b;
  b.bars = {"v"};
  for (int i = 0; i < 10; ++i) {
    b.groups.push_back(fmt::format("utility+statistical @ {}%", i));
    b.values.push_back({1.0 + i});
  }
  const std::string slanted = RenderSvg(b);
  CHECK(slanted.find("rotate(35") != std::string::npos);
  CHECK(slanted.find(fmt::format("height=\"{}\"", kChartHeight)) == std::string::npos);
  for (auto& g : b.groups) g = g.substr(g.size() - 2);  // "0%" .. "9%": fit
  const std::string flat = RenderSvg(b);
  CHECK(flat.find("rotate(35") == std::string::npos);
  CHECK(flat.find(fmt::format("height=\"{}\"", kChartHeight)) != std::string::npos);
}

namespace {
// The (y, height) of every bar rect ("class=\"bar...\""), in drawing order, and whether it is marked.
struct Rect {
  double y, h;
  bool marked;
};
std::vector<Rect> Bars(const std::string& svg) {
  std::vector<Rect> out;
  for (std::size_t p = svg.find("class=\"bar"); p != std::string::npos; p = svg.find("class=\"bar", p + 1)) {
    const std::size_t end = svg.find('>', p);
    const std::string tag = svg.substr(p, end - p);
    auto attr = [&](const char* name) { return std::stod(tag.substr(tag.find(name) + std::strlen(name))); };
    out.push_back({attr(" y=\""), attr("height=\""), tag.find(" marked") != std::string::npos});
  }
  return out;
}
}  // namespace

TEST_CASE("Charts: stacked bars sit on each other, heights in proportion; the axis spans the tallest stack") {
  BarChart b;
  b.stacked = true;
  b.bars = {"restored", "computed"};
  b.groups = {"a", "b"};
  b.values = {{30, 10}, {0, 80}};
  const auto r = Bars(RenderSvg(b));
  REQUIRE(r.size() == 4);
  CHECK(r[1].y + r[1].h == Approx(r[0].y).margin(0.15));  // computed on restored
  CHECK(r[0].h == Approx(3 * r[1].h).margin(0.3));
  CHECK(r[2].h == Approx(0).margin(0.05));
  CHECK(r[3].h == Approx(2 * (r[0].h + r[1].h)).margin(0.3));  // 80 = 2 x 40
  // The tallest stack (80) reaches the plot's top (80 is a tick: the axis ends there).
  CHECK(r[3].y == Approx(52).margin(0.15));
}

TEST_CASE("Charts: marked groups are outlined and labelled in the legend; byte axes tick at round units") {
  BarChart b;
  b.y_format = AxisFormat::kBytes;
  b.bars = {"nominal", "as stored"};
  b.groups = {"f32", "bf16"};
  b.values = {{448512, 466944}, {224256, 245760}};
  b.marked_groups = {false, true};
  b.marked_label = "this run: bf16";
  const std::string svg = RenderSvg(b);
  const auto r = Bars(svg);
  REQUIRE(r.size() == 4);
  CHECK_FALSE(r[0].marked);
  CHECK_FALSE(r[1].marked);
  CHECK(r[2].marked);
  CHECK(r[3].marked);
  CHECK(svg.find(">this run: bf16<") != std::string::npos);
  CHECK(svg.find("font-weight=\"bold\">bf16<") != std::string::npos);
  // 0..456 KiB: ticks every 100 KiB, not at decimal bytes (97.7 KiB).
  CHECK(svg.find(">100 KiB<") != std::string::npos);
  CHECK(svg.find(">500 KiB<") != std::string::npos);
  CHECK(svg.find("97.7 KiB") == std::string::npos);
  b.marked_groups.clear();
  CHECK(RenderSvg(b).find("this run") == std::string::npos);  // no marked group, no legend entry
}

TEST_CASE("Report: bench kv JSON without prefix rows is a bench kv page; malformed parts are named, not drawn") {
  auto r = RenderReport(R"({"model": "m", "tier": "nvme", "kv_codec": "bf16", "state_codec": "f32", "rows": [],
    "multi_turn": {"conversations": 1, "turns": 2, "rows": [
      {"turn": 1, "conversation": 1, "prompt_tokens": 100, "restored_tokens": 0, "computed_tokens": 100,
       "ttft_restore_s": 0.2, "restore_wait_s": 0, "blocks_requested": 0,
       "hit_rate_by_tier": {"hbm": 0, "host": 0, "nvme": 0}},
      {"turn": 2, "conversation": 1, "prompt_tokens": 150, "restored_tokens": 64, "computed_tokens": 86,
       "ttft_restore_s": 0.1, "restore_wait_s": 0.01, "blocks_requested": 4,
       "hit_rate_by_tier": {"hbm": 0, "host": 0.25, "nvme": 0.5}}]},
    "bytes_per_token_by_codec": {"bf16": {"kv_bytes_per_token": 320}, "f32": "x"}})",
                        "kv.json");
  REQUIRE(r.ok());
  CHECK(r->title == "Terrace bench kv: m");
  std::vector<std::string> names;
  for (const auto& c : r->charts) names.push_back(c.name);
  CHECK(names == std::vector<std::string>{"multi-turn-tokens", "multi-turn-ttft", "multi-turn-tier-shares",
                                          "kv-bytes-per-token-by-codec", "state-bytes-per-snapshot-by-codec"});
  // Turn 2 found 75% of its blocks: a fourth segment, "in no tier", stacks the remaining 25%.
  const std::string& tiers = r->charts[2].svg;
  CHECK(tiers.find("t2 c1 in no tier (fallback): 25%") != std::string::npos);
  CHECK(tiers.find("t1 c1 in no tier (fallback): 0%") != std::string::npos);  // asked for nothing: misses nothing
  CHECK(r->html.find("Not charted: codec f32 (its bytes_per_token_by_codec entry is not an object)") != std::string::npos);
  CHECK(r->html.find("No per-prefix rows") != std::string::npos);
  // multi_turn of the wrong type: named, no crash, the rest still drawn.
  auto bad = RenderReport(R"({"rows": [{"prefix_tokens": 64, "ttft_restore_s": 1, "hit_rate_by_tier": 3}],
    "multi_turn": [1]})",
                          "bad.json");
  REQUIRE(bad.ok());
  CHECK(bad->html.find("Not charted: the multi-turn workload (multi_turn is not an object)") != std::string::npos);
  CHECK(bad->html.find("Not charted: the hit rate per tier of prefix 64") != std::string::npos);
  CHECK(bad->html.find("Not charted: the bytes per codec") != std::string::npos);
  CHECK(bad->charts.size() == 2);  // ttft-vs-prefix, restore-bandwidth
}

TEST_CASE("Report: bench kv's per-tier lines name every tier with its own value") {
  auto r = RenderReport(R"({"rows": [{"prefix_tokens": 256, "ttft_restore_s": 0.1, "ttft_recompute_s": 0.5}],
    "hit_rate_by_tier": {"hbm": 0.25, "host": 0.5, "nvme": 0.125}, "blocks_requested": 8,
    "bytes_read_by_tier": {"hbm": 1024, "host": 2048, "nvme": 3072}})",
                        "kv.json");
  REQUIRE(r.ok());
  CHECK(r->html.find("hbm 25.0%, host 50.0%, nvme 12.5% of 8 blocks") != std::string::npos);
  CHECK(r->html.find("hbm 1 KiB, host 2 KiB, nvme 3 KiB") != std::string::npos);
}

namespace {
// Well-formed XML text as far as characters go: valid UTF-8, and no control character XML 1.0
// cannot hold (tab, newline and carriage return are allowed).
bool XmlChars(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      if (c < 0x20 && c != '\t' && c != '\n' && c != '\r') return false;
      ++i;
      continue;
    }
    const std::size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 ? 2 : 0;
    if (len == 0 || c > 0xF4 || i + len > s.size()) return false;
    for (std::size_t k = 1; k < len; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    i += len;
  }
  return true;
}

// Every object and array inside `j`, by JSON pointer.
void Containers(const nlohmann::json& j, const nlohmann::json::json_pointer& at,
                std::vector<nlohmann::json::json_pointer>* out) {
  if (!j.is_structured()) return;
  if (!at.empty()) out->push_back(at);
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) Containers(*it, at / it.key(), out);
  } else {
    for (std::size_t i = 0; i < j.size(); ++i) Containers(j[i], at / i, out);
  }
}

const char* kDemoRun = R"({"model": {"preset": "k3-toy"}, "verified": true,
  "turns": [{"ttft_s": 0.1, "ttft_recompute_s": 0.2, "prompt_tokens": 100, "restored_tokens": 50,
             "computed_tokens": 50, "prefix_hit_rate": {"hbm": 0.5, "host": 0.25},
             "restore_bytes": {"hbm": 10, "host": 20, "nvme": 0},
             "experts": {"hit_rate": 0.9, "stall_s_per_prefill_token": 0.001, "stall_s_per_decode_token": 0.002}}],
  "summary": {"tokens_per_s": 10, "bytes_moved": {"prefix_restored": 5},
              "experts": {"hit_rate": 0.8, "hot_factor": 2,
                          "layers": [{"layer": 1, "expert_load": [1, 5, 2], "hot_experts": [1],
                                      "prefetch_precision": 0.5}]}}})";
}  // namespace

TEST_CASE("Report: wrongly typed parts of a recognised run render with a note, never an error") {
  // The reviewer's cases: nlohmann's value() threw type_error on each (exit 1, "internal error").
  struct Case {
    const char* json;
    const char* note;  // on the page, or "" where the part is drawn from what is there
  };
  for (const Case& c : {Case{R"({"kind": "plan", "workload": 5})", "Not charted: the workload (workload is not an object)"},
                        Case{R"({"kind": "plan", "weights": [1]})", "Not charted: the weights (weights is not an object)"},
                        Case{R"({"kind": "plan", "trace": 5})", "Not charted: the trace replay (trace is not an object)"},
                        Case{R"({"kind": "plan", "memory": "x", "experts": 1, "lifecycle": [2]})",
                             "Not charted: the expert cache (experts is not an object)"},
                        Case{R"({"turns": [], "summary": {}, "verified": "yes"})",
                             "not recorded (verified is missing or not true or false)"},
                        Case{R"({"turns": [5, "x"], "summary": {"experts": 3}, "model": 1})", ""}}) {
    INFO(c.json);
    Result<Report> r = Status::Internal("not run");
    REQUIRE_NOTHROW(r = RenderReport(c.json, "bad.json"));
    REQUIRE(r.ok());
    if (*c.note != '\0') CHECK(r->html.find(c.note) != std::string::npos);
    CHECK(XmlChars(r->html));
  }
  // Systematically: each object or array of a plan and of a demo run replaced by each other type.
  for (const char* run : {kRun, kDemoRun}) {
    const nlohmann::json base = nlohmann::json::parse(run);
    std::vector<nlohmann::json::json_pointer> at;
    Containers(base, nlohmann::json::json_pointer(), &at);
    REQUIRE(at.size() > 5);
    for (const auto& p : at) {
      for (const nlohmann::json& other : {nlohmann::json(5), nlohmann::json("x"), nlohmann::json::array({1}),
                                          nlohmann::json::object(), nlohmann::json(nullptr), nlohmann::json(true)}) {
        nlohmann::json j = base;
        j[p] = other;
        INFO(p.to_string() << " = " << other.dump());
        Result<Report> r = Status::Internal("not run");
        REQUIRE_NOTHROW(r = RenderReport(j.dump(), "mutated.json"));
        CHECK(r.ok());
      }
    }
  }
}

TEST_CASE("XmlEscape keeps the page well-formed: control characters and bytes that are not UTF-8 become U+FFFD") {
  CHECK(XmlEscape("a\x01" "b\x1f" "c") == "a\xEF\xBF\xBD" "b\xEF\xBF\xBD" "c");
  CHECK(XmlEscape("tab\tnl\ncr\r") == "tab\tnl\ncr\r");
  CHECK(XmlEscape("caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80") == "caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80");
  CHECK(XmlEscape("s\xE9.json") == "s\xEF\xBF\xBD.json");  // Latin-1, not UTF-8
  CHECK(XmlEscape("\xC0\xAF") == "\xEF\xBF\xBD\xEF\xBF\xBD");  // overlong '/'
  CHECK(XmlEscape("\xED\xA0\x80") == "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // a surrogate
  CHECK(XmlEscape("\xEF\xBF\xBE") == "\xEF\xBF\xBD");  // U+FFFE is no XML character
  CHECK(XmlEscape("\xE2\x82") == "\xEF\xBF\xBD\xEF\xBF\xBD");  // cut short
  // Through a whole report: a control character in a JSON string (\u0001) and a source path that
  // is not UTF-8.
  auto r = RenderReport(R"({"kind": "plan", "model": "m\u0001x", "hardware": {"name": "h\u001b"}})", "r\xE9.json");
  REQUIRE(r.ok());
  CHECK(XmlChars(r->html));
  CHECK(r->html.find("m\xEF\xBF\xBDx") != std::string::npos);
}

namespace {
// The SVG of the chart `name` ("" when the report has none).
std::string ChartSvg(const Report& r, std::string_view name) {
  for (const auto& c : r.charts)
    if (c.name == name) return c.svg;
  return "";
}

std::size_t Count(std::string_view s, std::string_view what) {
  std::size_t n = 0;
  for (std::size_t at = s.find(what); at != std::string_view::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

// The tooltips of the bars ("<group> <bar>: <value>") in drawing order, and whether each is hot.
std::vector<std::pair<std::string, bool>> BarTitles(const std::string& svg) {
  std::vector<std::pair<std::string, bool>> out;
  for (std::size_t at = svg.find("<rect class=\"bar"); at != std::string::npos; at = svg.find("<rect class=\"bar", at + 1)) {
    const bool hot = svg.compare(at, 20, "<rect class=\"bar hot") == 0;
    const std::size_t t = svg.find("<title>", at) + 7;
    out.emplace_back(svg.substr(t, svg.find("</title>", t) - t), hot);
  }
  return out;
}

Report Render(const nlohmann::json& j) {
  auto r = RenderReport(j.dump(), "run.json");
  REQUIRE(r.ok());
  return std::move(r).value();
}
}  // namespace

TEST_CASE("Report: a null or missing figure is never drawn or printed as a measured 0") {
  auto cfg = [](const char* name, nlohmann::json tps, nlohmann::json recall, nlohmann::json layer_recall) {
    return nlohmann::json{{"name", name}, {"budget_fraction", 0.25}, {"tokens_per_s", tps}, {"stall_share", 0.1},
                          {"hit_rate", 0.5}, {"recall", recall}, {"precision", recall}, {"layer_recall", layer_recall}};
  };
  const Report b = Render({{"model", "m"},
                           {"configs", {cfg("on-demand", 130.0, nullptr, {0.0, 0.0, 0.0}),
                                        cfg("lru+lookahead", 166.0, 0.9, {0.9, nullptr, 1.0}),
                                        cfg("mmap", nullptr, nullptr, nlohmann::json::array())}}});
  // tokens/s and the stall per token (which divides by it): no bar for mmap, named in the subtitle.
  for (const char* chart : {"tokens-per-s", "stall-per-token"}) {
    INFO(chart);
    const std::string svg = ChartSvg(b, chart);
    CHECK(BarTitles(svg).size() == 2);
    CHECK(svg.find("mmap @ 25%:") == std::string::npos);
    CHECK(svg.find("no bar (not recorded): mmap @ 25%") != std::string::npos);
  }
  CHECK(BarTitles(ChartSvg(b, "recall")).size() == 1);
  // Recall per layer: only the configuration that predicts; its null layer has no point (not a 0).
  const std::string lr = ChartSvg(b, "recall-per-layer");
  CHECK(Points(lr, "on-demand @ 25%").empty());
  CHECK(Points(lr, "lru+lookahead @ 25%").size() == 2);

  nlohmann::json demo = nlohmann::json::parse(kDemoRun);
  demo["summary"]["experts"]["prefetch_recall"] = nullptr;
  demo["turns"].push_back(demo["turns"][0]);
  demo["turns"][1]["ttft_recompute_s"] = nullptr;
  const Report d = Render(demo);
  CHECK(d.html.find("recall not recorded") != std::string::npos);
  CHECK(d.html.find("recall 0.0%") == std::string::npos);
  CHECK(Points(ChartSvg(d, "ttft-per-turn"), "full recompute").size() == 1);
  CHECK(Points(ChartSvg(d, "ttft-per-turn"), "with restore").size() == 2);
  // The layer's missing recall and hit rate: no point on the prefetch chart.
  CHECK(Points(ChartSvg(d, "prefetch-per-layer"), "recall").empty());
  CHECK(Points(ChartSvg(d, "prefetch-per-layer"), "precision").size() == 1);
}

TEST_CASE("Report: a recognised run lacking a part renders and says so in red; its figures read 'not recorded'") {
  const Report d = Render(nlohmann::json::parse(R"({"turns": [], "summary": {}})"));
  CHECK(d.html.find("Not charted: the expert figures (summary.experts is missing)") != std::string::npos);
  CHECK(d.html.find("Not charted: the bytes moved (summary.bytes_moved is missing)") != std::string::npos);
  CHECK(d.html.find("<th>throughput</th><td>not recorded (decode not recorded)</td>") != std::string::npos);
  CHECK(d.html.find("0.0%") == std::string::npos);
  const Report p = Render(nlohmann::json::parse(R"({"kind": "plan"})"));
  CHECK(p.html.find("Not charted: the workload (workload is missing)") != std::string::npos);
  CHECK(p.html.find("Not charted: the memory figures (memory is missing)") != std::string::npos);
  CHECK(p.html.find("<th>MLA latents per token</th><td>not recorded</td>") != std::string::npos);
  CHECK(p.html.find("0 B") == std::string::npos);
}

TEST_CASE("Report: the load histogram's red bins hold exactly the hot experts (load > hot_factor x mean)") {
  nlohmann::json demo = nlohmann::json::parse(kDemoRun);
  auto& layer = demo["summary"]["experts"]["layers"][0];
  for (const auto& [top, hot] : {std::pair{60, 0}, std::pair{61, 1}}) {
    std::vector<int> load(15, 28);
    load.push_back(top);  // mean 30 (60 exactly 2 x the mean: not hot) or 30.06 (61: hot)
    layer["expert_load"] = load;
    layer["hot_experts"] = hot ? nlohmann::json{15} : nlohmann::json::array();
    INFO("top load " << top);
    int red = 0, all = 0;
    for (const auto& [title, is_hot] : BarTitles(ChartSvg(Render(demo), "expert-load-histogram"))) {
      const int n = std::stoi(title.substr(title.rfind(": ") + 2));
      all += n;
      red += is_hot ? n : 0;
    }
    CHECK(all == 16);
    CHECK(red == hot);
  }
}

TEST_CASE("Report: a nonsensical hot_factor or load is refused, and the histogram has at most 200 bins") {
  nlohmann::json demo = nlohmann::json::parse(kDemoRun);
  auto& e = demo["summary"]["experts"];
  for (const nlohmann::json& f : {nlohmann::json(1e-6), nlohmann::json(-2), nlohmann::json(0.5), nlohmann::json("2")}) {
    e["hot_factor"] = f;
    auto r = RenderReport(demo.dump(), "run.json");
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.status().message(), Catch::Contains("run.json") && Catch::Contains("summary.experts.hot_factor is " + f.dump()) &&
                                         Catch::Contains("at least 1"));
  }
  e["hot_factor"] = 2;
  e["layers"][0]["expert_load"] = {1, -3, 2};
  auto r = RenderReport(demo.dump(), "run.json");
  REQUIRE_FALSE(r.ok());
  CHECK_THAT(r.status().message(), Catch::Contains("summary.experts.layers[0].expert_load[1] is -3"));
  // One expert takes nearly all the tokens: load / mean near the expert count (384 / 0.25 bins uncapped).
  std::vector<double> load(384, 1.0);
  load[0] = 1e6;
  e["layers"][0]["expert_load"] = load;
  const auto titles = BarTitles(ChartSvg(Render(demo), "expert-load-histogram"));
  CHECK(titles.size() == 200);
  CHECK(titles.back().first.starts_with("&gt; 50 "));  // "> 50": the open last bin (199 x 0.25)
  CHECK(titles.back().first.ends_with(": 1"));
}

TEST_CASE("Report: the load histogram's bin i holds the experts with load / mean in (i, i + 1] x hot_factor / 8") {
  nlohmann::json demo = nlohmann::json::parse(kDemoRun);
  auto& e = demo["summary"]["experts"];
  e["hot_factor"] = 2;  // bins of width 0.25 x the mean; bin 8 and up are hot
  // Mean 10: load / mean = 0, 0.1, 0.3, 0.3, 0.6, 1.2, 1.9, 2.1 (hot), 2.6 (hot), and one that makes the mean 10.
  std::vector<double> load = {0, 1, 3, 3, 6, 12, 19, 21, 26};
  double sum = 0;
  for (double x : load) sum += x;
  load.push_back(10.0 * (static_cast<double>(load.size()) + 1) - sum);  // 9
  e["layers"][0]["expert_load"] = load;
  e["layers"][0]["hot_experts"] = nlohmann::json{7, 8};
  // The oracle: the smallest i with load / mean <= (i + 1) x width (0 in bin 0), each in its own words.
  const double mean = 10, width = 2.0 / 8;
  std::vector<int> expected;
  for (double x : load) {
    std::size_t i = 0;
    while (x / mean > (static_cast<double>(i) + 1) * width) ++i;
    if (expected.size() <= i) expected.resize(i + 1);
    expected[i] += 1;
  }
  const auto titles = BarTitles(ChartSvg(Render(demo), "expert-load-histogram"));
  REQUIRE(titles.size() == expected.size());
  for (std::size_t i = 0; i < titles.size(); ++i) {
    INFO("bin " << i << ": " << titles[i].first);
    CHECK(std::stoi(titles[i].first.substr(titles[i].first.rfind(": ") + 2)) == expected[i]);
    CHECK(titles[i].second == (i >= 8));
  }
}

TEST_CASE("Report: bench tiers draws the memcpy and reported reference lines at their own figures") {
  // y of the reference line named `name` (SVG y grows downwards).
  auto ref_y = [](const std::string& svg, const std::string& name) {
    const std::size_t at = svg.find("<line class=\"ref\" data-name=\"" + name + "\"");
    REQUIRE(at != std::string::npos);
    const std::size_t y = svg.find("y1=\"", at) + 4;
    return std::stod(svg.substr(y, svg.find('"', y) - y));
  };
  for (double memcpy_mb : {4000.0, 500.0}) {
    const nlohmann::json run = {{"tier", "host"}, {"op", "read"}, {"block_size", 1 << 20}, {"total_bytes", 64 << 20},
                                {"warmup", 1}, {"mb_per_s", 1000.0}, {"memcpy_mb_per_s", memcpy_mb},
                                {"passes_mb_per_s", {900.0, 1000.0, 1100.0}}};
    const std::string svg = ChartSvg(Render(run), "throughput-per-pass");
    INFO("memcpy " << memcpy_mb << " MB/s, reported 1000 MB/s");
    if (memcpy_mb > 1000) {
      CHECK(ref_y(svg, "memcpy") < ref_y(svg, "reported"));
    } else {
      CHECK(ref_y(svg, "memcpy") > ref_y(svg, "reported"));
    }
  }
}

TEST_CASE("Report: a bench experts load or a weight that is no number is refused or shown as it is, never drawn as 0") {
  nlohmann::json bench = {{"model", "m"},
                          {"configs", {{{"name", "on-demand"}, {"tokens_per_s", 1.0}, {"expert_load", {3, "x", 1}}}}}};
  auto r = RenderReport(bench.dump(), "run.json");
  REQUIRE_FALSE(r.ok());
  CHECK_THAT(r.status().message(), Catch::Contains("run.json") && Catch::Contains("configs[0].expert_load[1] is \"x\""));
  // A load that is present but no array is refused too, not drawn as no load at all.
  // A load that is no array is drawn nowhere, and the page says so (never an error: see "wrongly typed parts").
  for (const nlohmann::json& load : {nlohmann::json(5), nlohmann::json("3,2,1"), nlohmann::json::object()}) {
    bench["configs"][0]["expert_load"] = load;
    const Report noted = Render(bench);
    CHECK(noted.html.find("Not charted: an expert load (configs[0].expert_load is not an array)") != std::string::npos);
  }
  nlohmann::json demo = nlohmann::json::parse(kDemoRun);
  demo["summary"]["experts"]["layers"][0]["expert_load"] = 5;
  CHECK(Render(demo).html.find("Not charted: an expert load (summary.experts.layers[0].expert_load is not an array)") !=
        std::string::npos);
  bench["configs"][0]["expert_load"] = {3, 2, 1};
  CHECK(BarTitles(ChartSvg(Render(bench), "expert-utilisation")).size() == 3);

  const Report w = Render({{"kind", "plan"}, {"weights", {{"by_component", {{"attention", 1024}, {"embedding", "?"}}}}}});
  CHECK(w.html.find("<th>embedding</th><td>?</td>") != std::string::npos);
  CHECK(w.html.find("<th>embedding</th><td>0 B</td>") == std::string::npos);
}

TEST_CASE("Report: the All values table says how many values it left out") {
  nlohmann::json j;
  for (int i = 0; i < 2100; ++i) j["store"][fmt::format("k{:05d}", i)] = i;
  const Report r = Render(j);
  CHECK(Count(r.html, "<tr><th>store.k") == 2000);
  CHECK(r.html.find("The table stops at 2000 rows: 100 more values of run.json are not shown.") != std::string::npos);
  CHECK(Render(nlohmann::json{{"a", 1}}).html.find("The table stops") == std::string::npos);
}

TEST_CASE("Report: unreadable JSON is refused saying what and where; a repeated key is refused") {
  struct Case {
    std::string text;
    const char* says;
  };
  for (const Case& c : {Case{R"({"kind": "plan", "model": "k3)", "line 1, column 30"},
                        Case{"{\"a\":\"\xff\"}", "not valid JSON"}, Case{R"({"a":1e999})", "out of range"},
                        Case{R"({"turns":[],"summary":{"tokens_per_s":100,"tokens_per_s":5}})",
                             "duplicate key \"tokens_per_s\" in the object at \"summary\""},
                        Case{"[1]", "not a JSON object"}}) {
    INFO(c.text);
    auto r = RenderReport(c.text, "run.json");
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.status().message(), Catch::StartsWith("run.json: ") && Catch::Contains(c.says));
  }
}

TEST_CASE("Report: a plan over a context distribution shows its mean as the mean, and the distribution") {
  const Report r = Render(nlohmann::json::parse(R"({"kind": "plan",
    "workload": {"context_tokens": 18432, "context_tokens_mean": 18432.0,
                 "context_distribution": [{"tokens": 4096, "share": 0.5}, {"tokens": 32768, "share": 0.5}]},
    "memory": {"sequence_tokens": 18560, "sequence_bytes": 1000,
               "per_context": [{"sequence_tokens": 4224, "share": 0.5, "sequence_bytes": 300},
                               {"sequence_tokens": 32896, "share": 0.5, "sequence_bytes": 1700}]}})"));
  CHECK(r.html.find("a mean of 18432 tokens of context (4096 tokens 50.0%, 32768 tokens 50.0%)") != std::string::npos);
  CHECK(r.html.find("one sequence of the mean context (18560 tokens with the decoded ones)</th><td>1000 B") !=
        std::string::npos);
  CHECK(r.html.find("one sequence of 32896 tokens (50.0% of requests)</th><td>1.7 KiB") != std::string::npos);
  CHECK(r.html.find("one workload sequence") == std::string::npos);
  const Report one = Render(nlohmann::json::parse(R"({"kind": "plan", "workload": {"context_tokens": 4096,
    "context_distribution": [{"tokens": 4096, "share": 1.0}]}, "memory": {"sequence_bytes": 1000}})"));
  CHECK(one.html.find("4096 tokens of context,") != std::string::npos);
  CHECK(one.html.find("one workload sequence</th><td>1000 B") != std::string::npos);
}

TEST_CASE("Charts: a negative bar hangs below zero inside the plot, with a positive height") {
  BarChart b;
  b.bars = {"hit rate"};
  b.groups = {"hbm", "host"};
  b.values = {{-5}, {0.5}};
  b.y_format = AxisFormat::kPercent;
  const auto r = Bars(RenderSvg(b));
  REQUIRE(r.size() == 2);
  CHECK(r[0].h > 0);
  CHECK(r[1].h > 0);
  CHECK(r[0].h == Approx(10 * r[1].h).margin(0.5));
  CHECK(r[0].y == Approx(r[1].y + r[1].h).margin(0.15));  // both start at the zero line
  CHECK(r[0].y + r[0].h <= kChartHeight - 40);            // and stay inside the canvas
}

TEST_CASE("Report: a demo run whose turns are malformed says so where each chart would be") {
  nlohmann::json demo = nlohmann::json::parse(kDemoRun);
  demo["turns"] = "x";
  Report r = Render(demo);
  CHECK(r.html.find("Not charted: the per-turn charts (turns is not a list)") != std::string::npos);
  CHECK(ChartSvg(r, "ttft-per-turn").empty());
  demo["turns"] = nlohmann::json::array();
  r = Render(demo);
  CHECK(r.html.find("Not charted: the per-turn charts (turns is an empty list)") != std::string::npos);
  // Turns without any figure: a note per chart, no empty axes.
  demo["turns"] = nlohmann::json::array({nlohmann::json::object(), nlohmann::json::object()});
  r = Render(demo);
  CHECK(ChartSvg(r, "ttft-per-turn").empty());
  CHECK(ChartSvg(r, "prefix-restore-by-tier").empty());
  for (const char* note : {"Not charted: Time to first token per turn (no turn has a ttft_s",
                           "Not charted: Tier hit rates per turn (turns[0].prefix_hit_rate is missing)",
                           "Not charted: Restored prefix per turn, by the tier it came from (no turn has",
                           "Not charted: Stall on expert loads per token, per turn (turns[0].experts is missing)"}) {
    INFO(note);
    CHECK(r.html.find(note) != std::string::npos);
  }
  // The well-formed run has every chart and none of these notes.
  r = Render(nlohmann::json::parse(kDemoRun));
  CHECK(r.html.find("Not charted") == std::string::npos);
  CHECK_FALSE(ChartSvg(r, "ttft-per-turn").empty());
}
