#include "src/plan/report.h"

#include <algorithm>
#include <functional>

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

// `key` of `j` whatever its type, for Cell (0 when `j` is not an object or lacks it).
const json& Field(const json& j, const char* key) {
  static const json zero = 0;
  auto it = j.find(key);
  return it != j.end() ? *it : zero;
}

// A visible note where part of the run's JSON is missing or malformed, naming the key: the page says
// what it left out and why instead of drawing zeros.
void Skipped(std::string* body, std::string_view what, std::string_view why) {
  *body += fmt::format("<p class=\"skipped\">Not charted: {} ({}).</p>", XmlEscape(what), XmlEscape(why));
}

// Where `j` has `key` but not as an object: a note naming it (`what` is the part of the page).
// True when the part can be drawn (an object, or absent: drawn from zeros as before).
bool CheckObject(const json& j, const char* key, std::string_view what, std::string* body) {
  auto it = j.find(key);
  if (it == j.end() || it->is_object()) return true;
  Skipped(body, what, fmt::format("{} is not an object", key));
  return false;
}

double Num(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : 0.0;
}

std::string Str(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end()) return "";
  return it->is_string() ? it->get<std::string>() : it->dump();
}

// "1.23 ms" for the seconds under `key`, "not recorded" where the JSON has no number there.
std::string MsCell(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? fmt::format("{:.3g} ms", 1e3 * it->get<double>()) : "not recorded";
}

std::string Cell(const json& v) {
  if (v.is_string()) return XmlEscape(v.get<std::string>());
  if (v.is_number_float()) return fmt::format("{:.6g}", v.get<double>());
  return XmlEscape(v.dump());
}

// Rows "a.b.c = value" for every scalar, arrays of scalars as one cell; capped.
void Flatten(const json& j, const std::string& prefix, std::vector<std::pair<std::string, std::string>>* rows) {
  if (rows->size() >= 2000) return;
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) Flatten(it.value(), prefix.empty() ? it.key() : prefix + "." + it.key(), rows);
  } else if (j.is_array()) {
    bool scalars = true;
    for (const auto& e : j) scalars = scalars && !e.is_structured();
    if (scalars) {
      std::string d = j.dump();
      if (d.size() > 300) d = d.substr(0, 300) + "...";
      rows->emplace_back(prefix, XmlEscape(d));
    } else {
      for (std::size_t i = 0; i < j.size(); ++i) Flatten(j[i], fmt::format("{}[{}]", prefix, i), rows);
    }
  } else {
    rows->emplace_back(prefix, Cell(j));
  }
}

std::string KeyValueTable(const std::vector<std::pair<std::string, std::string>>& rows) {
  std::string s = "<table><tbody>";
  for (const auto& [k, v] : rows) s += fmt::format("<tr><th>{}</th><td>{}</td></tr>", XmlEscape(k), v);
  return s + "</tbody></table>";
}

std::string B(double v) { return XmlEscape(FormatAxisValue(v, AxisFormat::kBytes)); }
std::string P(double v) { return fmt::format("{:.1f}%", 100 * v); }

bool EndsWith(std::string_view s, std::string_view end) { return s.size() >= end.size() && s.substr(s.size() - end.size()) == end; }

// "decode_step_s" -> "decode step s": a JSON key as words.
std::string Words(std::string key) {
  std::replace(key.begin(), key.end(), '_', ' ');
  return key;
}

// A value with the unit its key names: ..._s seconds, ..._per_s a rate, ..._bytes... bytes, ..._share a share.
std::string WithUnit(const std::string& key, const json& v) {
  if (!v.is_number()) return Cell(v);
  const double x = v.get<double>();
  if (key.find("bytes") != std::string::npos) return B(x) + (EndsWith(key, "_per_s") ? "/s" : "");
  if (EndsWith(key, "_per_s")) return fmt::format("{:.4g} /s", x);
  if (EndsWith(key, "_share")) return P(x);
  if (EndsWith(key, "_s")) return x < 1 ? fmt::format("{:.3g} ms", 1e3 * x) : fmt::format("{:.3g} s", x);
  return fmt::format("{:.4g}", x);
}

