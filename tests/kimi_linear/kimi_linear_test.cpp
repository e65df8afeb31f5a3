// Terrace runs a checkpoint written by transformers' KimiLinearForCausalLM.save_pretrained and must
// reproduce transformers' own fp32 logits (tests/kimi_linear/make_fixture.py wrote both). Also: the
// same weights under the other names and dtypes real checkpoints use load to the same result, and
// the config keys that change the math are honoured or refused.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/model/inspect.h"
#include "src/model/names.h"
#include "src/model/safetensors.h"
#include "src/model/session.h"
#include "test_util.h"

#define REQUIRE_OK(r)                   \
  do {                                  \
    INFO((r).status().ToString());      \
    REQUIRE((r).ok());                  \
  } while (0)

namespace terrace::model {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

fs::path FixtureDir() {
  const char* src = std::getenv("TERRACE_SOURCE_DIR");
  return fs::path(src ? src : ".") / "tests" / "kimi_linear";
}

struct Expected {
  std::vector<int> ids;
  Tensor logits;  // [T, vocab]
};

Expected LoadExpected(const std::string& suffix = "") {
  auto f = SafetensorsFile::Open(FixtureDir() / ("expected" + suffix + ".safetensors"));
  REQUIRE_OK(f);
  auto ids = (*f)->Get("input_ids");
  REQUIRE_OK(ids);
  REQUIRE(ids->dtype == DType::kI32);
  Expected e;
  e.ids.resize(static_cast<std::size_t>(ids->numel()));
  std::memcpy(e.ids.data(), ids->data.data(), ids->data.size());
  auto logits = (*f)->Get("logits");
  REQUIRE_OK(logits);
  auto t = ToFloat(*logits, "logits");
  REQUIRE_OK(t);
  e.logits = std::move(*t);
  return e;
}

// Largest |a - b| over the largest |b| (over all logits), and the same per prompt position (the worst
// row: each row's largest difference over that row's largest logit).
struct Err {
  double rel_to_max = 0, worst_row = 0;
};
Err Compare(const std::vector<float>& a, const std::vector<float>& b, std::size_t row = 0) {
  REQUIRE(a.size() == b.size());
  if (row == 0) row = b.size();
  double num = 0, den = 0, worst = 0;
  for (std::size_t r0 = 0; r0 < b.size(); r0 += row) {
    double rn = 0, rd = 0;
    for (std::size_t i = r0; i < std::min(b.size(), r0 + row); ++i) {
      const double d = std::abs(static_cast<double>(a[i]) - b[i]);
      if (!std::isfinite(d)) return {1e30, 1e30};
      rn = std::max(rn, d);
      rd = std::max(rd, std::abs(static_cast<double>(b[i])));
    }
    num = std::max(num, rn);
    den = std::max(den, rd);
    worst = std::max(worst, rn / std::max(rd, 1e-30));
  }
  return {num / std::max(den, 1e-30), worst};
}

Result<Tensor> RunPrefill(const fs::path& dir, const std::vector<int>& ids) {
  TERRACE_ASSIGN_OR_RETURN(auto md, ModelDir::Open(dir));
  TERRACE_ASSIGN_OR_RETURN(auto model, Model::Load(md->config(), *md));
  Session s(*model);
  return s.Prefill(ids);
}

std::string ReadText(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A copy of the fixture: every tensor re-written through `edit` (which may rename it, change its
// dtype by returning a converted view, or drop it), config.json through `edit_config`.
void WriteVariant(const fs::path& out, const std::function<void(std::string&, TensorView&, std::vector<std::byte>&)>& edit,
                  const std::function<void(Json&)>& edit_config = {}) {
  auto f = SafetensorsFile::Open(FixtureDir() / "checkpoint" / "model.safetensors");
  REQUIRE_OK(f);
  SafetensorsWriter w;
  for (const std::string& name : (*f)->Names()) {
    auto v = (*f)->Get(name);
    REQUIRE_OK(v);
    std::string n = name;
    TensorView view = *v;
    std::vector<std::byte> storage;
    edit(n, view, storage);
    if (n.empty()) continue;
    REQUIRE(w.Add(n, view.dtype, view.shape, view.data).ok());
  }
  fs::create_directories(out);
  REQUIRE(w.Write(out / "model.safetensors").ok());
  Json cfg = Json::parse(ReadText(FixtureDir() / "checkpoint" / "config.json"));
  if (edit_config) edit_config(cfg);
  std::ofstream(out / "config.json") << cfg.dump(2);
}

// Converts an F32 view to BF16 or F16 bytes held in `storage`.
void Convert(TensorView& v, std::vector<std::byte>& storage, DType to) {
  REQUIRE(v.dtype == DType::kF32);
  auto t = ToFloat(v, "x");
  REQUIRE_OK(t);
  storage.resize(t->data.size() * 2);
  for (std::size_t i = 0; i < t->data.size(); ++i) {
    const std::uint16_t bits = to == DType::kBF16 ? FloatToBf16(t->data[i]) : FloatToF16(t->data[i]);
    std::memcpy(&storage[2 * i], &bits, 2);
  }
  v.dtype = to;
  v.data = storage;
}

// Rounds an F32 view through BF16 / F16 and back, in F32 (the oracle for Convert).
void Round(TensorView& v, std::vector<std::byte>& storage, DType through) {
  auto t = ToFloat(v, "x");
  REQUIRE_OK(t);
  storage.resize(t->data.size() * 4);
  for (std::size_t i = 0; i < t->data.size(); ++i) {
    const float r = through == DType::kBF16 ? Bf16ToFloat(FloatToBf16(t->data[i])) : F16ToFloat(FloatToF16(t->data[i]));
    std::memcpy(&storage[4 * i], &r, 4);
  }
  v.data = storage;
}

bool IsRoutedExpert(const std::string& name) { return name.find(".experts.") != std::string::npos; }

}  // namespace

TEST_CASE("a transformers KimiLinear checkpoint computes transformers' logits", "[kimi_linear]") {
  // "": plain q_proj (as Kimi Linear 48B); "_qlora": q_a_proj + q_a_layernorm + q_b_proj (as K3).
  const std::string suffix = GENERATE(as<std::string>{}, "", "_qlora");
  INFO("fixture checkpoint" << suffix);
  const Expected e = LoadExpected(suffix);
  auto md = ModelDir::Open(FixtureDir() / ("checkpoint" + suffix));
  REQUIRE_OK(md);
  const ModelConfig& c = (*md)->config();
  CHECK(c.model_type == "kimi_linear");
  CHECK(c.hidden_act == Activation::kSilu);
  CHECK(!c.kda.use_full_rank_gate);
  CHECK(c.IsMlaLayer(1));
  CHECK(c.IsDenseLayer(0));
  CHECK((*md)->unprefixed_names());
  auto model = Model::Load(c, **md);
  REQUIRE_OK(model);

  Session prefill(**model);
  auto logits = prefill.Prefill(e.ids);
  REQUIRE_OK(logits);
  const auto V = static_cast<std::size_t>(e.logits.dim(1));
  const Err p = Compare(logits->data, e.logits.data, V);

  // Token by token: recurrent KDA and absorbed MLA against the same logits.
  Session decode(**model);
  std::vector<float> stepped;
  for (int id : e.ids) {
    auto row = decode.Decode(id);
    REQUIRE_OK(row);
    stepped.insert(stepped.end(), row->begin(), row->end());
  }
  const Err d = Compare(stepped, e.logits.data, V);
  CHECK(c.q_lora_rank.has_value() == (suffix == "_qlora"));
  std::printf("kimi_linear fixture checkpoint%s vs transformers (%zu tokens x %zu vocab, fp32): prefill "
              "max|diff|/max|ref| = %.3g (worst position %.3g); decode %.3g (worst position %.3g)\n",
              suffix.c_str(), e.ids.size(), V, p.rel_to_max, p.worst_row, d.rel_to_max, d.worst_row);
  CHECK(p.rel_to_max < 1e-5);
  CHECK(d.rel_to_max < 1e-5);
  CHECK(p.worst_row < 1e-5);
  CHECK(d.worst_row < 1e-5);
  // The greedy choice agrees at every position.
  for (std::size_t t = 0; t < e.ids.size(); ++t) {
    const auto row = [&](const std::vector<float>& v) { return std::span<const float>(v).subspan(t * V, V); };
    CHECK(Argmax(row(logits->data)) == Argmax(row(e.logits.data)));
  }
}

TEST_CASE("the same weights load from other layouts and dtypes with the same result", "[kimi_linear]") {
  const Expected e = LoadExpected();
  auto base = RunPrefill(FixtureDir() / "checkpoint", e.ids);
  REQUIRE_OK(base);
  terrace::testing::TempDir tmp("kimi-variants");

  SECTION("with the language_model. prefix, dense MLP under mlp.") {
    WriteVariant(tmp.path() / "prefixed", [](std::string& n, TensorView&, std::vector<std::byte>&) {
      if (n.find("layers.0.block_sparse_moe.") != std::string::npos) n.replace(n.find(".block_sparse_moe."), 18, ".mlp.");
      n = "language_model." + n;
    });
    auto got = RunPrefill(tmp.path() / "prefixed", e.ids);
    REQUIRE_OK(got);
    CHECK(got->data == base->data);
  }
  for (DType dt : {DType::kBF16, DType::kF16}) {
    SECTION(fmt::format("routed experts in {}", DTypeName(dt))) {
      // The oracle: the same model in F32 with the experts' values rounded through dt.
      WriteVariant(tmp.path() / "low", [dt](std::string& n, TensorView& v, std::vector<std::byte>& s) {
        if (IsRoutedExpert(n)) Convert(v, s, dt);
      });
      WriteVariant(tmp.path() / "rounded", [dt](std::string& n, TensorView& v, std::vector<std::byte>& s) {
        if (IsRoutedExpert(n)) Round(v, s, dt);
      });
      auto low = RunPrefill(tmp.path() / "low", e.ids);
      REQUIRE_OK(low);
      auto rounded = RunPrefill(tmp.path() / "rounded", e.ids);
      REQUIRE_OK(rounded);
      CHECK(low->data == rounded->data);
      CHECK(low->data != base->data);  // the rounding is visible: the experts were really used
    }
  }
}

TEST_CASE("config keys that change the math are honoured or refused", "[kimi_linear][config]") {
  const Expected e = LoadExpected();
  terrace::testing::TempDir tmp("kimi-config");
  const auto keep = [](std::string&, TensorView&, std::vector<std::byte>&) {};
  auto base = RunPrefill(FixtureDir() / "checkpoint", e.ids);
  REQUIRE_OK(base);

  SECTION("hidden_act situ computes something else; an unknown activation is refused") {
    WriteVariant(tmp.path() / "situ", keep, [](Json& j) {
      j["hidden_act"] = "situ";
      j["activation_situ_beta"] = 4.0;  // a kimi_linear file must state both (no default is safe to guess)
      j["activation_situ_linear_beta"] = 25.0;
    });
    auto situ = RunPrefill(tmp.path() / "situ", e.ids);
    REQUIRE_OK(situ);
    CHECK(Compare(situ->data, e.logits.data).rel_to_max > 1e-2);
    WriteVariant(tmp.path() / "gelu", keep, [](Json& j) { j["hidden_act"] = "gelu"; });
    auto gelu = ModelDir::Open(tmp.path() / "gelu");
    REQUIRE(!gelu.ok());
    CHECK(gelu.status().message().find("hidden_act") != std::string::npos);
    CHECK(gelu.status().message().find("gelu") != std::string::npos);
    CHECK(gelu.status().message().find((tmp.path() / "gelu" / "config.json").string()) != std::string::npos);
  }
  SECTION("moe_renormalize false and routed_scaling_factor change the logits") {
    WriteVariant(tmp.path() / "norenorm", keep, [](Json& j) { j["moe_renormalize"] = false; });
    auto r = RunPrefill(tmp.path() / "norenorm", e.ids);
    REQUIRE_OK(r);
    CHECK(Compare(r->data, base->data).rel_to_max > 1e-3);
  }
  SECTION("an explicit full-rank gate needs g_proj; the low-rank gate it leaves unused is named") {
    WriteVariant(tmp.path() / "fullrank", keep, [](Json& j) { j["linear_attn_config"]["use_full_rank_gate"] = true; });
    auto md = ModelDir::Open(tmp.path() / "fullrank");
    REQUIRE(!md.ok());
    CHECK(md.status().message().find("g_a_proj.weight") != std::string::npos);
    CHECK(md.status().message().find("linear_attn_config.use_full_rank_gate = true leaves it unused") !=
          std::string::npos);
  }
  SECTION("settings Terrace does not implement are refused, naming the key") {
    const std::vector<std::pair<std::string, Json>> bad = {
        {"moe_router_activation_func", "softmax"}, {"num_expert_group", 2},  {"moe_layer_freq", 2},
        {"num_key_value_heads", 1},                {"attention_bias", true}, {"some_new_switch", 1},
        {"mlp_layer_types", Json::array({"sparse", "dense", "sparse", "sparse"})},
    };
    for (const auto& [key, value] : bad) {
      INFO(key);
      WriteVariant(tmp.path() / key, keep, [&, k = key, v = value](Json& j) { j[k] = v; });
      auto md = ModelDir::Open(tmp.path() / key);
      REQUIRE(!md.ok());
      CHECK(md.status().IsInvalidArgument());
      CHECK(md.status().message().find(key) != std::string::npos);
    }
  }
  SECTION("tie_word_embeddings uses embed_tokens as the head") {
    WriteVariant(
        tmp.path() / "tied",
        [](std::string& n, TensorView&, std::vector<std::byte>&) {
          if (n == "lm_head.weight") n.clear();
        },
        [](Json& j) { j["tie_word_embeddings"] = true; });
    auto tied = RunPrefill(tmp.path() / "tied", e.ids);
    REQUIRE_OK(tied);
    CHECK(Compare(tied->data, base->data).rel_to_max > 1e-3);
    // Untied without lm_head: refused, naming the tensor.
    WriteVariant(tmp.path() / "nohead", [](std::string& n, TensorView&, std::vector<std::byte>&) {
      if (n == "lm_head.weight") n.clear();
    });
    auto md = ModelDir::Open(tmp.path() / "nohead");
    REQUIRE(!md.ok());
    CHECK(md.status().message().find("lm_head.weight") != std::string::npos);
  }
}

TEST_CASE("inspect lists the config keys read and ignored", "[kimi_linear][inspect]") {
  auto r = InspectModelDir(FixtureDir() / "checkpoint");
  REQUIRE_OK(r);
  CHECK(r->problems.empty());
  auto has = [](const std::vector<std::string>& v, const std::string& k) {
    return std::find(v.begin(), v.end(), k) != v.end();
  };
  CHECK(has(r->config_keys.read, "hidden_act"));
  CHECK(has(r->config_keys.read, "linear_attn_config.num_heads"));
  CHECK(has(r->config_keys.read, "layer_types"));
  CHECK(has(r->config_keys.ignored, "architectures"));
  CHECK(has(r->config_keys.ignored, "dtype"));
  CHECK(!has(r->config_keys.ignored, "hidden_act"));
  const std::string text = FormatInspectText(*r, false);
  CHECK(text.find("config keys read") != std::string::npos);
  CHECK(text.find("ignored") != std::string::npos);
  const Json j = Json::parse(FormatInspectJson(*r, false));
  CHECK(j["config_keys"]["read"].size() == r->config_keys.read.size());
  CHECK(j["config_keys"]["ignored"].size() == r->config_keys.ignored.size());
}

}  // namespace terrace::model

namespace terrace::model {

TEST_CASE("a broken checkpoint never runs successfully", "[kimi_linear][broken]") {
  const Expected e = LoadExpected();
  terrace::testing::TempDir tmp("kimi-broken");
  const auto keep = [](std::string&, TensorView&, std::vector<std::byte>&) {};

  SECTION("a NaN or an infinity in a weight: inspect reports it, loading refuses it") {
    for (const char* kind : {"nan", "inf", "bf16-nan"}) {
      INFO(kind);
      const std::string victim = "model.layers.2.self_attn.k_proj.weight";
      const fs::path dir = tmp.path() / kind;
      WriteVariant(dir, [&](std::string& n, TensorView& v, std::vector<std::byte>& s) {
        if (n != victim) return;
        auto t = ToFloat(v, n);
        REQUIRE(t.ok());
        t->data[5] = std::string(kind) == "inf" ? INFINITY : NAN;
        s.assign(reinterpret_cast<const std::byte*>(t->data.data()),
                 reinterpret_cast<const std::byte*>(t->data.data() + t->data.size()));
        v.data = s;
        if (std::string(kind) == "bf16-nan") {
          std::vector<std::byte> copy = s;
          TensorView f32 = v;
          f32.data = copy;
          Convert(f32, s, DType::kBF16);
          v = f32;
        }
      });
      auto r = InspectModelDir(dir);
      REQUIRE_OK(r);
      REQUIRE(r->problems.size() == 1);
      CHECK(r->problems[0].find("language_model." + victim) != std::string::npos);
      CHECK(r->problems[0].find("NaN or infinite") != std::string::npos);
      CHECK(FormatInspectText(*r, false).find("no problems") == std::string::npos);
      auto md = ModelDir::Open(dir);
      REQUIRE_OK(md);
      auto model = Model::Load((*md)->config(), **md);
      REQUIRE(!model.ok());
      CHECK(model.status().IsCorruption());
      CHECK(model.status().message().find("language_model." + victim) != std::string::npos);
    }
  }
  SECTION("finite weights whose logits overflow: the forward pass fails instead of returning them") {
    WriteVariant(tmp.path() / "huge", [](std::string& n, TensorView& v, std::vector<std::byte>& s) {
      if (n != "lm_head.weight") return;
      std::vector<float> big(static_cast<std::size_t>(v.numel()), 3e38f);
      s.assign(reinterpret_cast<const std::byte*>(big.data()), reinterpret_cast<const std::byte*>(big.data() + big.size()));
      v.data = s;
    });
    auto md = ModelDir::Open(tmp.path() / "huge");
    REQUIRE_OK(md);
    auto model = Model::Load((*md)->config(), **md);
    REQUIRE_OK(model);
    Session s(**model);
    auto logits = s.Prefill(e.ids);
    REQUIRE(!logits.ok());
    CHECK(logits.status().IsCorruption());
    CHECK(logits.status().message().find("not finite") != std::string::npos);
    Session d(**model);
    CHECK(!d.Decode(e.ids[0]).ok());
  }
  SECTION("absurd config values are refused with their range, before anything is allocated") {
    const std::vector<std::tuple<std::string, Json, std::string>> bad = {
        {"rms_norm_eps", 1e300, "(0, 0.1]"},
        {"rms_norm_eps", 0.0, "(0, 0.1]"},
        {"num_experts", 100000000, "[1, 65536]"},
        {"hidden_size", 1 << 30, "[1, 65536]"},
        {"routed_scaling_factor", -1.0, "(0, 1000]"},
        {"num_experts_per_token", 5, "exceeds num_experts"},
    };
    for (const auto& [key, value, range] : bad) {
      INFO(key << " = " << value.dump());
      WriteVariant(tmp.path() / "absurd", keep, [&, k = key, v = value](Json& j) { j[k] = v; });
      auto md = ModelDir::Open(tmp.path() / "absurd");
      REQUIRE(!md.ok());
      CHECK(md.status().IsInvalidArgument());
      CHECK(md.status().message().find(key) != std::string::npos);
      CHECK(md.status().message().find(range) != std::string::npos);
    }
  }
  SECTION("config dimensions that disagree with the tensors are named") {
    const std::vector<std::tuple<std::string, Json, std::string>> bad = {
        {"num_experts", 64, "num_experts = 64, but tensor 'language_model.model.layers.1.block_sparse_moe.gate.weight'"},
        {"vocab_size", 100, "vocab_size = 100, but tensor 'language_model.model.embed_tokens.weight'"},
        {"moe_intermediate_size", 32, "moe_intermediate_size = 32"},
        {"kv_lora_rank", 8, "kv_lora_rank = 8"},
    };
    for (const auto& [key, value, what] : bad) {
      INFO(key);
      WriteVariant(tmp.path() / "mismatch", keep, [&, k = key, v = value](Json& j) { j[k] = v; });
      auto md = ModelDir::Open(tmp.path() / "mismatch");
      REQUIRE(!md.ok());
      CHECK(md.status().message().find(what) != std::string::npos);
    }
  }
}

}  // namespace terrace::model
