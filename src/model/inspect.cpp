#include "src/model/inspect.h"

#include <cmath>
#include <cstring>
#include <map>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/common/json_text.h"
#include "src/common/param_count.h"
#include "src/model/safetensors.h"

namespace terrace::model {
namespace {

void Total(InspectReport* r, const std::vector<TensorSpec>& specs, const std::vector<std::uint64_t>& bytes,
           const std::vector<bool>& present) {
  std::array<ComponentTotal, kNumComponents> per{};
  for (std::size_t i = 0; i < specs.size(); ++i) {
    if (!present[i]) continue;
    auto& t = per[static_cast<std::size_t>(specs[i].component)];
    t.tensors += 1;
    t.bytes += bytes[i];
    t.params += static_cast<std::uint64_t>(specs[i].params());
  }
  r->all = ComponentTotal{"total", 0, 0, 0};
  for (int c = 0; c < kNumComponents; ++c) {
    auto& t = per[static_cast<std::size_t>(c)];
    if (t.tensors == 0) continue;
    t.component = std::string(ComponentName(static_cast<Component>(c)));
    r->all.tensors += t.tensors;
    r->all.bytes += t.bytes;
    r->all.params += t.params;
    r->totals.push_back(t);
  }
}

std::string HumanBytes(std::uint64_t b) {
  if (b >= (1ull << 30)) return fmt::format("{:.2f} GiB", static_cast<double>(b) / (1ull << 30));
  if (b >= (1ull << 20)) return fmt::format("{:.2f} MiB", static_cast<double>(b) / (1ull << 20));
  if (b >= (1ull << 10)) return fmt::format("{:.2f} KiB", static_cast<double>(b) / (1ull << 10));
  return fmt::format("{} B", b);
}

// Counts the NaN / infinite values of a float tensor (or an MXFP4 scale tensor's NaN code 255).
std::string NonFiniteProblem(const std::string& name, const TensorView& v) {
  std::int64_t bad = 0, first = -1;
  const std::int64_t n = v.numel();
  const std::byte* p = v.data.data();
  for (std::int64_t i = 0; i < n; ++i) {
    bool finite = true;
    if (v.dtype == DType::kF32) {
      float x;
      std::memcpy(&x, p + 4 * i, 4);
      finite = std::isfinite(x);
    } else if (v.dtype == DType::kBF16 || v.dtype == DType::kF16) {
      std::uint16_t bits;
      std::memcpy(&bits, p + 2 * i, 2);
      finite = v.dtype == DType::kBF16 ? (bits & 0x7F80u) != 0x7F80u : (bits & 0x7C00u) != 0x7C00u;
    } else if (v.dtype == DType::kU8 && name.ends_with(".weight_scale")) {
      finite = static_cast<std::uint8_t>(p[i]) != 0xFF;  // E8M0 NaN
    } else {
      return "";
    }
    if (!finite) {
      if (bad++ == 0) first = i;
    }
  }
  if (bad == 0) return "";
  return fmt::format("tensor '{}' holds {} NaN or infinite value(s) (first at element {}); the model would compute "
                     "garbage",
                     name, bad, first);
}

}  // namespace

InspectReport InspectConfig(const ModelConfig& config, std::string source) {
  InspectReport r;
  r.config = config;
  r.source = std::move(source);
  const std::vector<TensorSpec> specs = ExpectedTensors(config);
  std::vector<std::uint64_t> bytes;
  bytes.reserve(specs.size());
  for (const auto& s : specs) {
    bytes.push_back(s.bytes());
    r.tensors.push_back(InspectedTensor{s.name, std::string(DTypeName(s.dtype)), s.shape, bytes.back(),
                                        std::string(ComponentName(s.component))});
  }
  Total(&r, specs, bytes, std::vector<bool>(specs.size(), true));
  return r;
}

Result<InspectReport> InspectModelDir(const std::filesystem::path& dir) {
  TERRACE_ASSIGN_OR_RETURN(auto md, ModelDir::Open(dir, /*check_tensors=*/false));
  InspectReport r;
  r.config = md->config();
  r.source = dir.string();
  r.shards = md->num_shards();
  const std::vector<TensorSpec> specs = ExpectedTensors(r.config, DetectExpertFormat(*md, r.config));
  std::vector<std::uint64_t> bytes(specs.size(), 0);
  std::vector<bool> present(specs.size(), false);
  std::set<std::string, std::less<>> expected;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& s = specs[i];
    expected.insert(s.name);
    auto view = md->Get(s.name);
    if (!view.ok()) continue;
    present[i] = true;
    bytes[i] = view->data.size();
    r.tensors.push_back(InspectedTensor{s.name, std::string(DTypeName(view->dtype)), view->shape, bytes[i],
                                        std::string(ComponentName(s.component))});
  }
  r.problems = FindWeightProblems(*md, r.config);
  r.config_keys = md->config_keys();
  r.unprefixed_names = md->unprefixed_names();
  for (const std::string& name : md->Names()) {
    auto view = md->Get(name);
    if (!view.ok()) continue;
    std::string p = NonFiniteProblem(name, *view);
    if (!p.empty()) r.problems.push_back(std::move(p));
  }
  for (const std::string& name : md->Names()) {
    if (expected.count(name)) continue;
    auto view = md->Get(name);
    r.tensors.push_back(InspectedTensor{name, std::string(DTypeName(view->dtype)), view->shape,
                                        view->data.size(), "unexpected"});  // FindWeightProblems says why
  }
  Total(&r, specs, bytes, present);
  return r;
}

