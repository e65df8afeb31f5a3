#include "src/plan/report.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "src/common/generator_mark.h"
#include "src/common/json_unique.h"
#include "src/plan/svg_chart.h"

namespace terrace::plan {
namespace {

using json = nlohmann::json;

// Every read of the run's JSON goes through these (or checks the type first): the JSON is whatever
// the file holds, and nlohmann's value() and operator[] throw on a value of another type.
// `key` of `j` when it is an array (an empty one when `j` is not an object or lacks it).
const json& Arr(const json& j, const char* key) {
  static const json empty = json::array();
  auto it = j.find(key);  // find on a non-object finds nothing
  return it != j.end() && it->is_array() ? *it : empty;
}

// `key` of `j` when it is an object (an empty one otherwise).
const json& Obj(const json& j, const char* key) {
  static const json empty = json::object();
  auto it = j.find(key);  // find on a non-object finds nothing
  return it != j.end() && it->is_object() ? *it : empty;
}

// A visible note where part of the run's JSON is missing or malformed, naming the key: the page says
// what it left out and why instead of drawing zeros.
void Skipped(std::string* body, std::string_view what, std::string_view why) {
  *body += fmt::format("<p class=\"skipped\">Not charted: {} ({}).</p>", XmlEscape(what), XmlEscape(why));
}

// Where `j` lacks `key` or has it as something other than an object: a note naming it (`what` is the
// part of the page, `path` the key as the note names it; `key` when empty). True when it is an
// object. A part a run may leave out (a plan's trace) is checked only where the JSON has it.
bool CheckObject(const json& j, const char* key, std::string_view what, std::string* body, std::string_view path = {}) {
  auto it = j.find(key);
  if (it != j.end() && it->is_object()) return true;
  Skipped(body, what, fmt::format("{} {}", path.empty() ? key : path, it == j.end() ? "is missing" : "is not an object"));
  return false;
}

// The number under `key` of `j`; none where `j` is not an object, lacks the key, or has null or
// another type there: a figure the run did not record, never a measured 0.
std::optional<double> Opt(const json& v) { return v.is_number() ? std::optional<double>(v.get<double>()) : std::nullopt; }
std::optional<double> Opt(const json& j, const char* key) {
  auto it = j.find(key);  // find on a non-object finds nothing
  return it != j.end() ? Opt(*it) : std::nullopt;
}

// The number under `key` of `j`, 0 where there is none: only for arithmetic whose result is itself
// checked (a guarded denominator) or shown with Opt's absence handled; figures shown go through Fig.
double Num(const json& j, const char* key) { return Opt(j, key).value_or(0.0); }

constexpr std::string_view kNotRecorded = "not recorded";

// `f` of the number under `key` of `j`, or "not recorded" where there is none (Opt).
std::string Fig(const json& j, const char* key, const std::function<std::string(double)>& f) {
  const std::optional<double> v = Opt(j, key);
  return v ? f(*v) : std::string(kNotRecorded);
}

// 1000 x `v`: seconds as milliseconds, none staying none.
std::optional<double> InMs(std::optional<double> v) { return v ? std::optional<double>(1e3 * *v) : std::nullopt; }

// Adds the group `label` to `b` with one bar per value of `values` when every value is there; a group
// with a value missing (null: not recorded) is left out and its label added to *missing: a bar drawn
// at 0 would read as a measured 0 (NoteMissing then names them).
void AddGroup(BarChart* b, std::string label, const std::vector<std::optional<double>>& values,
              std::vector<std::string>* missing) {
  std::vector<double> v;
  for (const std::optional<double>& x : values) {
    if (!x) return missing->push_back(std::move(label));
    v.push_back(*x);
  }
  b->groups.push_back(std::move(label));
  b->values.push_back(std::move(v));
}

// Ends the subtitle of a chart with the groups or points `missing` left out ("no bar (not recorded): a, b").
template <typename Chart>
void NoteMissing(Chart* c, const std::vector<std::string>& missing, std::string_view what = "no bar") {
  if (missing.empty()) return;
  c->subtitle += fmt::format("{}{} (not recorded): {}", c->subtitle.empty() ? "" : "; ", what, fmt::join(missing, ", "));
}

std::string Str(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end()) return "";
  return it->is_string() ? it->get<std::string>() : it->dump();
}

// "1.23 ms" for seconds.
std::string Ms(double s) { return fmt::format("{:.3g} ms", 1e3 * s); }

std::string Cell(const json& v) {
  if (v.is_string()) return XmlEscape(v.get<std::string>());
  if (v.is_number_float()) return fmt::format("{:.6g}", v.get<double>());
  return XmlEscape(v.dump());
}

// Cell of the value under `key` of `j`, or "not recorded" where it is absent or null.
std::string Val(const json& j, const char* key) {
  auto it = j.find(key);  // find on a non-object finds nothing
  return it == j.end() || it->is_null() ? std::string(kNotRecorded) : Cell(*it);
}

// The rows of the "All values" table: at most kMaxRows, and how many values were left out.
struct FlatRows {
  static constexpr std::size_t kMaxRows = 2000;
  std::vector<std::pair<std::string, std::string>> rows;
  std::size_t left_out = 0;
};

// Rows "a.b.c = value" for every scalar, arrays of scalars as one cell; past kMaxRows counted only.
void Flatten(const json& j, const std::string& prefix, FlatRows* out) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) Flatten(it.value(), prefix.empty() ? it.key() : prefix + "." + it.key(), out);
    return;
  }
  if (j.is_array() && std::any_of(j.begin(), j.end(), [](const json& e) { return e.is_structured(); })) {
    for (std::size_t i = 0; i < j.size(); ++i) Flatten(j[i], fmt::format("{}[{}]", prefix, i), out);
    return;
  }
  if (out->rows.size() >= FlatRows::kMaxRows) {
    ++out->left_out;
  } else if (j.is_array()) {  // of scalars: one cell
    std::string d = j.dump();
    if (d.size() > 300) d = d.substr(0, 300) + "...";
    out->rows.emplace_back(prefix, XmlEscape(d));
  } else {
    out->rows.emplace_back(prefix, Cell(j));
  }
}

std::string KeyValueTable(const std::vector<std::pair<std::string, std::string>>& rows) {
  std::string s = "<table><tbody>";
  for (const auto& [k, v] : rows) s += fmt::format("<tr><th>{}</th><td>{}</td></tr>", XmlEscape(k), v);
  return s + "</tbody></table>";
}

std::string B(double v) { return XmlEscape(FormatAxisValue(v, AxisFormat::kBytes)); }
std::string P(double v) { return fmt::format("{:.1f}%", 100 * v); }

// `rate` with its share of the hardware's `share` in brackets, "not recorded" parts said so.
std::string RateAndShare(const json& j, const char* rate, const char* share, const std::function<std::string(double)>& f) {
  return fmt::format("{} ({} of the hardware)", Fig(j, rate, f), Fig(j, share, P));
}

// The load each policy's replay put on the busiest node (`terrace plan --trace`'s policies[].load):
// writes into each lower tier and the recompute of the tokens not hit, as averages over the trace's
// span and shares of what the hardware gives. Nothing when no policy carries a load.
void TraceLoadTable(const json& policies, std::string* body) {
  std::vector<std::string> tier_names;
  bool any = false;
  for (const auto& p : policies) {
    if (!p.is_object() || !p.contains("load") || !p["load"].is_object()) continue;
    any = true;
    for (const auto& t : Arr(p["load"], "tiers")) {
      const std::string name = Str(t, "name");
      if (std::find(tier_names.begin(), tier_names.end(), name) == tier_names.end()) tier_names.push_back(name);
    }
  }
  if (!any) return;
  *body += "<h3>Load on the busiest node</h3><p>Averages over the trace's span. The replay does not time writes "
           "or prefills: a share over 100% makes its restore times and TTFT saved optimistic (the warnings above "
           "say which).</p><table><thead><tr><th>policy</th>";
  for (const std::string& n : tier_names) *body += fmt::format("<th>writes into {}</th>", XmlEscape(n));
  *body += "<th>recompute of tokens not hit</th></tr></thead><tbody>";
  const auto rate = [](double v) { return B(v) + "/s"; };
  const auto tokens = [](double v) { return fmt::format("{:.0f} tokens/s", v); };
  for (const auto& p : policies) {
    if (!p.is_object() || !p.contains("load") || !p["load"].is_object()) continue;
    const json& load = p["load"];
    *body += fmt::format("<tr><td>{}</td>", XmlEscape(Str(p, "policy")));
    for (const std::string& n : tier_names) {
      std::string cell = std::string(kNotRecorded);
      for (const auto& t : Arr(load, "tiers"))
        if (Str(t, "name") == n) cell = RateAndShare(t, "write_bytes_per_s", "write_utilisation", rate);
      *body += fmt::format("<td>{}</td>", cell);
    }
    *body += fmt::format("<td>{}</td></tr>", RateAndShare(load, "recompute_tokens_per_s", "prefill_utilisation", tokens));
  }
  *body += "</tbody></table>";
}

bool EndsWith(std::string_view s, std::string_view end) { return s.size() >= end.size() && s.substr(s.size() - end.size()) == end; }

