// Named model configurations. k3-toy and k3-small are instantiated with random weights for tests and
// demos; kimi-k3 and kimi-linear-48b describe the real models for planning (never instantiated
// here). Numbers and their sources: docs/model-format.md.
#include <fmt/format.h>

#include "src/model/config.h"

namespace terrace::model {
namespace {

// MLA every 4th layer (1-based 4, 8, ...) plus `extra` ones; KDA everywhere else.
void SetLayers(ModelConfig* c, int layers, std::vector<int> extra_mla = {}) {
  c->num_hidden_layers = layers;
  c->kda.full_attn_layers.clear();
  c->kda.kda_layers.clear();
  for (int l = 4; l <= layers; l += 4) c->kda.full_attn_layers.push_back(l);
  for (int l : extra_mla) c->kda.full_attn_layers.push_back(l);
  for (int l = 1; l <= layers; ++l) {
    bool mla = false;
    for (int m : c->kda.full_attn_layers) mla = mla || m == l;
    if (!mla) c->kda.kda_layers.push_back(l);
  }
}

// A toy size that keeps every K3 mechanism's character (docs/model-format.md section 3).
ModelConfig K3Toy() {
  ModelConfig c;
  c.model_type = "kimi_k3";
  SetLayers(&c, 8);
  c.hidden_size = 256;
  c.vocab_size = 512;
  c.rms_norm_eps = 1e-5f;
  c.kda.num_heads = 4;
  c.kda.head_dim = 64;
  c.kda.short_conv_kernel_size = 4;
  c.kda.use_full_rank_gate = true;
  c.kda.gate_lower_bound = -5.0f;
  c.num_attention_heads = 4;
  c.q_lora_rank = 128;
  c.kv_lora_rank = 64;
  c.qk_nope_head_dim = 32;
  c.qk_rope_head_dim = 16;
  c.v_head_dim = 32;
  c.mla_use_nope = true;
  c.mla_use_output_gate = true;
  c.num_experts = 16;
  c.num_experts_per_token = 2;
  c.num_shared_experts = 2;
  c.moe_intermediate_size = 96;
  c.routed_expert_hidden_size = 128;
  c.latent_moe_use_norm = true;
  c.routed_scaling_factor = 1.0f;
  c.first_k_dense_replace = 1;
  c.intermediate_size = 512;
  c.shared_expert_intermediate_size = 192;
  c.attn_res_block_size = 2;
  return c;
}

// Bigger than the toy so routed experts are tens of MB (64 x 11 layers x 102 KiB = 70 MiB in MXFP4).
ModelConfig K3Small() {
  ModelConfig c = K3Toy();
  SetLayers(&c, 12);
  c.hidden_size = 512;
  c.vocab_size = 2048;
  c.kda.num_heads = 8;
  c.kda.head_dim = 64;
  c.num_attention_heads = 8;
  c.q_lora_rank = 256;
  c.kv_lora_rank = 128;
  c.qk_nope_head_dim = 32;
  c.qk_rope_head_dim = 16;
  c.v_head_dim = 32;
  c.num_experts = 64;
  c.num_experts_per_token = 4;
  c.num_shared_experts = 2;
  c.moe_intermediate_size = 256;
  c.routed_expert_hidden_size = 256;
  c.shared_expert_intermediate_size = 512;
  c.intermediate_size = 1024;
  c.attn_res_block_size = 4;
  return c;
}

// The expert-offload benchmark's regime (docs/benchmarks.md, "Expert offload"): few layers, small
// attention and vocabulary, large routed experts and a wide top-k, so that the routed experts total
// over 2 GiB in MXFP4 (4 MoE layers x 256 experts x 2.19 MiB = 2.19 GiB) and a token whose 32 experts
// all miss moves 70 MiB, several times what the token costs to compute. Instantiated with
// PresetUsesRandomExpertCodes (seconds, not minutes).
ModelConfig MoeBench() {
  ModelConfig c = K3Toy();
  SetLayers(&c, 5);
  c.hidden_size = 1024;
  c.vocab_size = 1024;
  c.kda.num_heads = 4;
  c.kda.head_dim = 64;
  c.num_attention_heads = 4;
  c.q_lora_rank = 128;
  c.kv_lora_rank = 64;
  c.num_experts = 256;
  c.num_experts_per_token = 8;
  c.num_shared_experts = 1;
  c.moe_intermediate_size = 1408;
  c.routed_expert_hidden_size = 1024;
  c.shared_expert_intermediate_size = 256;
  c.intermediate_size = 1024;
  c.attn_res_block_size = 2;
  c.first_k_dense_replace = 1;
  return c;
}

// moe-bench with a plain residual stream (attn_res_block_size 0, as Kimi Linear 48B has) instead of
// Block AttnRes: every tensor but the AttnRes pseudo-queries is the same. With AttnRes a MoE layer's
// router reads a softmax mix over the block outputs, which the state leaving the previous layer does
// not carry, so lookahead cannot be judged on moe-bench's random weights (docs/experts.md,
// "Predictors"); here each layer adds to one stream, as in the models lookahead prefetching was
// published for.
ModelConfig MoeBenchPlain() {
  ModelConfig c = MoeBench();
  c.attn_res_block_size = 0;
  return c;
}

// Kimi K3 as its published config.json (text_config) states it; every value and its source:
// docs/model-format.md section 3.
ModelConfig KimiK3() {
  ModelConfig c = K3Toy();
  SetLayers(&c, 93, {93});
  c.hidden_size = 7168;
  c.vocab_size = 163840;
  c.kda.num_heads = 96;
  c.kda.head_dim = 128;
  c.num_attention_heads = 96;
  c.q_lora_rank = 1536;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  c.num_experts = 896;
  c.num_experts_per_token = 16;
  c.num_shared_experts = 2;
  c.moe_intermediate_size = 3072;
  c.routed_expert_hidden_size = 3584;
  c.shared_expert_intermediate_size = 2 * 3072;
  c.intermediate_size = 33792;
  c.attn_res_block_size = 12;
  return c;
}

// Kimi Linear 48B-A3B as its published config.json (and transformers' KimiLinearConfig defaults,
// which are that model's values) states it: no AttnRes (attn_res_block_size 0 = plain residual
// stream), unbounded gate, low-rank output gate, plain q_proj, no latent projection
// (routed_expert_hidden_size == hidden_size), no latent norm, no MLA output gate, SiLU MLPs.
ModelConfig KimiLinear48B() {
  ModelConfig c = K3Toy();
  c.model_type = "kimi_linear";
  SetLayers(&c, 27, {27});
  c.hidden_size = 2304;
  c.vocab_size = 163840;
  c.kda.num_heads = 32;
  c.kda.head_dim = 128;
  c.kda.use_full_rank_gate = false;
  c.kda.gate_lower_bound.reset();
  c.num_attention_heads = 32;
  c.q_lora_rank.reset();
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  c.mla_use_output_gate = false;
  c.num_experts = 256;
  c.num_experts_per_token = 8;
  c.num_shared_experts = 1;
  c.moe_intermediate_size = 1024;
  c.routed_expert_hidden_size = 2304;
  c.latent_moe_use_norm = false;
  c.routed_scaling_factor = 2.446f;
  c.shared_expert_intermediate_size = 1024;
  c.first_k_dense_replace = 1;
  c.intermediate_size = 9216;
  c.attn_res_block_size = 0;
  c.hidden_act = Activation::kSilu;
  return c;
}

}  // namespace

std::vector<std::string> PresetNames() {
  return {"k3-toy", "k3-small", "moe-bench", "moe-bench-plain", "kimi-k3", "kimi-linear-48b"};
}

bool PresetUsesRandomExpertCodes(std::string_view name) { return name == "moe-bench" || name == "moe-bench-plain"; }

Result<ModelConfig> Preset(std::string_view name) {
  ModelConfig c;
  if (name == "k3-toy") {
    c = K3Toy();
  } else if (name == "k3-small") {
    c = K3Small();
  } else if (name == "moe-bench") {
    c = MoeBench();
  } else if (name == "moe-bench-plain") {
    c = MoeBenchPlain();
  } else if (name == "kimi-k3") {
    c = KimiK3();
  } else if (name == "kimi-linear-48b") {
    c = KimiLinear48B();
  } else {
    return Status::InvalidArgument(fmt::format("unknown model preset '{}'; choose one of: {}", name,
                                               fmt::join(PresetNames(), ", ")));
  }
  TERRACE_RETURN_IF_ERROR(ValidateConfig(c).WithContext(fmt::format("preset '{}'", name)));
  return c;
}

}  // namespace terrace::model