void PlanSections(const json& j, Report* r, std::string* body) {
  const json& m = Obj(j, "memory");
  r->title = fmt::format("Terrace plan: {} on {}", Str(j, "model"), Str(Obj(j, "hardware"), "name"));
  const json& w = Obj(j, "workload");
  CheckObject(j, "workload", "the workload", body);
  *body += fmt::format("<p>KV codec <b>{}</b>, state codec <b>{}</b>. Workload: {} requests/s, {} tokens of context, "
                       "{} decoded tokens per request, {} concurrent sequences, {} of the prompt a reused prefix.</p>",
                       XmlEscape(Str(j, "kv_codec")), XmlEscape(Str(j, "state_codec")), Cell(Field(w, "rate_rps")),
                       Cell(Field(w, "context_tokens")), Cell(Field(w, "decode_tokens")),
                       Cell(Field(w, "concurrency")), P(Num(w, "prefix_reuse")));
  *body += "<h2>Memory per token and per sequence</h2>";
  CheckObject(j, "memory", "the memory figures", body);
  *body += KeyValueTable({
      {"MLA latents per token", B(Num(m, "mla_bytes_per_token"))},
      {"KDA recurrent state per layer", B(Num(m, "kda_recurrent_bytes_per_layer"))},
      {"KDA conv state per layer", B(Num(m, "kda_conv_bytes_per_layer"))},
      {"KDA state per sequence (fixed)", B(Num(m, "kda_state_bytes_per_sequence"))},
      {"AttnRes bank per token (transient)", B(Num(m, "attnres_bank_bytes_per_token"))},
      {"MHA comparison per token", B(Num(m, "mha_bytes_per_token"))},
      {"GQA comparison per token", B(Num(m, "gqa_bytes_per_token"))},
      {"one workload sequence", B(Num(m, "sequence_bytes"))},
  });
  if (!Arr(m, "curve").empty()) {
    LineChart c;
    c.title = "Memory per sequence vs context";
    c.x_label = "context (tokens)";
    c.y_label = "bytes per sequence";
    c.log_x = c.log_y = true;
    c.x_format = AxisFormat::kTokens;
    c.y_format = AxisFormat::kBytes;
    const std::pair<const char*, const char*> lines[] = {{"total_bytes", "MLA + KDA (this model)"},
                                                        {"mla_bytes", "MLA latents only"},
                                                        {"gqa_bytes", "GQA comparison"},
                                                        {"mha_bytes", "MHA comparison"}};
    for (auto [key, name] : lines) {
      Series s;
      s.name = name;
      s.dashed = std::string_view(key) == "mla_bytes";
      for (const auto& p : Arr(m, "curve")) s.points.emplace_back(Num(p, "tokens"), Num(p, key));
      c.series.push_back(std::move(s));
    }
    r->charts.push_back({"memory-vs-context", RenderSvg(c)});
    *body += r->charts.back().svg;
  }
  if (j.contains("weights") && CheckObject(j, "weights", "the weights", body)) {
    const json& wts = Obj(j, "weights");
    *body += "<h2>Weights</h2>";
    std::vector<std::pair<std::string, std::string>> rows;
    const json& comps = Obj(wts, "by_component");
    for (auto it = comps.begin(); it != comps.end(); ++it) {
      rows.emplace_back(it.key(), B(it->is_number() ? it->get<double>() : 0));
    }
    rows.emplace_back("total", B(Num(wts, "total_bytes")));
    rows.emplace_back("resident (all but routed experts)", B(Num(wts, "resident_bytes")));
    rows.emplace_back("one routed expert", B(Num(wts, "expert_bytes")));
    *body += KeyValueTable(rows);
  }
  if (j.contains("experts") && CheckObject(j, "experts", "the expert cache", body)) {
    const json& e = Obj(j, "experts");
    *body += "<h2>Expert cache</h2>";
    *body += KeyValueTable({
        {fmt::format("HBM for a {} hit rate", P(Num(e, "hit_target"))), B(Num(e, "bytes_for_target"))},
        {"budget", B(Num(e, "budget_bytes"))},
        {"hit rate of the budget", P(Num(e, "hit_rate"))},
        {"stall per token, batch 1", fmt::format("{:.3g} ms", 1e3 * Num(e, "stall_s_per_token_batch1"))},
        {"stall per token, batched", fmt::format("{:.3g} ms", 1e3 * Num(e, "stall_s_per_token_batched"))},
    });
    BarChart st;
    st.title = "Expected stall per decoded token";
    st.subtitle = fmt::format("expert-cache misses loaded over the host link, budget {} ({} hit rate)",
                              B(Num(e, "budget_bytes")), P(Num(e, "hit_rate")));
    st.y_label = "milliseconds per token";
    st.bars = {"stall per token"};
    st.value_labels = true;
    st.groups = {"batch 1", "batched (--concurrency)"};
    st.values = {{1e3 * Num(e, "stall_s_per_token_batch1")}, {1e3 * Num(e, "stall_s_per_token_batched")}};
    r->charts.push_back({"stall-per-token", RenderSvg(st)});
    *body += r->charts.back().svg;
  }
  if (!Arr(j, "tiers").empty()) {
    *body += "<h2>Tiers</h2><table><thead><tr><th>tier</th><th>capacity</th><th>for KV/state</th><th>sequences</th>"
             "<th>also holds</th></tr></thead><tbody>";
    for (const auto& t : Arr(j, "tiers")) {
      *body += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{} {}</td></tr>", XmlEscape(Str(t, "name")),
                           B(Num(t, "capacity_bytes")), B(Num(t, "kv_bytes")), Cell(Field(t, "sequences")),
                           B(Num(t, "other_bytes")), XmlEscape(Str(t, "holds")));
    }
    *body += "</tbody></table>";
  }
  if (!Arr(j, "bandwidth").empty()) {
    *body += "<h2>Bandwidth</h2><table><thead><tr><th>link</th><th>required</th><th>available</th><th>use</th>"
             "<th>for</th></tr></thead><tbody>";
    for (const auto& b : Arr(j, "bandwidth")) {
      const double u = Num(b, "utilisation");
      *body += fmt::format("<tr><td>{}</td><td>{}/s</td><td>{}/s</td><td class=\"{}\">{}</td><td>{}</td></tr>",
                           XmlEscape(Str(b, "link")), B(Num(b, "required_bytes_per_s")),
                           B(Num(b, "available_bytes_per_s")), u > 1 ? "over" : "", P(u), XmlEscape(Str(b, "what")));
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
                       "ceiling <b>{}</b>; replayed in {:.2f} s.</p>",
                       XmlEscape(Str(t, "file")), Cell(Field(t, "requests")), Cell(Field(t, "blocks")),
                       Cell(Field(t, "unique_blocks")), Cell(Field(t, "block_tokens")),
                       P(Num(t, "prefix_hit_ceiling")), Num(t, "replay_seconds"));
  if (!Arr(t, "sweep").empty()) {
    LineChart c;
    c.title = "Prefix hit rate vs cache capacity";
    c.x_label = "capacity (one tier)";
    c.y_label = "hit rate";
    c.log_x = true;
    c.x_format = AxisFormat::kBytes;
    c.y_format = AxisFormat::kPercent;
    std::vector<std::string> order;
    for (const auto& p : Arr(t, "sweep")) {
      const std::string pol = Str(p, "policy");
      auto it = std::find(order.begin(), order.end(), pol);
      if (it == order.end()) {
        order.push_back(pol);
        c.series.push_back({pol, {}, false});
        it = std::prev(order.end());
      }
      c.series[static_cast<std::size_t>(it - order.begin())].points.emplace_back(Num(p, "capacity_bytes"),
                                                                                 Num(p, "hit_rate"));
    }
    double lo = 0, hi = 0;
    for (const auto& s : c.series)
      for (auto [x, y] : s.points) {
        lo = lo == 0 ? x : std::min(lo, x);
        hi = std::max(hi, x);
      }
    c.series.push_back({"ceiling (infinite cache)", {{lo, Num(t, "prefix_hit_ceiling")}, {hi, Num(t, "prefix_hit_ceiling")}}, true});
    r->charts.push_back({"hit-rate-vs-capacity", RenderSvg(c)});
    *body += r->charts.back().svg;
  }
  if (!Arr(t, "policies").empty()) {
    BarChart b;
    b.title = "Prefix hit rate per tier and policy";
    b.y_label = "share of prompt blocks";
    b.y_format = AxisFormat::kPercent;
    for (const auto& p : Arr(t, "policies")) {
      b.groups.push_back(Str(p, "policy"));
      std::vector<double> v;
      for (const auto& tier : Arr(p, "tiers")) {
        if (b.groups.size() == 1) b.bars.push_back(Str(tier, "name"));
        v.push_back(Num(tier, "hit_rate"));
      }
      b.values.push_back(v);
    }
    r->charts.push_back({"tier-hit-rates", RenderSvg(b)});
    *body += r->charts.back().svg;
    *body += "<table><thead><tr><th>policy</th><th>hit rate</th><th>TTFT saved per request</th>"
             "<th>queued restore wait per request</th>"
             "<th>slower than recompute</th><th>bytes moved</th></tr></thead><tbody>";
    for (const auto& p : Arr(t, "policies")) {
      *body += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                           XmlEscape(Str(p, "policy")), P(Num(p, "hit_rate")), MsCell(p, "ttft_saved_s_per_request"),
                           MsCell(p, "queue_wait_s_per_request"), Cell(Field(p, "restores_slower_than_recompute")),
                           B(Num(p, "bytes_moved")));
    }
    *body += "</tbody></table>";
  }
  if (!Arr(t, "cluster").empty()) {
    *body += "<h3>Cluster projection</h3><table><thead><tr><th>routing</th><th>hit rate</th><th>load imbalance</th>"
             "</tr></thead><tbody>";
    for (const auto& c : Arr(t, "cluster")) {
      *body += fmt::format("<tr><td>{}</td><td>{}</td><td>{:.2f}</td></tr>", XmlEscape(Str(c, "routing")),
                           P(Num(c, "hit_rate")), Num(c, "load_imbalance"));
    }
    *body += "</tbody></table>";
  }
}


