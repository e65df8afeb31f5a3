// The analytic planner against hand-computed Kimi K3 figures (docs/model-format.md section 3:
// 93 layers, MLA at 1-based 4, 8, ..., 92 and 93 = 24 layers, KDA the other 69; kv_lora_rank 512,
// qk_rope_head_dim 64; 96 KDA heads of 128; conv kernel 4).
#include <catch2/catch.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/plan/analytic.h"
#include "src/plan/hardware.h"
#include "terrace/model_config.h"

using namespace terrace;
using namespace terrace::plan;

namespace {
Plan K3Plan(const char* kv_codec = "bf16", PlanOptions o = {}, std::uint64_t hbm_bytes_per_gpu = 0) {
  auto c = model::Preset("kimi-k3");
  REQUIRE(c.ok());
  auto hw = HardwarePreset("h200-gen5");
  REQUIRE(hw.ok());
  if (hbm_bytes_per_gpu > 0) hw->hbm_bytes_per_gpu = hbm_bytes_per_gpu;
  auto spec = codec::CodecSpec::Parse(kv_codec);
  REQUIRE(spec.ok());
  o.layout.kv_codec = *spec;
  auto p = MakePlan(*c, "kimi-k3", *hw, o);
  REQUIRE(p.ok());
  return *p;
}
// The same on a small preset (k3-small: a tenth of K3's tensor list), for tests about the workload
// arithmetic rather than K3's sizes.
Plan SmallPlan(PlanOptions o = {}) {
  auto c = model::Preset("k3-small");
  REQUIRE(c.ok());
  auto hw = HardwarePreset("h200-gen5");
  REQUIRE(hw.ok());
  auto p = MakePlan(*c, "k3-small", *hw, o);
  REQUIRE(p.ok());
  return *p;
}
}  // namespace

TEST_CASE("K3 memory per token and per sequence match the hand-computed values") {
  const Plan p = K3Plan();
  CHECK(p.memory.mla_layers == 24);
  CHECK(p.memory.kda_layers == 69);
  // 24 MLA layers x (512 + 64) values x 2 bytes (bf16) = 27,648 B per token.
  CHECK(p.memory.mla_bytes_per_token == 27648u);
  // 96 heads x 128 x 128 x 4 bytes (f32) = 6 MiB per KDA layer.
  CHECK(p.memory.kda_recurrent_bytes_per_layer == 6u * 1024 * 1024);
  // conv state: (4 - 1) rows x 3 * 96 * 128 columns x 4 bytes = 442,368 B.
  CHECK(p.memory.kda_conv_bytes_per_layer == 442368u);
  CHECK(p.memory.kda_state_bytes_per_sequence == 69u * (6291456u + 442368u));
  // AttnRes: ceil(93 / 12) = 8 bank vectors + the partial sum, 7168 floats each.
  CHECK(p.memory.attnres_sources == 9);
  CHECK(p.memory.attnres_bank_bytes_per_token == 9u * 7168u * 4u);
  // MHA comparison: 96 heads x (192 K + 128 V) x 2 B x 93 layers.
  CHECK(p.memory.mha_bytes_per_token == 96u * 320u * 2u * 93u);
  CHECK(p.memory.gqa_bytes_per_token == 8u * 320u * 2u * 93u);
  // The curve: 1k .. 1M, total = t * MLA + fixed KDA.
  REQUIRE(p.memory.curve.size() == 11);
  CHECK(p.memory.curve.front().tokens == 1024);
  CHECK(p.memory.curve.back().tokens == 1048576);
  CHECK(p.memory.curve.back().total_bytes == 1048576ull * 27648 + 69ull * (6291456 + 442368));
}

TEST_CASE("The KV codec changes the MLA bytes (fp8 halves bf16) but not the KDA state") {
  const Plan bf16 = K3Plan("bf16");
  const Plan fp8 = K3Plan("fp8");
  CHECK(fp8.memory.mla_bytes_per_token * 2 == bf16.memory.mla_bytes_per_token);
  CHECK(fp8.memory.kda_state_bytes_per_sequence == bf16.memory.kda_state_bytes_per_sequence);
  CHECK(fp8.kv_codec == "fp8");
}

TEST_CASE("K3 weights: routed experts dominate; one MXFP4 expert is 3 x 3584 x 3072 x (1/2 + 1/32) bytes") {
  const Plan p = K3Plan();
  CHECK(p.weights.moe_layers == 92);  // first_k_dense_replace = 1
  CHECK(p.weights.experts_per_layer == 896);
  CHECK(p.weights.expert_bytes == 3ull * 3584 * 3072 / 2 + 3ull * 3584 * 3072 / 32);
  CHECK(p.weights.routed_expert_bytes == p.weights.expert_bytes * 896 * 92);
  CHECK(p.weights.resident_bytes + p.weights.routed_expert_bytes == p.weights.total_bytes);
  std::uint64_t sum = 0;
  for (const auto& [name, b] : p.weights.bytes_by_component) sum += b;
  CHECK(sum == p.weights.total_bytes);
}