// "decode_step_s" -> "decode step s": a JSON key as words.
std::string Words(std::string key) {
  std::replace(key.begin(), key.end(), '_', ' ');
  return key;
}

// A value with the unit its key names: ..._s seconds, ..._per_s a rate, ..._bytes... bytes, ..._share a
// share; a trailing _with_stalls (decode_tokens_per_s_with_stalls) qualifies the figure, not its unit.
std::string WithUnit(std::string key, const json& v) {
  if (!v.is_number()) return Cell(v);
  if (EndsWith(key, "_with_stalls")) key.resize(key.size() - std::string_view("_with_stalls").size());
  const double x = v.get<double>();
  if (key.find("bytes") != std::string::npos) return B(x) + (EndsWith(key, "_per_s") ? "/s" : "");
  if (EndsWith(key, "_per_s")) return fmt::format("{:.4g} /s", x);
  if (EndsWith(key, "_share")) return P(x);
  if (EndsWith(key, "_s")) return x < 1 ? fmt::format("{:.3g} ms", 1e3 * x) : fmt::format("{:.3g} s", x);
  return fmt::format("{:.4g}", x);
}

// The plan's context: "4096 tokens of context", or for a --context distribution "a mean of 18432
// tokens of context (4096 tokens 50.0%, 32768 tokens 50.0%)".
std::string ContextText(const json& w) {
  const json& dist = Arr(w, "context_distribution");
  if (dist.size() <= 1) return fmt::format("{} tokens of context", Val(w, "context_tokens"));
  std::vector<std::string> parts;
  for (const auto& c : dist) parts.push_back(fmt::format("{} tokens {}", Val(c, "tokens"), Fig(c, "share", P)));
  return fmt::format("a mean of {} tokens of context ({})",
                     Fig(w, "context_tokens_mean", [](double x) { return fmt::format("{:.0f}", x); }),
                     fmt::join(parts, ", "));
}

// The memory table's sequence rows: one sequence of the workload, or with several contexts, one of
// the mean context and one of each context (memory.per_context).
void SequenceRows(const json& m, std::vector<std::pair<std::string, std::string>>* rows) {
  const json& per = Arr(m, "per_context");
  if (per.size() <= 1) {
    rows->emplace_back("one workload sequence", Fig(m, "sequence_bytes", B));
    return;
  }
  rows->emplace_back(fmt::format("one sequence of the mean context ({} tokens with the decoded ones)",
                                 Val(m, "sequence_tokens")),
                     Fig(m, "sequence_bytes", B));
  for (const auto& c : per) {
    rows->emplace_back(fmt::format("one sequence of {} tokens ({} of requests)", Val(c, "sequence_tokens"),
                                   Fig(c, "share", P)),
                       Fig(c, "sequence_bytes", B));
  }
}

// The plan's warnings (a model that does not fit, a link or the compute over its capacity), each a red
// line: the figures below them are only what the node would reach without what they warn about.
void PlanWarnings(const json& j, std::string* body) {
  for (const auto& w : Arr(j, "warnings"))
    *body += fmt::format("<p class=\"warning\">Warning: {}</p>", w.is_string() ? XmlEscape(w.get<std::string>()) : Cell(w));
}

// One line per key of `rows` (x = `x_key`, or the row index + 1 when x_key is null); a row without a
// number at x or y (null: not measured) has no point on that line.
LineChart Lines(const json& rows, const char* x_key, std::vector<std::pair<const char*, const char*>> keys) {
  LineChart c;
  for (auto [key, name] : keys) {
    Series s;
    s.name = name;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const std::optional<double> x = x_key ? Opt(rows[i], x_key) : static_cast<double>(i + 1), y = Opt(rows[i], key);
      if (x && y) s.points.emplace_back(*x, *y);
    }
    c.series.push_back(std::move(s));
  }
  return c;
}

