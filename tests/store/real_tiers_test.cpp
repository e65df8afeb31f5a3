// The Store over the real tiers: emulated HBM + host arena + NVMe (io_uring, RocksDB) in a TempDir.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <future>
#include <thread>

#include <fmt/format.h>

#include "src/common/aligned_buffer.h"
#include "src/store/store_impl.h"
#include "forwarding_tier.h"
#include "host_nvme.h"
#include "store_test_util.h"
#include "tiers/fault/fault_tier.h"
#include "tiers/hbm/hbm_tier.h"
#include "tiers/host/host_tier.h"
#include "tiers/nvme/nvme_tier.h"

namespace terrace::testing {
namespace {

constexpr std::size_t kBlock = 8 * 1024;

StoreOptions RealOptions(const std::filesystem::path& dir) {
  StoreOptions o = RealTierOptions(dir, 64 * kKiB, 256 * kKiB, 64 * kKiB);
  o.background_threads = 2;
  return o;
}

// A 64 KiB host tier over two NVMe tiers: 4 MiB (the smallest data file: a few hundred 8 KiB
// blocks) in dir/fast named `fast_name`, then 16 MiB in dir/slow named `slow_name` ("": the kind's
// own name).
std::vector<TierSlotOptions> HostOverTwoNvme(const std::filesystem::path& dir, const char* fast_name,
                                             const char* slow_name) {
  TierSlotOptions host{"host", "", {}, {}, {}};
  host.host.capacity_bytes = 64 * kKiB;
  host.host.chunk_bytes = 64 * kKiB;
  host.host.pin = false;
  TierSlotOptions fast{"nvme", fast_name, {}, {}, {}};
  fast.nvme.path = dir / "fast";
  fast.nvme.capacity_bytes = 4 * kMiB;
  TierSlotOptions slow{"nvme", slow_name, {}, {}, {}};
  slow.nvme.path = dir / "slow";
  slow.nvme.capacity_bytes = 16 * kMiB;
  return {host, fast, slow};
}

TEST_CASE("Real tiers: used_bytes is the blocks' sizes summed, allocated_bytes their pages") {
  TempDir dir("store-used");
  auto store = OpenStore(RealOptions(dir.path()));
  const std::vector<std::byte> one(1, std::byte{7});
  for (std::uint64_t i = 0; i < 3; ++i) {
    for (TierId t : {TierId::kHbm, TierId::kHost, TierId::kNvme}) {
      BlockKey k = TestKey(i);
      k.id.hi = static_cast<std::uint64_t>(t) + 1;
      REQUIRE(store->Put(k, one, {Codec::kRaw, t}).ok());
    }
  }
  const StoreStats st = store->Stats();
  const std::string text = store->PrometheusText();
  for (TierId t : {TierId::kHbm, TierId::kHost, TierId::kNvme}) {
    const TierStatsSnapshot& s = st.tiers[static_cast<std::size_t>(t)];
    INFO("tier " << s.name);
    CHECK(s.blocks == 3);
    CHECK(s.used_bytes == 3);
    CHECK(s.allocated_bytes >= 3 * 4096);  // whole pages (NVMe: plus a descriptor each)
    CHECK_THAT(text, Catch::Contains(fmt::format("terrace_tier_used_bytes{{tier=\"{}\"}} 3\n", s.name)));
  }
}

TEST_CASE("Real tiers: background demotion starts from the host tier's pages, not its blocks' bytes") {
  // 16 pages of host; 9 one-byte blocks take 9 pages (36 KiB), over the 50% watermark, although
  // their bytes (9) are far below it.
  TempDir dir("store-watermark");
  StoreOptions o = RealTierOptions(dir.path(), 0, 64 * kKiB, 16 * kKiB);
  o.hbm.mode = HbmMode::kOff;
  o.high_watermark = 0.5;
  o.low_watermark = 0.25;
  auto store = OpenStore(o);
  const std::vector<std::byte> one(1, std::byte{7});
  for (std::uint64_t i = 0; i < 9; ++i) REQUIRE(store->Put(TestKey(i), one).ok());
  // Background work is asynchronous: wait (bounded) for it to reach the low watermark.
  auto host_allocated = [&] { return store->Stats().tiers[static_cast<std::size_t>(TierId::kHost)].allocated_bytes; };
  for (int i = 0; i < 1000 && host_allocated() > 16 * kKiB; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  CHECK(host_allocated() <= 16 * kKiB);
  CHECK(store->Stats().evictions >= 5);
  for (std::uint64_t i = 0; i < 9; ++i) CHECK(*GetBytes(*store, TestKey(i)) == one);
}

TEST_CASE("Real tiers: background demotion starts from an NVMe tier's extents, not its blocks' bytes") {
  // One-byte blocks take 8 KiB extents each in the first NVMe tier (4 KiB of data + 4 KiB record
  // unit): 300 of them allocate over half its 4 MiB, over the 50% watermark, although their
  // bytes (300) are far below it.
  TempDir dir("store-nvme-watermark");
  StoreOptions o;
  o.high_watermark = 0.5;
  o.low_watermark = 0.25;
  o.tier_list = HostOverTwoNvme(dir.path(), "", "nvme-2");
  auto store = OpenStore(o);
  const std::vector<std::byte> one(1, std::byte{7});
  constexpr std::uint64_t kPuts = 300;
  for (std::uint64_t i = 0; i < kPuts; ++i) REQUIRE(store->Put(TestKey(i), one, {Codec::kRaw, TierId::kNvme}).ok());
  auto fast_allocated = [&] { return store->Stats().slots[1].allocated_bytes; };
  // Background work is asynchronous: wait (bounded) for it to reach the low watermark.
  for (int i = 0; i < 1000 && fast_allocated() > kMiB; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  CHECK(fast_allocated() <= kMiB);
  CHECK(store->Stats().slots[2].blocks > 0);
  CHECK(store->Stats().evictions > 0);
  for (std::uint64_t i = 0; i < kPuts; ++i) CHECK(*GetBytes(*store, TestKey(i)) == one);
}

TEST_CASE("Real tiers: blocks move hbm -> host -> nvme and read back intact") {
  TempDir dir("store-real");
  StoreOptions o = RealOptions(dir.path());
  o.put_tier = TierId::kHbm;
  auto store = OpenStore(o);
  REQUIRE(store->HasTier(TierId::kHbm));
  REQUIRE(store->HasTier(TierId::kNvme));
  constexpr int kBlocks = 60;  // 480 KiB: more than hbm + host hold
  for (int i = 0; i < kBlocks; ++i) {
    Status s = store->Put(TestKey(i), TestBytes(i, kBlock));
    INFO(s.ToString());
    REQUIRE(s.ok());
  }
  auto st = store->Stats();
  CHECK(st.demotions > 0);
  CHECK(st.tiers[2].blocks > 0);
  // Demotions from host to NVMe write straight from the host arena, registered with io_uring
  // (root may always register; other users depend on RLIMIT_MEMLOCK).
  INFO("nvme: " << st.tiers[2].detail);
  if (geteuid() == 0) CHECK_THAT(st.tiers[2].detail, !Catch::Contains("+ 0 registered external regions"));
  CHECK_THAT(st.tiers[2].detail, Catch::Contains("registered external regions"));
  for (int i = 0; i < kBlocks; ++i) {
    auto got = GetBytes(*store, TestKey(i), kBlock);
    INFO(i << ": " << got.status().ToString());
    REQUIRE(got.ok());
    CHECK(*got == TestBytes(i, kBlock));
  }
  auto h = store->Acquire(TestKey(3), TierId::kHbm);
  REQUIRE(h.ok());
  CHECK(h->memory_kind() == MemoryKind::kHost);  // emulated HBM lives in host memory
  CHECK(std::equal(h->data(), h->data() + kBlock, TestBytes(3, kBlock).begin()));
  h->Release();
  std::string prom = store->PrometheusText();
  CHECK_THAT(prom, Catch::Contains("terrace_tier_emulated{tier=\"hbm\"} 1"));
  CHECK_THAT(prom, Catch::Contains("terrace_tier_read_latency_seconds_bucket{tier=\"nvme\",le=\"+Inf\"}"));
}

TEST_CASE("Real tiers: every block written into a tier is timed, those an NVMe read lands in directly too") {
  TempDir dir("store-real-timed");
  auto store = OpenStore(RealOptions(dir.path()));
  PutOptions nvme;
  nvme.tier = TierId::kNvme;
  for (int i = 0; i < 8; ++i) REQUIRE(store->Put(TestKey(i), TestBytes(i, kBlock), nvme).ok());
  for (int i = 0; i < 8; ++i) REQUIRE(GetBytes(*store, TestKey(i), kBlock).ok());  // promoted into host
  const StoreStats st = store->Stats();
  REQUIRE(st.direct_transfers >= 8);  // the reads landed in host memory the tier reserved
  for (const TierStatsSnapshot& t : st.slots) {
    INFO(t.name);
    CHECK(t.writes == t.puts);  // terrace_tier_write_latency_seconds_count against terrace_tier_puts_total
  }
  CHECK(st.slots[1].puts == 8);
}

TEST_CASE("Real tiers: GetBatch and Prefetch of NVMe-only blocks return exactly what was put") {
  TempDir dir("store-real-batch");
  StoreOptions o = RealOptions(dir.path());
  o.host.capacity_bytes = 4 * kMiB;  // holds every block: nothing is evicted
  auto store = OpenStore(o);
  constexpr int kBlocks = 48;
  auto size_of = [](int i) { return kBlock / 2 + 777 * static_cast<std::size_t>(i); };  // unaligned sizes
  for (int i = 0; i < kBlocks; ++i) REQUIRE(store->Put(TestKey(i), TestBytes(i, size_of(i)), {Codec::kRaw, TierId::kNvme}).ok());
  std::vector<std::vector<std::byte>> bufs(kBlocks / 2);
  std::vector<Store::GetItem> items;
  for (int i = 0; i < kBlocks / 2; ++i) {
    bufs[i].resize(size_of(i));
    items.push_back({TestKey(i), bufs[i], {}});
  }
  auto st = store->GetBatch(items);
  for (int i = 0; i < kBlocks / 2; ++i) {
    INFO(i << ": " << st[i].ToString());
    REQUIRE(st[i].ok());
    CHECK(bufs[i] == TestBytes(i, size_of(i)));
    CHECK(TierOf(*store, TestKey(i)) == TierId::kHost);  // promoted on get
  }
  std::vector<BlockKey> rest;
  for (int i = kBlocks / 2; i < kBlocks; ++i) rest.push_back(TestKey(i));
  for (const auto& s : store->Prefetch(rest, TierId::kHost, Priority::kDemand).get()) CHECK(s.ok());
  for (int i = kBlocks / 2; i < kBlocks; ++i) {
    CHECK(TierOf(*store, TestKey(i)) == TierId::kHost);
    CHECK(*GetBytes(*store, TestKey(i), size_of(i)) == TestBytes(i, size_of(i)));
  }
}

TEST_CASE("Real tiers: a GetBatch into buffers laid out by read_gap_bytes reads adjacent NVMe blocks together") {
  TempDir dir("store-real-gap");
  StoreOptions o = RealOptions(dir.path());
  o.promote_on_get = false;  // reads go straight into the caller's buffers
  auto store = OpenStore(o);
  REQUIRE(store->read_gap_bytes() == 4096);
  constexpr int kBlocks = 12;
  constexpr std::size_t kSize = 5 * 4096;  // aligned: slots of 24 KiB with the gap
  for (int i = 0; i < kBlocks; ++i) REQUIRE(store->Put(TestKey(i), TestBytes(i, kSize), {Codec::kRaw, TierId::kNvme}).ok());
  const std::size_t slot = kSize + store->read_gap_bytes();
  AlignedBuffer mem(slot * kBlocks);
  REQUIRE(mem.data() != nullptr);
  std::vector<Store::GetItem> items;
  for (int i = 0; i < kBlocks; ++i)
    items.push_back({TestKey(i), std::span<std::byte>(mem.data() + slot * static_cast<std::size_t>(i), slot), {}});
  auto requests = [&] { return store->Stats().tiers[static_cast<std::size_t>(TierId::kNvme)].read_requests; };
  const std::uint64_t before = requests();
  auto st = store->GetBatch(items);
  for (int i = 0; i < kBlocks; ++i) {
    INFO(i << ": " << st[static_cast<std::size_t>(i)].ToString());
    REQUIRE(st[static_cast<std::size_t>(i)].ok());
    CHECK(items[static_cast<std::size_t>(i)].desc.size == kSize);
    const auto want = TestBytes(i, kSize);
    CHECK(std::equal(want.begin(), want.end(), items[static_cast<std::size_t>(i)].out.begin()));
    CHECK(TierOf(*store, TestKey(i)) == TierId::kNvme);  // not promoted
  }
  CHECK(requests() - before == 1);  // 12 x 24 KiB: one request
  // Exactly sized buffers: one request per block, the same bytes.
  std::vector<std::vector<std::byte>> bufs(kBlocks, std::vector<std::byte>(kSize));
  for (int i = 0; i < kBlocks; ++i) items[static_cast<std::size_t>(i)].out = bufs[static_cast<std::size_t>(i)];
  const std::uint64_t before_tight = requests();
  st = store->GetBatch(items);
  for (int i = 0; i < kBlocks; ++i) {
    REQUIRE(st[static_cast<std::size_t>(i)].ok());
    CHECK(bufs[static_cast<std::size_t>(i)] == TestBytes(i, kSize));
  }
  CHECK(requests() - before_tight == kBlocks);
}

TEST_CASE("Real tiers: write-through blocks survive a reopen") {
  TempDir dir("store-reopen");
  StoreOptions o = RealOptions(dir.path());
  o.hbm.mode = HbmMode::kOff;
  o.write_policy = WritePolicy::kWriteThrough;
  o.nvme.durability = Durability::kSync;
  {
    auto store = Store::Open(o);
    REQUIRE(store.ok());
    for (int i = 0; i < 20; ++i) REQUIRE((*store)->Put(TestKey(i), TestBytes(i, kBlock)).ok());
    REQUIRE((*store)->Erase(TestKey(0)).ok());
  }
  auto store = Store::Open(o);
  REQUIRE(store.ok());
  CHECK_FALSE((*store)->Contains(TestKey(0)));
  for (int i = 1; i < 20; ++i) {
    auto got = GetBytes(**store, TestKey(i), kBlock);
    REQUIRE(got.ok());
    CHECK(*got == TestBytes(i, kBlock));
  }
  CHECK((*store)->Stats().blocks == 19);
}

TEST_CASE("Real tiers: a put of a key whose kind no BlockKind names is refused (recovery dropped it: a lost block)") {
  TempDir dir("store-bad-kind");
  StoreOptions o = RealOptions(dir.path());
  o.hbm.mode = HbmMode::kOff;
  o.write_policy = WritePolicy::kWriteThrough;
  auto store = Store::Open(o);
  REQUIRE(store.ok());
  BlockKey k = TestKey(1);
  k.kind = static_cast<BlockKind>(200);
  const Status s = (*store)->Put(k, TestBytes(1, kBlock));
  CHECK(s.IsInvalidArgument());
  CHECK_THAT(s.message(), Catch::Contains("block kind 200"));
  CHECK_FALSE((*store)->Contains(k));
}

TEST_CASE("Real tiers: a write-back put that needs room above a read-only NVMe tier names read-only, not a full tier") {
  TempDir dir("store-read-only-room");
  StoreOptions o = RealOptions(dir.path());
  o.hbm.mode = HbmMode::kOff;
  { REQUIRE(Store::Open(o).ok()); }  // creates the store; read_only opens only an existing one
  o.nvme.read_only = true;
  o.write_policy = WritePolicy::kWriteBack;
  auto store = OpenStore(o);
  // 256 KiB of host: the fourth 64 KiB block needs a demotion the read-only NVMe tier refuses.
  Status s;
  for (std::uint64_t i = 0; i < 8 && s.ok(); ++i) s = store->Put(TestKey(i), TestBytes(i, 64 * kKiB));
  INFO(s.ToString());
  CHECK(s.IsInvalidArgument());
  CHECK_THAT(s.message(), Catch::Contains("read-only"));
  CHECK_THAT(s.message(), !Catch::Contains("is full"));
}

TEST_CASE("Real tiers: Store::Open refuses two tier_list slots given one name, creating nothing") {
  TempDir dir("store-dup-names");
  TierSlotOptions a{"host", "fast", {}, {}, {}};
  a.host.capacity_bytes = 64 * kKiB;
  a.host.chunk_bytes = 64 * kKiB;
  a.host.pin = false;
  TierSlotOptions b{"nvme", "fast", {}, {}, {}};
  b.nvme.path = dir.path() / "nvme";
  b.nvme.capacity_bytes = 16 * kMiB;
  StoreOptions o = Quiet();
  o.tier_list = {a, b};
  auto r = Store::Open(o);
  INFO(r.status().ToString());
  CHECK(r.status().IsInvalidArgument());
  CHECK_THAT(r.status().message(), Catch::Contains("tier_list[0] and tier_list[1] are both named 'fast'"));
  CHECK_FALSE(std::filesystem::exists(dir.path() / "nvme"));
}

TEST_CASE("Real tiers: an option holding an enum value the library does not name is refused at open, creating nothing") {
  TempDir dir("store-bad-enum");
  const StoreOptions base = RealOptions(dir.path() / "new");
  for (const char* field : {"eviction", "placement", "write_policy", "put_tier"}) {
    StoreOptions o = base;
    const std::string f = field;
    if (f == "eviction") o.eviction = static_cast<EvictionPolicy>(9);
    if (f == "placement") o.placement = static_cast<Placement>(9);
    if (f == "write_policy") o.write_policy = static_cast<WritePolicy>(9);
    if (f == "put_tier") o.put_tier = static_cast<TierId>(9);
    auto store = Store::Open(o);
    INFO(field << ": " << store.status().ToString());
    CHECK(store.status().IsInvalidArgument());
    CHECK_THAT(store.status().message(), Catch::Contains(field));
    CHECK_FALSE(std::filesystem::exists(dir.path() / "new"));  // no data file preallocated for a refused open
  }
}

// A store of one NVMe tier of `capacity` bytes, filled with 5000-byte blocks (12 KiB extents: 8 KiB
// of data units and a 4 KiB descriptor) until a put fails; `stored` gets how many went in. The NVMe
// tier is then full while its used_bytes (the blocks' sizes) are at about 40% of its capacity.
std::unique_ptr<Store> FullNvmeStore(const std::filesystem::path& dir, std::uint64_t capacity, Status* last,
                                     int* stored) {
  StoreOptions o = RealOptions(dir);
  o.hbm.mode = HbmMode::kOff;
  o.host.capacity_bytes = 0;
  o.nvme.capacity_bytes = capacity;
  auto store = Store::Open(o);
  INFO(store.status().ToString());
  REQUIRE(store.ok());
  for (*stored = 0; *stored < 1000; ++*stored) {
    *last = (*store)->Put(TestKey(*stored), TestBytes(*stored, 5000));
    if (!last->ok()) break;
  }
  return std::move(*store);
}

TEST_CASE("Real tiers: a put into an NVMe tier full of rounded-up extents says full and not fragmented") {
  TempDir dir("store-nvme-full");
  Status s;
  int stored = 0;
  auto store = FullNvmeStore(dir.path(), 2 * kMiB, &s, &stored);
  INFO(s.ToString());
  REQUIRE(s.IsOutOfCapacity());
  CHECK(stored > 100);
  CHECK(s.message().find("fragmented") == std::string::npos);
  CHECK(s.message().find("tier nvme is full") != std::string::npos);
  CHECK(s.message().find("it is full") != std::string::npos);  // the tier's own words agree
  // Overwriting a resident key: the tier writes the new copy before it frees the old one, so the
  // old copy's bytes are no room for it either.
  const Status over = store->Put(TestKey(0), TestBytes(12345, 5000));
  INFO(over.ToString());
  REQUIRE(over.IsOutOfCapacity());
  CHECK(over.message().find("fragmented") == std::string::npos);
  CHECK(over.message().find("tier nvme is full") != std::string::npos);
}

// Whatever the capacity, a block that does not fit the free extents of a full NVMe tier is "full":
// the superblock area is neither a block's nor free space (a window of one unit said "fragmented").
TEST_CASE("Real tiers: a full NVMe tier of any capacity says full and never fragmented") {
  for (std::uint64_t cap = 2 * kMiB; cap < 2 * kMiB + 20 * 4096; cap += 4096) {
    TempDir dir("store-nvme-cap");
    Status s;
    int stored = 0;
    auto store = FullNvmeStore(dir.path(), cap, &s, &stored);
    INFO("capacity " << cap << ": " << s.ToString());
    REQUIRE(s.IsOutOfCapacity());
    CHECK(s.message().find("fragmented") == std::string::npos);
  }
}

// A tier whose close starts late: the NVMe tier inside it commits only once this has slept, long
// after the callback that dropped the store returned (so a close nobody waits for is seen).
class LateClosingTier final : public ForwardingTier {
 public:
  using ForwardingTier::ForwardingTier;
  ~LateClosingTier() override { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }
};

// The store closes on a thread of its own; program exit waits for it (WaitForClosingStores is what
// the exit-time destructor runs). The long commit interval means only the close commits the puts.
TEST_CASE("Real tiers: a store dropped in a completion callback commits its puts before exit waits end") {
  TempDir dir("store-callback-close");
  StoreOptions o = RealOptions(dir.path());
  o.hbm.mode = HbmMode::kOff;
  o.put_tier = TierId::kNvme;
  o.nvme.durability = Durability::kAsync;
  o.nvme.group_commit_interval = std::chrono::seconds(60);
  constexpr int kPuts = 16;
  {
    auto nvme = NvmeTier::Open(o.nvme);
    REQUIRE(nvme.ok());
    std::array<std::unique_ptr<Tier>, kNumTiers> tiers;
    tiers[2] = std::make_unique<LateClosingTier>(std::shared_ptr<Tier>(std::move(*nvme)));
    auto opened = Store::OpenWithTiers(o, std::move(tiers));
    REQUIRE(opened.ok());
    std::shared_ptr<Store> store(std::move(*opened));
    for (int i = 0; i < kPuts - 1; ++i) REQUIRE(store->PutAsync(TestKey(i), TestBytes(i, kBlock)).get().ok());
    const std::vector<std::byte> last = TestBytes(kPuts - 1, kBlock);
    std::promise<Status> dropped;
    store->PutAsync(TestKey(kPuts - 1), last).then([store = std::move(store), &dropped](Status s) mutable {
      store.reset();  // the last owner, on a store thread
      dropped.set_value(s);
    });
    REQUIRE(dropped.get_future().get().ok());
  }
  store_internal::WaitForClosingStores();
  o.nvme.lock_wait = std::chrono::milliseconds(0);  // closed by now: its lock on the data file is gone
  auto store = Store::Open(o);
  INFO(store.status().ToString());
  REQUIRE(store.ok());
  for (int i = 0; i < kPuts; ++i) {
    auto got = GetBytes(**store, TestKey(i), kBlock);
    REQUIRE(got.ok());
    CHECK(*got == TestBytes(i, kBlock));
  }
}

TEST_CASE("Real tiers: bit flips from a fault-wrapped NVMe tier are never returned") {
  TempDir dir("store-fault");
  StoreOptions o = RealOptions(dir.path());
  auto nvme = NvmeTier::Open(o.nvme);
  REQUIRE(nvme.ok());
  auto fault = std::make_unique<FaultInjectingTier>(std::unique_ptr<Tier>(std::move(*nvme)));
  auto* fault_raw = fault.get();
  std::array<std::unique_ptr<Tier>, kNumTiers> tiers;
  tiers[2] = std::move(fault);
  auto opened = Store::OpenWithTiers(o, std::move(tiers));  // nvme only: every Get reads it
  REQUIRE(opened.ok());
  auto& store = *opened;
  for (int i = 0; i < 10; ++i) REQUIRE(store->Put(TestKey(i), TestBytes(i, kBlock)).ok());
  fault_raw->FlipBitInNextGets(3);
  int corrupt = 0;
  for (int i = 0; i < 10; ++i) {
    auto got = GetBytes(*store, TestKey(i), kBlock);
    if (got.ok()) {
      CHECK(*got == TestBytes(i, kBlock));
    } else {
      CHECK(got.status().IsCorruption());
      ++corrupt;
    }
  }
  // A mismatch seen on the unlocked fast path is re-read under the key lock before the copy is
  // dropped, so 3 transient flips corrupt between 1 and 3 keys.
  CHECK(fault_raw->injected().bit_flips == 3);
  CHECK(corrupt >= 1);
  CHECK(corrupt <= 3);
}

TEST_CASE("Real CUDA HBM: blocks round-trip through device memory; handles hold device pointers") {
  if (!HbmCudaDeviceAvailable()) {
    WARN("skipped: no CUDA device on this machine (the emulated HBM path is covered above)");
    return;
  }
  TempDir dir("store-cuda");
  StoreOptions o = RealOptions(dir.path());
  o.hbm.mode = HbmMode::kCuda;
  o.hbm.capacity_bytes = 64 * kKiB;
  o.put_tier = TierId::kHbm;
  auto store = OpenStore(o);
  for (int i = 0; i < 30; ++i) REQUIRE(store->Put(TestKey(i), TestBytes(i, kBlock)).ok());
  CHECK(store->Stats().demotions > 0);  // 240 KiB through a 64 KiB device tier
  for (int i = 0; i < 30; ++i) {
    auto got = GetBytes(*store, TestKey(i), kBlock);
    REQUIRE(got.ok());
    CHECK(*got == TestBytes(i, kBlock));
  }
  auto h = store->Acquire(TestKey(7), TierId::kHbm);
  REQUIRE(h.ok());
  CHECK(h->memory_kind() == MemoryKind::kDevice);
  CHECK(h->data() != nullptr);
  CHECK_FALSE(store->Stats().tiers[0].emulated);
}

TEST_CASE("Real tiers: an explicit tier list with two NVMe tiers spills into the second and reopens") {
  TempDir dir("store-list");
  auto options = [&] {
    StoreOptions o;
    o.high_watermark = 1.0;
    o.low_watermark = 1.0;
    o.tier_list = HostOverTwoNvme(dir.path(), "nvme-fast", "");
    return o;
  };
  std::uint64_t fast_blocks = 0, host_blocks = 0;
  int n = 0;
  {
    auto store = OpenStore(options());
    CHECK_FALSE(store->HasTier(TierId::kHbm));
    // Fill until the second NVMe tier holds blocks (the first one is then full).
    for (; n < 2000 && store->Stats().slots[2].blocks == 0; ++n) {
      Status s = store->Put(TestKey(n), TestBytes(n, kBlock));
      INFO(n << ": " << s.ToString());
      REQUIRE(s.ok());
    }
    StoreStats st = store->Stats();
    REQUIRE(st.slots.size() == 3);
    CHECK(st.slots[1].name == "nvme-fast");
    CHECK(st.slots[2].name == "nvme");
    REQUIRE(st.slots[2].blocks > 0);
    fast_blocks = st.slots[1].blocks;
    host_blocks = st.slots[0].blocks;
    CHECK(fast_blocks > 0);
    REQUIRE(store->Flush().ok());
  }
  auto reopened = Store::Open(options());
  REQUIRE(reopened.ok());
  auto& store = *reopened;
  CHECK(store->Stats().blocks == static_cast<std::uint64_t>(n) - host_blocks);  // host memory did not survive
  CHECK(store->Stats().slots[1].blocks == fast_blocks);
  for (int i = 0; i < n; ++i) {
    BlockKey k = TestKey(i);
    auto look = store->Lookup({&k, 1});
    if (!look[0].found) continue;  // a host-only block does not survive the process
    auto got = GetBytes(*store, k, kBlock);
    INFO(i << ": " << got.status().ToString());
    REQUIRE(got.ok());
    CHECK(*got == TestBytes(i, kBlock));
  }
}

TEST_CASE("Real tiers: a tier list naming an unknown kind is refused with the known kinds") {
  StoreOptions o;
  o.tier_list = {TierSlotOptions{"redis", "", {}, {}, {}}};
  auto r = Store::Open(o);
  REQUIRE(r.status().IsInvalidArgument());
  CHECK_THAT(r.status().message(), Catch::Contains("redis"));
  CHECK_THAT(r.status().message(), Catch::Contains("hbm, host, nvme"));
}

TEST_CASE("Real tiers: a prefetch from NVMe lands directly in the host arena, with no staging copy") {
  TempDir dir("store-direct");
  HostNvme hn(dir.path());
  Store* store = hn.store.get();
  NvmeTier* nvme_raw = hn.nvme;
  std::vector<BlockKey> keys;
  std::vector<std::size_t> sizes;
  for (int i = 0; i < 24; ++i) {
    keys.push_back(TestKey(i));
    sizes.push_back(i % 3 == 0 ? 64 * kKiB : 4096 * (i % 5) + 1 + 97 * i);  // aligned and ragged sizes
    REQUIRE(store->Put(keys.back(), TestBytes(i, sizes.back()), {Codec::kRaw, TierId::kNvme}).ok());
  }
  const std::uint64_t staged_before = nvme_raw->staged_ios();
  const StoreStats before = store->Stats();
  auto pf = store->Prefetch(keys, TierId::kHost).get();
  for (const Status& s : pf) REQUIRE(s.ok());
  const StoreStats after = store->Stats();
  CHECK(nvme_raw->staged_ios() == staged_before);  // every read went straight into the arena
  CHECK(after.direct_transfers - before.direct_transfers == keys.size());
  CHECK(after.staged_transfers == before.staged_transfers);
  std::uint64_t bytes = 0;
  for (std::size_t s : sizes) bytes += s;
  CHECK(after.direct_transfer_bytes - before.direct_transfer_bytes == bytes);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    CHECK(TierOf(*store, keys[i]) == TierId::kHost);
    auto got = GetBytes(*store, keys[i], 64 * kKiB);
    REQUIRE(got.ok());
    CHECK(*got == TestBytes(i, sizes[i]));
  }
}

TEST_CASE("Real tiers: PrometheusText exports each tier's bytes read and bytes written") {
  TempDir dir("store-prom-bytes");
  HostNvme hn(dir.path());
  Store* store = hn.store.get();
  constexpr int kPut = 6, kGot = 4;
  constexpr std::size_t kSize = 16 * kKiB;
  for (int i = 0; i < kPut; ++i) {
    REQUIRE(store->Put(TestKey(i), TestBytes(i, kSize), {Codec::kRaw, TierId::kNvme}).ok());
  }
  for (int i = 0; i < kGot; ++i) REQUIRE(GetBytes(*store, TestKey(i), kSize).ok());  // each read from NVMe once
  const std::string text = store->PrometheusText();
  auto value = [&](const std::string& name) -> std::uint64_t {
    const std::string prefix = name + "{tier=\"nvme\"} ";
    const std::size_t at = text.find("\n" + prefix);
    INFO(text);
    REQUIRE(at != std::string::npos);
    return std::stoull(text.substr(at + 1 + prefix.size()));
  };
  CHECK(value("terrace_tier_written_bytes_total") == kPut * kSize);
  CHECK(value("terrace_tier_read_bytes_total") == kGot * kSize);
}


// Options the reviewer found were accepted (a store whose every Put then failed) or refused with
// advice that did not fit: each is refused at open, or its error names the option that fixes it.
TEST_CASE("Real tiers: put_tier with no tier at or below it is refused at open, naming put_tier and the fix") {
  TempDir dir("store-put-tier");
  StoreOptions o = RealOptions(dir.path());
  o.nvme.path.clear();  // hbm + host only
  o.put_tier = TierId::kNvme;
  auto store = Store::Open(o);
  INFO(store.status().ToString());
  REQUIRE(store.status().IsInvalidArgument());
  CHECK_THAT(store.status().message(), Catch::Contains("put_tier nvme"));
  CHECK_THAT(store.status().message(), Catch::Contains("nvme.path"));
  // An explicit tier list without NVMe too.
  StoreOptions listed = Quiet();
  TierSlotOptions host{"host", "", {}, {}, {}};
  host.host.capacity_bytes = 1 * kMiB;
  host.host.chunk_bytes = 1 * kMiB;
  host.host.pin = false;
  listed.tier_list = {host};
  listed.put_tier = TierId::kNvme;
  CHECK(Store::Open(listed).status().IsInvalidArgument());
  listed.put_tier = TierId::kHbm;  // a faster put_tier than any tier: the nearest below, host
  auto ok = Store::Open(listed);
  REQUIRE(ok.ok());
  CHECK((*ok)->Put(TestKey(1), TestBytes(1, kBlock)).ok());
}

TEST_CASE("Real tiers: no tier at all is refused in the words of the call that was made") {
  StoreOptions o = Quiet();
  o.hbm.mode = HbmMode::kOff;
  o.host.capacity_bytes = 0;
  auto open = Store::Open(o);
  REQUIRE(open.status().IsInvalidArgument());
  CHECK_THAT(open.status().message(), Catch::Contains("store options configure no tier"));
  auto with = Store::OpenWithTiers(o, std::vector<std::unique_ptr<Tier>>{});
  REQUIRE(with.status().IsInvalidArgument());
  CHECK_THAT(with.status().message(), Catch::Contains("OpenWithTiers was given no tier"));
  CHECK_THAT(with.status().message(), !Catch::Contains("enable host"));
  auto array = Store::OpenWithTiers(o, std::array<std::unique_ptr<Tier>, kNumTiers>{});
  CHECK_THAT(array.status().message(), Catch::Contains("OpenWithTiers was given no tier"));
}

TEST_CASE("Real tiers: a block larger than a host chunk is refused naming chunk_bytes, not the capacity") {
  StoreOptions o = Quiet();
  o.hbm.mode = HbmMode::kOff;
  o.host.capacity_bytes = 64 * kMiB;
  o.host.chunk_bytes = 4 * kMiB;
  o.host.pin = false;
  auto store = Store::Open(o);
  REQUIRE(store.ok());
  const Status s = (*store)->Put(TestKey(1), TestBytes(1, 5 * kMiB));
  INFO(s.ToString());
  CHECK(s.IsOutOfCapacity());
  CHECK_THAT(s.message(), Catch::Contains("HostTierOptions::chunk_bytes"));
  CHECK_THAT(s.message(), Catch::Contains(std::to_string(5 * kMiB)));  // the chunk size it needs
  CHECK_THAT(s.message(), !Catch::Contains("raise the tier's capacity"));
  // A block larger than the whole tier still says capacity.
  o.host.capacity_bytes = 4 * kMiB;
  auto small = Store::Open(o);
  REQUIRE(small.ok());
  CHECK_THAT((*small)->Put(TestKey(2), TestBytes(2, 5 * kMiB)).message(), Catch::Contains("raise the tier's capacity"));
}

TEST_CASE("Real tiers: a tier's refusal at open names the tier once, and the link model's bounds read right") {
  StoreOptions o = Quiet();
  o.hbm.mode = HbmMode::kOff;
  o.host.capacity_bytes = 64 * kMiB;
  o.host.chunk_bytes = 0;
  auto store = Store::Open(o);
  INFO(store.status().ToString());
  REQUIRE(store.status().IsInvalidArgument());
  CHECK_THAT(store.status().message(), Catch::StartsWith("open store: host tier: chunk_bytes 0"));
  CHECK(store.status().message().find("host tier: host tier") == std::string::npos);
  StoreOptions h = Quiet();
  h.hbm.mode = HbmMode::kEmulated;
  h.hbm.link.bandwidth_bytes_per_s = 0;
  auto hbm = Store::Open(h);
  INFO(hbm.status().ToString());
  REQUIRE(hbm.status().IsInvalidArgument());
  CHECK_THAT(hbm.status().message(), Catch::Contains("bandwidth_bytes_per_s > 0 and latency_us >= 0, got 0 B/s"));
}

struct CountingLogger : Logger {
  void Log(LogLevel level, std::string_view, std::string_view message) override {
    if (level == LogLevel::kError) errors.emplace_back(message);
  }
  std::vector<std::string> errors;
};

#ifdef NDEBUG  // debug builds assert instead (the Store's destructor)
TEST_CASE("Real tiers: a Store destroyed while BlockHandles live logs an error naming how many") {
  auto logger = std::make_shared<CountingLogger>();
  StoreOptions o = Quiet();
  o.hbm.mode = HbmMode::kOff;
  o.host.capacity_bytes = 4 * kMiB;
  o.host.chunk_bytes = 4 * kMiB;
  o.host.pin = false;
  o.logger = logger;
  auto store = Store::Open(o);
  REQUIRE(store.ok());
  for (int i = 1; i <= 2; ++i) REQUIRE((*store)->Put(TestKey(i), TestBytes(i, kBlock)).ok());
  auto released = (*store)->Acquire(TestKey(1));
  REQUIRE(released.ok());
  released->Release();
  auto held = (*store)->Acquire(TestKey(2));
  auto held2 = (*store)->Acquire(TestKey(2));
  REQUIRE(held.ok());
  REQUIRE(held2.ok());
  // Two handles outlive the store. They are parked where their destructors never run: a release
  // after the store is gone is the use-after-free the error warns about.
  alignas(BlockHandle) static unsigned char parked[2][sizeof(BlockHandle)];
  new (parked[0]) BlockHandle(std::move(*held));
  new (parked[1]) BlockHandle(std::move(*held2));
  store->reset();
  REQUIRE(logger->errors.size() == 1);
  CHECK_THAT(logger->errors[0], Catch::Contains("2 BlockHandle(s)"));
  CHECK_THAT(logger->errors[0], Catch::Contains(TestKey(2).ToString()));
}
#endif

}  // namespace
}  // namespace terrace::testing
