// Key schema and KvLayout: sizes hand-computed from the presets, the namespace's documented byte
// string checked against XXH3 directly, keys identical across two processes, and every input of a
// key (model, layout, codec, tenant, tokens) changing it.
#include <catch2/catch.hpp>

#include <array>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include <fmt/format.h>

#include "src/model/weights_init.h"
#include "terrace/hash.h"
#include "terrace/keys.h"
#include "terrace/kv_layout.h"
#include "test_util.h"

namespace terrace::kv {
namespace {

model::ModelConfig PresetOrDie(const char* name) {
  auto c = model::Preset(name);
  REQUIRE(c.ok());
  return *c;
}

TEST_CASE("KvLayout of kimi-k3: MLA bf16 27648 B/token over 24 layers, KDA f32 state 6 MiB + conv") {
  const auto config = PresetOrDie("kimi-k3");
  auto layout = KvLayout::FromConfig(config, {});
  REQUIRE(layout.ok());
  CHECK(layout->chunk_tokens() == 256);
  CHECK(layout->mla_layers().size() == 24);
  CHECK(layout->kda_layers().size() == 93 - 24);
  CHECK(layout->mla_layers().back() == 92);  // layer 93 (1-based) is MLA in K3
  CHECK(layout->mla_layers().front() == 3);
  CHECK(layout->mla_width() == 512 + 64);
  CHECK(layout->mla_bytes_per_token() == 576ull * 2 * 24);
  CHECK(layout->mla_bytes_per_token() == 27648);
  // 96 heads x 128 x 128 x 4 B = 6 MiB.
  CHECK(layout->kda_recurrent_bytes_per_layer() == 6ull << 20);
  // (kernel 4 - 1) rows x 3 * 96 * 128 channels x 4 B.
  CHECK(layout->kda_conv_bytes_per_layer() == 3ull * 3 * 96 * 128 * 4);
  CHECK(layout->kda_state_bytes_per_sequence() == ((6ull << 20) + 442368ull) * 69);
  // One chunk block holds 24 sub-ranges of 256 x 576 bf16 (+ the codec's header), each 4 KiB aligned.
  CHECK(layout->mla_chunk_block_bytes() >= 4096 + 24ull * 256 * 576 * 2);
  CHECK(layout->mla_chunk_block_bytes() % kSubRangeAlign == 0);
  CHECK(layout->chunk_header_bytes() % kSubRangeAlign == 0);
  CHECK(layout->state_block_bytes() >= (6ull << 20) + 442368ull);

  KvLayoutOptions fp32;
  fp32.kv_codec = {codec::CodecKind::kF32};
  fp32.state_codec = {codec::CodecKind::kBf16};
  auto l2 = KvLayout::FromConfig(config, fp32);
  REQUIRE(l2.ok());
  CHECK(l2->mla_bytes_per_token() == 576ull * 4 * 24);
  CHECK(l2->kda_recurrent_bytes_per_layer() == 3ull << 20);
  CHECK(l2->Id() != layout->Id());
}

TEST_CASE("KvLayout of k3-toy and option errors") {
  const auto config = PresetOrDie("k3-toy");
  auto layout = KvLayout::FromConfig(config, {.chunk_tokens = 16, .snapshot_every = 2});
  REQUIRE(layout.ok());
  CHECK(layout->mla_layers() == std::vector<int>{3, 7});
  CHECK(layout->kda_layers() == std::vector<int>{0, 1, 2, 4, 5, 6});
  CHECK(layout->mla_width() == 80);
  CHECK(layout->mla_bytes_per_token() == 80ull * 2 * 2);
  CHECK(layout->kda_recurrent_bytes_per_layer() == 4ull * 64 * 64 * 4);
  CHECK(layout->kda_conv_bytes_per_layer() == 3ull * 3 * 4 * 64 * 4);
  CHECK(layout->Id() ==
        "kv-layout-v2 chunk=16 mla=3,7 width=80 kda=0,1,2,4,5,6 kda_heads=4 kda_dim=64 kernel=4 kv=bf16 state=f32");
  CHECK(layout->SnapshotDue(2, 5));
  CHECK(!layout->SnapshotDue(3, 5));
  CHECK(layout->SnapshotDue(5, 5));  // the request's last full chunk
  auto end_only = KvLayout::FromConfig(config, {.chunk_tokens = 16, .snapshot_every = 0});
  REQUIRE(end_only.ok());
  CHECK(!end_only->SnapshotDue(2, 5));
  CHECK(end_only->SnapshotDue(5, 5));
  // snapshot_every decides which snapshots exist, not their bytes: same Id.
  CHECK(end_only->Id() == layout->Id());

  auto bad = KvLayout::FromConfig(config, {.chunk_tokens = 0});
  REQUIRE(!bad.ok());
  CHECK(bad.status().message().find("chunk_tokens") != std::string::npos);
  auto bad2 = KvLayout::FromConfig(config, {.snapshot_every = -1});
  REQUIRE(!bad2.ok());
  CHECK(bad2.status().message().find("snapshot_every") != std::string::npos);
  // A hand-filled codec spec that Encode refuses is refused here, not at every write-back.
  KvLayoutOptions int4_g0{.chunk_tokens = 16};
  int4_g0.kv_codec = {codec::CodecKind::kInt4, codec::ScaleMode::kGroup, 0};
  auto bad3 = KvLayout::FromConfig(config, int4_g0);
  REQUIRE(!bad3.ok());
  CHECK(bad3.status().IsInvalidArgument());
  CHECK(bad3.status().message().find("kv_codec") != std::string::npos);
  CHECK(bad3.status().message().find("group size 0") != std::string::npos);
  KvLayoutOptions kind42{.chunk_tokens = 16};
  kind42.state_codec.kind = static_cast<codec::CodecKind>(42);
  auto bad4 = KvLayout::FromConfig(config, kind42);
  REQUIRE(!bad4.ok());
  CHECK(bad4.status().IsInvalidArgument());
  CHECK(bad4.status().message().find("state_codec") != std::string::npos);
}

TEST_CASE("Namespace is the documented XXH3-64 byte string") {
  const ContentId model{0x0123456789abcdefull, 0xfedcba9876543210ull};
  std::string buf = "terrace-keys-v1";
  auto le = [&](std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) buf.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  le(model.hi, 8);
  le(model.lo, 8);
  le(6, 8);
  buf += "layout";
  le(4, 8);
  buf += "bf16";
  le(1, 4);
  const auto want = static_cast<std::uint32_t>(XXH3_64bits(buf.data(), buf.size()));
  CHECK(keys::Namespace(model, "layout", "bf16", 1) == want);
  // Its root is XXH3-128 of the same bytes.
  const XXH128_hash_t root = XXH3_128bits(buf.data(), buf.size());
  CHECK(keys::NamespaceRoot(model, "layout", "bf16", 1) == ContentId{root.high64, root.low64});
  CHECK(keys::NamespaceRoot(model, "layout", "bf16", 2) != ContentId{root.high64, root.low64});
  // The length prefixes keep ("ab", "c") and ("a", "bc") apart.
  CHECK(keys::Namespace(model, "ab", "c", 1) != keys::Namespace(model, "a", "bc", 1));
  CHECK(keys::Namespace(model, "layout", "bf16", 2) != want);
  CHECK(keys::Namespace(ContentId{model.hi, model.lo + 1}, "layout", "bf16", 1) != want);
}

TEST_CASE("chunk ids chain the tenant root and every token") {
  const std::uint32_t ns = 77;
  const ContentId root{0x1111, 0x2222};
  std::vector<std::int32_t> t(50);
  for (int i = 0; i < 50; ++i) t[static_cast<std::size_t>(i)] = i * 3;
  const auto ids = keys::ChunkIds(root, "", t, 16);
  REQUIRE(ids.size() == 3);  // 50 / 16 full chunks
  ContentId parent = keys::TenantRoot(root, "");
  for (std::size_t c = 0; c < 3; ++c) {
    parent = ChainContentId(parent, std::span(t).subspan(c * 16, 16));
    CHECK(ids[c] == parent);
  }
  CHECK(keys::TenantRoot(root, "") != root);
  CHECK(keys::TenantRoot(root, "a") != keys::TenantRoot(root, ""));
  CHECK(keys::TenantRoot(root, "a") != keys::TenantRoot(root, "b"));
  // Roots differing in any bit (as two namespaces sharing their 32 bits do) chain apart.
  CHECK(keys::TenantRoot(ContentId{root.hi ^ (1ull << 63), root.lo}, "a") != keys::TenantRoot(root, "a"));
  CHECK(keys::ChunkIds(ContentId{root.hi ^ (1ull << 63), root.lo}, "", t, 16)[0] != ids[0]);
  const auto other = keys::ChunkIds(root, "tenant-b", t, 16);
  for (std::size_t c = 0; c < 3; ++c) CHECK(other[c] != ids[c]);
  // A changed token changes its chunk and every later one, not the earlier ones.
  auto t2 = t;
  t2[20] += 1;
  const auto ids2 = keys::ChunkIds(root, "", t2, 16);
  CHECK(ids2[0] == ids[0]);
  CHECK(ids2[1] != ids[1]);
  CHECK(ids2[2] != ids[2]);

  const BlockKey kv = keys::KvChunkKey(ns, ids[1]);
  CHECK(kv == BlockKey{ns, BlockKind::kKv, 0, ids[1]});
  const BlockKey st = keys::StateKey(ns, 6, ids[1]);
  CHECK(st == BlockKey{ns, BlockKind::kState, 6, ids[1]});
  const BlockKey ex = keys::ExpertKey(ns, root, 3, 900);
  const std::int32_t which[2] = {3, 900};
  CHECK(ex == BlockKey{ns, BlockKind::kExpert, 3, ChainContentId(root, which)});
  CHECK(keys::ExpertKey(ns, ContentId{root.hi, root.lo ^ 1}, 3, 900) != ex);  // another model's root
  CHECK(keys::ExpertKey(ns, root, 3, 901) != ex);
}

std::string RunPrinter(const std::filesystem::path& dir, const std::string& tenant) {
  const std::string cmd = fmt::format("'{}' '{}' '{}'", KV_KEYS_PRINT, dir.string(), tenant);
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  std::array<char, 4096> buf{};
  while (std::fgets(buf.data(), buf.size(), p)) out += buf.data();
  REQUIRE(pclose(p) == 0);
  return out;
}

TEST_CASE("keys computed by two separate processes are identical; weights and tenant change them") {
  testing::TempDir dir("kvkeys");
  auto config = PresetOrDie("k3-toy");
  REQUIRE(model::InitWeights(config, dir.path() / "a", {.seed = 3}).ok());
  REQUIRE(model::InitWeights(config, dir.path() / "b", {.seed = 4}).ok());
  const std::string a1 = RunPrinter(dir.path() / "a", "");
  const std::string a2 = RunPrinter(dir.path() / "a", "");
  CHECK(a1 == a2);
  CHECK(std::count(a1.begin(), a1.end(), '\n') == 1 + 2 * 2 + 1);

  // In this process too.
  auto ckpt = model::OpenCheckpoint(dir.path() / "a");
  REQUIRE(ckpt.ok());
  const auto id = keys::ModelId(ckpt->config, *ckpt->weights);
  CHECK(a1.rfind(fmt::format("model {:016x}{:016x}\n", id.hi, id.lo), 0) == 0);

  const std::string b = RunPrinter(dir.path() / "b", "");
  CHECK(b.substr(0, 40) != a1.substr(0, 40));  // other weights, other model id
  std::set<std::string> lines_a, lines_b, lines_t;
  auto split = [](const std::string& s, std::set<std::string>* out) {
    std::size_t p = 0;
    while (p < s.size()) {
      auto e = s.find('\n', p);
      out->insert(s.substr(p, e - p));
      p = e + 1;
    }
  };
  split(a1, &lines_a);
  split(b, &lines_b);
  split(RunPrinter(dir.path() / "a", "tenant-x"), &lines_t);
  for (const auto& l : lines_a) {
    CHECK(lines_b.count(l) == 0);
    if (l.find(":expert:") == std::string::npos && l.rfind("model", 0) != 0) CHECK(lines_t.count(l) == 0);
  }
}

TEST_CASE("ModelId covers the config and every tensor byte") {
  testing::TempDir dir("kvmid");
  auto config = PresetOrDie("k3-toy");
  REQUIRE(model::InitWeights(config, dir.path(), {.seed = 3}).ok());
  auto ckpt = model::OpenCheckpoint(dir.path());
  REQUIRE(ckpt.ok());
  const auto id = keys::ModelId(ckpt->config, *ckpt->weights);
  CHECK(id == keys::ModelId(ckpt->config, *ckpt->weights));
  auto c2 = ckpt->config;
  c2.rms_norm_eps = 2e-5f;
  CHECK(keys::ModelId(c2, *ckpt->weights) != id);
}

// Golden key vectors: the keys of fixed inputs (model id, layout, codecs, tenants, tokens) pinned as
// literals, so "identical in every process and on every machine" is checked against constants, not
// only between two processes of this build. They pin the whole derivation of docs/keys.md: the
// namespace byte string and its XXH3-64, the root and tenant salt, the XXH3-128 chunk chain and the
// key text. The literals were reproduced independently from the byte strings of docs/keys.md with
// Python's xxhash 4.1.0 (xxh3_64 / xxh3_128), not only printed by this code.
//
// Changing any of them is a key-schema break: every block stored by an earlier build stops being
// hit, and machines running both builds stop sharing blocks. Do it only on purpose, together with a
// bump of keys::kKeySchemaVersion (docs/keys.md, "Versioning"), and update the literals here in the
// same commit. (A new KvLayout::Id text, e.g. a block format version, changes the layout input and
// so the keys too; that one is versioned inside the text: docs/prefix-cache.md.)
TEST_CASE("golden key vectors: fixed inputs give the pinned namespaces, content ids and keys") {
  CHECK(keys::kKeySchemaVersion == 2);
  const ContentId model{0x0123456789abcdefull, 0xfedcba9876543210ull};
  const std::string layout =
      "kv-layout-v2 chunk=16 mla=3,7 width=80 kda=0,1,2,4,5,6 kda_heads=4 kda_dim=64 kernel=4 kv=bf16 state=f32";
  auto toy = KvLayout::FromConfig(PresetOrDie("k3-toy"), {.chunk_tokens = 16});
  REQUIRE(toy.ok());
  CHECK(toy->Id() == layout);  // the layout input is k3-toy's at 16 tokens a chunk, bf16 KV, f32 state

  const std::uint32_t ns_kv = keys::Namespace(model, layout, "bf16", keys::kKeySchemaVersion);
  const std::uint32_t ns_state = keys::Namespace(model, layout, "f32", keys::kKeySchemaVersion);
  const std::uint32_t ns_expert = keys::Namespace(model, "experts-mxfp4-v1", "mxfp4", keys::kKeySchemaVersion);
  CHECK(ns_kv == 499751406u);
  CHECK(ns_state == 3282177034u);
  CHECK(ns_expert == 1108106529u);
  const ContentId kv_root = keys::NamespaceRoot(model, layout, "bf16", keys::kKeySchemaVersion);
  const ContentId expert_root = keys::NamespaceRoot(model, "experts-mxfp4-v1", "mxfp4", keys::kKeySchemaVersion);
  CHECK(kv_root == ContentId{0x974b2b8d09485171ull, 0x2b2d501346dd2590ull});

  CHECK(keys::TenantRoot(kv_root, "") == ContentId{0x5ea2f55c6c5eee2aull, 0x8dd2c93ce8a78f62ull});
  CHECK(keys::TenantRoot(kv_root, "tenant-a") == ContentId{0xaf218eb995111497ull, 0x8ed68d821357c8f6ull});

  std::vector<std::int32_t> tokens(40);
  for (int i = 0; i < 40; ++i) tokens[static_cast<std::size_t>(i)] = (i * 37 + 5) % 512;
  const auto ids = keys::ChunkIds(kv_root, "", tokens, 16);
  const auto ids_a = keys::ChunkIds(kv_root, "tenant-a", tokens, 16);
  REQUIRE(ids.size() == 2);
  REQUIRE(ids_a.size() == 2);
  CHECK(ids[0] == ContentId{0xb7511fc089f24943ull, 0xa419628527657a6eull});
  CHECK(ids[1] == ContentId{0xb67075cfea034011ull, 0x5596c4da0fdaae28ull});
  CHECK(ids_a[0] == ContentId{0xdb34ae87db3409d3ull, 0x6ad9007254376782ull});
  CHECK(ids_a[1] == ContentId{0xdce116dcfaef7a3bull, 0xb1720d659af88e10ull});

  CHECK(keys::KvChunkKey(ns_kv, ids[1]).ToString() == "499751406:kv:0:b67075cfea0340115596c4da0fdaae28");
  CHECK(keys::StateKey(ns_state, 2, ids[1]).ToString() == "3282177034:state:2:b67075cfea0340115596c4da0fdaae28");
  CHECK(keys::KvChunkKey(ns_kv, ids_a[0]).ToString() == "499751406:kv:0:db34ae87db3409d36ad9007254376782");
  CHECK(keys::ExpertKey(ns_expert, expert_root, 5, 13).ToString() ==
        "1108106529:expert:5:983671f5ea1bf6dc019644d575eb0cb0");
}

// A fixed two-tensor weight source for the model-id golden vector.
class FixedSource final : public model::WeightSource {
 public:
  FixedSource() {
    const float z[2] = {1.0f, -2.0f};
    z_.resize(sizeof(z));
    std::memcpy(z_.data(), z, sizeof(z));
    a_ = {1, 2, 3};
  }
  Result<model::TensorView> Get(std::string_view name) const override {
    if (name == "z.weight") return model::TensorView{model::DType::kF32, {2}, std::as_bytes(std::span(z_))};
    if (name == "a.bias") return model::TensorView{model::DType::kU8, {1, 3}, std::as_bytes(std::span(a_))};
    return Status::NotFound(std::string(name));
  }
  bool Has(std::string_view name) const override { return name == "z.weight" || name == "a.bias"; }
  std::vector<std::string> Names() const override { return {"z.weight", "a.bias"}; }  // unsorted on purpose