void PlanSections(const json& j, Report* r, std::string* body) {
  const json& m = Obj(j, "memory");
  r->title = fmt::format("Terrace plan: {} on {}", Str(j, "model"), Str(Obj(j, "hardware"), "name"));
  PlanWarnings(j, body);
  const json& w = Obj(j, "workload");
  CheckObject(j, "workload", "the workload", body);
  *body += fmt::format("<p>KV codec <b>{}</b>, state codec <b>{}</b>. Workload: {} requests/s, {}, "
                       "{} decoded tokens per request, {} concurrent sequences, {} of the prompt a reused prefix.</p>",
                       XmlEscape(Str(j, "kv_codec")), XmlEscape(Str(j, "state_codec")), Val(w, "rate_rps"),
                       ContextText(w), Val(w, "decode_tokens"), Val(w, "concurrency"), Fig(w, "prefix_reuse", P));
  *body += "<h2>Memory per token and per sequence</h2>";
  CheckObject(j, "memory", "the memory figures", body);
  std::vector<std::pair<std::string, std::string>> mem = {
      {"MLA latents per token", Fig(m, "mla_bytes_per_token", B)},
      {"KDA recurrent state per layer", Fig(m, "kda_recurrent_bytes_per_layer", B)},
      {"KDA conv state per layer", Fig(m, "kda_conv_bytes_per_layer", B)},
      {"KDA state per sequence (fixed)", Fig(m, "kda_state_bytes_per_sequence", B)},
      {"AttnRes bank per token (transient)", Fig(m, "attnres_bank_bytes_per_token", B)},
      {"MHA comparison per token", Fig(m, "mha_bytes_per_token", B)},
      {"GQA comparison per token", Fig(m, "gqa_bytes_per_token", B)},
  };
  SequenceRows(m, &mem);
  *body += KeyValueTable(mem);
  if (!Arr(m, "curve").empty()) {
    LineChart c;
    c.title = "Memory per sequence vs context";
    c.x_label = "context (tokens)";
    c.y_label = "bytes per sequence";
    c.log_x = c.log_y = true;
    c.x_format = AxisFormat::kTokens;
    c.y_format = AxisFormat::kBytes;
    c.series = Lines(Arr(m, "curve"), "tokens", {{"total_bytes", "MLA + KDA (this model)"}, {"mla_bytes", "MLA latents only"},
                                                 {"gqa_bytes", "GQA comparison"}, {"mha_bytes", "MHA comparison"}})
                   .series;
    c.series[1].dashed = true;  // MLA latents only
    r->charts.push_back({"memory-vs-context", RenderSvg(c)});
    *body += r->charts.back().svg;
  }
  if (j.contains("weights") && CheckObject(j, "weights", "the weights", body)) {
    const json& wts = Obj(j, "weights");
    *body += "<h2>Weights</h2>";
    std::vector<std::pair<std::string, std::string>> rows;
    const json& comps = Obj(wts, "by_component");
    for (auto it = comps.begin(); it != comps.end(); ++it) {  // a value that is no byte count is shown as it is
      rows.emplace_back(it.key(), it->is_number() ? B(it->get<double>()) : Cell(*it));
    }
    rows.emplace_back("total", Fig(wts, "total_bytes", B));
    rows.emplace_back("resident (all but routed experts)", Fig(wts, "resident_bytes", B));
    rows.emplace_back("one routed expert", Fig(wts, "expert_bytes", B));
    // The formats as stored ("mxfp4", "bf16+f32", "none") and why the experts' is taken to be so.
    rows.emplace_back("resident weights' format", Val(wts, "resident_format"));
    rows.emplace_back("routed experts' format", Val(wts, "expert_format"));
    rows.emplace_back("routed experts' format from", Val(wts, "expert_format_from"));
    *body += KeyValueTable(rows);
  }
  if (j.contains("experts") && CheckObject(j, "experts", "the expert cache", body)) {
    const json& e = Obj(j, "experts");
    *body += "<h2>Expert cache</h2>";
    *body += KeyValueTable({
        {fmt::format("HBM for a {} hit rate", Fig(e, "hit_target", P)), Fig(e, "bytes_for_target", B)},
        {"budget", Fig(e, "budget_bytes", B)},
        {"hit rate of the budget", Fig(e, "hit_rate", P)},
        {"stall per token, batch 1", Fig(e, "stall_s_per_token_batch1", Ms)},
        {"stall per token, batched", Fig(e, "stall_s_per_token_batched", Ms)},
    });
    BarChart st;
    st.title = "Expected stall per decoded token";
    st.subtitle = fmt::format("expert-cache misses loaded over the host link, budget {} ({} hit rate)",
                              Fig(e, "budget_bytes", B), Fig(e, "hit_rate", P));
    st.y_label = "milliseconds per token";
    st.bars = {"stall per token"};
    st.value_labels = true;
    std::vector<std::string> missing;
    AddGroup(&st, "batch 1", {InMs(Opt(e, "stall_s_per_token_batch1"))}, &missing);
    AddGroup(&st, "batched (--concurrency)", {InMs(Opt(e, "stall_s_per_token_batched"))}, &missing);
    NoteMissing(&st, missing);
    r->charts.push_back({"stall-per-token", RenderSvg(st)});
    *body += r->charts.back().svg;
  }
  if (!Arr(j, "tiers").empty()) {
    *body += "<h2>Tiers</h2><table><thead><tr><th>tier</th><th>capacity</th><th>for KV/state</th><th>sequences</th>"
             "<th>also holds</th></tr></thead><tbody>";
    for (const auto& t : Arr(j, "tiers")) {
      *body += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{} {}</td></tr>", XmlEscape(Str(t, "name")),
                           Fig(t, "capacity_bytes", B), Fig(t, "kv_bytes", B), Val(t, "sequences"),
                           Fig(t, "other_bytes", B), XmlEscape(Str(t, "holds")));
    }
    *body += "</tbody></table>";
  }
  if (!Arr(j, "bandwidth").empty()) {
    *body += "<h2>Bandwidth</h2><table><thead><tr><th>link</th><th>required</th><th>available</th><th>use</th>"
             "<th>for</th></tr></thead><tbody>";
    for (const auto& b : Arr(j, "bandwidth")) {
      const double u = Num(b, "utilisation");  // for the colour; shown through Fig
      *body += fmt::format("<tr><td>{}</td><td>{}/s</td><td>{}/s</td><td class=\"{}\">{}</td><td>{}</td></tr>",
                           XmlEscape(Str(b, "link")), Fig(b, "required_bytes_per_s", B),
                           Fig(b, "available_bytes_per_s", B), u > 1 ? "over" : "", Fig(b, "utilisation", P), XmlEscape(Str(b, "what")));
    }
    *body += "</tbody></table>";
  }
  if (j.contains("lifecycle") && CheckObject(j, "lifecycle", "the lifecycle figures", body)) {
    std::vector<std::pair<std::string, std::string>> rows;
    const json& l = Obj(j, "lifecycle");
    for (auto it = l.begin(); it != l.end(); ++it) rows.emplace_back(Words(it.key()), WithUnit(it.key(), *it));
    *body += "<h2>Lifecycle</h2>" + KeyValueTable(rows);
  }
  if (!j.contains("trace") || !CheckObject(j, "trace", "the trace replay", body)) return;
  const json& t = Obj(j, "trace");
  *body += fmt::format("<h2>Trace replay: {}</h2><p>{} requests, {} blocks ({} unique) of {} tokens; prefix-hit "
                       "ceiling <b>{}</b>; replayed in {}.</p>",
                       XmlEscape(Str(t, "file")), Val(t, "requests"), Val(t, "blocks"),
                       Val(t, "unique_blocks"), Val(t, "block_tokens"),
                       Fig(t, "prefix_hit_ceiling", P), Fig(t, "replay_seconds", [](double x) { return fmt::format("{:.2f} s", x); }));
  // What the replay left out or could not measure (`terrace plan`'s note: lines).
  for (const auto& n : Arr(t, "notes")) *body += fmt::format("<p>Note: {}</p>", Cell(n));
  if (!Arr(t, "sweep").empty()) {
    LineChart c;
    c.title = "Prefix hit rate vs cache capacity";
    c.x_label = "capacity (one tier)";
    c.y_label = "hit rate";
    c.log_x = true;
    c.x_format = AxisFormat::kBytes;
    c.y_format = AxisFormat::kPercent;
    std::vector<std::string> order, missing;
    for (const auto& p : Arr(t, "sweep")) {
      const std::string pol = Str(p, "policy");
      const std::optional<double> cap = Opt(p, "capacity_bytes"), hit = Opt(p, "hit_rate");
      if (!cap || !hit) {
        missing.push_back(fmt::format("{} at {}", pol, Fig(p, "capacity_bytes", B)));
        continue;
      }
      auto it = std::find(order.begin(), order.end(), pol);
      if (it == order.end()) {
        order.push_back(pol);
        c.series.push_back({pol, {}, false});
        it = std::prev(order.end());
      }
      c.series[static_cast<std::size_t>(it - order.begin())].points.emplace_back(*cap, *hit);
    }
    double lo = 0, hi = 0;
    for (const auto& s : c.series)
      for (auto [x, y] : s.points) {
        lo = lo == 0 ? x : std::min(lo, x);
        hi = std::max(hi, x);
      }
    NoteMissing(&c, missing, "no point");
    if (const std::optional<double> ceil = Opt(t, "prefix_hit_ceiling"))
      c.series.push_back({"ceiling (infinite cache)", {{lo, *ceil}, {hi, *ceil}}, true});
    else
      NoteMissing(&c, {"the ceiling"}, "no line");
    r->charts.push_back({"hit-rate-vs-capacity", RenderSvg(c)});
    *body += r->charts.back().svg;
  }
  if (!Arr(t, "policies").empty()) {
    BarChart b;
    b.title = "Prefix hit rate per tier and policy";
    b.y_label = "share of prompt blocks";
    b.y_format = AxisFormat::kPercent;
    std::vector<std::string> missing;
    for (const auto& p : Arr(t, "policies")) {
      std::vector<std::optional<double>> v;
      for (const auto& tier : Arr(p, "tiers")) {
        if (b.bars.size() < Arr(p, "tiers").size()) b.bars.push_back(Str(tier, "name"));
        v.push_back(Opt(tier, "hit_rate"));
      }
      AddGroup(&b, Str(p, "policy"), v, &missing);
    }
    NoteMissing(&b, missing);
    r->charts.push_back({"tier-hit-rates", RenderSvg(b)});
    *body += r->charts.back().svg;
    *body += "<table><thead><tr><th>policy</th><th>hit rate</th><th>TTFT saved per request</th>"
             "<th>queued restore wait per request</th>"
             "<th>slower than recompute</th><th>bytes moved</th></tr></thead><tbody>";
    for (const auto& p : Arr(t, "policies")) {
      *body += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                           XmlEscape(Str(p, "policy")), Fig(p, "hit_rate", P), Fig(p, "ttft_saved_s_per_request", Ms),
                           Fig(p, "queue_wait_s_per_request", Ms), Val(p, "restores_slower_than_recompute"),
                           Fig(p, "bytes_moved", B));
    }
    *body += "</tbody></table>";
    TraceLoadTable(Arr(t, "policies"), body);
  }
  if (!Arr(t, "cluster").empty()) {
    // The projection replays one policy (`terrace plan`'s first), which each row names.
    const json& first = Arr(t, "cluster").front();
    const std::string policy = first.is_object() && first.contains("policy") ? Str(first, "policy") : "";
    *body += fmt::format("<h3>Cluster projection{}</h3><table><thead><tr><th>routing</th><th>hit rate</th>"
                         "<th>load imbalance</th></tr></thead><tbody>",
                         policy.empty() ? "" : fmt::format(" ({} eviction)", XmlEscape(policy)));
    for (const auto& c : Arr(t, "cluster")) {
      *body += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td></tr>", XmlEscape(Str(c, "routing")),
                           Fig(c, "hit_rate", P), Fig(c, "load_imbalance", [](double x) { return fmt::format("{:.2f}", x); }));
    }
    *body += "</tbody></table>";
  }
}


// Adds a chart to the report and the page.
void Add(Report* r, std::string* body, std::string name, std::string svg) {
  r->charts.push_back({std::move(name), std::move(svg)});
  *body += r->charts.back().svg;
}

// A line chart, or where no series has a point, a note saying why (`why`) in its place: never empty axes.
void AddLines(Report* r, std::string* body, std::string name, const LineChart& c, std::string_view why) {
  for (const Series& s : c.series)
    if (!s.points.empty()) return Add(r, body, std::move(name), RenderSvg(c));
  Skipped(body, c.title, why);
}

// A chart over the demo's turns (x: turn number in run order, a dot per turn).
LineChart TurnChart(std::string title, std::string subtitle, std::string y_label,
                    AxisFormat y_format = AxisFormat::kPlain) {
  LineChart c;
  c.title = std::move(title);
  c.subtitle = std::move(subtitle);
  c.x_label = "turn (in run order)";
  c.y_label = std::move(y_label);
  c.y_format = y_format;
  c.integer_x = c.markers = true;
  return c;
}

// Tokens routed to each expert of a layer, hot experts (listed in `hot`) in red.
BarChart ExpertLoad(const json& layer, std::string title) {
  BarChart b;
  b.title = std::move(title);
  b.y_label = "tokens routed";
  b.bars = {"tokens routed"};
  const json& load = Arr(layer, "expert_load");
  const json& hot = Arr(layer, "hot_experts");
  for (std::size_t e = 0; e < load.size(); ++e) {
    b.groups.push_back(std::to_string(e));
    b.values.push_back({load[e].is_number() ? load[e].get<double>() : 0.0});
    bool h = false;
    for (const auto& x : hot) h = h || (x.is_number_integer() && x.get<std::size_t>() == e);
    b.hot_groups.push_back(h);
  }
  return b;
}

double Mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? 0 : sum / static_cast<double>(v.size());
}

std::vector<double> Numbers(const json& a) {
  std::vector<double> v;
  for (const auto& x : a) v.push_back(x.is_number() ? x.get<double>() : 0.0);
  return v;
}

// Per expert of one MoE layer: tokens routed to it, the hot ones (listed in `hot`) in red, with the
// layer mean and the hot threshold (hot_factor x mean) as reference lines.
BarChart LayerLoad(const json& layer, double hot_factor, std::string title, std::string subtitle) {
  BarChart b = ExpertLoad(layer, std::move(title));
  b.subtitle = std::move(subtitle);
  b.x_label = "expert";
  const double mean = Mean(Numbers(Arr(layer, "expert_load")));
  b.ref_lines = {{"layer mean", mean}, {fmt::format("hot: > {:.3g} x mean", hot_factor), hot_factor * mean}};
  return b;
}

