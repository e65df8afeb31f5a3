// Restores that read by layer (RestoreReadOrder::kLayers, docs/prefix-cache.md "Read order"): each
// MLA layer's sub-ranges of every chunk in turn, through Store::GetRanges. They equal a restore that
// reads whole chunks and a full recompute, bitwise, for every codec without a lossless stage; a
// range that comes back damaged is read again as a whole verified block (counted, output exact);
// a block gone between two layers' reads moves the boundary back; and the first MLA layer is handed
// out while the next layer's ranges are still in flight.
#include <catch2/catch.hpp>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <tuple>

#include <fmt/format.h>

#include "forwarding_tier.h"
#include "kv_test_util.h"
#include "tiers/fault/fault_tier.h"
#include "tiers/nvme/nvme_tier.h"

namespace terrace::kv {
namespace {

using namespace testing;
using namespace std::chrono_literals;

// A host tier posing as an NVMe-kind tier whose ranged reads the test watches: `on_range` runs on
// each range op after the inner tier's GetRangeBatch filled it (it may change the bytes or the
// status), and ranges past a block's first layer (offset > 0) wait at a gate while it is closed.
class RangeTapTier final : public terrace::testing::ForwardingTier {
 public:
  static constexpr auto kGateTimeout = 20s;  // long: a loaded machine must not open a gate the test still holds
  using Hook = std::function<void(RangeOp&, Status&)>;
  explicit RangeTapTier(std::unique_ptr<Tier> inner) : ForwardingTier(std::move(inner)) { PoseAsNvme(&caps_); }
  void set_hook(Hook h) { hook_ = std::move(h); }
  void CloseLaterLayers() {
    std::lock_guard lock(mu_);
    closed_ = true;
  }
  void Open() {
    {
      std::lock_guard lock(mu_);
      closed_ = false;
    }
    cv_.notify_all();
  }
  bool WaitHeld(std::chrono::milliseconds d) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, d, [&] { return held_ > 0; });
  }
  int later_ranges_done() const {
    std::lock_guard lock(mu_);
    return later_done_;
  }

  std::vector<Status> GetRangeBatch(std::span<RangeOp> ops) override {
    const bool later = !ops.empty() && ops.front().offset > 0;
    if (later) {
      std::unique_lock lock(mu_);
      ++held_;
      cv_.notify_all();
      cv_.wait_for(lock, kGateTimeout, [&] { return !closed_; });
      --held_;
    }
    auto st = inner_->GetRangeBatch(ops);
    if (hook_)
      for (std::size_t i = 0; i < ops.size(); ++i) hook_(ops[i], st[i]);
    if (later) {
      std::lock_guard lock(mu_);
      later_done_ += static_cast<int>(ops.size());
    }
    return st;
  }

 private:
  Hook hook_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool closed_ = false;
  int held_ = 0, later_done_ = 0;
};

