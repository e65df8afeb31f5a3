#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "src/model/config.h"
#include "model_io/mentions.h"

using namespace terrace::model;
using Json = nlohmann::json;

namespace {

// A complete K3-style config (the toy sizes), as a JSON object to edit per test.
Json ToyJson() { return Json::parse(ToConfigJson(*Preset("k3-toy"))); }

std::string ErrorOf(const Json& j) {
  auto r = ParseConfigJson(j.dump(), "my/config.json");
  if (r.ok()) return "";
  CHECK(r.status().IsInvalidArgument());
  CHECK(r.status().message().find("my/config.json") != std::string::npos);
  return r.status().message();
}

}  // namespace

TEST_CASE("config parses at top level and under text_config", "[config]") {
  const std::string text = R"({
    "model_type": "kimi_k3", "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 100,
    "rms_norm_eps": 1e-6, "architectures": ["KimiK3ForCausalLM"],
    "linear_attn_config": {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
      "use_full_rank_gate": true, "gate_lower_bound": -5.0, "full_attn_layers": [2, 4], "kda_layers": [1, 3]},
    "num_attention_heads": 2, "q_lora_rank": null, "kv_lora_rank": 32, "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": true, "mla_use_output_gate": true,
    "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 32,
    "routed_expert_hidden_size": 32, "latent_moe_use_norm": true, "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1, "intermediate_size": 128, "attn_res_block_size": 2,
    "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0})";
  auto top = ParseConfigJson(text);
  REQUIRE(top.ok());
  const ModelConfig& c = *top;
  CHECK(c.num_hidden_layers == 4);
  CHECK(c.rms_norm_eps == 1e-6f);
  CHECK(!c.q_lora_rank.has_value());
  CHECK(c.kda.gate_lower_bound == -5.0f);
  CHECK(c.IsMlaLayer(1));   // 1-based 2
  CHECK(c.IsMlaLayer(3));   // 1-based 4
  CHECK(c.IsKdaLayer(0));
  CHECK(c.IsDenseLayer(0));
  CHECK(!c.IsDenseLayer(1));
  CHECK(c.routed_scaling_factor == 2.5f);
  CHECK(c.shared_expert_intermediate_size == 32);  // 1 shared x 32
  CHECK(c.HasLatentProjection());

  Json nested = {{"model_type", "kimi_k3"}, {"vision_config", {{"depth", 3}}}, {"text_config", Json::parse(text)}};
  auto inner = ParseConfigJson(nested.dump());
  REQUIRE(inner.ok());
  CHECK(ToConfigJson(*inner) == ToConfigJson(c));
  nested["model_type"] = "deepseek_v3";  // a wrapper is read only as K3's
  auto other = ParseConfigJson(nested.dump(), "wrapped.json");
  REQUIRE(!other.ok());
  CHECK(other.status().message().find("wrapped.json: field 'model_type' is 'deepseek_v3'") != std::string::npos);
}

TEST_CASE("ToConfigJson round trips every preset", "[config]") {
  for (const auto& name : PresetNames()) {
    INFO(name);
    auto p = Preset(name);
    REQUIRE(p.ok());
    auto back = ParseConfigJson(ToConfigJson(*p));
    REQUIRE(back.ok());
    CHECK(ToConfigJson(*back) == ToConfigJson(*p));
    CHECK(back->q_lora_rank == p->q_lora_rank);
    CHECK(back->kda.gate_lower_bound == p->kda.gate_lower_bound);
    CHECK(back->rms_norm_eps == p->rms_norm_eps);
  }
}

TEST_CASE("missing required fields are named", "[config]") {
  for (const char* field : {"num_hidden_layers", "hidden_size", "vocab_size", "linear_attn_config", "kv_lora_rank",
                            "num_experts", "moe_intermediate_size", "intermediate_size"}) {
    Json j = ToyJson();
    j.erase(field);
    CHECK(Mentions(ErrorOf(j), std::string("'") + field + "'"));
  }
  Json j = ToyJson();
  j["linear_attn_config"].erase("num_heads");
  CHECK(Mentions(ErrorOf(j), "'linear_attn_config.num_heads'"));
  Json n = {{"text_config", ToyJson()}};
  n["text_config"].erase("hidden_size");
  CHECK(Mentions(ErrorOf(n), "'text_config.hidden_size'"));
}