// The histogram's bins: kHotBin of them up to the hot threshold, the last one open-ended.
constexpr std::size_t kHotBin = 8, kMaxLoadBins = 200;

// The bin of an expert with `load` in a layer of mean load `mean` (> 0): bin i holds load / mean in
// (i, i + 1] x width (bin 0 from 0), width = hot_factor / kHotBin, so that the hot rule's strict > (load > hot_factor
// x mean, as ExpertOffload marks hot experts) puts exactly the hot experts at kHotBin and above;
// loads past the last bin land in it.
std::size_t LoadBin(double load, double mean, double hot_factor) {
  const bool hot = load > hot_factor * mean;  // the rule itself, so rounding cannot cross the edge
  const double edge = std::ceil(load / mean / (hot_factor / kHotBin));
  const double bin = std::clamp(edge - 1, hot ? double{kHotBin} : 0.0, hot ? double{kMaxLoadBins - 1} : double{kHotBin - 1});
  return static_cast<std::size_t>(bin);
}

// All MoE layers' experts by load relative to their layer's mean: a histogram whose bins above
// hot_factor x mean (the hot experts) are red; at most kMaxLoadBins bins. `hot_factor` is >= 1 and
// every load a number >= 0 (CheckExpertLoads).
BarChart LoadHistogram(const json& layers, double hot_factor) {
  BarChart b;
  b.title = "Expert utilisation histogram, all MoE layers";
  b.subtitle = fmt::format("experts per bin of (tokens routed / layer mean); red: hot (> {:.3g} x mean)", hot_factor);
  b.x_label = "tokens routed / layer mean";
  b.y_label = "experts";
  b.bars = {"experts"};
  b.value_labels = true;
  const double width = hot_factor / kHotBin;
  std::vector<double> counts;
  for (const auto& l : layers) {
    const std::vector<double> load = Numbers(Arr(l, "expert_load"));
    const double mean = Mean(load);
    if (mean <= 0) continue;
    for (double x : load) {
      const std::size_t bin = LoadBin(x, mean, hot_factor);
      if (counts.size() <= bin) counts.resize(bin + 1);
      counts[bin] += 1;
    }
  }
  for (std::size_t i = 0; i < counts.size(); ++i) {
    const bool last = i + 1 == kMaxLoadBins;
    b.groups.push_back(last ? fmt::format("> {:.2g}", static_cast<double>(i) * width)
                            : fmt::format("{:.2g}", (static_cast<double>(i) + 0.5) * width));
    b.values.push_back({counts[i]});
    b.hot_groups.push_back(i >= kHotBin);
  }
  return b;
}

// InvalidArgument naming `where`[k] unless every element of `load` is a number of at least 0.
Status CheckLoadCounts(const json& load, std::string_view where) {
  for (std::size_t k = 0; k < load.size(); ++k) {
    if (!(load[k].is_number() && load[k].get<double>() >= 0)) {
      return Status::InvalidArgument(fmt::format("{}[{}] is {}; a load is a count of tokens, a number of at least 0",
                                                 where, k, load[k].dump()));
    }
  }
  return Status::Ok();
}

// InvalidArgument naming `where` unless `parent`'s expert_load is absent or an array whose every
// element is a number of at least 0 (CheckLoadCounts).
Status CheckExpertLoad(const json& parent, std::string_view where) {
  return CheckLoadCounts(Arr(parent, "expert_load"), where);
}

// A note for each of `items` whose expert_load is there but no array (`where`[i].expert_load): its
// loads are drawn nowhere, and the page says so rather than leave them out silently.
void NoteLoadsNotArrays(const json& items, std::string_view where, std::string* body) {
  for (std::size_t i = 0; i < items.size(); ++i) {
    auto it = items[i].find("expert_load");  // none on a non-object
    if (it != items[i].end() && !it->is_array())
      Skipped(body, "an expert load", fmt::format("{}[{}].expert_load is not an array", where, i));
  }
}

// The expert figures as the charts need them: a demo run's hot_factor, where present, a finite
// number of at least 1, and every expert_load (a demo run's layers, a bench run's
// configurations) that is an array, numbers of at least 0 (one that is no array is noted on the page,
// NoteLoadsNotArrays). InvalidArgument naming the key.
Status CheckExpertLoads(const json& j) {
  const json& e = Obj(Obj(j, "summary"), "experts");
  if (auto it = e.find("hot_factor"); it != e.end() && !(it->is_number() && it->get<double>() >= 1)) {
    return Status::InvalidArgument(fmt::format("summary.experts.hot_factor is {}; it must be a number of at least 1 "
                                               "(an expert is hot when its load exceeds hot_factor x its layer's mean)",
                                               it->dump()));
  }
  const json& layers = Arr(e, "layers");
  for (std::size_t i = 0; i < layers.size(); ++i) {
    TERRACE_RETURN_IF_ERROR(CheckExpertLoad(layers[i], fmt::format("summary.experts.layers[{}].expert_load", i)));
  }
  const json& cfgs = Arr(j, "configs");
  for (std::size_t i = 0; i < cfgs.size(); ++i) {
    TERRACE_RETURN_IF_ERROR(CheckExpertLoad(cfgs[i], fmt::format("configs[{}].expert_load", i)));
  }
  return Status::Ok();
}