TEST_CASE("reading by layer == reading by chunk == full recompute, bitwise, across chunk sizes, intervals and codecs",
          "[no-tsan]") {
  const auto& m = Toy();
  terrace::testing::TempDir dir("kvorder");
  int store_no = 0;
  for (const auto& [C, every, codec] : {std::tuple{16, 1, "f32"}, std::tuple{8, 3, "f32"}, std::tuple{32, 2, "f32"},
                                        std::tuple{16, 1, "bf16"}, std::tuple{16, 2, "fp8"}, std::tuple{8, 1, "int4-g32"}}) {
    CAPTURE(C, every, codec);
    // On the NVMe tier: its own ranged reads (direct, only the sectors of the range).
    auto kv = NvmeStore(dir.path() / fmt::format("kv{}", store_no));
    auto st = NvmeStore(dir.path() / fmt::format("st{}", store_no++));
    auto cache = PrefixCache::Create(Layout(C, every, codec), m.id, kv.get(), st.get());
    REQUIRE(cache.ok());
    REQUIRE((*cache)->layout().mla_layers().size() >= 2);  // k3-toy: layers 4 and 8
    const int n1 = 4 * C + 5;
    const auto p = Tokens(n1);
    // Nothing stored yet: the restore reads nothing, so nothing by layer.
    const Run empty = Prefill(*m.model, **cache, p, "", {.restore = true, .write_back = false});
    CHECK(empty.prefill.restored_tokens == 0);
    CHECK(!empty.prefill.restore.read_by_layer);
    CHECK(empty.prefill.restore.blocks_requested == 0);
    Prefill(*m.model, **cache, p, "");
    (*cache)->Flush();
    for (const int n2 : {4 * C + 1, 4 * C + C / 2 + 3, 3 * C + 1}) {
      CAPTURE(n2);
      const auto p2 = Extend(p, std::min(n1, n2), n2);
      const Run cold = Prefill(*m.model, **cache, p2, "", {.restore = false, .write_back = false}, 2);
      (*cache)->SetRestoreReadOrder(RestoreReadOrder::kChunks);
      const auto ranges_before = kv->Stats().range_reads;
      const Run chunks = Prefill(*m.model, **cache, p2, "", {.restore = true, .write_back = false}, 2);
      CHECK(kv->Stats().range_reads == ranges_before);
      (*cache)->SetRestoreReadOrder(RestoreReadOrder::kLayers);
      const Run layers = Prefill(*m.model, **cache, p2, "", {.restore = true, .write_back = false}, 2);
      CHECK(kv->Stats().range_reads > ranges_before);
      const std::int64_t want = ExpectedBoundary(n1, std::min(n1, n2), n2, C, every);
      REQUIRE(want > 0);
      CHECK(chunks.prefill.restored_tokens == want);
      CHECK(layers.prefill.restored_tokens == want);
      CHECK(!chunks.prefill.restore.read_by_layer);
      CHECK(layers.prefill.restore.read_by_layer);
      CHECK(layers.prefill.restore.range_rereads == 0);
      CHECK(layers.prefill.restore.fallbacks == 0);
      // Blocks are blocks whatever the read order: each KV chunk and each KDA layer's snapshot at
      // the boundary once, all from NVMe; by layer, a chunk is one sub-range read per MLA layer.
      const auto& L = (*cache)->layout();
      const auto blocks = static_cast<std::uint64_t>(want / C) + L.kda_layers().size();
      const auto nvme = static_cast<std::size_t>(TierId::kNvme);
      for (const Run* r : {&chunks, &layers}) {
        CHECK(r->prefill.restore.blocks_requested == blocks);
        CHECK(r->prefill.restore.blocks_read[nvme] == blocks);
      }
      CHECK(chunks.prefill.restore.range_reads[nvme] == 0);
      CHECK(layers.prefill.restore.range_reads[nvme] == static_cast<std::uint64_t>(want / C) * L.mla_layers().size());
      // The sub-ranges cover the header and each layer's bytes: never more than the whole blocks.
      CHECK(layers.prefill.restore.kv_bytes <= chunks.prefill.restore.kv_bytes);
      CHECK(layers.prefill.restore.kv_bytes > 0);
      CHECK(Bitwise(layers.prefill.logits.data, chunks.prefill.logits.data));
      if (std::string(codec) == "f32") CHECK(Bitwise(layers.prefill.logits.data, Rows(cold.prefill.logits, want)));
      CHECK(Bitwise(layers.decode_logits.back(), chunks.decode_logits.back()));
    }
    CHECK((*cache)->Stats().range_rereads == 0);
  }
}

TEST_CASE("a lossless stage or a single MLA layer reads whole chunks whatever the read order") {
  const auto& m = Toy();
  auto store = HostStore();
  auto cache = PrefixCache::Create(Layout(16, 1, "f32+zstd"), m.id, store.get(), store.get());
  REQUIRE(cache.ok());
  const auto p = Tokens(3 * 16 + 2);
  Prefill(*m.model, **cache, p, "");
  (*cache)->Flush();
  (*cache)->SetRestoreReadOrder(RestoreReadOrder::kLayers);
  const Run r = Prefill(*m.model, **cache, Extend(p, 3 * 16 + 2, 3 * 16 + 4), "", {.restore = true, .write_back = false});
  CHECK(r.prefill.restored_tokens == 48);
  CHECK(!r.prefill.restore.read_by_layer);  // compressed: a layer's offset is not the layout's
  CHECK(store->Stats().range_reads == 0);
}

// A cache whose KV pool is a RangeTapTier (the state pool a host store) holding an 83-token
// prompt's 5 chunks of 16 tokens, and a cold run of a prompt that extends it by 6 tokens.
struct TapFixture {
  const ToyModel& m = Toy();
  WrappedStore<RangeTapTier> kv = StoreOver(std::make_unique<RangeTapTier>(SmallHostTier()));
  std::unique_ptr<Store> st = HostStore();
  std::unique_ptr<PrefixCache> cache;
  std::vector<std::int32_t> p = Tokens(5 * 16 + 3), p2 = Extend(p, 5 * 16 + 3, 5 * 16 + 9);
  Run cold;