TEST_CASE("a required field given as null is named as null, an integer past int64 as out of range", "[config]") {
  Json j = ToyJson();
  j["hidden_size"] = nullptr;
  CHECK(Mentions(ErrorOf(j), "required field 'hidden_size' is null"));
  j = Json::parse(R"({"x": 18446744073709551616})");  // past uint64: nlohmann reads it as a float
  Json big = ToyJson();
  big["hidden_size"] = j["x"];
  CHECK(Mentions(ErrorOf(big), "field 'hidden_size' must be an integer within +-2^30"));
  big["hidden_size"] = 1.5;
  CHECK(Mentions(ErrorOf(big), "field 'hidden_size' must be an integer"));
  CHECK_FALSE(Mentions(ErrorOf(big), "2^30"));
}

TEST_CASE("kda_layers defaults to the complement of full_attn_layers", "[config]") {
  Json j = ToyJson();
  j["linear_attn_config"].erase("kda_layers");
  auto c = ParseConfigJson(j.dump());
  REQUIRE(c.ok());
  CHECK(c->kda.kda_layers == std::vector<int>{1, 2, 3, 5, 6, 7});
}

TEST_CASE("full_attn_layers defaults to the complement of kda_layers", "[config]") {
  for (const char* type : {"kimi_k3", "kimi_linear"}) {  // kimi_linear also has a default pattern
    INFO(type);
    Json j = ToyJson();
    j["model_type"] = type;
    j["linear_attn_config"].erase("full_attn_layers");
    j["linear_attn_config"]["kda_layers"] = {1, 2, 4, 5, 6, 8};
    auto c = ParseConfigJson(j.dump());
    INFO(c.status().ToString());
    REQUIRE(c.ok());
    CHECK(c->kda.full_attn_layers == std::vector<int>{3, 7});
    CHECK(c->IsMlaLayer(2));
    CHECK_FALSE(c->IsMlaLayer(3));
  }
}

TEST_CASE("inconsistent fields are named", "[config]") {
  auto with = [](auto edit) {
    Json j = ToyJson();
    edit(j);
    return ErrorOf(j);
  };
  CHECK(Mentions(with([](Json& j) { j["linear_attn_config"]["full_attn_layers"] = {4, 9}; }), "outside"));
  CHECK(Mentions(with([](Json& j) { j["linear_attn_config"]["full_attn_layers"] = {0, 8}; }), "outside"));
  CHECK(Mentions(with([](Json& j) { j["linear_attn_config"]["full_attn_layers"] = {4, 8, 3}; }), "more than once"));
  CHECK(Mentions(with([](Json& j) { j["linear_attn_config"]["full_attn_layers"] = {4}; }), "miss layer 8"));
  CHECK(Mentions(with([](Json& j) { j["num_experts_per_token"] = 17; }), "num_experts_per_token"));
  CHECK(Mentions(with([](Json& j) { j["kv_lora_rank"] = 0; }), "kv_lora_rank"));
  CHECK(Mentions(with([](Json& j) { j["routed_expert_hidden_size"] = 100000; }), "routed_expert_hidden_size"));
  CHECK(Mentions(with([](Json& j) { j["moe_intermediate_size"] = 0; }), "moe_intermediate_size"));
  CHECK(Mentions(with([](Json& j) { j["hidden_size"] = -1; }), "hidden_size"));
  CHECK(Mentions(with([](Json& j) { j["hidden_size"] = "big"; }), "'hidden_size' must be an integer"));
  CHECK(Mentions(with([](Json& j) { j["first_k_dense_replace"] = 9; }), "first_k_dense_replace"));
  CHECK(Mentions(with([](Json& j) { j["linear_attn_config"]["gate_lower_bound"] = 1.0; }), "gate_lower_bound"));
  CHECK(Mentions(with([](Json& j) { j["attn_res_block_size"] = -2; }), "attn_res_block_size"));
  CHECK(Mentions(with([](Json& j) { j["mla_use_nope"] = false; }), "mla_use_nope"));
  CHECK(Mentions(ErrorOf(Json::array()), "JSON object"));
  CHECK(!ParseConfigJson("{not json").ok());
}