// `terrace demo --json` / DIR/demo-run.json: {"turns": [...], "summary": {"experts": ...}}.
void DemoSections(const json& j, Report* r, std::string* body) {
  const json& turns = Arr(j, "turns");
  const json& s = Obj(j, "summary");
  const json& e = Obj(s, "experts");
  const json& moved = Obj(s, "bytes_moved");
  // A run is taken for a demo's by its turns key, so it has one.
  if (const auto it = j.find("turns"); it != j.end() && !it->is_array())
    Skipped(body, "the per-turn charts", "turns is not a list");
  else if (turns.empty())
    Skipped(body, "the per-turn charts", "turns is an empty list");
  r->title = fmt::format("Terrace demo: {} turns on {}", turns.size(), Str(Obj(j, "model"), "preset"));
  const json& verified = j.contains("verified") ? j["verified"] : json();
  // The verdict holds only when every turn agrees with it: a turn recorded as unequal (or with a
  // difference) makes it NOT EQUAL whatever `verified` says.
  std::vector<std::string> differ;
  for (std::size_t i = 0; i < turns.size(); ++i) {
    const json& t = turns[i];
    if (!t.is_object()) continue;
    const bool unequal = t.contains("equal") && t["equal"].is_boolean() && !t["equal"].get<bool>();
    if (unequal || Opt(t, "max_abs_diff").value_or(0) != 0) differ.push_back(std::to_string(i + 1));
  }
  const std::string verdict =
      !differ.empty() ? fmt::format("NOT EQUAL (turn{} {} differ{} from the recompute)", differ.size() == 1 ? "" : "s",
                                    fmt::join(differ, ", "), differ.size() == 1 ? "s" : "")
      : !verified.is_boolean() ? "not recorded (verified is missing or not true or false)"
      : verified.get<bool>()   ? "bitwise equal"
                               : "NOT EQUAL";
  *body += fmt::format("<p>Every figure below was measured on the real model and the real stores; every turn was "
                       "checked against a full recompute with all experts resident and no store: <b>{}</b>.</p>",
                       verdict);
  auto tps = [](double x) { return fmt::format("{:.1f} tokens/s", x); };
  auto sec = [](double x) { return fmt::format("{:.3f} s", x); };
  *body += KeyValueTable({
      {"throughput", fmt::format("{} (decode {})", Fig(s, "tokens_per_s", tps), Fig(s, "decode_tokens_per_s", tps))},
      {"time to first token", fmt::format("{} with restore, {} by full recompute (mean of all turns)",
                                          Fig(s, "ttft_mean_s", sec), Fig(s, "ttft_recompute_mean_s", sec))},
      {"prefix restored", fmt::format("{} of prompt tokens", Fig(s, "restored_share", P))},
      {"expert fast-tier hit rate", Fig(e, "hit_rate", P)},
      {"expert prefetch", fmt::format("precision {}, recall {}", Fig(e, "prefetch_precision", P),
                                      Fig(e, "prefetch_recall", P))},
      {"stalls on expert loads", fmt::format("{} of forward time; {} per computed prompt token, {} per decode step",
                                             Fig(e, "stall_share", P), Fig(e, "stall_s_per_prefill_token", Ms),
                                             Fig(e, "stall_s_per_decode_token", Ms))},
      {"bytes moved", fmt::format("prefix restored {}, written {}; experts on demand {}, prefetched {}",
                                  Fig(moved, "prefix_restored", B), Fig(moved, "prefix_written", B),
                                  Fig(moved, "experts_on_demand", B), Fig(moved, "experts_prefetched", B))},
  });
  CheckObject(s, "experts", "the expert figures", body, "summary.experts");
  CheckObject(s, "bytes_moved", "the bytes moved", body, "summary.bytes_moved");
  LineChart t = Lines(turns, nullptr, {{"ttft_s", "with restore"}, {"ttft_recompute_s", "full recompute"}});
  t.title = "Time to first token per turn";
  t.subtitle = "with prefix restore and expert offload vs a full recompute with every expert resident";
  t.x_label = "turn (in run order)";
  t.y_label = "seconds";
  t.integer_x = t.markers = true;
  if (!turns.empty()) AddLines(r, body, "ttft-per-turn", t, "no turn has a ttft_s or ttft_recompute_s figure");
  // Tier hit rates over time: per turn, hits / lookups of each prefix-pool tier and of the expert cache.
  if (!turns.empty() && turns[0].contains("prefix_hit_rate")) {
    LineChart h = TurnChart("Tier hit rates per turn",
                            "hits / lookups in the turn; a tier with no lookups in a turn has no point", "hit rate",
                            AxisFormat::kPercent);
    for (const char* tier : {"hbm", "host", "nvme"}) {
      Series ser{fmt::format("prefix {}", tier), {}, false};
      for (std::size_t i = 0; i < turns.size(); ++i) {
        const json& v = Obj(turns[i], "prefix_hit_rate");
        if (v.contains(tier) && v[tier].is_number()) ser.points.emplace_back(static_cast<double>(i + 1), v[tier].get<double>());
      }
      if (!ser.points.empty()) h.series.push_back(std::move(ser));
    }
    Series ex{"expert cache (hbm)", {}, false};
    for (std::size_t i = 0; i < turns.size(); ++i) {
      const json& x = Obj(turns[i], "experts");
      if (x.contains("hit_rate") && x["hit_rate"].is_number()) ex.points.emplace_back(static_cast<double>(i + 1), x["hit_rate"].get<double>());
    }
    if (!ex.points.empty()) h.series.push_back(std::move(ex));
    AddLines(r, body, "tier-hit-rates-over-time", h, "no turn has a prefix_hit_rate or experts.hit_rate figure");
  } else if (!turns.empty()) {
    Skipped(body, "Tier hit rates per turn", "turns[0].prefix_hit_rate is missing");
  }
  LineChart h = TurnChart("Restored prefix per turn, by the tier it came from",
                          "share of the turn's prompt tokens, split by restored bytes per tier",
                          "share of the prompt's tokens", AxisFormat::kPercent);
  for (const char* tier : {"hbm", "host", "nvme"}) h.series.push_back({tier, {}, false});
  for (std::size_t i = 0; i < turns.size(); ++i) {  // a turn without these figures has no points
    const json& rb = Obj(turns[i], "restore_bytes");
    const std::optional<double> prompt = Opt(turns[i], "prompt_tokens"), restored = Opt(turns[i], "restored_tokens");
    if (!prompt || !restored || !Opt(rb, "hbm") || !Opt(rb, "host") || !Opt(rb, "nvme")) continue;
    const double all = Num(rb, "hbm") + Num(rb, "host") + Num(rb, "nvme");
    const double share = *prompt > 0 ? *restored / *prompt : 0;
    for (auto& ser : h.series)
      ser.points.emplace_back(static_cast<double>(i + 1), all > 0 ? share * Num(rb, ser.name.c_str()) / all : 0.0);
  }
  if (!turns.empty()) {
    AddLines(r, body, "prefix-restore-by-tier", h,
             "no turn has prompt_tokens, restored_tokens and restore_bytes for hbm, host and nvme");
  }
  if (!turns.empty() && !turns[0].contains("experts")) {
    Skipped(body, "Stall on expert loads per token, per turn", "turns[0].experts is missing");
  } else if (!turns.empty()) {
    LineChart st = TurnChart("Stall on expert loads per token, per turn",
                             fmt::format("forward time waiting for experts; whole run: {} of forward time",
                                         Fig(e, "stall_share", P)),
                             "milliseconds per token");
    Series pre{"prompt token (prefill)", {}, false}, dec{"decode step", {}, false};
    for (std::size_t i = 0; i < turns.size(); ++i) {
      const json& x = Obj(turns[i], "experts");
      const std::optional<double> p = Opt(x, "stall_s_per_prefill_token"), d = Opt(x, "stall_s_per_decode_token");
      if (p && Num(turns[i], "computed_tokens") > 0) pre.points.emplace_back(static_cast<double>(i + 1), 1e3 * *p);
      // A turn that generated one token made no decode step: a 0 written for it (older runs) is no figure.
      if (d && Arr(turns[i], "generated").size() > 1) dec.points.emplace_back(static_cast<double>(i + 1), 1e3 * *d);
    }
    st.series = {std::move(pre), std::move(dec)};
    Add(r, body, "stall-per-token", RenderSvg(st));
  }
  const json& layers = Arr(e, "layers");
  if (layers.empty()) return;
  NoteLoadsNotArrays(layers, "summary.experts.layers", body);
  LineChart pr = Lines(layers, "layer", {{"prefetch_precision", "precision"}, {"prefetch_recall", "recall"},
                                         {"hit_rate", "fast-tier hit rate"}});
  pr.title = "Expert prefetch precision and recall per layer";
  pr.subtitle = "the lookahead predictor, over the whole run";
  pr.x_label = "MoE layer";
  pr.y_label = "rate";
  pr.y_format = AxisFormat::kPercent;
  pr.integer_x = pr.markers = true;
  Add(r, body, "prefetch-per-layer", RenderSvg(pr));
  if (!Opt(e, "hot_factor")) return Skipped(body, "the expert loads and hot experts", "summary.experts.hot_factor is missing");
  const double hot_factor = Num(e, "hot_factor");  // a finite number >= 1 (CheckExpertLoads)
  // Per-expert bars of the layer with the most hot experts (ties: the first); then all layers as a histogram.
  std::size_t pick = 0;
  for (std::size_t i = 0; i < layers.size(); ++i)
    if (Arr(layers[i], "hot_experts").size() > Arr(layers[pick], "hot_experts").size()) pick = i;
  Add(r, body, "expert-utilisation",
      RenderSvg(LayerLoad(layers[pick], hot_factor,
                          fmt::format("Tokens routed to each expert of layer {}", Str(layers[pick], "layer")),
                          fmt::format("the MoE layer with the most hot experts ({} of {}); red: hot",
                                      Arr(layers[pick], "hot_experts").size(), Arr(layers[pick], "expert_load").size()))));
  Add(r, body, "expert-load-histogram", RenderSvg(LoadHistogram(layers, hot_factor)));
  std::vector<std::pair<std::string, std::string>> hot_rows;
  for (const auto& l : layers) {
    std::vector<std::string> ids;
    for (const auto& x : Arr(l, "hot_experts")) ids.push_back(x.dump());
    hot_rows.emplace_back(fmt::format("layer {}", Str(l, "layer")), ids.empty() ? "none" : XmlEscape(fmt::format("{}", fmt::join(ids, ", "))));
  }
  *body += fmt::format("<h2>Hot experts per layer (load &gt; {:.3g} x the layer mean)</h2>", hot_factor) + KeyValueTable(hot_rows);
}

// A bench-experts configuration's label: its name, and its expert-cache budget when it has one
// below 100% (the same names repeat for each --budgets entry).
std::string ConfigLabel(const json& c) {
  const double b = Num(c, "budget_fraction");
  return b > 0 && b < 1 ? fmt::format("{} @ {:.3g}%", Str(c, "name"), 100 * b) : Str(c, "name");
}