std::string FormatInspectText(const InspectReport& r, bool list_tensors) {
  std::string out = fmt::format("model: {} ({}; {} layers, hidden {}, {} experts top-{}{})\n", r.source,
                                r.config.model_type, r.config.num_hidden_layers, r.config.hidden_size,
                                r.config.num_experts, r.config.num_experts_per_token,
                                r.shards ? fmt::format(", {} shard(s)", r.shards) : "");
  if (list_tensors) {
    for (const auto& t : r.tensors) {
      out += fmt::format("  {:<72} {:<5} {:<16} {:>10}  {}\n", t.name, t.dtype, ShapeString(t.shape), t.bytes,
                         t.component);
    }
  }
  out += fmt::format("{:<16} {:>9} {:>12} {:>14} {:>7}\n", "component", "tensors", "params", "bytes", "share");
  auto line = [&](const ComponentTotal& t) {
    const double share = r.all.bytes ? 100.0 * static_cast<double>(t.bytes) / static_cast<double>(r.all.bytes) : 0;
    out += fmt::format("{:<16} {:>9} {:>12} {:>14} {:>6.1f}%\n", t.component, t.tensors, ParamCount(static_cast<double>(t.params)),
                       HumanBytes(t.bytes), share);
  };
  for (const auto& t : r.totals) line(t);
  line(r.all);
  if (r.shards > 0) {
    if (r.unprefixed_names) out += "tensor names: without the 'language_model.' prefix (transformers' layout)\n";
    out += fmt::format("config keys read ({}): {}\n", r.config_keys.read.size(), fmt::join(r.config_keys.read, ", "));
    out += fmt::format("config keys ignored, no effect on the computation ({}): {}\n", r.config_keys.ignored.size(),
                       fmt::join(r.config_keys.ignored, ", "));
  }
  if (r.shards == 0) {
    // A preset: nothing on disk to check.
  } else if (r.problems.empty()) {
    out += "no problems: every expected tensor is present with its shape and dtype, and every value is finite\n";
  } else {
    out += fmt::format("{} problem(s):\n", r.problems.size());
    for (const auto& p : r.problems) out += "  " + p + "\n";
  }
  return out;
}

std::string FormatInspectJson(const InspectReport& r, bool list_tensors) {
  nlohmann::json j;
  j["source"] = r.source;
  j["shards"] = r.shards;
  j["config"] = nlohmann::json::parse(ToConfigJson(r.config));
  if (list_tensors) {
    j["tensors"] = nlohmann::json::array();
    for (const auto& t : r.tensors) {
      j["tensors"].push_back({{"name", t.name}, {"dtype", t.dtype}, {"shape", t.shape}, {"bytes", t.bytes},
                              {"component", t.component}});
    }
  }
  auto tot = [](const ComponentTotal& t) {
    return nlohmann::json{{"tensors", t.tensors}, {"bytes", t.bytes}, {"params", t.params}};
  };
  j["components"] = nlohmann::json::object();
  for (const auto& t : r.totals) j["components"][t.component] = tot(t);
  j["total"] = tot(r.all);
  j["problems"] = r.problems;
  if (r.shards > 0) {
    j["config_keys"] = {{"read", r.config_keys.read}, {"ignored", r.config_keys.ignored}};
    j["unprefixed_names"] = r.unprefixed_names;
  }
  return JsonText(j, 2) + "\n";
}

}  // namespace terrace::model
