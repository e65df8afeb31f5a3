#include <functional>
#include <map>
#include <set>

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include "src/model/config.h"
#include "src/model/names.h"

using namespace terrace::model;

TEST_CASE("K3 tensor names", "[names]") {
  CHECK(LayerPrefix(3) == "language_model.model.layers.3.");
  CHECK(AttnTensorName(0, "q_proj.weight") == "language_model.model.layers.0.self_attn.q_proj.weight");
  CHECK(ExpertTensorName(1, 5, "w1", "weight_packed") ==
        "language_model.model.layers.1.block_sparse_moe.experts.5.w1.weight_packed");
  CHECK(MoeTensorName(2, "gate.e_score_correction_bias") ==
        "language_model.model.layers.2.block_sparse_moe.gate.e_score_correction_bias");
  CHECK(DenseMlpTensorName(0, "down_proj") == "language_model.model.layers.0.mlp.down_proj.weight");
  CHECK(kLmHead == "language_model.lm_head.weight");
}

TEST_CASE("ExpectedTensors for the toy model", "[names]") {
  const ModelConfig c = *Preset("k3-toy");
  const auto specs = ExpectedTensors(c);
  std::map<std::string, TensorSpec> by_name;
  for (const auto& s : specs) CHECK(by_name.emplace(s.name, s).second);  // names are unique
  auto shape = [&](const std::string& n) {
    INFO(n);
    REQUIRE(by_name.count(n) == 1);
    return by_name.at(n).shape;
  };
  using S = std::vector<std::int64_t>;
  CHECK(shape(std::string(kEmbed)) == S{512, 256});
  CHECK(shape(std::string(kLmHead)) == S{512, 256});
  CHECK(shape(std::string(kOutputAttnResProj)) == S{1, 256});
  // Layer 0: KDA + dense MLP.
  CHECK(shape(AttnTensorName(0, "q_proj.weight")) == S{256, 256});
  CHECK(shape(AttnTensorName(0, "q_conv1d.weight")) == S{256, 1, 4});
  CHECK(shape(AttnTensorName(0, "f_a_proj.weight")) == S{64, 256});
  CHECK(shape(AttnTensorName(0, "f_b_proj.weight")) == S{256, 64});
  CHECK(shape(AttnTensorName(0, "b_proj.weight")) == S{4, 256});
  CHECK(shape(AttnTensorName(0, "A_log")) == S{4});
  CHECK(by_name.at(AttnTensorName(0, "A_log")).dtype == DType::kF32);
  CHECK(shape(AttnTensorName(0, "dt_bias")) == S{256});
  CHECK(shape(AttnTensorName(0, "g_proj.weight")) == S{256, 256});
  CHECK(shape(AttnTensorName(0, "o_norm.weight")) == S{64});
  CHECK(shape(DenseMlpTensorName(0, "gate_proj")) == S{512, 256});
  CHECK(by_name.count(MoeTensorName(0, "gate.weight")) == 0);
  // Layer 3 (1-based 4): MLA + MoE.
  CHECK(shape(AttnTensorName(3, "q_a_proj.weight")) == S{128, 256});
  CHECK(shape(AttnTensorName(3, "q_b_proj.weight")) == S{4 * 48, 128});
  CHECK(shape(AttnTensorName(3, "kv_a_proj_with_mqa.weight")) == S{80, 256});
  CHECK(shape(AttnTensorName(3, "kv_b_proj.weight")) == S{4 * 64, 64});
  CHECK(shape(AttnTensorName(3, "o_proj.weight")) == S{256, 128});
  CHECK(shape(AttnTensorName(3, "g_proj.weight")) == S{128, 256});
  CHECK(shape(MoeTensorName(3, "gate.weight")) == S{16, 256});
  CHECK(shape(MoeTensorName(3, "routed_expert_down_proj.weight")) == S{128, 256});
  CHECK(shape(MoeTensorName(3, "routed_expert_up_proj.weight")) == S{256, 128});
  CHECK(shape(ExpertTensorName(3, 15, "w1", "weight_packed")) == S{96, 64});
  CHECK(shape(ExpertTensorName(3, 15, "w1", "weight_scale")) == S{96, 4});
  CHECK(shape(ExpertTensorName(3, 15, "w2", "weight_packed")) == S{128, 48});
  CHECK(shape(ExpertTensorName(3, 15, "w2", "weight_scale")) == S{128, 3});
  CHECK(shape(MoeTensorName(3, "shared_experts.down_proj.weight")) == S{256, 192});
  CHECK(by_name.at(ExpertTensorName(3, 0, "w3", "weight_packed")).dtype == DType::kU8);
  CHECK(by_name.at(ExpertTensorName(3, 0, "w3", "weight_packed")).component == Component::kRoutedExperts);

  // Every expert of every MoE layer, 6 tensors each.
  int experts = 0;
  for (const auto& s : specs) experts += s.component == Component::kRoutedExperts;
  CHECK(experts == 7 * 16 * 6);
  // Logical parameter count of one expert: 3 * 96 * 128.
  std::int64_t p = 0;
  for (const auto& s : specs) {
    if (s.layer == 1 && s.expert == 0) p += s.params();
  }
  CHECK(p == 3 * 96 * 128);
}