// `terrace bench experts --json`: {"configs": [{"name", "tokens_per_s", "layer_recall", ...}]}.
void BenchExpertsSections(const json& j, Report* r, std::string* body) {
  const json& cfgs = Arr(j, "configs");
  r->title = fmt::format("Terrace bench experts: {}", Str(j, "model"));
  // One bar per configuration with a value(config): one without (null: not measured, or no such
  // figure) gets no bar rather than a 0, and the subtitle names it.
  auto bars = [&](const std::function<std::optional<double>(const json&)>& value, std::string y_label,
                  std::string title, AxisFormat f, std::string name) {
    BarChart b;
    b.title = std::move(title);
    b.y_format = f;
    b.y_label = y_label;
    b.bars = {std::move(y_label)};
    b.value_labels = true;
    std::vector<std::string> none;
    for (const auto& c : cfgs) AddGroup(&b, ConfigLabel(c), {value(c)}, &none);
    NoteMissing(&b, none);
    Add(r, body, std::move(name), RenderSvg(b));
  };
  auto key = [](const char* k) { return [k](const json& c) { return Opt(c, k); }; };
  bars(key("tokens_per_s"), "tokens/s", "Decode tokens/s per configuration", AxisFormat::kPlain, "tokens-per-s");
  bars(key("stall_share"), "share of decode time", "Stall share per configuration", AxisFormat::kPercent, "stall-share");
  // stall_share is stall time / decode time and tokens_per_s decode tokens / decode time.
  bars(
      [](const json& c) {
        const std::optional<double> share = Opt(c, "stall_share"), tps = Opt(c, "tokens_per_s");
        return share && tps && *tps > 0 ? std::optional<double>(1e3 * *share / *tps) : std::nullopt;
      },
      "ms per decoded token", "Stall per decoded token per configuration", AxisFormat::kPlain, "stall-per-token");
  // Null where the row has no such figure (resident; the mmap rows' recall and precision).
  bars(key("hit_rate"), "hit rate", "Fast-tier hit rate per configuration", AxisFormat::kPercent, "hit-rate");
  bars(key("precision"), "precision", "Prefetch precision per configuration", AxisFormat::kPercent, "precision");
  bars(key("recall"), "recall", "Prefetch recall per configuration", AxisFormat::kPercent, "recall");
  LineChart lr;
  lr.title = "Prefetch recall per layer";
  lr.x_label = "MoE layer (in order)";
  lr.y_label = "recall";
  lr.y_format = AxisFormat::kPercent;
  lr.integer_x = lr.markers = true;
  for (const auto& c : cfgs) {  // a configuration that predicts (its recall a number); a null layer has no point
    const json& rec = Arr(c, "layer_recall");
    if (rec.empty() || !Opt(c, "recall")) continue;
    Series ser{ConfigLabel(c), {}, false};
    for (std::size_t i = 0; i < rec.size(); ++i)
      if (rec[i].is_number()) ser.points.emplace_back(static_cast<double>(i), rec[i].get<double>());
    lr.series.push_back(std::move(ser));
  }
  if (!lr.series.empty()) Add(r, body, "recall-per-layer", RenderSvg(lr));
  NoteLoadsNotArrays(cfgs, "configs", body);
  for (const auto& c : cfgs) {  // routing is the same for every configuration: the first with loads
    if (Arr(c, "expert_load").empty()) continue;
    Add(r, body, "expert-utilisation",
        [&] {
          BarChart b = ExpertLoad(c, "Tokens routed to each expert, summed over the MoE layers");
          b.subtitle = fmt::format("{}; red: hot (load > the hot factor x the layer mean) in some layer", ConfigLabel(c));
          b.x_label = "expert";
          return RenderSvg(b);
        }());
    break;
  }
}

constexpr const char* kTiers[] = {"hbm", "host", "nvme"};

// "hbm 0 B, host 2.2 MiB, nvme 2.2 MiB": the bytes of a `*_by_tier` object.
std::string TierBytes(const json& by_tier) {
  std::vector<std::string> parts;
  for (const char* tier : kTiers) parts.push_back(fmt::format("{} {}", tier, Fig(by_tier, tier, B)));
  return fmt::format("{}", fmt::join(parts, ", "));
}

// "hbm 0.0%, host 0.0%, nvme 100.0% of 10 blocks": the shares of a `hit_rate_by_tier` object.
std::string TierShareText(const json& j) {
  const json& h = Obj(j, "hit_rate_by_tier");
  std::vector<std::string> parts;
  for (const char* tier : kTiers) parts.push_back(fmt::format("{} {}", tier, Fig(h, tier, P)));
  return fmt::format("{} of {} blocks", fmt::join(parts, ", "), Val(j, "blocks_requested"));
}

// Adds `b` (its titles and x label set) as stacked bars, one per row of `rows` (labelled by `label`):
// the share of the blocks the row's restore asked for that each tier served (`hit_rate_by_tier`)
// and, on top, the share found in no tier (a fallback; drawn only when some row has one). Rows
// without a `hit_rate_by_tier` object, or with a tier's share not a number (null: not recorded), are
// left out and named in a note ("Not charted: <what> <labels>").
void AddTierShares(Report* r, std::string* body, BarChart b, const json& rows,
                   const std::function<std::string(const json&)>& label, std::string name, std::string_view what) {
  std::vector<std::string> missing;
  b.groups.clear();
  b.y_label = "share of the blocks asked for";
  b.y_format = AxisFormat::kPercent;
  b.stacked = true;
  b.bars = {"hbm", "host", "nvme", "in no tier (fallback)"};
  bool fallbacks = false;
  for (const auto& row : rows) {
    const json& h = Obj(row, "hit_rate_by_tier");
    if (std::any_of(std::begin(kTiers), std::end(kTiers), [&](const char* tier) { return !Opt(h, tier); })) {
      missing.push_back(label(row));
      continue;
    }
    std::vector<double> v;
    double found = 0;
    for (const char* tier : kTiers) {
      v.push_back(*Opt(h, tier));
      found += v.back();
    }
    // A row that asked for no block (a turn that computed its whole prompt) misses nothing.
    const bool asked = row.contains("blocks_requested") ? Num(row, "blocks_requested") > 0 : found > 0;
    v.push_back(asked ? std::max(0.0, 1 - found) : 0.0);
    fallbacks = fallbacks || v.back() > 1e-9;
    b.groups.push_back(label(row));
    b.values.push_back(std::move(v));
  }
  if (!fallbacks) {
    b.bars.pop_back();
    for (auto& v : b.values) v.pop_back();
  }
  if (!b.groups.empty()) Add(r, body, std::move(name), RenderSvg(b));
  if (!missing.empty())
    Skipped(body, fmt::format("{} {}", what, fmt::join(missing, ", ")),
            "hit_rate_by_tier is missing, not an object, or lacks a tier's share");
}

// Per codec of `bytes_per_token_by_codec` (largest first): the nominal and the as-stored bytes
// (`nominal_key`, `stored_key`), the codec the run used (`used`, its lossless stage stripped: the
// table has none) outlined. Entries that are not objects are left out; one without both figures
// (null: not recorded) has no bars, and the subtitle names it.
BarChart CodecBytes(const json& by_codec, const char* nominal_key, const char* stored_key, const std::string& used) {
  std::vector<std::pair<std::string, const json*>> codecs;
  for (auto it = by_codec.begin(); it != by_codec.end(); ++it) {
    if (it->is_object()) codecs.emplace_back(it.key(), &*it);
  }
  std::stable_sort(codecs.begin(), codecs.end(),
                   [&](const auto& a, const auto& b) { return Num(*a.second, nominal_key) > Num(*b.second, nominal_key); });
  const std::string base = used.substr(0, used.find('+'));
  BarChart c;
  c.y_format = AxisFormat::kBytes;
  c.bars = {"nominal", "as stored"};
  c.value_labels = codecs.size() <= 6;  // more: the labels of neighbouring bars overlap (the tooltips keep them)
  c.marked_label = fmt::format("this run: {}", used);
  bool found = false;
  std::vector<std::string> missing;
  for (const auto& [name, entry] : codecs) {
    const std::size_t before = c.groups.size();
    AddGroup(&c, name, {Opt(*entry, nominal_key), Opt(*entry, stored_key)}, &missing);
    if (c.groups.size() > before) c.marked_groups.push_back(name == base);
    found = found || name == base;
  }
  const std::string mark = !found        ? fmt::format("this run's codec {} is not in the table", used)
                           : base != used ? fmt::format("outlined: {}, the run's {} before its lossless stage", base, used)
                                          : fmt::format("outlined: {}, the codec this run used", used);
  c.subtitle = "as stored: with the block header, scales and 4 KiB alignment; " + mark;
  NoteMissing(&c, missing);
  return c;
}

// "t2 c1": a multi-turn row's turn and conversation ("?" where the row lacks one).
std::string TurnLabel(const json& row) {
  auto part = [&](const char* key) { return row.contains(key) ? Str(row, key) : "?"; };
  return fmt::format("t{} c{}", part("turn"), part("conversation"));
}

// Whether a `bench kv` prefix row restored fewer tokens than the prefix's full chunks because turn 1's
// block writes failed (write_failures > 0, restored_tokens < restorable_tokens; false where a key is
// missing, as in JSON from before these keys).
bool ShortRestore(const json& row) {
  const auto failures = Opt(row, "write_failures"), restored = Opt(row, "restored_tokens"),
             restorable = Opt(row, "restorable_tokens");
  return failures && restored && restorable && *failures > 0 && *restored < *restorable;
}