TEST_CASE("null q_lora_rank means a plain q_proj; absent switches are off", "[config]") {
  Json j = ToyJson();
  j["q_lora_rank"] = nullptr;
  j.erase("latent_moe_use_norm");
  j.erase("mla_use_output_gate");
  j.erase("attn_res_block_size");
  j.erase("routed_expert_hidden_size");
  j["linear_attn_config"]["gate_lower_bound"] = nullptr;
  auto c = ParseConfigJson(j.dump());
  REQUIRE(c.ok());
  CHECK(!c->q_lora_rank);
  CHECK(!c->latent_moe_use_norm);
  CHECK(!c->mla_use_output_gate);
  CHECK(c->attn_res_block_size == 0);
  CHECK(!c->HasLatentProjection());
  CHECK(!c->kda.gate_lower_bound);
}

TEST_CASE("presets validate and match the published configs", "[config][presets]") {
  for (const auto& name : PresetNames()) CHECK(Preset(name).ok());
  CHECK(Preset("k3-huge").status().message().find("k3-toy") != std::string::npos);

  auto toy = *Preset("k3-toy");
  CHECK(toy.vocab_size == 512);
  CHECK(toy.kda.full_attn_layers == std::vector<int>{4, 8});
  CHECK(toy.MlaCacheWidth() == 80);
  CHECK(toy.shared_expert_intermediate_size == 192);

  auto k3 = *Preset("kimi-k3");
  CHECK(k3.num_hidden_layers == 93);
  CHECK(k3.kda.full_attn_layers.size() == 24);
  CHECK(k3.kda.kda_layers.size() == 69);
  CHECK(k3.IsMlaLayer(92));
  CHECK(k3.IsMlaLayer(91));
  CHECK(!k3.IsMlaLayer(90));
  CHECK(k3.MlaCacheWidth() == 576);
  // KDA state: 96 * 128 * 128 * 4 B = 6 MiB per layer.
  CHECK(std::int64_t{k3.kda.num_heads} * k3.kda.head_dim * k3.kda.head_dim * 4 == 6 << 20);

  auto kl = *Preset("kimi-linear-48b");
  CHECK(kl.kda.full_attn_layers == std::vector<int>{4, 8, 12, 16, 20, 24, 27});
  CHECK(kl.attn_res_block_size == 0);
  CHECK(!kl.kda.gate_lower_bound);
  CHECK(!kl.kda.use_full_rank_gate);
  CHECK(!kl.HasLatentProjection());
}

TEST_CASE("every key is read, known harmless, or refused", "[config][keys]") {
  Json j = ToyJson();
  j["architectures"] = {"KimiK3ForCausalLM"};
  j["torch_dtype"] = "bfloat16";
  j["rope_theta"] = 50000.0;  // NoPE: no rotation anywhere
  ConfigKeys keys;
  auto c = ParseConfigJson(j.dump(), "my/config.json", &keys);
  REQUIRE(c.ok());
  auto has = [](const std::vector<std::string>& v, const std::string& k) {
    return std::find(v.begin(), v.end(), k) != v.end();
  };
  CHECK(has(keys.read, "hidden_size"));
  CHECK(has(keys.read, "hidden_act"));
  CHECK(has(keys.read, "linear_attn_config.gate_lower_bound"));
  CHECK(has(keys.ignored, "architectures"));
  CHECK(has(keys.ignored, "torch_dtype"));
  CHECK(has(keys.ignored, "rope_theta"));
  CHECK(keys.read.size() + keys.ignored.size() == j.size() + j["linear_attn_config"].size());

  Json unknown = ToyJson();
  unknown["some_future_field"] = {{"x", 1}};
  CHECK(Mentions(ErrorOf(unknown), "'some_future_field' is not one Terrace knows"));
  Json nested_unknown = ToyJson();
  nested_unknown["linear_attn_config"]["chunk_size"] = 32;
  CHECK(Mentions(ErrorOf(nested_unknown), "'linear_attn_config.chunk_size'"));
  Json wrapped = {{"model_type", "kimi_k3"}, {"text_config", ToyJson()}, {"vision_config", {{"depth", 3}}},
                  {"vision_tower_secret", 1}};
  CHECK(Mentions(ErrorOf(wrapped), "'vision_tower_secret'"));
}