  TapFixture() {
    auto c = PrefixCache::Create(Layout(16, 1), m.id, kv.store.get(), st.get());
    REQUIRE(c.ok());
    cache = std::move(c).value();
    Prefill(*m.model, *cache, p, "");
    cache->Flush();
    cold = Prefill(*m.model, *cache, p2, "", {.restore = false, .write_back = false}, 2);
  }
  // Chunk i's block key in the restore of p2.
  BlockKey Chunk(std::size_t i) const { return keys::KvChunkKey(cache->kv_namespace(), cache->Prepare(p2, "").chunk_ids[i]); }
};

TEST_CASE("a damaged range is read again as a whole verified block: counted, output exact") {
  TapFixture f;
  auto& cache = f.cache;
  for (const bool later_layer : {false, true}) {
    CAPTURE(later_layer);
    // One bit of one range flipped on its way out (the stored block stays good): chunk 3's header
    // range (layer 0's phase) or its second MLA layer's.
    const BlockKey victim = f.Chunk(3);
    std::mutex mu;
    int flipped = 0;
    f.kv.tier->set_hook([&](RangeOp& op, Status& s) {
      std::lock_guard lock(mu);
      if (!s.ok() || !(op.key == victim) || (op.offset > 0) != later_layer || flipped > 0) return;
      // The middle of the layer's values (the first range starts with the block's header).
      const auto& L = cache->layout();
      op.out[(later_layer ? 0 : L.chunk_header_bytes()) + L.mla_layer_range_bytes() / 2] ^= std::byte{0x10};
      ++flipped;
    });
    const auto rereads_before = cache->Stats().range_rereads;
    const Run r = Prefill(*f.m.model, *cache, f.p2, "", {.restore = true, .write_back = false}, 2);
    f.kv.tier->set_hook(nullptr);
    CHECK(flipped == 1);
    CHECK(r.prefill.restore.read_by_layer);
    CHECK(r.prefill.restore.range_rereads == 1);
    CHECK(cache->Stats().range_rereads == rereads_before + 1);
    // The block read again whole is still one block: 5 KV chunks and the boundary's snapshots.
    CHECK(r.prefill.restore.blocks_requested == 5 + cache->layout().kda_layers().size());
    CHECK(r.prefill.restored_tokens == 80);  // the whole block read back good: no fallback
    CHECK(r.prefill.restore.fallbacks == 0);
    CHECK(Bitwise(r.prefill.logits.data, Rows(f.cold.prefill.logits, 80)));
    CHECK(Bitwise(r.decode_logits.back(), f.cold.decode_logits.back()));
  }
}

TEST_CASE("over the real NVMe tier, a failed range read is read again whole: counted, output exact") {
  const auto& m = Toy();
  terrace::testing::TempDir dir("kvorderfault");
  NvmeTierOptions no;
  no.path = dir.path() / "kv";
  no.capacity_bytes = 32 * kMiB;
  no.io_threads = static_cast<unsigned>(kRestoreKvReaders);
  auto nvme = NvmeTier::Open(no);
  REQUIRE(nvme.ok());
  auto kv = StoreOver(std::make_unique<FaultInjectingTier>(std::unique_ptr<Tier>(std::move(*nvme))));
  auto st = HostStore();
  auto cache = PrefixCache::Create(Layout(16, 1), m.id, kv.store.get(), st.get());
  REQUIRE(cache.ok());
  const auto p = Tokens(5 * 16 + 3);
  Prefill(*m.model, **cache, p, "");
  (*cache)->Flush();
  const auto p2 = Extend(p, 5 * 16 + 3, 5 * 16 + 9);
  const Run cold = Prefill(*m.model, **cache, p2, "", {.restore = false, .write_back = false}, 2);
  // The restore's first KV read is a range of chunk 0 (the header and the first MLA layer): an EIO.
  kv.tier->FailNextGets(1, FaultInjectingTier::Eio(false));
  const Run r = Prefill(*m.model, **cache, p2, "", {.restore = true, .write_back = false}, 2);
  CHECK(kv.tier->injected().get_errors == 1);
  CHECK(r.prefill.restore.read_by_layer);
  CHECK(r.prefill.restore.range_rereads == 1);
  CHECK(r.prefill.restored_tokens == 80);
  CHECK(r.prefill.restore.fallbacks == 0);
  // Every other range came through the real NVMe tier (the failed one is not counted).
  CHECK(kv.store->Stats().range_reads == (*cache)->layout().mla_layers().size() * 5 - 1);
  // The report agrees, and chunk 0 is still one block, served by its whole re-read.
  const RestoreReport& rep = r.prefill.restore;
  const std::uint64_t blocks = 5 + (*cache)->layout().kda_layers().size();
  CHECK(rep.blocks_requested == blocks);
  CHECK(rep.blocks_read[0] + rep.blocks_read[1] + rep.blocks_read[2] == blocks);
  CHECK(rep.range_reads[0] + rep.range_reads[1] + rep.range_reads[2] == (*cache)->layout().mla_layers().size() * 5 - 1);
  CHECK(Bitwise(r.prefill.logits.data, Rows(cold.prefill.logits, 80)));
  CHECK(Bitwise(r.decode_logits.back(), cold.decode_logits.back()));
}