TEST_CASE("ExpectedTensors follows the config's switches", "[names]") {
  const ModelConfig kl = *Preset("kimi-linear-48b");
  std::set<std::string> names;
  for (const auto& s : ExpectedTensors(kl)) {
    if (s.layer <= 3) names.insert(s.name);
  }
  CHECK(names.count(AttnTensorName(0, "g_a_proj.weight")) == 1);
  CHECK(names.count(AttnTensorName(0, "g_proj.weight")) == 0);
  CHECK(names.count(AttnTensorName(3, "q_proj.weight")) == 1);
  CHECK(names.count(AttnTensorName(3, "q_a_proj.weight")) == 0);
  CHECK(names.count(AttnTensorName(3, "g_proj.weight")) == 0);
  CHECK(names.count(MoeTensorName(1, "routed_expert_down_proj.weight")) == 0);
  CHECK(names.count(MoeTensorName(1, "routed_expert_norm.weight")) == 0);
  CHECK(names.count(LayerTensorName(1, "mlp_res_proj.weight")) == 0);
  CHECK(names.count(std::string(kOutputAttnResProj)) == 0);
}

// Shapes from the tensor list of Kimi K3's published checkpoint (moonshotai/Kimi-K3: 96 shards,
// 497,220 tensors of which 168 belong to the vision tower and its projector).
TEST_CASE("the kimi-k3 preset implies the published K3 checkpoint's tensors", "[names][presets]") {
  const ModelConfig c = *Preset("kimi-k3");
  const auto specs = ExpectedTensors(c);
  CHECK(specs.size() == 497'220 - 168);
  std::map<std::string, std::vector<std::int64_t>> shape;
  for (const auto& s : specs) shape[s.name] = s.shape;
  const std::vector<std::pair<std::string, std::vector<std::int64_t>>> published = {
      {"language_model.model.embed_tokens.weight", {163840, 7168}},
      {"language_model.lm_head.weight", {163840, 7168}},
      {"language_model.model.layers.0.mlp.gate_proj.weight", {33792, 7168}},
      {"language_model.model.layers.0.self_attn.q_proj.weight", {12288, 7168}},
      {"language_model.model.layers.0.self_attn.b_proj.weight", {96, 7168}},
      {"language_model.model.layers.0.self_attn.f_a_proj.weight", {128, 7168}},
      {"language_model.model.layers.0.self_attn.f_b_proj.weight", {12288, 128}},
      {"language_model.model.layers.0.self_attn.dt_bias", {12288}},
      {"language_model.model.layers.0.self_attn.q_conv1d.weight", {12288, 1, 4}},
      {"language_model.model.layers.0.self_attn.g_proj.weight", {12288, 7168}},
      {"language_model.model.layers.0.self_attn.o_norm.weight", {128}},
      {"language_model.model.layers.3.self_attn.q_a_proj.weight", {1536, 7168}},
      {"language_model.model.layers.3.self_attn.q_b_proj.weight", {18432, 1536}},
      {"language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight", {576, 7168}},
      {"language_model.model.layers.3.self_attn.kv_b_proj.weight", {24576, 512}},
      {"language_model.model.layers.3.self_attn.g_proj.weight", {12288, 7168}},
      {"language_model.model.layers.3.self_attn.o_proj.weight", {7168, 12288}},
      {"language_model.model.layers.92.self_attn.kv_b_proj.weight", {24576, 512}},
      {"language_model.model.layers.1.block_sparse_moe.gate.weight", {896, 7168}},
      {"language_model.model.layers.1.block_sparse_moe.routed_expert_down_proj.weight", {3584, 7168}},
      {"language_model.model.layers.1.block_sparse_moe.routed_expert_up_proj.weight", {7168, 3584}},
      {"language_model.model.layers.1.block_sparse_moe.routed_expert_norm.weight", {3584}},
      {"language_model.model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight", {6144, 7168}},
      {"language_model.model.layers.1.block_sparse_moe.shared_experts.down_proj.weight", {7168, 6144}},
      {"language_model.model.layers.92.block_sparse_moe.experts.895.w1.weight_packed", {3072, 1792}},
      {"language_model.model.layers.92.block_sparse_moe.experts.895.w1.weight_scale", {3072, 112}},
      {"language_model.model.layers.92.block_sparse_moe.experts.895.w2.weight_packed", {3584, 1536}},
      {"language_model.model.layers.92.block_sparse_moe.experts.895.w2.weight_scale", {3584, 96}},
      {"language_model.model.layers.92.mlp_res_proj.weight", {1, 7168}},
      {"language_model.model.output_attn_res_proj.weight", {1, 7168}},
  };
  for (const auto& [name, want] : published) {
    INFO(name);
    REQUIRE(shape.count(name));
    CHECK(shape[name] == want);
  }
  CHECK(c.hidden_act == Activation::kSitu);
  CHECK(c.num_attention_heads == c.kda.num_heads);
}

namespace {

// A checkpoint holding exactly the tensors `specs` names, with their shapes and dtypes (no bytes).
class SpecSource final : public WeightSource {
 public:
  explicit SpecSource(const std::vector<TensorSpec>& specs) {
    for (const TensorSpec& s : specs) views_[s.name] = TensorView{s.dtype, s.shape, {}};
  }
  terrace::Result<TensorView> Get(std::string_view name) const override {
    auto it = views_.find(std::string(name));
    if (it == views_.end()) return terrace::Status::NotFound(std::string(name));
    return it->second;
  }
  bool Has(std::string_view name) const override { return views_.count(std::string(name)) > 0; }
  std::vector<std::string> Names() const override {
    std::vector<std::string> out;
    for (const auto& [name, view] : views_) out.push_back(name);
    return out;
  }

 private:
  std::map<std::string, TensorView> views_;
};

struct SwitchCase {
  const char* key;
  std::function<void(ModelConfig&)> with_tensors;     // the setting that uses some tensors
  std::function<void(ModelConfig&)> without_tensors;  // the setting that leaves them out
};

}  // namespace

TEST_CASE("a tensor the config switches off is refused, naming the setting", "[names]") {
  const std::vector<SwitchCase> cases = {
      {"mla_use_output_gate", [](ModelConfig& c) { c.mla_use_output_gate = true; },
       [](ModelConfig& c) { c.mla_use_output_gate = false; }},
      {"latent_moe_use_norm", [](ModelConfig& c) { c.latent_moe_use_norm = true; },
       [](ModelConfig& c) { c.latent_moe_use_norm = false; }},
      {"attn_res_block_size", [](ModelConfig& c) { c.attn_res_block_size = 2; },
       [](ModelConfig& c) { c.attn_res_block_size = 0; }},
      {"num_shared_experts",
       [](ModelConfig& c) {
         c.num_shared_experts = 1;
         c.shared_expert_intermediate_size = c.moe_intermediate_size;
       },
       [](ModelConfig& c) { c.num_shared_experts = 0; }},
      {"tie_word_embeddings", [](ModelConfig& c) { c.tie_word_embeddings = false; },
       [](ModelConfig& c) { c.tie_word_embeddings = true; }},
      {"routed_expert_hidden_size", [](ModelConfig& c) { c.routed_expert_hidden_size = c.hidden_size / 2; },
       [](ModelConfig& c) { c.routed_expert_hidden_size = c.hidden_size; }},
      {"linear_attn_config.use_full_rank_gate", [](ModelConfig& c) { c.kda.use_full_rank_gate = true; },
       [](ModelConfig& c) { c.kda.use_full_rank_gate = false; }},
      {"q_lora_rank", [](ModelConfig& c) { c.q_lora_rank = 32; }, [](ModelConfig& c) { c.q_lora_rank.reset(); }},
  };
  for (const SwitchCase& sc : cases) {
    INFO(sc.key);
    ModelConfig written = *Preset("k3-toy");
    sc.with_tensors(written);
    ModelConfig read = written;
    sc.without_tensors(read);
    const SpecSource checkpoint(ExpectedTensors(written));
    CHECK(FindWeightProblems(checkpoint, written).empty());  // the control: its own config fits
    const std::vector<std::string> problems = FindWeightProblems(checkpoint, read);
    std::string all;
    for (const auto& p : problems) all += p + "\n";
    INFO(all);
    CHECK(all.find(fmt::format("config.json's {} = ", sc.key)) != std::string::npos);
    CHECK(all.find("leaves it unused") != std::string::npos);
    CHECK(all.find("does not imply it") == std::string::npos);  // every unused tensor traced to the setting
    CHECK_FALSE(ValidateWeights(checkpoint, read).ok());
  }
}

TEST_CASE("vision tensors of a K3 wrapper and multi-token-prediction layers are not refused", "[names]") {
  const ModelConfig c = *Preset("k3-toy");
  std::vector<TensorSpec> specs = ExpectedTensors(c);
  const std::vector<std::int64_t> shape = {4, 4};
  auto extra = [&](std::string name) {
    specs.push_back(TensorSpec{std::move(name), DType::kBF16, shape, Component::kNormsOther, -1, -1, false});
  };
  extra("vision_tower.patch_embed.proj.weight");
  extra("multi_modal_projector.linear_1.weight");
  extra(LayerTensorName(c.num_hidden_layers, "eh_proj.weight"));  // an MTP layer
  extra(LayerTensorName(c.num_hidden_layers, "enorm.weight"));
  CHECK(FindWeightProblems(SpecSource(specs), c).empty());
  // A plain extra decoder layer (no eh_proj) is refused: the config would drop a layer.
  extra(LayerTensorName(c.num_hidden_layers + 1, "input_layernorm.weight"));
  const auto problems = FindWeightProblems(SpecSource(specs), c);
  REQUIRE(problems.size() == 1);
  CHECK(problems[0].find(LayerTensorName(c.num_hidden_layers + 1, "input_layernorm.weight")) != std::string::npos);
}