TEST_CASE("hidden_act: silu and situ are honoured, anything else refused", "[config]") {
  Json j = ToyJson();
  CHECK(ParseConfigJson(j.dump())->hidden_act == Activation::kSitu);  // K3
  j["hidden_act"] = "silu";
  CHECK(ParseConfigJson(j.dump())->hidden_act == Activation::kSilu);
  j["hidden_act"] = "swish";
  CHECK(ParseConfigJson(j.dump())->hidden_act == Activation::kSilu);
  j.erase("hidden_act");
  j["model_type"] = "kimi_linear";  // transformers' KimiLinearConfig default
  CHECK(ParseConfigJson(j.dump())->hidden_act == Activation::kSilu);
  for (const char* bad : {"gelu", "relu2", "SiLU"}) {
    j["hidden_act"] = bad;
    const std::string msg = ErrorOf(j);
    CHECK(Mentions(msg, "'hidden_act'"));
    CHECK(Mentions(msg, bad));
  }
}

TEST_CASE("absurd values are refused with the supported range", "[config][ranges]") {
  auto with = [](const char* key, Json value) {
    Json j = ToyJson();
    j[key] = value;
    return ErrorOf(j);
  };
  CHECK(Mentions(with("rms_norm_eps", 1e300), "(0, 0.1]"));
  CHECK(Mentions(with("rms_norm_eps", 1e-60), "rounds to 0"));
  CHECK(Mentions(with("rms_norm_eps", -1e-5), "rms_norm_eps"));
  CHECK(Mentions(with("num_experts", 100000000), "[1, 65536]"));
  CHECK(Mentions(with("num_hidden_layers", 100000), "[1, 1024]"));
  CHECK(Mentions(with("moe_intermediate_size", 1 << 30), "moe_intermediate_size"));
  CHECK(Mentions(with("routed_scaling_factor", 1e30), "(0, 1000]"));
  CHECK(Mentions(with("activation_situ_beta", 0.0), "activation_situ_beta"));
  CHECK(Mentions(with("num_attention_heads", 5000), "[1, 1024]"));
  CHECK(Mentions(with("attn_res_block_size", 9), "attn_res_block_size"));
  // Within the per-key ranges but too many tensors in all.
  Json j = ToyJson();
  j["num_hidden_layers"] = 1000;
  j["linear_attn_config"]["full_attn_layers"] = {4};
  j["linear_attn_config"].erase("kda_layers");
  j["num_experts"] = 60000;
  CHECK(Mentions(ErrorOf(j), "tensors"));
}

TEST_CASE("two names for one setting must agree", "[config]") {
  Json j = ToyJson();
  j["num_experts_per_tok"] = j["num_experts_per_token"];
  CHECK(ParseConfigJson(j.dump()).ok());
  j["num_experts_per_tok"] = 3;
  CHECK(Mentions(ErrorOf(j), "disagree"));
}

TEST_CASE("a key written twice in config.json is refused, naming it", "[config]") {
  std::string text = ToyJson().dump();
  text.insert(1, "\"hidden_size\": 7, ");  // a second hidden_size, first in the object
  auto r = ParseConfigJson(text, "my/config.json");
  REQUIRE_FALSE(r.ok());
  CHECK(Mentions(r.status().message(), "duplicate key \"hidden_size\""));
  CHECK(Mentions(r.status().message(), "my/config.json"));
}

TEST_CASE("a flat linear_* key and its linear_attn_config spelling must agree", "[config]") {
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"linear_num_heads", "num_heads"}, {"linear_head_dim", "head_dim"},
      {"linear_conv_kernel_dim", "short_conv_kernel_size"}};
  for (const auto& [flat, nested] : pairs) {
    INFO(flat);
    Json j = ToyJson();
    j[flat] = j["linear_attn_config"][nested];
    CHECK(ParseConfigJson(j.dump()).ok());  // the same value twice is fine
    j[flat] = nullptr;
    CHECK(ParseConfigJson(j.dump()).ok());  // null is absent (transformers writes unset fields so)
    j[flat] = j["linear_attn_config"][nested].get<int>() + 1;
    const std::string e = ErrorOf(j);
    CHECK(Mentions(e, "'" + flat + "'"));
    CHECK(Mentions(e, "linear_attn_config." + nested));
  }
}