// Adds a chart to the report and the page.
void Add(Report* r, std::string* body, std::string name, std::string svg) {
  r->charts.push_back({std::move(name), std::move(svg)});
  *body += r->charts.back().svg;
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

// One line per key of `rows` (x = `x_key`, or the row index + 1 when x_key is null).
LineChart Lines(const json& rows, const char* x_key, std::vector<std::pair<const char*, const char*>> keys) {
  LineChart c;
  for (auto [key, name] : keys) {
    Series s;
    s.name = name;
    for (std::size_t i = 0; i < rows.size(); ++i)
      s.points.emplace_back(x_key ? Num(rows[i], x_key) : static_cast<double>(i + 1), Num(rows[i], key));
    c.series.push_back(std::move(s));
  }
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

// All MoE layers' experts by load relative to their layer's mean: a histogram whose bins at or above
// hot_factor x mean (the hot experts) are red.
BarChart LoadHistogram(const json& layers, double hot_factor) {
  BarChart b;
  b.title = "Expert utilisation histogram, all MoE layers";
  b.subtitle = fmt::format("experts per bin of (tokens routed / layer mean); red: hot (> {:.3g} x mean)", hot_factor);
  b.x_label = "tokens routed / layer mean";
  b.y_label = "experts";
  b.bars = {"experts"};
  b.value_labels = true;
  const double width = hot_factor > 0 ? hot_factor / 8 : 0.25;  // hot_factor is a bin edge
  std::vector<double> counts;
  for (const auto& l : layers) {
    const std::vector<double> load = Numbers(Arr(l, "expert_load"));
    const double mean = Mean(load);
    if (mean <= 0) continue;
    for (double x : load) {
      if (!(x >= 0)) continue;  // a negative or NaN load has no bin
      const auto bin = static_cast<std::size_t>(std::min(x / mean / width, 1e6));
      if (counts.size() <= bin) counts.resize(bin + 1);
      counts[bin] += 1;
    }
  }
  for (std::size_t i = 0; i < counts.size(); ++i) {
    b.groups.push_back(fmt::format("{:.2g}", (static_cast<double>(i) + 0.5) * width));
    b.values.push_back({counts[i]});
    b.hot_groups.push_back(static_cast<double>(i) * width >= hot_factor * (1 - 1e-9));
  }
  return b;
}

// `terrace demo --json` / DIR/demo-run.json: {"turns": [...], "summary": {"experts": ...}}.
void DemoSections(const json& j, Report* r, std::string* body) {
  const json& turns = Arr(j, "turns");
  const json& s = Obj(j, "summary");
  const json& e = Obj(s, "experts");
  const json& moved = Obj(s, "bytes_moved");
  r->title = fmt::format("Terrace demo: {} turns on {}", turns.size(), Str(Obj(j, "model"), "preset"));
  const json& verified = Field(j, "verified");
  *body += fmt::format("<p>Every figure below was measured on the real model and the real stores; every turn was "
                       "checked against a full recompute with all experts resident and no store: <b>{}</b>.</p>",
                       !verified.is_boolean()  ? "not recorded (verified is missing or not true or false)"
                       : verified.get<bool>() ? "bitwise equal"
                                              : "NOT EQUAL");
  *body += KeyValueTable({
      {"throughput", fmt::format("{:.1f} tokens/s (decode {:.1f} tokens/s)", Num(s, "tokens_per_s"),
                                 Num(s, "decode_tokens_per_s"))},
      {"time to first token", fmt::format("{:.3f} s with restore, {:.3f} s by full recompute (mean of all turns)",
                                          Num(s, "ttft_mean_s"), Num(s, "ttft_recompute_mean_s"))},
      {"prefix restored", fmt::format("{} of prompt tokens", P(Num(s, "restored_share")))},
      {"expert fast-tier hit rate", P(Num(e, "hit_rate"))},
      {"expert prefetch", fmt::format("precision {}, recall {}", P(Num(e, "prefetch_precision")),
                                      P(Num(e, "prefetch_recall")))},
      {"stalls on expert loads", fmt::format("{} of forward time; {:.3g} ms per computed prompt token, {:.3g} ms per "
                                             "decode step",
                                             P(Num(e, "stall_share")), 1e3 * Num(e, "stall_s_per_prefill_token"),
                                             1e3 * Num(e, "stall_s_per_decode_token"))},
      {"bytes moved", fmt::format("prefix restored {}, written {}; experts on demand {}, prefetched {}",
                                  B(Num(moved, "prefix_restored")), B(Num(moved, "prefix_written")),
                                  B(Num(moved, "experts_on_demand")), B(Num(moved, "experts_prefetched")))},
  });
  LineChart t = Lines(turns, nullptr, {{"ttft_s", "with restore"}, {"ttft_recompute_s", "full recompute"}});
  t.title = "Time to first token per turn";
  t.subtitle = "with prefix restore and expert offload vs a full recompute with every expert resident";
  t.x_label = "turn (in run order)";
  t.y_label = "seconds";
  t.integer_x = t.markers = true;
  Add(r, body, "ttft-per-turn", RenderSvg(t));
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
    Add(r, body, "tier-hit-rates-over-time", RenderSvg(h));
  }
  LineChart h = TurnChart("Restored prefix per turn, by the tier it came from",
                          "share of the turn's prompt tokens, split by restored bytes per tier",
                          "share of the prompt's tokens", AxisFormat::kPercent);
  for (const char* tier : {"hbm", "host", "nvme"}) h.series.push_back({tier, {}, false});
  for (std::size_t i = 0; i < turns.size(); ++i) {
    const json& rb = Obj(turns[i], "restore_bytes");
    const double all = Num(rb, "hbm") + Num(rb, "host") + Num(rb, "nvme");
    const double share = Num(turns[i], "prompt_tokens") > 0 ? Num(turns[i], "restored_tokens") / Num(turns[i], "prompt_tokens") : 0;
    for (auto& ser : h.series)
      ser.points.emplace_back(static_cast<double>(i + 1), all > 0 ? share * Num(rb, ser.name.c_str()) / all : 0.0);
  }
  Add(r, body, "prefix-restore-by-tier", RenderSvg(h));
  if (!turns.empty() && turns[0].contains("experts")) {
    LineChart st = TurnChart("Stall on expert loads per token, per turn",
                             fmt::format("forward time waiting for experts; whole run: {} of forward time",
                                         P(Num(e, "stall_share"))),
                             "milliseconds per token");
    Series pre{"prompt token (prefill)", {}, false}, dec{"decode step", {}, false};
    for (std::size_t i = 0; i < turns.size(); ++i) {
      const json& x = Obj(turns[i], "experts");
      if (Num(turns[i], "computed_tokens") > 0) pre.points.emplace_back(static_cast<double>(i + 1), 1e3 * Num(x, "stall_s_per_prefill_token"));
      dec.points.emplace_back(static_cast<double>(i + 1), 1e3 * Num(x, "stall_s_per_decode_token"));
    }
    st.series = {std::move(pre), std::move(dec)};
    Add(r, body, "stall-per-token", RenderSvg(st));
  }
  const json& layers = Arr(e, "layers");
  if (layers.empty()) return;
  LineChart pr = Lines(layers, "layer", {{"prefetch_precision", "precision"}, {"prefetch_recall", "recall"},
                                         {"hit_rate", "fast-tier hit rate"}});
  pr.title = "Expert prefetch precision and recall per layer";
  pr.subtitle = "the lookahead predictor, over the whole run";
  pr.x_label = "MoE layer";
  pr.y_label = "rate";
  pr.y_format = AxisFormat::kPercent;
  pr.integer_x = pr.markers = true;
  Add(r, body, "prefetch-per-layer", RenderSvg(pr));
  const double hot_factor = Num(e, "hot_factor") > 0 ? Num(e, "hot_factor") : 2.0;
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
  // One bar per configuration of value(config); with `needs`, only the configurations where that
  // key is a number (a null one was not measured, so it gets no bar rather than a 0).
  auto bars = [&](const std::function<double(const json&)>& value, std::string y_label, std::string title,
                  AxisFormat f, std::string name, const char* needs = nullptr) {
    BarChart b;
    b.title = std::move(title);
    b.y_format = f;
    b.y_label = y_label;
    b.bars = {std::move(y_label)};
    b.value_labels = true;
    for (const auto& c : cfgs) {
      if (needs != nullptr && !(c.contains(needs) && c[needs].is_number())) continue;
      b.groups.push_back(ConfigLabel(c));
      b.values.push_back({value(c)});
    }
    Add(r, body, std::move(name), RenderSvg(b));
  };
  auto key = [](const char* k) { return [k](const json& c) { return Num(c, k); }; };
  bars(key("tokens_per_s"), "tokens/s", "Decode tokens/s per configuration", AxisFormat::kPlain, "tokens-per-s");
  bars(key("stall_share"), "share of decode time", "Stall share per configuration", AxisFormat::kPercent, "stall-share",
       "stall_share");
  // stall_share is stall time / decode time and tokens_per_s decode tokens / decode time.
  bars([](const json& c) { return Num(c, "tokens_per_s") > 0 ? 1e3 * Num(c, "stall_share") / Num(c, "tokens_per_s") : 0.0; },
       "ms per decoded token", "Stall per decoded token per configuration", AxisFormat::kPlain, "stall-per-token",
       "stall_share");
  // Null where the row has no such figure (resident; the mmap rows' recall and precision).
  bars(key("hit_rate"), "hit rate", "Fast-tier hit rate per configuration", AxisFormat::kPercent, "hit-rate", "hit_rate");
  bars(key("precision"), "precision", "Prefetch precision per configuration", AxisFormat::kPercent, "precision",
       "precision");
  bars(key("recall"), "recall", "Prefetch recall per configuration", AxisFormat::kPercent, "recall", "recall");
  LineChart lr;
  lr.title = "Prefetch recall per layer";
  lr.x_label = "MoE layer (in order)";
  lr.y_label = "recall";
  lr.y_format = AxisFormat::kPercent;
  lr.integer_x = lr.markers = true;
  for (const auto& c : cfgs) {
    const json& rec = Arr(c, "layer_recall");
    if (rec.empty()) continue;
    Series ser{ConfigLabel(c), {}, false};
    for (std::size_t i = 0; i < rec.size(); ++i) ser.points.emplace_back(static_cast<double>(i), rec[i].is_number() ? rec[i].get<double>() : 0);
    lr.series.push_back(std::move(ser));
  }
  if (!lr.series.empty()) Add(r, body, "recall-per-layer", RenderSvg(lr));
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
  for (const char* tier : kTiers) parts.push_back(fmt::format("{} {}", tier, B(Num(by_tier, tier))));
  return fmt::format("{}", fmt::join(parts, ", "));
}

// "hbm 0.0%, host 0.0%, nvme 100.0% of 10 blocks": the shares of a `hit_rate_by_tier` object.
std::string TierShareText(const json& j) {
  const json& h = Obj(j, "hit_rate_by_tier");
  std::vector<std::string> parts;
  for (const char* tier : kTiers) parts.push_back(fmt::format("{} {}", tier, P(Num(h, tier))));
  return fmt::format("{} of {} blocks", fmt::join(parts, ", "), Cell(Field(j, "blocks_requested")));
}

// Adds `b` (its titles and x label set) as stacked bars, one per row of `rows` (labelled by `label`):
// the share of the blocks the row's restore asked for that each tier served (`hit_rate_by_tier`)
// and, on top, the share found in no tier (a fallback; drawn only when some row has one). Rows
// without a `hit_rate_by_tier` object are left out and named in a note ("Not charted: <what> <labels>").
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
    if (h.empty()) {
      missing.push_back(label(row));
      continue;
    }
    std::vector<double> v;
    double found = 0;
    for (const char* tier : kTiers) {
      v.push_back(Num(h, tier));
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
    Skipped(body, fmt::format("{} {}", what, fmt::join(missing, ", ")), "hit_rate_by_tier is missing or not an object");
}

// Per codec of `bytes_per_token_by_codec` (largest first): the nominal and the as-stored bytes
// (`nominal_key`, `stored_key`), the codec the run used (`used`, its lossless stage stripped: the
// table has none) outlined. Entries that are not objects are left out.
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
  for (const auto& [name, entry] : codecs) {
    c.groups.push_back(name);
    c.values.push_back({Num(*entry, nominal_key), Num(*entry, stored_key)});
    c.marked_groups.push_back(name == base);
    found = found || name == base;
  }
  const std::string mark = !found        ? fmt::format("this run's codec {} is not in the table", used)
                           : base != used ? fmt::format("outlined: {}, the run's {} before its lossless stage", base, used)
                                          : fmt::format("outlined: {}, the codec this run used", used);
  c.subtitle = "as stored: with the block header, scales and 4 KiB alignment; " + mark;
  return c;
}