TEST_CASE("Zipf expert cache sizing, by hand") {
  // 4 experts, s = 1, top-1: p = 12/25, 6/25, 4/25, 3/25.
  CHECK(ZipfMass(4, 1.0, 1, 1) == Approx(0.48));
  CHECK(ZipfMass(4, 1.0, 1, 2) == Approx(0.72));
  CHECK(ExpertsForHitRate(4, 1.0, 1, 0.70) == 2);
  CHECK(ExpertsForHitRate(4, 1.0, 1, 0.73) == 3);
  CHECK(ExpertsForHitRate(4, 1.0, 1, 1.0) == 4);
  // Uniform: cached / E, whatever top-k.
  CHECK(ZipfMass(10, 0.0, 1, 3) == Approx(0.3));
  CHECK(ZipfMass(10, 0.0, 4, 3) == Approx(0.3));
}

TEST_CASE("Top-k routing picks k distinct experts: inclusion probabilities min(1, c w) summing to k") {
  // 4 experts, s = 1, top-3: w = .48, .24, .16, .12. c = 3 would give the hottest 1.44 > 1, so it is
  // always picked and the other two picks spread over the rest: c = 2 / .52, p = 1, 12/13, 8/13, 6/13.
  const std::vector<double> p = ExpertInclusion(4, 1.0, 3);
  REQUIRE(p.size() == 4);
  CHECK(p[0] == 1.0);
  CHECK(p[1] == Approx(12.0 / 13));
  CHECK(p[2] == Approx(8.0 / 13));
  CHECK(p[3] == Approx(6.0 / 13));
  // Caching the hottest holds 1 of the 3 picks (drawing with replacement would say .48).
  CHECK(ZipfMass(4, 1.0, 3, 1) == Approx(1.0 / 3));
  CHECK(ZipfMass(4, 1.0, 3, 2) == Approx((1 + 12.0 / 13) / 3));
  CHECK(ExpertsForHitRate(4, 1.0, 3, 0.5) == 2);
  // top-2: no expert saturates, p = 2 w.
  const std::vector<double> q = ExpertInclusion(4, 1.0, 2);
  CHECK(q[0] == Approx(0.96));
  CHECK(q[3] == Approx(0.24));
  // K3: 896 experts, top-16, s = 1: the picks sum to 16, none over 1.
  const std::vector<double> k3 = ExpertInclusion(896, 1.0, 16);
  double sum = 0;
  for (double x : k3) {
    CHECK(x <= 1.0);
    sum += x;
  }
  CHECK(sum == Approx(16.0));
  CHECK(k3[0] == 1.0);  // 16 x 1/H(896) = 2.2 > 1: the hottest expert is in every token's picks
  // top-k >= experts: every expert every time; all cached: exactly 1.
  for (double x : ExpertInclusion(4, 1.0, 4)) CHECK(x == 1.0);
  CHECK(ZipfMass(896, 1.0, 16, 896) == 1.0);
}

TEST_CASE("K3 default expert-cache hit rate under top-k without repeats") {
  // 338 of 896 experts cached per layer (the default budget): the reviewer's independent figure, 85.5%.
  const Plan p = K3Plan();
  CHECK(p.experts.cached_per_layer == 338);
  CHECK(p.experts.hit_rate == Approx(0.855).margin(0.0005));
}

TEST_CASE("Expert cache: a bigger budget never stalls more; the whole model cached never stalls") {
  PlanOptions small, big, all;
  small.expert_cache_bytes = 64ull << 30;
  big.expert_cache_bytes = 256ull << 30;
  all.expert_cache_bytes = 2ull << 40;  // all routed experts (1.3 TiB) fit, on GPUs with 1 TiB of HBM each
  const Plan a = K3Plan("bf16", small), b = K3Plan("bf16", big), c = K3Plan("bf16", all, 1ull << 40);
  CHECK(a.experts.hit_rate < b.experts.hit_rate);
  CHECK(a.experts.stall_s_per_token_batch1 > b.experts.stall_s_per_token_batch1);
  CHECK(c.experts.cached_per_layer == 896);
  // Exactly: every expert cached leaves nothing to miss (not 1 - 2e-16 and a 1e-21 s stall).
  CHECK(c.experts.hit_rate == 1.0);
  CHECK(c.experts.stall_s_per_token_batch1 == 0.0);
  CHECK(c.experts.stall_s_per_token_batched == 0.0);
  CHECK(c.experts.miss_bytes_per_token_batch1 == 0.0);
  // Batch 1, by hand: misses = top-16 x 92 layers x (1 - hit) experts of expert_bytes each.
  CHECK(a.experts.miss_bytes_per_token_batch1 ==
        Approx((1 - a.experts.hit_rate) * 16 * 92 * static_cast<double>(a.weights.expert_bytes)));
}