 private:
  std::vector<std::uint8_t> z_, a_;
};

// The model id's golden vector: k3-toy's config with two fixed tensors. Pins ToConfigJson's
// canonical text (by its XXH3-64) and the id's byte string (docs/keys.md, "Model id"); both literals
// were reproduced with Python's xxhash 4.1.0 from the byte string that section describes. A
// changed config JSON (a new key, another number format) or id derivation moves every namespace:
// every stored block stops being hit. Do that only on purpose, as for the key vectors above.
TEST_CASE("golden model id: k3-toy's config and two fixed tensors give the pinned id") {
  const model::ModelConfig config = PresetOrDie("k3-toy");
  const std::string json = model::ToConfigJson(config);
  CHECK(XXH3_64bits(json.data(), json.size()) == 0x06cfeeb9bf730cbaull);
  FixedSource weights;
  CHECK(keys::ModelId(config, weights) == ContentId{0x08c2b7009f6b275eull, 0x6c551fb2deba974dull});
  // Every input counts: a tensor byte, a dtype, a shape, the config.
  class Tweaked final : public model::WeightSource {
   public:
    explicit Tweaked(int what) : what_(what) {}
    Result<model::TensorView> Get(std::string_view name) const override {
      auto v = base_.Get(name);
      if (!v.ok() || name != "a.bias") return v;
      if (what_ == 0) return model::TensorView{v->dtype, v->shape, std::as_bytes(std::span(other_))};
      if (what_ == 1) return model::TensorView{model::DType::kI8, v->shape, v->data};
      return model::TensorView{v->dtype, {3}, v->data};
    }
    bool Has(std::string_view name) const override { return base_.Has(name); }
    std::vector<std::string> Names() const override { return base_.Names(); }

   private:
    FixedSource base_;
    int what_;
    std::vector<std::uint8_t> other_ = {1, 2, 4};
  };
  const ContentId id = keys::ModelId(config, weights);
  for (int what = 0; what < 3; ++what) CHECK(keys::ModelId(config, Tweaked(what)) != id);
  model::ModelConfig c2 = config;
  c2.vocab_size += 1;
  CHECK(keys::ModelId(c2, weights) != id);
}

}  // namespace
}  // namespace terrace::kv