// "t2 c1": a multi-turn row's turn and conversation ("?" where the row lacks one).
std::string TurnLabel(const json& row) {
  auto part = [&](const char* key) { return row.contains(key) ? Str(row, key) : "?"; };
  return fmt::format("t{} c{}", part("turn"), part("conversation"));
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
                [](const json& row) { return FormatAxisValue(Num(row, "prefix_tokens"), AxisFormat::kTokens); },
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
  const double restored = Num(mt, "restored_tokens"), computed = Num(mt, "computed_tokens");
  *body += KeyValueTable({
      {"workload", fmt::format("{} conversations x {} turns, a {}-token system prompt, {} new tokens per turn",
                               Cell(Field(mt, "conversations")), Cell(Field(mt, "turns")),
                               Cell(Field(mt, "system_tokens")), Cell(Field(mt, "user_tokens")))},
      {"prompt tokens", fmt::format("{:.0f} restored, {:.0f} computed ({} restored)", restored, computed,
                                    P(restored + computed > 0 ? restored / (restored + computed) : 0))},
      {"time", fmt::format("TTFT summed over the turns {:.3g} s; the part, flushes included, {:.3g} s",
                           Num(mt, "ttft_restore_s_sum"), Num(mt, "seconds"))},
      {"blocks restored", TierShareText(mt)},
      {"bytes read", TierBytes(Obj(mt, "bytes_read_by_tier"))},
      {"bytes written", TierBytes(Obj(mt, "bytes_written_by_tier"))},
      {"write failures", Cell(Field(mt, "write_failures"))},
  });
  if (rows.empty()) return Skipped(body, "the multi-turn charts", "multi_turn.rows is missing or empty");
  // One group per turn, in the order played (tN cM: turn N of conversation M).
  auto per_turn = [&](std::string title, std::string subtitle, std::string y_label) {
    BarChart b;
    b.title = std::move(title);
    b.subtitle = std::move(subtitle);
    b.x_label = "turn t of conversation c, in the order played";
    b.y_label = std::move(y_label);
    for (const auto& row : rows) b.groups.push_back(TurnLabel(row));
    return b;
  };
  BarChart tok = per_turn("Prompt tokens per turn: restored vs computed",
                          "restored from the cache (bottom) and computed (top); the stack is the prompt", "tokens");
  tok.stacked = true;
  tok.bars = {"restored", "computed"};
  for (const auto& row : rows) tok.values.push_back({Num(row, "restored_tokens"), Num(row, "computed_tokens")});
  Add(r, body, "multi-turn-tokens", RenderSvg(tok));
  BarChart ttft = per_turn("Time to first token per turn, with restore",
                           "restore + the rest of the prompt's forward pass; beside it, the time it waited on reads",
                           "milliseconds");
  ttft.bars = {"TTFT with restore", "waiting on reads"};
  ttft.value_labels = rows.size() * 2 <= 24;
  for (const auto& row : rows) ttft.values.push_back({1e3 * Num(row, "ttft_restore_s"), 1e3 * Num(row, "restore_wait_s")});
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
                       XmlEscape(Str(j, "state_codec")), Cell(Field(j, "chunk_tokens")));
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
  auto bars = [&](std::vector<std::pair<const char*, const char*>> keys, std::string title, AxisFormat f,
                  std::string name, std::string y_label = "") {
    BarChart b;
    b.title = std::move(title);
    b.y_format = f;
    b.y_label = y_label.empty() ? keys.front().second : std::move(y_label);
    for (auto [k, n] : keys) b.bars.push_back(n);
    b.value_labels = rows.size() * keys.size() <= 24;
    for (const auto& row : rows) {
      b.groups.push_back(Str(row, "codec"));
      std::vector<double> v;
      for (auto [k, n] : keys) v.push_back(Num(row, k));
      b.values.push_back(v);
    }
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
  bars({{"compression_ratio", "compression vs f32"}}, "Compression ratio per codec", AxisFormat::kPlain,
       "codec-compression");
}

