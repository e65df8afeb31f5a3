// The store's one transfer path over the real tiers: which route a move takes (direct into the
// host arena, direct from it, or staged through the bounce pool), what StoreStats counts for it,
// and that the bytes that arrive are the bytes that were put.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <thread>

#include "forwarding_tier.h"
#include "host_nvme.h"
#include "tiers/hbm/hbm_tier.h"

namespace terrace::testing {
namespace {

// A device-memory tier (an emulated HBM tier relabelled kDevice) that records the host regions the
// store registers with it, as the CUDA HBM tier would page-lock them.
class RegionRecordingDeviceTier final : public ForwardingTier {
 public:
  explicit RegionRecordingDeviceTier(std::shared_ptr<Tier> inner) : ForwardingTier(std::move(inner)) {
    caps_.memory = MemoryKind::kDevice;
    caps_.emulated = false;
  }
  Status RegisterIoRegions(std::span<const std::span<std::byte>> regions) override {
    registered += regions.size();
    return Status::Ok();
  }
  std::atomic<std::size_t> registered{0};
};

TEST_CASE("Transfer: an unpinned host tier's memory is not registered (page-locked) with a device tier") {
  const bool pin = GENERATE(false, true);
  INFO("host pin " << pin);
  HbmTierOptions ho;
  ho.mode = HbmMode::kEmulated;
  ho.capacity_bytes = 4 * kMiB;
  ho.link.enabled = false;
  auto hbm = CreateHbmTier(ho);
  REQUIRE(hbm.ok());
  auto device = std::make_unique<RegionRecordingDeviceTier>(std::shared_ptr<Tier>(std::move(*hbm)));
  RegionRecordingDeviceTier* dev = device.get();
  REQUIRE(dev->caps().device_buffers);
  HostTierOptions hostopt;
  hostopt.capacity_bytes = 4 * kMiB;
  hostopt.chunk_bytes = 4 * kMiB;
  hostopt.pin = pin;
  auto host = HostTier::Create(hostopt);
  REQUIRE(host.ok());
  CHECK((*host)->caps().pageable == !pin);
  std::vector<std::unique_ptr<Tier>> tiers;
  tiers.push_back(std::move(device));
  tiers.push_back(std::move(*host));
  StoreOptions so = Quiet();
  so.put_tier = TierId::kHbm;  // reads promote into the device tier
  auto opened = Store::OpenWithTiers(so, std::move(tiers));
  INFO(opened.status().ToString());
  REQUIRE(opened.ok());
  Store& store = **opened;
  const auto data = TestBytes(3, 64 * kKiB);
  REQUIRE(store.Put(TestKey(3), data, {Codec::kRaw, TierId::kHost}).ok());
  std::vector<std::byte> out(data.size());
  REQUIRE(store.Get(TestKey(3), out).ok());  // moved up into the device tier (put_tier)
  CHECK(out == data);
  CHECK(TierOf(store, TestKey(3)) == TierId::kHbm);
  CHECK((dev->registered.load() > 0) == pin);
}

TEST_CASE("Transfer: a single Get that promotes from NVMe reads straight into the host arena") {
  // Whatever the caller's buffer: the block lands in the arena, then is copied once from there.
  const Shape shape = GENERATE(Shape::kUnaligned, Shape::kAlignedRoom);
  INFO(ShapeName(shape));
  TempDir dir("xfer-get");
  HostNvme s(dir.path());
  constexpr int kN = 12;
  auto keys = PutInNvme(*s.store, kN);
  const StoreStats before = s.store->Stats();
  const std::uint64_t staged_ios = s.nvme->staged_ios();
  for (int i = 0; i < kN; ++i) {
    ShapedBuffer out(shape, SizeOf(i));
    auto r = s.store->Get(keys[i], out.out());
    INFO(i << ": " << r.status().ToString());
    REQUIRE(r.ok());
    CHECK(out.First(r->size) == TestBytes(i, SizeOf(i)));
    CHECK(TierOf(*s.store, keys[i]) == TierId::kHost);
  }
  const StoreStats after = s.store->Stats();
  CHECK(after.direct_transfers - before.direct_transfers == kN);
  CHECK(after.direct_transfer_bytes - before.direct_transfer_bytes == BytesOf(kN));
  CHECK(after.staged_transfers == before.staged_transfers);
  CHECK(after.staged_transfer_bytes == before.staged_transfer_bytes);
  CHECK(after.promotions - before.promotions == kN);
  CHECK(s.nvme->staged_ios() == staged_ios);  // the NVMe tier staged nothing either
  CHECK(after.bounce_memory == "none");       // and no store buffer was used
  // Read again from the host tier: the committed reservation holds the block.
  for (int i = 0; i < kN; ++i) CHECK(*GetBytes(*s.store, keys[i], SizeOf(i)) == TestBytes(i, SizeOf(i)));
}

TEST_CASE("Transfer: GetBatch promotions land in the host arena, then in the caller's buffers") {
  TempDir dir("xfer-batch");
  HostNvme s(dir.path());
  constexpr int kN = 20;
  auto keys = PutInNvme(*s.store, kN);
  std::vector<std::vector<std::byte>> bufs(kN);
  std::vector<Store::GetItem> items;
  for (int i = 0; i < kN; ++i) {
    bufs[i].resize(SizeOf(i));
    items.push_back({keys[i], bufs[i], {}});
  }
  const StoreStats before = s.store->Stats();
  const std::uint64_t staged_ios = s.nvme->staged_ios();
  auto st = s.store->GetBatch(items);
  for (int i = 0; i < kN; ++i) {
    INFO(i << ": " << st[i].ToString());
    REQUIRE(st[i].ok());
    CHECK(bufs[i] == TestBytes(i, SizeOf(i)));
    CHECK(TierOf(*s.store, keys[i]) == TierId::kHost);
  }
  const StoreStats after = s.store->Stats();
  CHECK(after.direct_transfers - before.direct_transfers == kN);
  CHECK(after.direct_transfer_bytes - before.direct_transfer_bytes == BytesOf(kN));
  CHECK(after.staged_transfers == before.staged_transfers);
  CHECK(s.nvme->staged_ios() == staged_ios);
}

TEST_CASE("Transfer: a move with no direct route is staged through the bounce pool and counted") {
  // Two NVMe tiers: a block evicted from the first is written to the second through a bounce
  // buffer (neither tier has addressable memory nor reserves). Bounce buffers of 4 KiB force the
  // larger blocks through the oversize slot.
  TempDir dir("xfer-staged");
  StoreOptions o = Quiet();
  o.bounce_buffers = 1;
  o.bounce_buffer_bytes = 4096;
  std::vector<std::unique_ptr<Tier>> tiers;
  std::vector<NvmeTier*> raw;
  for (const char* sub : {"a", "b"}) {
    NvmeTierOptions no;
    no.path = dir.path() / sub;
    std::filesystem::create_directories(no.path);
    no.capacity_bytes = 16 * kMiB;
    auto n = NvmeTier::Open(no);
    REQUIRE(n.ok());
    raw.push_back(n->get());
    tiers.push_back(std::move(*n));
  }
  auto opened = Store::OpenWithTiers(o, std::move(tiers));
  REQUIRE(opened.ok());
  Store& store = **opened;
  // Fill the first NVMe tier past capacity so Puts demote into the second.
  constexpr std::size_t kBig = 512 * kKiB;
  int n = 0;
  std::uint64_t demoted_bytes = 0;
  for (; n < 64 && store.Stats().slots[1].blocks < 4; ++n) {
    const std::size_t size = n % 2 == 0 ? kBig : kBig / 2 + 123;
    REQUIRE(store.Put(TestKey(n), TestBytes(n, size)).ok());
  }
  const StoreStats st = store.Stats();
  REQUIRE(st.slots[1].blocks >= 4);
  for (int i = 0; i < n; ++i) {
    BlockKey k = TestKey(i);
    if (store.Lookup({&k, 1})[0].slot == 1) demoted_bytes += i % 2 == 0 ? kBig : kBig / 2 + 123;
  }
  CHECK(st.demotions == st.slots[1].blocks);
  CHECK(st.staged_transfers == st.demotions);
  CHECK(st.staged_transfer_bytes == demoted_bytes);
  CHECK(st.direct_transfers == 0);
  for (int i = 0; i < n; ++i) {
    const std::size_t size = i % 2 == 0 ? kBig : kBig / 2 + 123;
    auto got = GetBytes(store, TestKey(i), size);
    INFO(i << ": " << got.status().ToString());
    REQUIRE(got.ok());
    CHECK(*got == TestBytes(i, size));
  }
}

TEST_CASE("Transfer: demotion from the host arena to NVMe is direct and counted") {
  TempDir dir("xfer-demote");
  StoreOptions o = Quiet();
  HostNvme s(dir.path(), o);
  constexpr std::size_t kBlock = 256 * kKiB;
  // 8 MiB of host: the 40th block of 256 KiB forces evictions.
  constexpr int kN = 40;
  for (int i = 0; i < kN; ++i) REQUIRE(s.store->Put(TestKey(i), TestBytes(i, kBlock)).ok());
  const StoreStats st = s.store->Stats();
  REQUIRE(st.demotions > 0);
  CHECK(st.direct_transfers == st.demotions);
  CHECK(st.direct_transfer_bytes == st.demotions * kBlock);
  CHECK(st.staged_transfers == 0);
  for (int i = 0; i < kN; ++i) CHECK(*GetBytes(*s.store, TestKey(i), kBlock) == TestBytes(i, kBlock));
}

TEST_CASE("Transfer: GetBatch of a corrupt NVMe copy says Corruption naming key and tier, then and later") {
  TempDir dir("xfer-corrupt");
  constexpr int kN = 6;
  HostNvme s(dir.path());
  auto keys = PutInNvme(*s.store, kN);
  REQUIRE(s.store->Flush().ok());
  REQUIRE(CorruptOnDisk(dir.path(), TestBytes(2, SizeOf(2))));
  auto batch = [&] {
    std::vector<std::vector<std::byte>> bufs(kN);
    std::vector<Store::GetItem> items;
    for (int i = 0; i < kN; ++i) {
      bufs[i].resize(SizeOf(i));
      items.push_back({keys[i], bufs[i], {}});
    }
    items.push_back({keys[2], bufs[2], {}});  // the same key twice in one batch
    auto st = s.store->GetBatch(items);
    for (int i = 0; i < kN; ++i) {
      if (i == 2) continue;
      REQUIRE(st[i].ok());
      CHECK(bufs[i] == TestBytes(i, SizeOf(i)));
    }
    return std::vector<Status>{st[2], st[kN]};
  };
  for (const Status& st : batch()) {
    INFO(st.ToString());
    CHECK(st.IsCorruption());
    CHECK_THAT(st.message(), Catch::Contains(keys[2].ToString()) && Catch::Contains("nvme"));
  }
  // Later calls still tell "stored but lost" from "never stored".
  for (const Status& st : batch()) {
    INFO(st.ToString());
    CHECK(st.IsCorruption());
    CHECK_THAT(st.message(), Catch::Contains(keys[2].ToString()) && Catch::Contains("nvme"));
  }
  std::vector<std::byte> out(SizeOf(2));
  auto single = s.store->Get(keys[2], out);
  CHECK(single.status().IsCorruption());
  CHECK(s.store->Get(TestKey(999), out).status().IsNotFound());
  CHECK(s.store->Stats().corruptions_dropped == 1);
}


// The standard tiers with the HBM tier emulated: its "device memory" is host memory, so a test can
// model a GPU engine's buffers with plain vectors marked BufferKind::kDevice.
StoreOptions DeviceOptions(const std::filesystem::path& dir) {
  StoreOptions o = RealTierOptions(dir, 4 * kMiB, 4 * kMiB, 1 * kMiB);
  o.high_watermark = 1.0;
  o.low_watermark = 1.0;
  return o;
}

TEST_CASE("Transfer: device buffers are put into and got from the HBM tier with no host bounce") {
  TempDir dir("xfer-device");
  auto owned = OpenStore(DeviceOptions(dir.path()));
  Store& store = *owned;
  const BlockKey k = TestKey(1);
  const auto bytes = TestBytes(1, 300 * kKiB + 5);
  // put_tier is host, which cannot read device memory: refused, nothing stored.
  Status refused = store.Put(k, ConstBufferRef{bytes, BufferKind::kDevice});
  CHECK(refused.IsInvalidArgument());
  CHECK_THAT(refused.message(), Catch::Contains("device memory") && Catch::Contains("hbm"));
  CHECK_FALSE(store.Contains(k));

  PutOptions to_hbm;
  to_hbm.tier = TierId::kHbm;
  to_hbm.codec = Codec::kBf16;
  REQUIRE(store.Put(k, ConstBufferRef{bytes, BufferKind::kDevice}, to_hbm).ok());
  auto look = store.Lookup({&k, 1});
  REQUIRE(look[0].found);
  CHECK(look[0].tier == TierId::kHbm);
  CHECK(look[0].desc == DescribeBlock(bytes, Codec::kBf16));  // the tier's checksum is the block's
  std::vector<std::byte> dev(bytes.size());
  auto got = store.Get(k, BufferRef{dev, BufferKind::kDevice});
  INFO(got.status().ToString());
  REQUIRE(got.ok());
  CHECK(got->codec == Codec::kBf16);
  CHECK(dev == bytes);
  StoreStats st = store.Stats();
  CHECK(st.slots[1].blocks == 0);  // nothing passed through the host tier
  CHECK(st.direct_transfers + st.staged_transfers == 0);
  // A host Get of the same block still works (a plain span means host memory).
  CHECK(*GetBytes(store, k, bytes.size()) == bytes);
  // Too small a device buffer is refused, naming the size.
  std::vector<std::byte> small(10);
  auto r = store.Get(k, BufferRef{small, BufferKind::kDevice});
  CHECK(r.status().IsInvalidArgument());
  CHECK_THAT(r.status().message(), Catch::Contains(std::to_string(bytes.size())));
}

TEST_CASE("Transfer: a device Get of an unknown key counts a miss in every tier, as a host Get does") {
  TempDir dir("xfer-device-miss");
  auto owned = OpenStore(DeviceOptions(dir.path()));
  Store& store = *owned;
  std::vector<std::byte> dev(4096);
  CHECK(store.Get(TestKey(9), BufferRef{dev, BufferKind::kDevice}).status().IsNotFound());
  CHECK(store.Get(TestKey(9), std::span<std::byte>(dev)).status().IsNotFound());
  for (const TierStatsSnapshot& t : store.Stats().slots) {
    INFO(t.name);
    CHECK(t.misses == 2);
    CHECK(t.hits == 0);
  }
}

TEST_CASE("Transfer: a promotion from the host arena into HBM copies from the arena, not a bounce buffer") {
  TempDir dir("xfer-host-hbm");
  auto owned = OpenStore(DeviceOptions(dir.path()));
  Store& store = *owned;
  std::vector<BlockKey> keys;
  std::uint64_t bytes = 0;
  for (int i = 0; i < 4; ++i) {
    keys.push_back(TestKey(i));
    REQUIRE(store.Put(keys.back(), TestBytes(i, SizeOf(i))).ok());  // into the host tier
    bytes += SizeOf(i);
  }
  std::vector<Status> done = store.Prefetch(keys, TierId::kHbm, Priority::kDemand).get();
  for (const Status& s : done) REQUIRE(s.ok());
  for (const LookupResult& l : store.Lookup(keys)) CHECK(l.tier == TierId::kHbm);
  const StoreStats st = store.Stats();
  CHECK(st.direct_transfers == keys.size());
  CHECK(st.direct_transfer_bytes == bytes);
  CHECK(st.staged_transfers == 0);
  for (int i = 0; i < 4; ++i) CHECK(*GetBytes(store, keys[i], SizeOf(i)) == TestBytes(i, SizeOf(i)));
}

TEST_CASE("Transfer: a device Get of a block on NVMe brings it into HBM first, then copies it") {
  TempDir dir("xfer-device-nvme");
  auto owned = OpenStore(DeviceOptions(dir.path()));
  Store& store = *owned;
  const BlockKey k = TestKey(2);
  const auto bytes = TestBytes(2, 64 * kKiB + 77);
  REQUIRE(store.Put(k, bytes, {Codec::kRaw, TierId::kNvme}).ok());
  const StoreStats before = store.Stats();
  std::vector<std::byte> dev(bytes.size());
  auto got = store.Get(k, BufferRef{dev, BufferKind::kDevice});
  INFO(got.status().ToString());
  REQUIRE(got.ok());
  CHECK(dev == bytes);
  CHECK(TierOf(store, k) == TierId::kHbm);
  const StoreStats after = store.Stats();
  // NVMe -> emulated HBM has no direct route (HBM does not reserve, NVMe has no resident bytes).
  CHECK(after.staged_transfers - before.staged_transfers == 1);
  CHECK(after.staged_transfer_bytes - before.staged_transfer_bytes == bytes.size());
  CHECK(after.direct_transfers == before.direct_transfers);
  // Never stored: NotFound, not an error about device memory.
  CHECK(store.Get(TestKey(3), BufferRef{dev, BufferKind::kDevice}).status().IsNotFound());
}

TEST_CASE("Transfer: a write-through device Put copies the block down from HBM to NVMe") {
  TempDir dir("xfer-device-wt");
  StoreOptions o = DeviceOptions(dir.path());
  o.write_policy = WritePolicy::kWriteThrough;
  o.put_tier = TierId::kHbm;
  auto owned = OpenStore(o);
  Store& store = *owned;
  const auto bytes = TestBytes(4, 40 * kKiB + 3);
  REQUIRE(store.Put(TestKey(4), ConstBufferRef{bytes, BufferKind::kDevice}).ok());
  StoreStats st = store.Stats();
  CHECK(st.slots[0].blocks == 1);  // hbm
  CHECK(st.slots[2].blocks == 1);  // nvme
  CHECK(st.direct_transfers == 1);  // from the (emulated) HBM tier's resident bytes
  CHECK(st.direct_transfer_bytes == bytes.size());
  REQUIRE(store.EvictCopy(TestKey(4), TierId::kHbm).ok());
  CHECK(*GetBytes(store, TestKey(4), bytes.size()) == bytes);  // read back from NVMe
}

// Device-buffer GetBatch. Layout: keys 0-2 in HBM, 3-5 in the host tier, 6-11 on NVMe only, with
// key 8's NVMe copy corrupted on disk; key 99 was never stored.
constexpr int kLayoutKeys = 12;
constexpr int kCorruptKey = 8;
const BlockKey kMissing = TestKey(99);

std::unique_ptr<Store> OpenLayout(const std::filesystem::path& dir) {
  auto opened = Store::Open(DeviceOptions(dir));
  INFO(opened.status().ToString());
  REQUIRE(opened.ok());
  std::unique_ptr<Store> store = std::move(*opened);
  for (int i = 0; i < kLayoutKeys; ++i) {
    const TierId where = i < 3 ? TierId::kHbm : i < 6 ? TierId::kHost : TierId::kNvme;
    REQUIRE(store->Put(TestKey(i), TestBytes(i, SizeOf(i)), {Codec::kRaw, where}).ok());
    REQUIRE(TierOf(*store, TestKey(i)) == where);
  }
  REQUIRE(store->Flush().ok());
  REQUIRE(CorruptOnDisk(dir, TestBytes(kCorruptKey, SizeOf(kCorruptKey))));
  return store;
}

enum class GetMode { kDeviceBatch, kDeviceSingle, kHostBatch };

struct LayoutResult {
  std::vector<Status> status;                   // keys 0..11, then kMissing
  std::vector<std::vector<std::byte>> bytes;   // what landed in each buffer
  std::vector<BlockDesc> desc;
  StoreStats stats;
};

LayoutResult GetLayout(Store& store, GetMode mode) {
  LayoutResult r;
  std::vector<BlockKey> keys;
  for (int i = 0; i < kLayoutKeys; ++i) keys.push_back(TestKey(i));
  keys.push_back(kMissing);
  r.bytes.resize(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) r.bytes[i].assign(SizeOf(static_cast<int>(i)) + 11, std::byte{0});
  const BufferKind kind = mode == GetMode::kHostBatch ? BufferKind::kHost : BufferKind::kDevice;
  if (mode == GetMode::kDeviceSingle) {
    for (std::size_t i = 0; i < keys.size(); ++i) {
      auto g = store.Get(keys[i], BufferRef{r.bytes[i], kind});
      r.status.push_back(g.status());
      r.desc.push_back(g.ok() ? *g : BlockDesc{});
    }
  } else {
    std::vector<Store::GetRefItem> items;
    for (std::size_t i = 0; i < keys.size(); ++i) items.push_back({keys[i], BufferRef{r.bytes[i], kind}, {}});
    r.status = store.GetBatch(std::span<Store::GetRefItem>(items));
    for (const auto& it : items) r.desc.push_back(it.desc);
  }
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (r.status[i].ok()) r.bytes[i].resize(r.desc[i].size);
  }
  r.stats = store.Stats();
  return r;
}

void CheckLayout(const LayoutResult& r) {
  REQUIRE(r.status.size() == kLayoutKeys + 1);
  for (int i = 0; i < kLayoutKeys; ++i) {
    INFO(i << ": " << r.status[i].ToString());
    if (i == kCorruptKey) {
      CHECK(r.status[i].IsCorruption());
      CHECK_THAT(r.status[i].message(), Catch::Contains(TestKey(i).ToString()) && Catch::Contains("nvme"));
      continue;
    }
    REQUIRE(r.status[i].ok());
    CHECK(r.desc[i] == DescribeBlock(TestBytes(i, SizeOf(i)), Codec::kRaw));
    CHECK(r.bytes[i] == TestBytes(i, SizeOf(i)));
  }
  CHECK(r.status[kLayoutKeys].IsNotFound());
  CHECK(r.stats.corruptions_dropped == 1);
}

TEST_CASE("Transfer: GetBatch into device buffers == single device Gets == host GetBatch, byte for byte") {
  TempDir d1("xfer-devbatch"), d2("xfer-devsingle"), d3("xfer-hostbatch");
  auto batched = OpenLayout(d1.path());
  auto single = OpenLayout(d2.path());
  auto host = OpenLayout(d3.path());
  const LayoutResult b = GetLayout(*batched, GetMode::kDeviceBatch);
  const LayoutResult s = GetLayout(*single, GetMode::kDeviceSingle);
  const LayoutResult h = GetLayout(*host, GetMode::kHostBatch);
  CheckLayout(b);
  CheckLayout(s);
  CheckLayout(h);
  for (std::size_t i = 0; i < b.status.size(); ++i) {
    INFO(i);
    CHECK(b.status[i].code() == s.status[i].code());
    CHECK(b.status[i].code() == h.status[i].code());
    CHECK(b.bytes[i] == s.bytes[i]);
    CHECK(b.bytes[i] == h.bytes[i]);
  }
  // Every good block now has a copy in HBM, where the device copies came from.
  for (int i = 0; i < kLayoutKeys; ++i) {
    if (i != kCorruptKey) CHECK(TierOf(*batched, TestKey(i)) == TierId::kHbm);
  }
  // NVMe-only blocks (6, 7, 9, 10, 11) were staged into HBM; host blocks (3-5) moved direct from
  // the arena; all 11 good blocks were copied device to device. The single-key path counts the same.
  std::uint64_t nvme_bytes = 0, host_bytes = 0, good_bytes = 0;
  for (int i = 0; i < kLayoutKeys; ++i) {
    if (i == kCorruptKey) continue;
    good_bytes += SizeOf(i);
    if (i >= 6) nvme_bytes += SizeOf(i);
    if (i >= 3 && i < 6) host_bytes += SizeOf(i);
  }
  CHECK(b.stats.staged_transfers == 5);
  CHECK(b.stats.staged_transfer_bytes == nvme_bytes);
  CHECK(b.stats.direct_transfers == 3);
  CHECK(b.stats.direct_transfer_bytes == host_bytes);
  CHECK(b.stats.device_copies == 11);
  CHECK(b.stats.device_copy_bytes == good_bytes);
  CHECK(s.stats.staged_transfers == b.stats.staged_transfers);
  CHECK(s.stats.direct_transfers == b.stats.direct_transfers);
  CHECK(s.stats.device_copies == b.stats.device_copies);
  CHECK(h.stats.device_copies == 0);
  // The staging buffers say what memory they are (no CUDA device here: mlock'ed or pageable).
  CHECK(b.stats.bounce_cuda_registered == 0);
  CHECK(b.stats.bounce_locked + b.stats.bounce_pageable > 0);
  CHECK((b.stats.bounce_memory == "mlock" || b.stats.bounce_memory == "pageable"));
  CHECK_THAT(batched->PrometheusText(), Catch::Contains("terrace_store_device_copies_total 11"));
  // Again: the corrupt block stays an error (stored but lost), the rest are served from HBM.
  const LayoutResult again = GetLayout(*batched, GetMode::kDeviceBatch);
  CheckLayout(again);
  CHECK(again.stats.staged_transfers == b.stats.staged_transfers);
  CHECK(again.stats.device_copies == 22);
}

TEST_CASE("Transfer: concurrent device GetBatches of the same NVMe blocks each get every block") {
  TempDir dir("xfer-devbatch-mt");
  auto owned = OpenStore(DeviceOptions(dir.path()));
  Store& store = *owned;
  constexpr int kN = 16;
  auto keys = PutInNvme(store, kN);
  constexpr int kThreads = 3;
  std::vector<int> bad(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::vector<std::byte>> bufs(kN);
      std::vector<Store::GetRefItem> items;
      for (int i = 0; i < kN; ++i) {
        const int k = (i + 5 * t) % kN;  // overlapping batches in different orders
        bufs[i].resize(SizeOf(k));
        items.push_back({keys[k], BufferRef{bufs[i], BufferKind::kDevice}, {}});
      }
      std::vector<Status> st = store.GetBatch(std::span<Store::GetRefItem>(items));
      for (int i = 0; i < kN; ++i) {
        const int k = (i + 5 * t) % kN;
        if (!st[i].ok() || bufs[i] != TestBytes(k, SizeOf(k))) ++bad[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) CHECK(bad[t] == 0);
  const StoreStats st = store.Stats();
  CHECK(st.staged_transfers == kN);  // each block moved up once, however many batches wanted it
  CHECK(st.staged_transfer_bytes == BytesOf(kN));
  CHECK(st.device_copies == kThreads * kN);
}

TEST_CASE("Transfer: a mixed GetBatch without a device tier refuses only its device items") {
  TempDir dir("xfer-devbatch-nohbm");
  HostNvme s(dir.path());
  auto keys = PutInNvme(*s.store, 2);
  std::vector<std::byte> a(SizeOf(0)), b(SizeOf(1));
  std::vector<Store::GetRefItem> items{{keys[0], BufferRef{a, BufferKind::kDevice}, {}},
                                       {keys[1], BufferRef{b, BufferKind::kHost}, {}}};
  std::vector<Status> st = s.store->GetBatch(std::span<Store::GetRefItem>(items));
  CHECK(st[0].IsInvalidArgument());
  CHECK_THAT(st[0].message(), Catch::Contains("device memory") && Catch::Contains(keys[0].ToString()));
  REQUIRE(st[1].ok());
  CHECK(b == TestBytes(1, SizeOf(1)));
  CHECK(items[1].desc.size == SizeOf(1));
}

// --- A host-memory source copy is verified before Transfer copies it from where it lies ---------
// (Transfer's route 2: a demotion from HBM / the host arena, or a promotion into a device_buffers
// tier.) The destination's Put takes the store's descriptor, so a corrupt source copy copied there
// would pass on its damage: into the Get's buffer at once, or into a device-memory handle that
// Acquire cannot check.

// The emulated HBM tier, optionally relabelled device memory (as the CUDA tier is: Acquire does
// not read its bytes back to check them), over a fake host tier and, optionally, a fake NVMe tier.
class DeviceLabelledTier final : public ForwardingTier {
 public:
  explicit DeviceLabelledTier(std::shared_ptr<Tier> inner) : ForwardingTier(std::move(inner)) {
    caps_.memory = MemoryKind::kDevice;
    caps_.emulated = false;
  }
  const std::byte* ResidentPtr(const BlockKey& key) const override { return inner_->ResidentPtr(key); }
};

struct HbmOverFakes {
  Tier* hbm = nullptr;
  FakeTier* host = nullptr;
  FakeTier* nvme = nullptr;
  std::unique_ptr<Store> store;
  HbmOverFakes(const StoreOptions& o, std::uint64_t hbm_bytes, bool with_nvme, bool device_memory = false) {
    HbmTierOptions ho;
    ho.mode = HbmMode::kEmulated;
    ho.capacity_bytes = hbm_bytes;
    ho.link.enabled = false;
    auto made = CreateHbmTier(ho);
    REQUIRE(made.ok());
    std::vector<std::unique_ptr<Tier>> tiers;
    if (device_memory) {
      tiers.push_back(std::make_unique<DeviceLabelledTier>(std::shared_ptr<Tier>(std::move(*made))));
    } else {
      tiers.push_back(std::move(*made));
    }
    hbm = tiers.back().get();
    REQUIRE(hbm->caps().device_buffers);
    REQUIRE_FALSE(hbm->caps().reserves);
    auto h = std::make_unique<FakeTier>(TierId::kHost, 1 << 20);
    host = h.get();
    tiers.push_back(std::move(h));
    if (with_nvme) {
      auto n = std::make_unique<FakeTier>(TierId::kNvme, 1 << 22);
      nvme = n.get();
      tiers.push_back(std::move(n));
    }
    auto r = Store::OpenWithTiers(o, std::move(tiers));
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    store = std::move(*r);
  }
  std::uint64_t corruptions(TierId t) const { return store->Stats().tiers[static_cast<int>(t)].corruptions; }
};

TEST_CASE("Transfer: a Get promoting a corrupt host copy into HBM: Corruption or the lower copy, never bad bytes") {
  const bool lower_copy = GENERATE(false, true);
  INFO("good copy in nvme: " << lower_copy);
  StoreOptions o = Quiet();
  o.put_tier = TierId::kHbm;  // a Get promotes into HBM, from the host copy where it lies
  if (lower_copy) o.write_policy = WritePolicy::kWriteThrough;
  HbmOverFakes s(o, 1 * kMiB, /*with_nvme=*/true);
  const BlockKey key = TestKey(40);
  const auto bytes = TestBytes(40, 24 * kKiB);
  REQUIRE(s.store->Put(key, bytes, {Codec::kRaw, TierId::kHost}).ok());
  REQUIRE(TierOf(*s.store, key) == TierId::kHost);
  REQUIRE(s.nvme->Has(key) == lower_copy);
  REQUIRE(s.host->CorruptStored(key));

  auto r = GetBytes(*s.store, key);
  CHECK(s.store->Stats().corruptions_dropped == 1);
  CHECK(s.corruptions(TierId::kHost) == 1);
  if (lower_copy) {
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    CHECK(*r == bytes);
    CHECK(TierOf(*s.store, key) == TierId::kHbm);
    CHECK(*GetBytes(*s.store, key) == bytes);  // from HBM now
  } else {
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().IsCorruption());
    CHECK_THAT(r.status().message(), Catch::Contains(key.ToString()));
    CHECK(s.hbm->block_count() == 0);  // nothing was copied up
    CHECK_FALSE(s.store->Contains(key));
  }
}

TEST_CASE("Transfer: Acquire into a device-memory tier never hands out a corrupt host copy") {
  const bool lower_copy = GENERATE(false, true);
  INFO("good copy in nvme: " << lower_copy);
  StoreOptions o = Quiet();
  if (lower_copy) o.write_policy = WritePolicy::kWriteThrough;
  HbmOverFakes s(o, 1 * kMiB, /*with_nvme=*/true, /*device_memory=*/true);
  const BlockKey key = TestKey(41);
  const auto bytes = TestBytes(41, 24 * kKiB);
  REQUIRE(s.store->Put(key, bytes, {Codec::kRaw, TierId::kHost}).ok());
  REQUIRE(s.host->CorruptStored(key));

  auto h = s.store->Acquire(key, TierId::kHbm);
  CHECK(s.store->Stats().corruptions_dropped == 1);
  CHECK(s.corruptions(TierId::kHost) == 1);
  if (lower_copy) {
    INFO(h.status().ToString());
    REQUIRE(h.ok());
    CHECK(h->memory_kind() == MemoryKind::kDevice);
    REQUIRE(h->size() == bytes.size());
    CHECK(std::vector<std::byte>(h->data(), h->data() + h->size()) == bytes);  // emulated: host-readable
  } else {
    REQUIRE_FALSE(h.ok());
    CHECK(h.status().IsCorruption());
    CHECK_THAT(h.status().message(), Catch::Contains(key.ToString()));
    CHECK(s.hbm->block_count() == 0);
  }
}

TEST_CASE("Transfer: a corrupt HBM copy evicted to make room is dropped, not demoted into the host tier") {
  StoreOptions o = Quiet();
  o.put_tier = TierId::kHbm;
  HbmOverFakes s(o, 64 * kKiB, /*with_nvme=*/false);
  const BlockKey a = TestKey(42), b = TestKey(43);
  const auto a_bytes = TestBytes(42, 40 * kKiB), b_bytes = TestBytes(43, 40 * kKiB);
  REQUIRE(s.store->Put(a, a_bytes).ok());
  REQUIRE(TierOf(*s.store, a) == TierId::kHbm);
  {  // flip a bit of the resident copy, in the emulated HBM tier's memory
    REQUIRE(s.hbm->Pin(a).ok());
    auto* p = const_cast<std::byte*>(s.hbm->ResidentPtr(a));
    REQUIRE(p != nullptr);
    p[100] ^= std::byte{0x10};
    REQUIRE(s.hbm->Unpin(a).ok());
  }
  // b does not fit beside a: a is the victim, and its write-back to the host tier reads the HBM copy.
  REQUIRE(s.store->Put(b, b_bytes).ok());
  CHECK(TierOf(*s.store, b) == TierId::kHbm);
  CHECK_FALSE(s.host->Has(a));  // the damage went nowhere
  const StoreStats st = s.store->Stats();
  CHECK(st.demotions == 0);
  CHECK(st.corruptions_dropped == 1);
  CHECK(s.corruptions(TierId::kHbm) == 1);
  auto r = GetBytes(*s.store, a);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().IsCorruption());
  CHECK_THAT(r.status().message(), Catch::Contains("hbm"));
  CHECK(*GetBytes(*s.store, b) == b_bytes);
}

}  // namespace
}  // namespace terrace::testing
