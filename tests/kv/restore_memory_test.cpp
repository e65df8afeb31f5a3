// Where a restore's bytes land (docs/prefix-cache.md, "Restore", "Buffers"): blocks are a multiple
// of 4 KiB (block format 2), so the NVMe tier reads them straight into the restore's aligned
// buffers without a staging copy; a restore into a state reused after Reset decodes into that
// state's own latent memory (a serving process's warm restore), with the same output.
#include <catch2/catch.hpp>

#include <string>

#include "kv_test_util.h"
#include "src/kv/block_format.h"

namespace terrace::kv {
namespace {

using namespace testing;

// The NVMe tier's count of I/Os that went through a staging buffer (its stats detail text).
std::uint64_t StagedIos(const Store& store) {
  const StoreStats stats = store.Stats();
  const std::string& d = stats.tiers[static_cast<std::size_t>(TierId::kNvme)].detail;
  const std::string tag = "staged I/Os: ";
  const auto at = d.find(tag);
  REQUIRE(at != std::string::npos);
  return std::stoull(d.substr(at + tag.size()));
}

TEST_CASE("KV chunk and KDA snapshot blocks are 4 KiB multiples; a block of another length is refused") {
  for (const char* codec : {"f32", "bf16", "int4-g32"}) {
    CAPTURE(codec);
    const KvLayout L = Layout(16, 1, codec, codec);
    const ContentId id{0x1234, 0x5678};
    std::vector<std::vector<float>> rows(L.mla_layers().size(),
                                         std::vector<float>(static_cast<std::size_t>(16 * L.mla_width()), 0.25f));
    std::vector<std::byte> chunk;
    REQUIRE(format::EncodeKvChunk(L, id, rows, &chunk).ok());
    CHECK(chunk.size() % 4096 == 0);
    CHECK(chunk.size() <= L.mla_chunk_block_bytes());
    REQUIRE(format::ParseKvChunkHeader(L, id, chunk).ok());
    // The same bytes without the padding (the size a version-1 block had) or with a unit more.
    auto shorter = std::span<const std::byte>(chunk).first(chunk.size() - 1);
    CHECK(format::ParseKvChunkHeader(L, id, shorter).status().IsCorruption());
    std::vector<std::byte> longer = chunk;
    longer.resize(chunk.size() + 4096);
    CHECK(format::ParseKvChunkHeader(L, id, longer).status().IsCorruption());

    const auto rec_n = static_cast<std::size_t>(L.kda_heads() * L.kda_head_dim() * L.kda_head_dim());
    const auto conv_n = static_cast<std::size_t>(L.kda_conv_rows() * L.kda_conv_cols());
    std::vector<float> rec(rec_n, 0.5f), conv(conv_n, -0.5f), rec2(rec_n), conv2(conv_n);
    const int layer = L.kda_layers().front();
    std::vector<std::byte> snap;
    REQUIRE(format::EncodeState(L, layer, 16, id, rec, conv, &snap).ok());
    CHECK(snap.size() % 4096 == 0);
    CHECK(snap.size() <= L.state_block_bytes());
    REQUIRE(format::DecodeState(L, layer, 16, id, snap, rec2, conv2).ok());
    CHECK(format::DecodeState(L, layer, 16, id, std::span<const std::byte>(snap).first(snap.size() - 1), rec2, conv2)
              .IsCorruption());
  }
}

TEST_CASE("a KDA snapshot or KV chunk block encoded with another codec than the layout's is refused, not decoded") {
  const KvLayout f32 = Layout(16, 1, "f32", "f32");
  const KvLayout bf16 = Layout(16, 1, "bf16", "bf16");
  const ContentId id{0x1234, 0x5678};
  const auto rec_n = static_cast<std::size_t>(f32.kda_heads() * f32.kda_head_dim() * f32.kda_head_dim());
  const auto conv_n = static_cast<std::size_t>(f32.kda_conv_rows() * f32.kda_conv_cols());
  std::vector<float> rec(rec_n, 0.3f), conv(conv_n, -0.7f), rec2(rec_n), conv2(conv_n);
  const int layer = f32.kda_layers().front();
  std::vector<std::byte> snap;
  REQUIRE(format::EncodeState(bf16, layer, 16, id, rec, conv, &snap).ok());
  REQUIRE(format::DecodeState(bf16, layer, 16, id, snap, rec2, conv2).ok());
  const Status s = format::DecodeState(f32, layer, 16, id, snap, rec2, conv2);
  CHECK(s.IsCorruption());
  CHECK(s.message().find("codec") != std::string::npos);

  std::vector<std::vector<float>> rows(f32.mla_layers().size(),
                                       std::vector<float>(static_cast<std::size_t>(16 * f32.mla_width()), 0.25f));
  std::vector<std::byte> chunk;
  REQUIRE(format::EncodeKvChunk(bf16, id, rows, &chunk).ok());
  REQUIRE(format::ParseKvChunkHeader(bf16, id, chunk).ok());
  CHECK(format::ParseKvChunkHeader(f32, id, chunk).status().IsCorruption());
}

TEST_CASE("a KV layer's sub-range checksum: verified by default, skipped only for a block the store verified") {
  const KvLayout L = Layout(16, 1, "bf16", "f32");
  const ContentId id{0x1234, 0x5678};
  std::vector<std::vector<float>> rows(L.mla_layers().size(), std::vector<float>(static_cast<std::size_t>(16 * L.mla_width())));
  for (std::size_t i = 0; i < rows[0].size(); ++i) rows[0][i] = 0.01f * static_cast<float>(i % 97);
  std::vector<std::byte> chunk;
  REQUIRE(format::EncodeKvChunk(L, id, rows, &chunk).ok());
  auto ranges = format::ParseKvChunkHeader(L, id, chunk);
  REQUIRE(ranges.ok());
  const format::LayerRange& r0 = (*ranges)[0];
  std::vector<float> good(rows[0].size()), out(rows[0].size());
  REQUIRE(format::DecodeKvLayer(L, chunk, r0, good).ok());
  REQUIRE(format::DecodeKvLayer(L, chunk, r0, out, format::LayerCheck::kBlockVerifiedByStore).ok());
  CHECK(out == good);  // the same decode, only the hash left out
  // One flipped payload byte: the default check names the layer; the store-verified mode decodes
  // what it was given (the store's whole-block checksum is what refuses such a block on a get).
  std::vector<std::byte> bad = chunk;
  bad[r0.offset + r0.size / 2] ^= std::byte{0x40};  // in the middle of the payload, past the codec header
  const Status s = format::DecodeKvLayer(L, bad, r0, out);
  CHECK(s.IsCorruption());
  CHECK(s.message().find("layer " + std::to_string(r0.model_layer)) != std::string::npos);
  CHECK(format::DecodeKvLayer(L, bad, r0, out, format::LayerCheck::kBlockVerifiedByStore).ok());
  CHECK(out != good);
}

TEST_CASE("a restore from NVMe reads every block straight into its buffer (no staged I/O), output exact") {
  const auto& m = Toy();
  terrace::testing::TempDir dir("kvdirect");
  auto kv_store = NvmeStore(dir.path() / "kv");
  auto st_store = NvmeStore(dir.path() / "state");
  auto cache = PrefixCache::Create(Layout(16, 1), m.id, kv_store.get(), st_store.get());
  REQUIRE(cache.ok());
  const auto p = Tokens(5 * 16 + 3);
  const auto p2 = Tokens(5 * 16 + 9);  // the same first 83 tokens: restores 80
  const auto [cold, req] = StoreThenRecompute(*m.model, **cache, p, p2);
  // Every stored block's size is a multiple of the NVMe tier's 4 KiB unit ...
  std::vector<BlockKey> keys;
  for (int i = 0; i < 5; ++i) keys.push_back(keys::KvChunkKey((*cache)->kv_namespace(), req.chunk_ids[static_cast<std::size_t>(i)]));
  for (const auto& r : kv_store->Lookup(keys)) {
    REQUIRE(r.found);
    CHECK(r.desc.size % 4096 == 0);
  }
  // ... so both the whole and the layerwise restore read them without a staging copy.
  for (bool layerwise : {false, true}) {
    CAPTURE(layerwise);
    const std::uint64_t kv_before = StagedIos(*kv_store), st_before = StagedIos(*st_store);
    const Run r = Prefill(*m.model, **cache, p2, "", {.restore = true, .write_back = false, .layerwise = layerwise});
    REQUIRE(r.prefill.restored_tokens == 80);
    CHECK(r.prefill.restore.bytes_read[static_cast<std::size_t>(TierId::kNvme)] ==
          r.prefill.restore.kv_bytes + r.prefill.restore.state_bytes);
    CHECK(StagedIos(*kv_store) == kv_before);
    CHECK(StagedIos(*st_store) == st_before);
    CHECK(Bitwise(r.prefill.logits.data, Rows(cold.prefill.logits, 80)));
  }
}

TEST_CASE("a restore into a state reused after Reset decodes into that state's own latent memory") {
  const auto& m = Toy();
  auto store = HostStore();
  auto cache = PrefixCache::Create(Layout(16, 1), m.id, store.get(), store.get());
  REQUIRE(cache.ok());
  const auto& L = (*cache)->layout();
  const auto p = Tokens(5 * 16 + 3);
  const auto p2 = Tokens(5 * 16 + 9);
  const auto [cold, req] = StoreThenRecompute(*m.model, **cache, p, p2);
  for (bool layerwise : {true, false}) {
    CAPTURE(layerwise);
    model::Session s(*m.model);
    auto first = PrefillWithCache(&s, **cache, req, {.restore = true, .write_back = false, .layerwise = layerwise});
    REQUIRE(first.ok());
    REQUIRE(first->restored_tokens == 80);
    std::vector<const float*> where;
    for (int l : L.mla_layers()) where.push_back(s.state().layer(l).latents.data());
    // The serving process's next request on this state: its memory is reused, not reallocated.
    s.state().Reset();
    auto again = PrefillWithCache(&s, **cache, req, {.restore = true, .write_back = false, .layerwise = layerwise});
    REQUIRE(again.ok());
    REQUIRE(again->restored_tokens == 80);
    for (std::size_t j = 0; j < L.mla_layers().size(); ++j)
      CHECK(s.state().layer(L.mla_layers()[j]).latents.data() == where[j]);
    CHECK(Bitwise(again->logits.data, first->logits.data));
    CHECK(Bitwise(again->logits.data, Rows(cold.prefill.logits, 80)));
    // A prompt with nothing cached (boundary 0) leaves the state its memory too.
    s.state().Reset();
    auto none = PrefillWithCache(&s, **cache, (*cache)->Prepare(Tokens(5 * 16 + 9, 3), ""),
                                 {.restore = true, .write_back = false, .layerwise = layerwise});
    REQUIRE(none.ok());
    CHECK(none->restored_tokens == 0);
    for (std::size_t j = 0; j < L.mla_layers().size(); ++j)
      CHECK(s.state().layer(L.mla_layers()[j]).latents.data() == where[j]);
  }
}

}  // namespace
}  // namespace terrace::kv