// `terrace bench tiers --json`: one object with `tier`, `op`, `mb_per_s` and `passes_mb_per_s`.
void BenchTiersSections(const json& j, Report* r, std::string* body) {
  r->title = fmt::format("Terrace bench tiers: {} {} of {} blocks", Str(j, "tier"), Str(j, "op"),
                         B(Num(j, "block_size")));
  *body += fmt::format("<p>{} at queue depth {}, {} thread(s), batch {}; {}.</p>", B(Num(j, "total_bytes")),
                       Cell(Field(j, "queue_depth")), Cell(Field(j, "threads")),
                       Cell(Field(j, "batch")), XmlEscape(Str(j, "detail")));
  BarChart t;
  t.title = "Throughput per pass";
  t.subtitle = fmt::format("{} passes after {} warm-up; dashed: the reported figure{}", Arr(j, "passes_mb_per_s").size(),
                           Cell(Field(j, "warmup")), j.contains("memcpy_mb_per_s") ? ", dotted: memcpy" : "");
  t.x_label = "pass";
  t.y_label = "MB/s";
  t.bars = {"MB/s"};
  t.value_labels = Arr(j, "passes_mb_per_s").size() <= 24;
  const std::vector<double> passes = Numbers(Arr(j, "passes_mb_per_s"));
  for (std::size_t i = 0; i < passes.size(); ++i) {
    t.groups.push_back(std::to_string(i + 1));
    t.values.push_back({passes[i]});
  }
  if (j.contains("memcpy_mb_per_s")) t.ref_lines.push_back({"memcpy", Num(j, "memcpy_mb_per_s")});
  t.ref_lines.push_back({"reported", Num(j, "mb_per_s")});
  Add(r, body, "throughput-per-pass", RenderSvg(t));
  if (j.contains("p50_us")) {
    BarChart l;
    l.title = "Latency per operation";
    l.subtitle = Str(j, "latency");
    l.y_label = "microseconds";
    l.bars = {"latency"};
    l.value_labels = true;
    l.groups = {"p50", "p99"};
    l.values = {{Num(j, "p50_us")}, {Num(j, "p99_us")}};
    Add(r, body, "latency", RenderSvg(l));
  }
}