// The prefix rows of `bench kv`: TTFT, restore bandwidth and, per prefix, the restore's blocks by tier.
void BenchKvRows(const json& j, Report* r, std::string* body) {
  const json& rows = Arr(j, "rows");
  *body += "<h2>Restore vs recompute per prefix length</h2>";
  if (rows.empty()) {
    *body += "<p>No per-prefix rows (<code>--prefix-tokens none</code>).</p>";
    return;
  }
  *body += KeyValueTable({{"blocks restored, all rows", TierShareText(j)},
                          {"bytes read, all rows", TierBytes(Obj(j, "bytes_read_by_tier"))},
                          {"bytes written by turn 1, all rows", TierBytes(Obj(j, "bytes_written_by_tier"))}});
  // Rows whose turn 1 could not store the whole prefix (a pool full): each said on the page, and
  // marked `!` in the hit-rate chart, as the text output marks them; rows whose bitwise checks failed.
  for (const auto& row : rows) {
    if (ShortRestore(row))
      *body += fmt::format(
          "<p class=\"warning\">! prefix {}: {} of turn 1's block writes failed (a pool's tiers are full), so turn 2 "
          "restored only {} of the prefix's {} tokens in full chunks: this row measures a {}-token restore; raise "
          "--store-nvme-size / --state-nvme-size.</p>",
          Val(row, "prefix_tokens"), Val(row, "write_failures"), Val(row, "restored_tokens"),
          Val(row, "restorable_tokens"), Val(row, "restored_tokens"));
    std::vector<std::string> failed;
    for (const auto& c : Arr(row, "failed_checks")) failed.push_back(Cell(c));
    if (!failed.empty())
      *body += fmt::format("<p class=\"warning\">prefix {}: check failed: {} (the run exited 1).</p>",
                           Val(row, "prefix_tokens"), fmt::join(failed, ", "));
  }
  LineChart t = Lines(rows, "prefix_tokens", {{"ttft_restore_s", "restore"}, {"ttft_recompute_s", "recompute"}});
  t.title = "Time to first token vs prefix length";
  t.x_label = "prefix (tokens)";
  t.y_label = "seconds";
  t.x_format = AxisFormat::kTokens;
  Add(r, body, "ttft-vs-prefix", RenderSvg(t));
  LineChart b = Lines(rows, "prefix_tokens", {{"restore_mb_per_s", "restore"}, {"tier_read_mb_per_s", "tier read"}});
  b.title = "Restore bandwidth vs the tier's raw read bandwidth";
  b.x_label = "prefix (tokens)";
  b.y_label = "MB/s";
  b.x_format = AxisFormat::kTokens;
  Add(r, body, "restore-bandwidth", RenderSvg(b));
  BarChart h;
  h.title = "Restore hit rate per tier vs prefix length";
  h.subtitle = fmt::format("the share of the prepared restore's blocks each tier served (--tier {})", Str(j, "tier"));
  h.x_label = "prefix (tokens)";
  AddTierShares(r, body, std::move(h), rows,
                [](const json& row) {
                  return Fig(row, "prefix_tokens", [](double x) { return FormatAxisValue(x, AxisFormat::kTokens); }) +
                         (ShortRestore(row) ? "!" : "");
                },
                "tier-hit-rates-by-prefix", "the hit rate per tier of prefix");
}

// The `multi_turn` part of `bench kv`: per turn, restored vs computed tokens, TTFT and the tier shares.
void BenchKvMultiTurn(const json& j, Report* r, std::string* body) {
  *body += "<h2>Multi-turn workload</h2>";
  auto it = j.find("multi_turn");
  if (it == j.end()) {
    *body += "<p>Not run (<code>--turns 0</code>).</p>";
    return;
  }
  if (!it->is_object()) return Skipped(body, "the multi-turn workload", "multi_turn is not an object");
  const json& mt = *it;
  const json& rows = Arr(mt, "rows");
  const std::optional<double> restored = Opt(mt, "restored_tokens"), computed = Opt(mt, "computed_tokens");
  auto tokens = [](double x) { return fmt::format("{:.0f}", x); };
  auto sec = [](double x) { return fmt::format("{:.3g} s", x); };
  *body += KeyValueTable({
      {"workload", fmt::format("{} conversations x {} turns, a {}-token system prompt, {} new tokens per turn",
                               Val(mt, "conversations"), Val(mt, "turns"),
                               Val(mt, "system_tokens"), Val(mt, "user_tokens"))},
      {"prompt tokens", fmt::format("{} restored, {} computed ({} restored)", Fig(mt, "restored_tokens", tokens),
                                    Fig(mt, "computed_tokens", tokens),
                                    restored && computed && *restored + *computed > 0
                                        ? P(*restored / (*restored + *computed))
                                        : std::string(kNotRecorded))},
      {"time", fmt::format("TTFT summed over the turns {}; the part, flushes included, {}",
                           Fig(mt, "ttft_restore_s_sum", sec), Fig(mt, "seconds", sec))},
      {"blocks restored", TierShareText(mt)},
      {"bytes read", TierBytes(Obj(mt, "bytes_read_by_tier"))},
      {"bytes written", TierBytes(Obj(mt, "bytes_written_by_tier"))},
      {"write failures", Val(mt, "write_failures")},
  });
  if (rows.empty()) return Skipped(body, "the multi-turn charts", "multi_turn.rows is missing or empty");
  // One group per turn, in the order played (tN cM: turn N of conversation M); a turn without a figure
  // (null: not recorded) has no group, and the subtitle names it.
  auto per_turn = [&](std::string title, std::string subtitle, std::string y_label) {
    BarChart b;
    b.title = std::move(title);
    b.subtitle = std::move(subtitle);
    b.x_label = "turn t of conversation c, in the order played";
    b.y_label = std::move(y_label);
    return b;  // its groups: the turns with every figure (AddGroup)
  };
  BarChart tok = per_turn("Prompt tokens per turn: restored vs computed",
                          "restored from the cache (bottom) and computed (top); the stack is the prompt", "tokens");
  tok.stacked = true;
  tok.bars = {"restored", "computed"};
  std::vector<std::string> missing;
  for (const auto& row : rows) AddGroup(&tok, TurnLabel(row), {Opt(row, "restored_tokens"), Opt(row, "computed_tokens")}, &missing);
  NoteMissing(&tok, missing);
  Add(r, body, "multi-turn-tokens", RenderSvg(tok));
  BarChart ttft = per_turn("Time to first token per turn, with restore",
                           "restore + the rest of the prompt's forward pass; beside it, the time it waited on reads",
                           "milliseconds");
  ttft.bars = {"TTFT with restore", "waiting on reads"};
  ttft.value_labels = rows.size() * 2 <= 24;
  missing.clear();
  for (const auto& row : rows)
    AddGroup(&ttft, TurnLabel(row), {InMs(Opt(row, "ttft_restore_s")), InMs(Opt(row, "restore_wait_s"))}, &missing);
  NoteMissing(&ttft, missing);
  Add(r, body, "multi-turn-ttft", RenderSvg(ttft));
  AddTierShares(r, body,
                per_turn("Restore hit rate per tier, per turn",
                         "the share of the turn's restored blocks each tier served; empty: the turn restored nothing", ""),
                rows, TurnLabel, "multi-turn-tier-shares", "the tier shares of turn");
}

// `bytes_per_token_by_codec` of `bench kv`: KV bytes per token and state bytes per snapshot per codec.
void BenchKvCodecs(const json& j, Report* r, std::string* body) {
  *body += "<h2>Bytes per token per codec</h2>";
  auto it = j.find("bytes_per_token_by_codec");
  if (it == j.end() || !it->is_object() || it->empty())
    return Skipped(body, "the bytes per codec", "bytes_per_token_by_codec is missing, empty or not an object");
  BarChart kv = CodecBytes(*it, "kv_bytes_per_token", "kv_block_bytes_per_token", Str(j, "kv_codec"));
  kv.title = "KV bytes per token per codec";
  kv.y_label = "bytes per token (every MLA layer)";
  Add(r, body, "kv-bytes-per-token-by-codec", RenderSvg(kv));
  BarChart st = CodecBytes(*it, "state_bytes_per_snapshot", "state_block_bytes_per_snapshot", Str(j, "state_codec"));
  st.title = "KDA state bytes per snapshot per codec";
  st.y_label = "bytes per snapshot (every KDA layer)";
  Add(r, body, "state-bytes-per-snapshot-by-codec", RenderSvg(st));
  std::vector<std::string> missing;
  for (auto c = it->begin(); c != it->end(); ++c)
    if (!c->is_object()) missing.push_back(c.key());
  if (!missing.empty())
    Skipped(body, fmt::format("codec {}", fmt::join(missing, ", ")), "its bytes_per_token_by_codec entry is not an object");
}

// `terrace bench kv --json`: {"rows": [{"prefix_tokens", "ttft_restore_s", ...}], "multi_turn": {...},
// "bytes_per_token_by_codec": {...}}; rows is empty with --prefix-tokens none, multi_turn absent with --turns 0.
void BenchKvSections(const json& j, Report* r, std::string* body) {
  r->title = Arr(j, "rows").empty() ? fmt::format("Terrace bench kv: {}", Str(j, "model"))
                                    : fmt::format("Terrace bench kv: {} from {}", Str(j, "model"), Str(j, "tier"));
  *body += fmt::format("<p>KV codec <b>{}</b>, state codec <b>{}</b>, {}-token chunks.</p>", XmlEscape(Str(j, "kv_codec")),
                       XmlEscape(Str(j, "state_codec")), Val(j, "chunk_tokens"));
  BenchKvRows(j, r, body);
  BenchKvMultiTurn(j, r, body);
  BenchKvCodecs(j, r, body);
}

bool RowsHave(const json& j, const char* key) {
  const json& rows = Arr(j, "rows");
  return !rows.empty() && rows[0].is_object() && rows[0].contains(key);
}