TEST_CASE("Decode with stalls: each of the step's sequences waits for its own token's expert misses") {
  // stall_s_per_token_batched is per token; a decode step makes `concurrency` tokens, so the step
  // with stalls is decode_step_s + stall per token x concurrency.
  for (const int conc : {1, 32, 64}) {
    CAPTURE(conc);
    PlanOptions o;
    o.expert_cache_bytes = 64ull << 30;  // small: experts miss, so there are stalls
    o.workload.concurrency = conc;
    const Plan p = K3Plan("bf16", o);
    const LifecyclePlan& lc = p.lifecycle;
    REQUIRE(p.experts.stall_s_per_token_batched > 0);
    CHECK(lc.decode_step_with_stalls_s ==
          Approx(lc.decode_step_s + p.experts.stall_s_per_token_batched * static_cast<double>(conc)));
    CHECK(lc.decode_tokens_per_s_with_stalls == Approx(conc / lc.decode_step_with_stalls_s));
  }
}

TEST_CASE("Tiers: sequences per tier are the KV bytes over one sequence's bytes") {
  const Plan p = K3Plan();
  const std::uint64_t seq = (32768 + 512) * 27648ull + 69ull * (6291456 + 442368);
  CHECK(p.memory.sequence_bytes == seq);
  for (const TierPlan& t : p.tiers) CHECK(t.sequences == t.kv_bytes / seq);
  CHECK(p.tiers[0].kv_bytes + p.tiers[0].other_bytes == p.tiers[0].capacity_bytes);
}

TEST_CASE("Bad workload values are errors naming the CLI flag") {
  auto c = model::Preset("k3-small");
  auto hw = HardwarePreset("h100-gen4");
  REQUIRE(c.ok());
  REQUIRE(hw.ok());
  PlanOptions o;
  o.workload.prefix_reuse = 1.5;
  auto p = MakePlan(*c, "k3-small", *hw, o);
  REQUIRE_FALSE(p.ok());
  CHECK_THAT(p.status().message(), Catch::Contains("--prefix-reuse"));
  o = {};
  o.workload.concurrency = 0;
  p = MakePlan(*c, "k3-small", *hw, o);
  REQUIRE_FALSE(p.ok());
  CHECK_THAT(p.status().message(), Catch::Contains("--concurrency"));
}