// `terrace bench store --json`: one object of `<path>_mb_per_s` figures (puts and gets by tier).
void BenchStoreSections(const json& j, Report* r, std::string* body) {
  r->title = fmt::format("Terrace bench store: {} blocks of {}", Cell(Field(j, "blocks")), B(Num(j, "block_size")));
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

Result<Report> RenderReport(std::string_view text, std::string_view source) {
  if (const int depth = JsonNestingDepth(text); depth > kMaxJsonDepth) {  // Flatten recurses per level
    return Status::InvalidArgument(fmt::format("{}: objects and arrays nest {} levels deep, over the limit of {} (give "
                                               "the output of a --json run)",
                                               source, depth, kMaxJsonDepth));
  }
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::InvalidArgument(fmt::format("{}: not a JSON object (give the output of a --json run)", source));
  }
  Report r;
  std::string body;
  if (Str(j, "kind") == "plan") {
    PlanSections(j, &r, &body);
  } else if (j.contains("turns") && j.contains("summary") && j["summary"].is_object()) {
    DemoSections(j, &r, &body);
  } else if (!Arr(j, "configs").empty()) {
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
  std::vector<std::pair<std::string, std::string>> rows;
  Flatten(j, "", &rows);
  body += "<details><summary>All values</summary>" + KeyValueTable(rows) + "</details>";
  r.html = fmt::format(
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">{3}<title>{0}</title><style>"
      "body{{font-family:sans-serif;max-width:980px;margin:2em auto;color:#222}}"
      "table{{border-collapse:collapse;margin:0.5em 0 1.5em}}td,th{{border:1px solid #ccc;padding:3px 8px;"
      "text-align:left}}th{{background:#f3f3f3}}td.over{{color:#b00;font-weight:bold}}p.skipped{{color:#b00}}svg{{display:block;margin:1em 0}}"
      "</style></head><body><h1>{0}</h1><p>Source: {1}</p>\n{2}\n</body></html>\n",
      XmlEscape(r.title), XmlEscape(source), body, kHtmlGeneratorMeta);
  return r;
}

}  // namespace terrace::plan