// `terrace verify kv --json`: {"rows": [{"codec", "kl_mean", "top1_agreement", "compression_ratio"}]}.
void VerifyKvSections(const json& j, Report* r, std::string* body) {
  const json& rows = Arr(j, "rows");
  r->title = fmt::format("Terrace verify kv: codec quality on {}", Str(j, "model"));
  *body += fmt::format("<p>State codec <b>{}</b>, a {}-token context restored in {}-token chunks, then {} evaluation "
                       "tokens compared with the exact f32 path. Measured, not judged: no pass or fail "
                       "threshold.</p>",
                       XmlEscape(Str(j, "state_codec")), Val(j, "context_tokens"), Val(j, "chunk_tokens"),
                       Val(j, "eval_tokens"));
  auto bars = [&](std::vector<std::pair<const char*, const char*>> keys, std::string title, AxisFormat f,
                  std::string name, std::string y_label = "") {
    BarChart b;
    b.title = std::move(title);
    b.y_format = f;
    b.y_label = y_label.empty() ? keys.front().second : std::move(y_label);
    for (auto [k, n] : keys) b.bars.push_back(n);
    b.value_labels = rows.size() * keys.size() <= 24;
    std::vector<std::string> missing;
    for (const auto& row : rows) {
      std::vector<std::optional<double>> v;
      for (auto [k, n] : keys) v.push_back(Opt(row, k));
      AddGroup(&b, Str(row, "codec"), v, &missing);
    }
    NoteMissing(&b, missing);
    Add(r, body, std::move(name), RenderSvg(b));
  };
  bars({{"kl_mean", "KL mean (nats)"}, {"kl_max", "KL max (nats)"}}, "KL divergence from the exact path per codec",
       AxisFormat::kPlain, "codec-kl", "KL divergence (nats)");
  bars({{"top1_agreement", "top-1 agreement"}}, "Top-1 agreement with the exact path per codec", AxisFormat::kPercent,
       "codec-top1");
  if (RowsHave(j, "top8_overlap_mean")) {
    bars({{"top8_overlap_mean", "mean"}, {"top8_overlap_min", "min"}},
         "Attention overlap with the exact path per codec (top-8 positions kept)", AxisFormat::kPercent,
         "codec-attention-overlap", "share of the exact top-8 kept");
  }
  bars({{"compression_ratio", "compression vs f32 (stored blocks)"}},
       "Compression ratio per codec: the f32 codec's stored KV blocks / the codec's", AxisFormat::kPlain,
       "codec-compression");
}

// `terrace bench tiers --json`: one object with `tier`, `op`, `mb_per_s` and `passes_mb_per_s`.
void BenchTiersSections(const json& j, Report* r, std::string* body) {
  r->title = fmt::format("Terrace bench tiers: {} {} of {} blocks", Str(j, "tier"), Str(j, "op"),
                         Fig(j, "block_size", B));
  *body += fmt::format("<p>{} at queue depth {}, {} thread(s), batch {}; {}.</p>", Fig(j, "total_bytes", B),
                       Val(j, "queue_depth"), Val(j, "threads"),
                       Val(j, "batch"), XmlEscape(Str(j, "detail")));
  BarChart t;
  t.title = "Throughput per pass";
  const std::optional<double> memcpy = Opt(j, "memcpy_mb_per_s"), reported = Opt(j, "mb_per_s");
  t.subtitle = fmt::format("{} passes after {} warm-up; {}{}", Arr(j, "passes_mb_per_s").size(), Val(j, "warmup"),
                           reported ? "dashed: the reported figure" : "the reported figure: not recorded",
                           memcpy ? ", dotted: memcpy" : ", no memcpy reference (not measured for this tier)");
  t.x_label = "pass";
  t.y_label = "MB/s";
  t.bars = {"MB/s"};
  t.value_labels = Arr(j, "passes_mb_per_s").size() <= 24;
  const json& passes = Arr(j, "passes_mb_per_s");
  std::vector<std::string> missing;
  for (std::size_t i = 0; i < passes.size(); ++i) AddGroup(&t, std::to_string(i + 1), {Opt(passes[i])}, &missing);
  NoteMissing(&t, missing);
  if (memcpy) t.ref_lines.push_back({"memcpy", *memcpy});
  if (reported) t.ref_lines.push_back({"reported", *reported});
  Add(r, body, "throughput-per-pass", RenderSvg(t));
  if (j.contains("p50_us")) {
    BarChart l;
    l.title = "Latency per operation";
    l.subtitle = Str(j, "latency");
    l.y_label = "microseconds";
    l.bars = {"latency"};
    l.value_labels = true;
    std::vector<std::string> missing_l;
    AddGroup(&l, "p50", {Opt(j, "p50_us")}, &missing_l);
    AddGroup(&l, "p99", {Opt(j, "p99_us")}, &missing_l);
    NoteMissing(&l, missing_l);
    Add(r, body, "latency", RenderSvg(l));
  }
}

// `terrace bench store --json`: one object of `<path>_mb_per_s` figures (puts and gets by tier).
void BenchStoreSections(const json& j, Report* r, std::string* body) {
  r->title = fmt::format("Terrace bench store: {} blocks of {}", Val(j, "blocks"), Fig(j, "block_size", B));
  BarChart b;
  b.title = "Store throughput by path";
  b.subtitle = "each figure's JSON key without _mb_per_s; the tier's raw rate next to the store's";
  b.y_label = "MB/s";
  b.bars = {"MB/s"};
  b.value_labels = true;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (!it->is_number() || !EndsWith(it.key(), "_mb_per_s")) continue;
    b.groups.push_back(Words(it.key().substr(0, it.key().size() - 9)));
    b.values.push_back({it->get<double>()});
  }
  Add(r, body, "store-throughput", RenderSvg(b));
}

}  // namespace

constexpr std::string_view kChartNames[] = {
    "memory-vs-context", "stall-per-token", "hit-rate-vs-capacity", "tier-hit-rates", "ttft-per-turn",
    "tier-hit-rates-over-time", "prefix-restore-by-tier", "prefetch-per-layer", "expert-utilisation",
    "expert-load-histogram", "tokens-per-s", "stall-share", "hit-rate", "recall-per-layer", "ttft-vs-prefix",
    "restore-bandwidth", "tier-hit-rates-by-prefix", "multi-turn-tokens", "multi-turn-ttft",
    "multi-turn-tier-shares", "kv-bytes-per-token-by-codec", "state-bytes-per-snapshot-by-codec", "codec-kl",
    "codec-attention-overlap", "codec-compression", "codec-top1", "precision", "recall", "throughput-per-pass",
    "latency", "store-throughput",
};

std::span<const std::string_view> ReportChartNames() { return kChartNames; }

Result<Report> RenderReport(std::string_view text, std::string_view source) {
  auto refuse = [&](std::string_view why) {
    return Status::InvalidArgument(fmt::format("{}: {} (give the output of a --json run)", source, why));
  };
  // Also refuses a nesting deeper than kMaxJsonDepth (Flatten recurses per level) and repeated keys.
  Result<json> parsed = ParseJsonUniqueKeys(text);
  if (!parsed.ok()) return refuse(parsed.status().message());
  const json j = std::move(parsed).value();
  if (!j.is_object()) return refuse(fmt::format("not a JSON object but {}", j.type_name()));
  Report r;
  std::string body;
  if (Str(j, "kind") == "plan") {
    PlanSections(j, &r, &body);
  } else if (j.contains("turns") && j.contains("summary") && j["summary"].is_object()) {
    if (Status s = CheckExpertLoads(j); !s.ok()) return refuse(s.message());
    DemoSections(j, &r, &body);
  } else if (!Arr(j, "configs").empty()) {
    if (Status s = CheckExpertLoads(j); !s.ok()) return refuse(s.message());
    BenchExpertsSections(j, &r, &body);
  } else if (RowsHave(j, "prefix_tokens") || j.contains("multi_turn") || j.contains("bytes_per_token_by_codec")) {
    BenchKvSections(j, &r, &body);
  } else if (RowsHave(j, "codec")) {
    VerifyKvSections(j, &r, &body);
  } else if (j.contains("tier") && j.contains("op") && !Arr(j, "passes_mb_per_s").empty()) {
    BenchTiersSections(j, &r, &body);
  } else if (j.contains("put_first_mb_per_s") || j.contains("get_host_mb_per_s")) {
    BenchStoreSections(j, &r, &body);
  } else {
    r.title = fmt::format("Terrace report: {}", source);
  }
  FlatRows all;
  Flatten(j, "", &all);
  body += "<details><summary>All values</summary>" + KeyValueTable(all.rows);
  if (all.left_out > 0) {
    body += fmt::format("<p class=\"skipped\">The table stops at {} rows: {} more values of {} are not shown.</p>",
                        FlatRows::kMaxRows, all.left_out, XmlEscape(source));
  }
  body += "</details>";
  for (const ReportChart& c : r.charts) {
    if (std::find(std::begin(kChartNames), std::end(kChartNames), c.name) == std::end(kChartNames))
      return Status::Internal(fmt::format("report chart '{}' is missing from ReportChartNames", c.name));
  }
  r.html = fmt::format(
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"/>{3}<title>{0}</title><style>"
      "body{{font-family:sans-serif;max-width:980px;margin:2em auto;color:#222}}"
      "table{{border-collapse:collapse;margin:0.5em 0 1.5em}}td,th{{border:1px solid #ccc;padding:3px 8px;"
      "text-align:left}}th{{background:#f3f3f3}}td.over{{color:#b00;font-weight:bold}}p.warning{{color:#b00;font-weight:bold}}p.skipped{{color:#b00}}svg{{display:block;margin:1em 0}}"
      "</style></head><body><h1>{0}</h1><p>Source: {1}</p>\n{2}\n</body></html>\n",
      XmlEscape(r.title), XmlEscape(source), body, kHtmlGeneratorMeta);
  return r;
}

}  // namespace terrace::plan