TEST_CASE("Hardware JSON: a base preset with overrides; unknown keys and bad values name the key") {
  auto h = ParseHardwareJson(R"({"base": "h100-gen4", "gpus": 4, "host_bytes": 1000000000})", "my.json");
  REQUIRE(h.ok());
  CHECK(h->gpus == 4);
  CHECK(h->host_bytes == 1'000'000'000u);
  CHECK(h->hbm_bytes_per_gpu == 81'559ull << 20);
  CHECK(h->hbm_bytes() == 4 * (81'559ull << 20));
  auto bad = ParseHardwareJson(R"({"base": "h200-gen5", "hbm_gb": 3})", "my.json");
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(bad.status().message(), Catch::Contains("my.json") && Catch::Contains("hbm_gb"));
  bad = ParseHardwareJson(R"({"base": "h200-gen5", "mfu": 2})", "my.json");
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(bad.status().message(), Catch::Contains("mfu"));
  bad = ParseHardwareJson(R"({"gpus": 8})", "my.json");  // no base: the sizes and bandwidths are missing
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(bad.status().message(), Catch::Contains("my.json: \"hbm_bytes_per_gpu\" is missing") &&
                                         Catch::Contains("\"base\"") && !Catch::Contains("positive"));
  bad = ParseHardwareJson(R"({"base": "nosuch"})", "my.json");
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(bad.status().message(), Catch::Contains("my.json: \"base\" is \"nosuch\", which is not a hardware preset") &&
                                         !Catch::Contains("JSON file"));
  bad = ParseHardwareJson(R"({"gpus": 8, "hbm_byte_per_gpu": 1000})", "my.json");  // a misspelt key, no base
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(bad.status().message(), Catch::Contains("unknown key \"hbm_byte_per_gpu\""));
  // Zero sizes are refused (docs/plan.md), and so is an HBM total past 2^64 bytes (it would wrap).
  for (const char* key : {"host_bytes", "nvme_bytes", "hbm_bytes_per_gpu"}) {
    bad = ParseHardwareJson(fmt::format(R"({{"base": "h200-gen5", "{}": 0}})", key), "my.json");
    REQUIRE_FALSE(bad.ok());
    CHECK_THAT(bad.status().message(), Catch::Contains(key) && Catch::Contains("positive"));
  }
  bad = ParseHardwareJson(R"({"base": "h200-gen5", "hbm_bytes_per_gpu": 3e18, "gpus": 8})", "my.json");
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(bad.status().message(), Catch::Contains("hbm_bytes_per_gpu") && Catch::Contains("2^64"));
  // A rate past any node (1e308 would be inf once multiplied by the GPUs: a decode speed of 0) is
  // refused naming the key; a number no double holds is named as out of range, not "not an object".
  for (const char* key : {"hbm_bandwidth_per_gpu", "pcie_bandwidth_per_gpu", "nvme_read_bandwidth",
                          "nvme_write_bandwidth", "gpu_flops_per_gpu"}) {
    bad = ParseHardwareJson(fmt::format(R"({{"base": "h200-gen5", "{}": 1e308}})", key), "my.json");
    REQUIRE_FALSE(bad.ok());
    CHECK_THAT(bad.status().message(), Catch::Contains(key) && Catch::Contains("1e+308"));
  }
  // Sizes and rates far under any node are a units mistake (GB and GB/s given as bytes and bytes/s):
  // planned, they printed 1e12 % link utilisation and "add GPUs".
  for (const char* key : {"host_bytes", "nvme_bytes", "hbm_bytes_per_gpu"}) {
    bad = ParseHardwareJson(fmt::format(R"({{"base": "h200-gen5", "{}": 141}})", key), "my.json");
    REQUIRE_FALSE(bad.ok());
    CHECK_THAT(bad.status().message(), Catch::Contains(key) && Catch::Contains("is 141, under the 1 MiB") &&
                                           Catch::Contains("check the units"));
    bad = ParseHardwareJson(fmt::format(R"({{"base": "h200-gen5", "{}": 1048576.5}})", key), "my.json");
    REQUIRE_FALSE(bad.ok());
    CHECK_THAT(bad.status().message(), Catch::Contains(key) && Catch::Contains("whole, positive number of bytes"));
    bad = ParseHardwareJson(fmt::format(R"({{"base": "h200-gen5", "{}": -5}})", key), "my.json");
    REQUIRE_FALSE(bad.ok());
    CHECK_THAT(bad.status().message(), Catch::Contains(key) && Catch::Contains("whole, positive number of bytes"));
  }
  for (const char* key : {"hbm_bandwidth_per_gpu", "pcie_bandwidth_per_gpu", "nvme_read_bandwidth",
                          "nvme_write_bandwidth", "gpu_flops_per_gpu"}) {
    for (const char* value : {"55", "1e-300"}) {
      bad = ParseHardwareJson(fmt::format(R"({{"base": "h200-gen5", "{}": {}}})", key, value), "my.json");
      REQUIRE_FALSE(bad.ok());
      CHECK_THAT(bad.status().message(), Catch::Contains(key) && Catch::Contains("under the") &&
                                             Catch::Contains("check the units"));
    }
  }
  bad = ParseHardwareJson(R"({"base": "h200-gen5", "host_bytes": 1e30})", "my.json");
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(bad.status().message(), Catch::Contains("host_bytes") && Catch::Contains("2^62"));
  bad = ParseHardwareJson(R"({"base": "h200-gen5", "hbm_bandwidth_per_gpu": 1e400})", "my.json");
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(bad.status().message(), Catch::Contains("my.json") && Catch::Contains("out of range") &&
                                         Catch::Contains("1e400") && !Catch::Contains("not a JSON object"));
  bad = ParseHardwareJson(R"({"base": "h200-gen5", "gpus": 4, "gpus": 8})", "my.json");
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(bad.status().message(), Catch::Contains("my.json") && Catch::Contains("duplicate key \"gpus\""));
  bad = ParseHardwareJson("[1]", "my.json");
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(bad.status().message(), Catch::Contains("not a JSON object"));
  auto round = ParseHardwareJson(HardwareToJson(*HardwarePreset("h200-gen5")), "x");
  REQUIRE(round.ok());
  CHECK(round->pcie_bandwidth_per_gpu == 55e9);
  CHECK_FALSE(HardwarePreset("a100").ok());
}

TEST_CASE("HBM presets are the driver's total per GPU in MiB (nvidia-smi), not the data sheet's GB") {
  // nvidia-smi --query-gpu=memory.total: 143771 MiB on an H200, 81559 MiB on an H100 80GB SXM.
  auto h200 = HardwarePreset("h200-gen5");
  auto h100 = HardwarePreset("h100-gen4");
  REQUIRE(h200.ok());
  REQUIRE(h100.ok());
  CHECK(h200->hbm_bytes_per_gpu == 143'771ull * 1024 * 1024);
  CHECK(h100->hbm_bytes_per_gpu == 81'559ull * 1024 * 1024);
  CHECK(h200->hbm_bytes() == 8 * 143'771ull * 1024 * 1024);
  // The plan's HBM tier is what the preset says.
  CHECK(K3Plan().tiers[0].capacity_bytes == 8 * 143'771ull * 1024 * 1024);
}

TEST_CASE("Hardware JSON without a name or base takes its path as the name; HardwareToJson survives a non-UTF-8 one") {
  auto preset = HardwarePreset("h100-gen4");
  REQUIRE(preset.ok());
  nlohmann::json j = nlohmann::json::parse(HardwareToJson(*preset));
  j.erase("name");
  auto h = ParseHardwareJson(j.dump(), "s\xe9.json");
  REQUIRE(h.ok());
  CHECK(h->name == "s\xe9.json");
  const std::string text = HardwareToJson(*h);  // threw type_error.316 before
  CHECK_THAT(text, Catch::Contains("\"name\":\"s\xef\xbf\xbd.json\""));
}

TEST_CASE("Routing FLOPs come from the router gate tensors: 2 x experts x hidden per MoE layer") {
  const Plan p = K3Plan();
  // K3's router gate is [896 experts, 7168 hidden] in each of the 92 MoE layers (not the 3584-wide latent).
  CHECK(p.lifecycle.router_flops_per_token == Approx(2.0 * 896 * 7168 * 92));
  CHECK(p.lifecycle.routing_flops_share ==
        Approx(896.0 * 7168 * 92 / p.weights.active_params_per_token));
}

TEST_CASE("--context parses token counts and weighted distributions") {
  auto one = ParseContextDistribution("32k", "--context");
  REQUIRE(one.ok());
  REQUIRE(one->size() == 1);
  CHECK((*one)[0].tokens == 32768);
  CHECK((*one)[0].share == 1.0);
  auto d = ParseContextDistribution("4k:1,32768:2,1M:1", "--context");
  REQUIRE(d.ok());
  REQUIRE(d->size() == 3);
  CHECK((*d)[0].tokens == 4096);
  CHECK((*d)[1].share == Approx(0.5));
  CHECK((*d)[2].tokens == 1048576);
  for (const char* bad : {"", "0", "32x", "-5", "4k:0.5,32k", "4k:0", "4k:-1", "4k:x", "17M", "4k,,8k", "1.5k"}) {
    auto r = ParseContextDistribution(bad, "--context");
    CHECK_FALSE(r.ok());
    if (!r.ok()) CHECK_THAT(r.status().message(), Catch::Contains("--context"));
  }
}

TEST_CASE("A context distribution plans like its mean (every figure is linear in length) and bounds the longest") {
  PlanOptions dist, mean;
  dist.workload.context = *ParseContextDistribution("4k:1,128k:1", "--context");
  mean.workload.context = *ParseContextDistribution("67584", "--context");  // (4096 + 131072) / 2
  const Plan a = SmallPlan(dist), b = SmallPlan(mean);
  CHECK(a.memory.sequence_bytes == b.memory.sequence_bytes);
  for (std::size_t i = 0; i < a.bandwidth.size(); ++i) CHECK(a.bandwidth[i].required == Approx(b.bandwidth[i].required));
  CHECK(a.lifecycle.offload_bytes_per_request == b.lifecycle.offload_bytes_per_request);
  // Per entry: (context + decode) x MLA per token + the fixed KDA state; their share-weighted mean is the mean's.
  REQUIRE(a.memory.per_context.size() == 2);
  double weighted = 0;
  for (const auto& r : a.memory.per_context) {
    CHECK(r.bytes == r.tokens * a.memory.mla_bytes_per_token + a.memory.kda_state_bytes_per_sequence);
    weighted += r.share * static_cast<double>(r.bytes);
  }
  CHECK(weighted == Approx(static_cast<double>(a.memory.sequence_bytes)));
  CHECK(a.memory.longest_sequence_tokens == 131072 + 512);
  for (const TierPlan& t : a.tiers) {
    CHECK(t.sequences_longest == t.kv_bytes / a.memory.longest_sequence_bytes);
    CHECK(t.sequences_longest < t.sequences);
  }
}

TEST_CASE("Every workload input moves the figures it should") {
  const Plan base = SmallPlan();
  auto with = [](auto set) {
    PlanOptions o;
    set(o.workload);
    return SmallPlan(o);
  };
  // --rate: linear in every bandwidth line and in the prefill load.
  const Plan r2 = with([](Workload& w) { w.rate_rps = 2; });
  for (std::size_t i = 0; i < base.bandwidth.size(); ++i) {
    CHECK(r2.bandwidth[i].required == Approx(2 * base.bandwidth[i].required));
  }
  CHECK(r2.lifecycle.prefill_utilisation == Approx(2 * base.lifecycle.prefill_utilisation));
  // --prefix-reuse: restores grow, prefill shrinks.
  const Plan reuse = with([](Workload& w) { w.prefix_reuse = 0.9; });
  CHECK(reuse.bandwidth[3].required > base.bandwidth[3].required);  // nvme-read: restores
  CHECK(reuse.lifecycle.prefill_tokens_needed_per_s == Approx(1.0 * 0.1 * 32768));
  // --concurrency: more sequences read per decode step, more tokens per step.
  const Plan conc = with([](Workload& w) { w.concurrency = 64; });
  CHECK(conc.lifecycle.decode_step_s > base.lifecycle.decode_step_s);
  CHECK(conc.lifecycle.decode_tokens_per_s > base.lifecycle.decode_tokens_per_s);
  // --decode-tokens: longer sequences, more decode tokens needed.
  const Plan dec = with([](Workload& w) { w.decode_tokens = 1024; });
  CHECK(dec.memory.sequence_bytes == base.memory.sequence_bytes + 512 * base.memory.mla_bytes_per_token);
  CHECK(dec.lifecycle.decode_tokens_needed_per_s == Approx(2 * base.lifecycle.decode_tokens_needed_per_s));
}

TEST_CASE("A workload that does not fit is reported in CLI flag words; an expert cache larger than HBM is refused") {
  PlanOptions o;
  o.workload.concurrency = 100000;
  const Plan p = SmallPlan(o);
  bool named = false;
  for (const std::string& w : p.warnings) named = named || w.find("--concurrency 100000") != std::string::npos;
  CHECK(named);
  PlanOptions light;
  light.workload.rate_rps = 0.01;
  CHECK(SmallPlan(light).warnings.empty());

  auto c = model::Preset("k3-small");
  auto hw = HardwarePreset("h200-gen5");
  REQUIRE(c.ok());
  REQUIRE(hw.ok());
  o = {};
  o.expert_cache_bytes = 10ull << 40;
  auto r = MakePlan(*c, "k3-small", *hw, o);
  REQUIRE_FALSE(r.ok());
  CHECK_THAT(r.status().message(), Catch::Contains("--expert-cache") && Catch::Contains("HBM"));
}

TEST_CASE("Stored MLA bytes per token are the store's chunk blocks: near nominal in bf16, more with int4 scales") {
  const Plan bf16 = K3Plan("bf16");
  CHECK(bf16.memory.mla_stored_bytes_per_token == Approx(bf16.memory.mla_chunk_block_bytes / 256.0));
  // bf16: one 4 KiB header + 24 sub-ranges of 256 x 576 x 2 B payload, each with its codec header
  // padded to 4 KiB (at most one alignment unit more than the payload).
  const std::uint64_t payload = 24ull * 256 * 576 * 2 + 4096;
  CHECK(bf16.memory.mla_chunk_block_bytes > payload);
  CHECK(bf16.memory.mla_chunk_block_bytes <= payload + 24ull * 4096);
  const Plan int4 = K3Plan("int4-g32");
  CHECK(int4.memory.mla_bytes_per_token * 4 == bf16.memory.mla_bytes_per_token);  // nominal 0.5 B/value
  // Stored: the group scales make it more than nominal.
  CHECK(int4.memory.mla_stored_bytes_per_token > 1.1 * static_cast<double>(int4.memory.mla_bytes_per_token));
}

TEST_CASE("The default expert cache is at most all routed experts; a larger --expert-cache is capped at them") {
  // k3-small: 11 MoE layers x 64 experts x 3 x 256 x 256 MXFP4 weights at 1/2 + 1/32 byte = 70.1 MiB,
  // far below half of 8 H200s' HBM.
  const std::uint64_t all_experts = 11ull * 64 * (3 * 256 * 256 / 2 + 3 * 256 * 256 / 32);
  const Plan p = SmallPlan();
  CHECK(p.weights.routed_expert_bytes == all_experts);
  CHECK(p.experts.budget_bytes == all_experts);
  CHECK_FALSE(p.experts.budget_capped);
  CHECK(p.experts.cached_per_layer == 64);
  // HBM is charged for what the cache holds, the rest is KV's.
  const std::uint64_t hbm = 8 * 143'771ull * 1024 * 1024;
  CHECK(p.tiers[0].kv_bytes == hbm - p.weights.resident_bytes - all_experts);
  PlanOptions o;
  o.expert_cache_bytes = 1ull << 30;
  const Plan c = SmallPlan(o);
  CHECK(c.experts.budget_bytes == all_experts);
  CHECK(c.experts.budget_capped);
  CHECK(c.experts.budget_requested_bytes == 1ull << 30);
  CHECK(c.tiers[0].kv_bytes == p.tiers[0].kv_bytes);
  // A budget below all experts is taken as given.
  o.expert_cache_bytes = 32ull << 20;
  const Plan s = SmallPlan(o);
  CHECK(s.experts.budget_bytes == 32ull << 20);
  CHECK_FALSE(s.experts.budget_capped);
  // K3's 1.3 TiB of routed experts are more than half the HBM left: the default stays half of it.
  const Plan k3 = K3Plan();
  CHECK(k3.experts.budget_bytes == (hbm - k3.weights.resident_bytes) / 2);
}

TEST_CASE("Resident weights larger than the HBM are a warning naming the fix; the rates are marked hypothetical") {
  // K3's resident weights (~105.7 GiB) against one H100 (81559 MiB) and two.
  auto c = model::Preset("kimi-k3");
  REQUIRE(c.ok());
  auto hw = HardwarePreset("h100-gen4");
  REQUIRE(hw.ok());
  hw->gpus = 1;
  auto one = MakePlan(*c, "kimi-k3", *hw, {});
  REQUIRE(one.ok());
  CHECK_FALSE(one->weights.resident_fits_hbm);
  REQUIRE_FALSE(one->warnings.empty());
  CHECK_THAT(one->warnings[0], Catch::Contains("resident weights") &&
                                   Catch::Contains(fmt::format("{:.1f} GiB of HBM", 81'559 / 1024.0)) &&
                                   Catch::Contains("does not fit") && Catch::Contains("--hardware gpus") &&
                                   Catch::Contains("rates"));
  for (const std::string& w : one->warnings) CHECK_THAT(w, !Catch::Contains("lower --concurrency, --context"));
  hw->gpus = 2;
  auto two = MakePlan(*c, "kimi-k3", *hw, {});
  REQUIRE(two.ok());
  CHECK(two->weights.resident_fits_hbm);
  for (const std::string& w : two->warnings) CHECK_THAT(w, !Catch::Contains("resident weights"));
}

TEST_CASE("Routed experts are sized in the checkpoint's format: Kimi Linear's BF16, K3's MXFP4") {
  CHECK(*PresetExpertFormat("kimi-linear-48b") == model::ExpertFormat::kF32);
  CHECK(*PresetExpertFormat("kimi-k3") == model::ExpertFormat::kMxfp4);
  CHECK(*PresetExpertFormat("k3-small") == model::ExpertFormat::kMxfp4);
  CHECK_FALSE(PresetExpertFormat("gpt-9").ok());
  auto c = model::Preset("kimi-linear-48b");
  REQUIRE(c.ok());
  auto hw = HardwarePreset("h200-gen5");
  REQUIRE(hw.ok());
  PlanOptions o;
  o.expert_format = model::ExpertFormat::kF32;
  auto p = MakePlan(*c, "kimi-linear-48b", *hw, o);
  REQUIRE(p.ok());
  CHECK(p->weights.expert_format == "bf16");
  // w1, w2, w3 of 1024 x 2304 in BF16; 256 experts in each of 26 MoE layers: 87.75 GiB.
  CHECK(p->weights.expert_bytes == 3ull * 1024 * 2304 * 2);
  CHECK(p->weights.routed_expert_bytes == 26ull * 256 * 3 * 1024 * 2304 * 2);
  o.expert_format = model::ExpertFormat::kMxfp4;
  auto q = MakePlan(*c, "kimi-linear-48b", *hw, o);
  REQUIRE(q.ok());
  CHECK(q->weights.expert_format == "mxfp4");
  CHECK(q->weights.expert_bytes == 3ull * 1024 * 2304 / 2 + 3ull * 1024 * 2304 / 32);
  // The format changes the bytes, not the parameters.
  CHECK(q->weights.active_params_per_token == p->weights.active_params_per_token);
}

TEST_CASE("The input-embedding lookup is not an active parameter nor read whole per step; tied, it is the lm_head") {
  // Tied and untied K3 differ only by the lm_head tensor [163840, 7168]. Untied, the embedding is a
  // lookup (left out) and the lm_head counts; tied, the embedding is the lm_head and counts once:
  // the same active parameters either way.
  auto c = model::Preset("kimi-k3");
  REQUIRE(c.ok());
  auto hw = HardwarePreset("h200-gen5");
  REQUIRE(hw.ok());
  auto untied = MakePlan(*c, "kimi-k3", *hw, {});
  c->tie_word_embeddings = true;
  auto tied = MakePlan(*c, "kimi-k3", *hw, {});
  REQUIRE(untied.ok());
  REQUIRE(tied.ok());
  CHECK(untied->weights.resident_bytes - tied->weights.resident_bytes == 163840ull * 7168 * 2);
  CHECK(untied->weights.active_params_per_token == tied->weights.active_params_per_token);
  CHECK(untied->weights.lookup_embedding_bytes == 163840ull * 7168 * 2);
  CHECK(untied->weights.embedding_row_bytes == 7168u * 2);
  CHECK(tied->weights.lookup_embedding_bytes == 0);
  // A decode step reads the lm_head either way; untied it also reads one embedding row per sequence
  // (32 at the default --concurrency), not the whole table.
  CHECK(untied->lifecycle.decode_step_bytes - tied->lifecycle.decode_step_bytes == Approx(32.0 * 7168 * 2));
  CHECK(untied->lifecycle.prefill_tokens_per_s == Approx(tied->lifecycle.prefill_tokens_per_s));
}

TEST_CASE("Write-back counts the KDA snapshot the store writes at every chunk boundary of the new prompt") {
  // K3 defaults: 32k prompt, half restored, so 16384 new tokens = 64 chunks of 256, a snapshot at
  // each (snapshot_every 1) of 69 KDA layers x state_block_bytes; KV at the stored bytes per token.
  // Generated tokens are not written.
  const Plan p = K3Plan();
  const double snapshot = 69.0 * static_cast<double>(p.memory.state_block_bytes);
  CHECK(p.lifecycle.snapshot_bytes == snapshot);
  CHECK(p.lifecycle.snapshots_per_request == Approx(64.0));
  const double wb = 16384.0 * p.memory.mla_stored_bytes_per_token + 64.0 * snapshot;
  CHECK(p.lifecycle.writeback_bytes_per_request == Approx(wb));
  CHECK(p.lifecycle.restore_bytes_per_request == Approx(16384.0 * p.memory.mla_stored_bytes_per_token + snapshot));
  REQUIRE(p.bandwidth.size() == 5);
  CHECK(p.bandwidth[2].link == "pcie-d2h");
  CHECK(p.bandwidth[2].required == Approx(wb));  // --rate 1
  CHECK(p.bandwidth[4].link == "nvme-write");
  CHECK(p.bandwidth[4].required == Approx(wb));
  CHECK(p.bandwidth[4].utilisation() == Approx(wb / 64e9));  // ~47% of the preset's 64 GB/s
  CHECK(p.lifecycle.offload_bytes_per_request >= static_cast<std::uint64_t>(wb));
  // --rate 3 needs ~140% of nvme-write: a warning naming the link.
  PlanOptions r3;
  r3.workload.rate_rps = 3;
  const Plan q = K3Plan("bf16", r3);
  bool warned = false;
  for (const std::string& w : q.warnings) warned = warned || w.find("link nvme-write") != std::string::npos;
  CHECK(warned);
  // The layout's snapshot interval decides the count: every 2 chunks over the new chunks 65..128 is 32 (the last,
  // 128, is due anyway); 0 is the last full chunk's only.
  PlanOptions e2, e0;
  e2.layout.snapshot_every = 2;
  e0.layout.snapshot_every = 0;
  CHECK(K3Plan("bf16", e2).lifecycle.snapshots_per_request == Approx(32.0));
  CHECK(K3Plan("bf16", e0).lifecycle.snapshots_per_request == Approx(1.0));
  // The chunk size too: 512-token chunks halve the snapshots.
  PlanOptions c512;
  c512.layout.chunk_tokens = 512;
  CHECK(K3Plan("bf16", c512).lifecycle.snapshots_per_request == Approx(32.0));
  // --decode-tokens does not change what is written.
  PlanOptions dec;
  dec.workload.decode_tokens = 4096;
  CHECK(K3Plan("bf16", dec).lifecycle.writeback_bytes_per_request == Approx(wb));
}

TEST_CASE("Routed experts larger than host RAM: their misses are read from NVMe and the nvme-read line counts them") {
  auto c = model::Preset("kimi-k3");
  REQUIRE(c.ok());
  auto hw = HardwarePreset("h200-gen5");
  REQUIRE(hw.ok());
  auto fits = MakePlan(*c, "kimi-k3", *hw, {});
  hw->host_bytes = 1ull << 20;
  auto small = MakePlan(*c, "kimi-k3", *hw, {});
  REQUIRE(fits.ok());
  REQUIRE(small.ok());
  const double misses = small->experts.miss_bytes_per_token_batched * small->lifecycle.decode_tokens_needed_per_s;
  CHECK(small->bandwidth[3].link == "nvme-read");
  CHECK(small->bandwidth[3].required == Approx(small->lifecycle.restore_bytes_per_request + misses));
  CHECK(fits->bandwidth[3].required == Approx(fits->lifecycle.restore_bytes_per_request));
  CHECK(small->bandwidth[3].utilisation() > 10);
  bool warned = false;
  for (const std::string& w : small->warnings) warned = warned || w.find("link nvme-read") != std::string::npos;
  CHECK(warned);
}

TEST_CASE("A tier smaller than what the plan puts there is a warning naming the tier and the hardware key") {
  auto c = model::Preset("kimi-k3");
  REQUIRE(c.ok());
  auto hw = HardwarePreset("h200-gen5");
  REQUIRE(hw.ok());
  auto ok = MakePlan(*c, "kimi-k3", *hw, {});
  REQUIRE(ok.ok());
  for (const std::string& w : ok->warnings) CHECK(w.find("tier") == std::string::npos);
  hw->nvme_bytes = 1ull << 20;
  auto p = MakePlan(*c, "kimi-k3", *hw, {});
  REQUIRE(p.ok());
  bool warned = false;
  for (const std::string& w : p->warnings) {
    warned = warned || (w.find("the nvme tier's 1.0 MiB cannot hold the checkpoint") != std::string::npos &&
                        w.find("raise nvme_bytes (--hardware)") != std::string::npos);
  }
  CHECK(warned);
}

TEST_CASE("MXFP4 experts need dimensions in whole 32-value blocks, as model init requires") {
  auto c = model::Preset("k3-small");
  REQUIRE(c.ok());
  auto hw = HardwarePreset("h200-gen5");
  REQUIRE(hw.ok());
  c->moe_intermediate_size = 200;
  PlanOptions o;
  auto p = MakePlan(*c, "k3-small", *hw, o);
  REQUIRE_FALSE(p.ok());
  CHECK_THAT(p.status().message(), Catch::Contains("config field 'moe_intermediate_size' is 200") &&
                                       Catch::Contains("must be a multiple of 32"));
  // Plain-float experts have no blocks.
  o.expert_format = model::ExpertFormat::kF32;
  CHECK(MakePlan(*c, "k3-small", *hw, o).ok());
  CHECK(CheckExpertDims(*c, model::ExpertFormat::kF32, "").ok());
}

TEST_CASE("--expert-cache 0 is honoured as no expert cache; a full cache hits exactly 1 and never stalls") {
  PlanOptions zero;
  zero.expert_cache_bytes = 0;
  const Plan z = SmallPlan(zero), d = SmallPlan();
  CHECK(z.experts.budget_given);
  CHECK_FALSE(d.experts.budget_given);
  CHECK(z.experts.budget_bytes == 0);
  CHECK(z.experts.cached_per_layer == 0);
  CHECK(z.experts.hit_rate == 0.0);
  CHECK(z.experts.stall_s_per_token_batch1 > d.experts.stall_s_per_token_batch1);
  // k3-small's default budget holds every routed expert.
  REQUIRE(d.experts.cached_per_layer == d.weights.experts_per_layer);
  CHECK(d.experts.hit_rate == 1.0);
  CHECK(d.experts.stall_s_per_token_batch1 == 0.0);
  CHECK(d.experts.stall_s_per_token_batched == 0.0);
}
