#include <cmath>
#include <fstream>
#include <iterator>

#include <catch2/catch.hpp>

#include "src/model/inspect.h"
#include "src/model/mxfp4.h"
#include "src/model/names.h"
#include "src/model/safetensors.h"
#include "src/model/weights_init.h"
#include "test_util.h"

using namespace terrace::model;
using terrace::testing::TempDir;

namespace {

std::string Slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::vector<float> Values(const ModelDir& md, const TensorSpec& s) {
  if (!s.mxfp4) return ToFloat(*md.Get(s.name), s.name)->data;
  const std::string base = s.name.substr(0, s.name.rfind('.') + 1);
  auto packed = md.Get(base + "weight_packed");
  auto scales = md.Get(base + "weight_scale");
  const std::int64_t rows = packed->shape[0], cols = packed->shape[1] * 2;
  std::vector<float> out(static_cast<std::size_t>(rows * cols));
  auto u8 = [](const TensorView& v) {
    return std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(v.data.data()), v.data.size());
  };
  REQUIRE(DequantizeMxfp4(u8(*packed), u8(*scales), rows, cols, out).ok());
  return out;
}

}  // namespace

TEST_CASE("model init writes every expected tensor with its shape and dtype", "[init]") {
  TempDir dir("init");
  const ModelConfig c = *Preset("k3-toy");
  REQUIRE(InitWeights(c, dir.path(), InitOptions{7}).ok());
  CHECK(std::filesystem::exists(dir.path() / "model.safetensors"));
  CHECK(!std::filesystem::exists(dir.path() / "model.safetensors.index.json"));
  auto md = ModelDir::Open(dir.path());  // validates against ExpectedTensors
  REQUIRE(md.ok());
  CHECK(ToConfigJson((*md)->config()) == ToConfigJson(c));
  const auto specs = ExpectedTensors(c);
  CHECK((*md)->Names().size() == specs.size());
  std::uint64_t bytes = 0;
  for (const auto& s : specs) {
    auto v = (*md)->Get(s.name);
    REQUIRE(v.ok());
    CHECK(v->dtype == s.dtype);
    CHECK(v->shape == s.shape);
    bytes += v->data.size();
  }
  CHECK(bytes == WeightBytes(c));
}

TEST_CASE("model init is deterministic for a seed", "[init]") {
  TempDir a("init"), b("init"), d("init");
  const ModelConfig c = *Preset("k3-toy");
  REQUIRE(InitWeights(c, a.path(), InitOptions{42}).ok());
  REQUIRE(InitWeights(c, b.path(), InitOptions{42}).ok());
  REQUIRE(InitWeights(c, d.path(), InitOptions{43}).ok());
  const std::string fa = Slurp(a.path() / "model.safetensors");
  CHECK(fa.size() > 1'000'000);
  CHECK(fa == Slurp(b.path() / "model.safetensors"));
  CHECK(fa != Slurp(d.path() / "model.safetensors"));
  CHECK(Slurp(a.path() / "config.json") == Slurp(b.path() / "config.json"));
}

TEST_CASE("sharded init holds the same tensors as the single file", "[init]") {
  TempDir one("init"), many("init");
  const ModelConfig c = *Preset("k3-toy");
  REQUIRE(InitWeights(c, one.path(), InitOptions{5}).ok());
  InitOptions sharded{5};
  sharded.shard_bytes = 1 << 20;
  REQUIRE(InitWeights(c, many.path(), sharded).ok());
  CHECK(std::filesystem::exists(many.path() / "model.safetensors.index.json"));
  CHECK(!std::filesystem::exists(many.path() / "model.safetensors"));
  auto a = ModelDir::Open(one.path());
  auto b = ModelDir::Open(many.path());
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK((*b)->num_shards() > 3);
  CHECK((*a)->Names() == (*b)->Names());
  for (const auto& name : (*a)->Names()) {
    auto x = (*a)->Get(name);
    auto y = (*b)->Get(name);
    REQUIRE(y.ok());
    CHECK(x->shape == y->shape);
    CHECK(std::equal(x->data.begin(), x->data.end(), y->data.begin(), y->data.end()));
  }
  // Re-initialising the sharded directory as a single file removes the old shards and index.
  REQUIRE(InitWeights(c, many.path(), InitOptions{5}).ok());
  CHECK(!std::filesystem::exists(many.path() / "model.safetensors.index.json"));
  CHECK(!std::filesystem::exists(many.path() / "model-00001-of-00002.safetensors"));
  REQUIRE(ModelDir::Open(many.path()).ok());
}