TEST_CASE("a block gone between two layers' reads moves the boundary back to before it; output exact") {
  TapFixture f;
  const BlockKey victim = f.Chunk(2);
  // Chunk 2's block is erased from the store once its first layer was read (an eviction between
  // the two phases): the second MLA layer's range and the whole-block re-read both miss.
  std::mutex mu;
  std::condition_variable cv;
  bool erased = false;  // (mu) set on a reader thread: checked here after the run
  Store* store = f.kv.store.get();
  f.kv.tier->set_hook([&](RangeOp& op, Status& s) {
    std::unique_lock lock(mu);
    if (!(op.key == victim)) return;
    if (op.offset > 0) {
      // A later layer's range of the victim: the two readers can have it in flight beside the
      // first layer's, so it waits here for the erase (bounded) rather than racing it. The hook
      // runs after the tier's read, which a slow run (a sanitizer build) may have finished before
      // the erase: the block is gone by the time this read is handed back either way.
      cv.wait_for(lock, std::chrono::seconds(10), [&] { return erased; });
      if (s.ok()) s = Status::NotFound("erased between two layers' reads (test)");
      return;
    }
    if (erased) return;
    erased = store->Erase(victim).ok();  // the store holds no lock while a tier reads
    cv.notify_all();
  });
  const Run r = Prefill(*f.m.model, *f.cache, f.p2, "", {.restore = true, .write_back = false}, 2);
  f.kv.tier->set_hook(nullptr);
  CHECK(erased);
  CHECK(r.prefill.restore.read_by_layer);
  CHECK(r.prefill.restore.lookup_boundary_tokens == 80);
  CHECK(r.prefill.restored_tokens == 32);
  CHECK(r.prefill.restore.fallbacks >= 1);
  CHECK(Bitwise(r.prefill.logits.data, Rows(f.cold.prefill.logits, 32)));
  CHECK(Bitwise(r.decode_logits.back(), f.cold.decode_logits.back()));
}

TEST_CASE("the first MLA layer is handed out while the next MLA layer's ranges are still in flight") {
  TapFixture f;
  const auto& L = f.cache->layout();
  const int first = L.mla_layers().front(), second = L.mla_layers()[1];
  const auto req = f.cache->Prepare(f.p, "");
  f.kv.tier->CloseLaterLayers();
  auto state = model::SequenceState::ForConfig(f.m.ckpt.config);
  auto restore = f.cache->BeginRestore(req, &state);
  REQUIRE(restore.ok());
  for (int l = 0; l < second; ++l) CHECK((*restore)->RetrieveLayer(l).ok());
  CHECK(state.layer(first).tokens == 80);
  // The second layer's ranges were asked for and are held: none has come back.
  CHECK(f.kv.tier->WaitHeld(10s));
  CHECK(f.kv.tier->later_ranges_done() == 0);
  CHECK(state.layer(second).tokens == 0);
  f.kv.tier->Open();
  for (int l = second; l < L.num_layers(); ++l) CHECK((*restore)->RetrieveLayer(l).ok());
  auto rep = (*restore)->Finish();
  REQUIRE(rep.ok());
  CHECK(rep->read_by_layer);
  CHECK(rep->boundary_tokens == 80);
  f.cache->SetRestoreReadOrder(RestoreReadOrder::kChunks);
  auto whole_state = model::SequenceState::ForConfig(f.m.ckpt.config);
  auto whole = f.cache->Restore(req, &whole_state);
  REQUIRE(whole.ok());
  CHECK(!whole->read_by_layer);
  CHECK(SameState(state, whole_state));
}

}  // namespace
}  // namespace terrace::kv