// tests/model_io/data/kimi_k3_config.json: Kimi K3's published config.json (moonshotai/Kimi-K3, as
// written by transformers 4.56): a kimi_k3 wrapper around a kimi_linear text_config, with every
// generation default and the vision tower's settings. It must parse, every key accounted for, to
// exactly the kimi-k3 preset.
TEST_CASE("K3's published config.json parses to the kimi-k3 preset", "[config][presets]") {
  const char* src = std::getenv("TERRACE_SOURCE_DIR");
  const std::filesystem::path path =
      std::filesystem::path(src ? src : ".") / "tests" / "model_io" / "data" / "kimi_k3_config.json";
  ConfigKeys keys;
  auto c = LoadConfig(path, &keys);
  INFO(c.status().ToString());
  REQUIRE(c.ok());
  CHECK(ToConfigJson(*c) == ToConfigJson(*Preset("kimi-k3")));
  CHECK(c->model_type == "kimi_k3");
  CHECK(c->MlaLatentNormEps() == 1e-5f);
  auto has = [](const std::vector<std::string>& v, const std::string& k) {
    return std::find(v.begin(), v.end(), k) != v.end();
  };
  CHECK(has(keys.read, "text_config.hidden_act"));
  CHECK(has(keys.read, "text_config.quantization_config"));
  CHECK(has(keys.ignored, "vision_config"));
  CHECK(has(keys.ignored, "text_config.max_position_embeddings"));
}

// LoadConfig caps what it reads at kMaxConfigJsonBytes, as the CLI's --model and --config do: a
// larger file (a wrong path, a damaged file) is refused naming its size, never read whole (an 8 GB
// sparse config.json read under a memory limit failed as "not valid JSON ... unexpected end of input").
TEST_CASE("a config.json over the size cap is refused naming its size, without reading it", "[config]") {
  const char* base = std::getenv("TERRACE_TEST_TMPDIR");
  const std::filesystem::path dir =
      std::filesystem::path(base ? base : std::filesystem::temp_directory_path().string()) / "config-cap";
  std::filesystem::create_directories(dir);
  const std::filesystem::path path = dir / "config.json";
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << ToConfigJson(*Preset("k3-toy"));
  }
  REQUIRE(LoadConfig(path).ok());
  // Just over the cap first: code that reads the file whole fails there (REQUIRE), before the 8 GiB one.
  for (const std::uint64_t size : {kMaxConfigJsonBytes + 1, std::uint64_t{8} << 30}) {
    CAPTURE(size);
    std::filesystem::resize_file(path, size);  // sparse: the valid JSON, then zeros
    auto c = LoadConfig(path);
    INFO(c.status().ToString());
    REQUIRE_FALSE(c.ok());
    CHECK(c.status().IsInvalidArgument());
    REQUIRE(c.status().message().find("config file '" + path.string() + "' is " + std::to_string(size) +
                                      " bytes, over the limit of " + std::to_string(kMaxConfigJsonBytes) +
                                      " bytes") == 0);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("ValidateConfig refuses a model_type the model does not implement, even one not UTF-8", "[config]") {
  // A config built in code skips the parser's model_type check: a type that is not UTF-8 used to pass
  // and then make ToConfigJson (and the model id built from it) throw nlohmann's type_error 316.
  for (const std::string& type : {std::string("\xff\xfe"), std::string("deepseek_v3"), std::string()}) {
    auto c = *Preset("k3-toy");
    c.model_type = type;
    const auto st = ValidateConfig(c);
    REQUIRE_FALSE(st.ok());
    CHECK(st.message().find("'model_type'") != std::string::npos);
    CHECK(st.message().find("'kimi_k3'") != std::string::npos);
    CHECK(st.message().find("'kimi_linear'") != std::string::npos);
    CHECK(Json::parse(ToConfigJson(c)).is_object());  // no exception: invalid bytes become U+FFFD
  }
  auto c = *Preset("k3-toy");
  c.model_type = "\xff\xfe";
  CHECK(ValidateConfig(c).message().find("\xEF\xBF\xBD") != std::string::npos);  // U+FFFD, not the raw bytes
  CHECK(ValidateConfig(*Preset("k3-toy")).ok());
  CHECK(ValidateConfig(*Preset("kimi-linear-48b")).ok());
}