TEST_CASE("init scales keep weights well conditioned", "[init]") {
  TempDir dir("init");
  const ModelConfig c = *Preset("k3-toy");
  REQUIRE(InitWeights(c, dir.path(), InitOptions{3}).ok());
  auto md = ModelDir::Open(dir.path());
  REQUIRE(md.ok());
  for (const auto& s : ExpectedTensors(c)) {
    if (s.name.ends_with("weight_scale")) continue;
    INFO(s.name);
    const std::vector<float> v = Values(**md, s);
    double sum = 0, sq = 0;
    std::size_t non_finite = 0;
    for (float x : v) {
      non_finite += !std::isfinite(x);
      sum += x;
      sq += static_cast<double>(x) * x;
    }
    REQUIRE(non_finite == 0);
    const double n = static_cast<double>(v.size());
    const double mean = sum / n, rms = std::sqrt(sq / n);
    if (s.name.ends_with("norm.weight")) {
      CHECK(std::fabs(mean - 1.0) < 0.05);
    } else if (s.name.ends_with("_res_proj.weight")) {
      CHECK(rms > 0.0);  // small non-zero pseudo-queries
      CHECK(rms * std::sqrt(static_cast<double>(c.hidden_size)) < 1.0);
    } else if (s.name.ends_with("q_proj.weight") || s.name.ends_with("gate.weight") || s.name.ends_with(".w1.weight_packed")) {
      // Plain linear layers: rms ~ 1/sqrt(fan_in) (MXFP4 adds a little quantisation noise).
      const double want = 1.0 / std::sqrt(static_cast<double>(s.mxfp4 ? s.shape[1] * 2 : s.shape[1]));
      CHECK(rms == Approx(want).epsilon(0.15));
    } else if (s.name.ends_with(".A_log")) {
      for (float x : v) CHECK((std::exp(x) >= 0.499f && std::exp(x) <= 1.501f));
    }
  }
}

TEST_CASE("init refuses huge presets unless forced, and bad options", "[init]") {
  TempDir dir("init");
  for (const char* name : {"kimi-k3", "kimi-linear-48b"}) {
    auto s = InitWeights(*Preset(name), dir.path() / name, InitOptions{1});
    REQUIRE(s.IsInvalidArgument());
    CHECK(s.message().find("--force") != std::string::npos);
    CHECK(!std::filesystem::exists(dir.path() / name));
  }
  CHECK(WeightBytes(*Preset("kimi-k3")) > (500ull << 30));
  InitOptions zero{1};
  zero.shard_bytes = 0;
  CHECK(InitWeights(*Preset("k3-toy"), dir.path() / "z", zero).IsInvalidArgument());
}

TEST_CASE("the loader and inspect flag missing, wrong-shape and unexpected tensors", "[init][inspect]") {
  TempDir dir("init");
  ModelConfig c = *Preset("k3-toy");
  c.num_experts = 4;  // keep it small
  c.num_experts_per_token = 2;
  REQUIRE(InitWeights(c, dir.path(), InitOptions{9}).ok());
  {
    auto r = InspectModelDir(dir.path());
    REQUIRE(r.ok());
    CHECK(r->problems.empty());
    CHECK(r->all.tensors == ExpectedTensors(c).size());
    CHECK(r->all.bytes == WeightBytes(c));
    std::uint64_t sum = 0;
    for (const auto& t : r->totals) sum += t.bytes;
    CHECK(sum == r->all.bytes);
    CHECK(FormatInspectJson(*r, true).find("\"routed_experts\"") != std::string::npos);
  }
  // Rewrite the file with one tensor dropped, one reshaped and one extra.
  const std::string dropped = AttnTensorName(0, "q_proj.weight");
  const std::string reshaped = MoeTensorName(1, "gate.weight");
  {
    auto md = ModelDir::Open(dir.path());
    REQUIRE(md.ok());
    SafetensorsWriter w;
    for (const auto& name : (*md)->Names()) {
      if (name == dropped) continue;
      auto v = (*md)->Get(name);
      std::vector<std::int64_t> shape = v->shape;
      if (name == reshaped) shape = {shape[1], shape[0]};
      REQUIRE(w.Add(name, v->dtype, shape, v->data).ok());
    }
    const std::vector<float> extra{1.0f};
    REQUIRE(w.Add("language_model.model.extra", DType::kF32, {1}, std::as_bytes(std::span(extra))).ok());
    md->reset();  // unmap before replacing the file
    REQUIRE(w.Write(dir.path() / "model.safetensors").ok());
  }
  auto md = ModelDir::Open(dir.path());
  REQUIRE(md.status().IsInvalidArgument());
  CHECK(md.status().message().find("num_experts = 4") != std::string::npos);
  CHECK(md.status().message().find("and 3 more problems") != std::string::npos);
  auto r = InspectModelDir(dir.path());
  REQUIRE(r.ok());
  std::string all;
  for (const auto& p : r->problems) all += p + "\n";
  INFO(all);
  REQUIRE(r->problems.size() == 4);
  // The router's shape disagrees with num_experts: said first, in the config's terms.
  CHECK(r->problems.front().find("num_experts = 4, but tensor '" + reshaped + "' has shape [256, 4]") !=
        std::string::npos);
  CHECK(all.find(dropped + "' is missing") != std::string::npos);
  CHECK(all.find(reshaped + "' has shape [256, 4], expected [4, 256]") != std::string::npos);
  CHECK(all.find("language_model.model.extra") != std::string::npos);
}

TEST_CASE("ModelDir rejects broken indexes", "[init]") {
  TempDir dir("init");
  ModelConfig c = *Preset("k3-toy");
  InitOptions o{2};
  o.shard_bytes = 1 << 21;
  REQUIRE(InitWeights(c, dir.path(), o).ok());
  const auto index = dir.path() / "model.safetensors.index.json";
  const std::string good = Slurp(index);
  auto write = [&](const std::string& text) { std::ofstream(index, std::ios::binary | std::ios::trunc) << text; };
  write(R"({"weight_map": {"language_model.lm_head.weight": "../../etc/passwd"}})");
  CHECK(ModelDir::Open(dir.path(), false).status().IsCorruption());
  write(R"({"weight_map": {"language_model.lm_head.weight": "model-00001-of-00099.safetensors"}})");
  CHECK(ModelDir::Open(dir.path(), false).status().IsNotFound());
  write("{not json");
  CHECK(ModelDir::Open(dir.path(), false).status().IsCorruption());
  {  // a tensor mapped twice (to two shards) is refused, naming it
    const std::string name = "language_model.lm_head.weight";
    write(R"({"weight_map": {")" + name + R"(": "a.safetensors", ")" + name + R"(": "b.safetensors"}})");
    auto twice = ModelDir::Open(dir.path(), false);
    CHECK(twice.status().IsCorruption());
    CHECK(twice.status().message().find("duplicate key \"" + name + "\"") != std::string::npos);
  }
  write(good);
  CHECK(ModelDir::Open(dir.path()).ok());
  std::filesystem::remove(index);
  CHECK(ModelDir::Open(dir.path()).status().IsNotFound());
}
