#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"
#include "tiers/host/host_tier.h"
#include "tiers/host/stream_copy.h"

using namespace terrace;
using terrace::testing::TestBytes;
using terrace::testing::TestKey;

namespace {

std::unique_ptr<HostTier> MakeHost(std::uint64_t capacity, std::uint64_t chunk, bool pin = true) {
  HostTierOptions o;
  o.capacity_bytes = capacity;
  o.chunk_bytes = chunk;
  o.pin = pin;
  auto t = HostTier::Create(o);
  REQUIRE(t.ok());
  return std::move(t).value();
}

// Runs `readers` threads that Get `key` from `t` in a loop while `writer` runs on this thread, and
// returns the number of reads that found the key but did not get exactly one of `versions` (bytes
// and descriptor); NotFound (an erase in between) counts as neither.
int RacingReadersBadReads(HostTier& t, const BlockKey& key, const std::vector<std::vector<std::byte>>& versions,
                          int readers, const std::function<void()>& writer) {
  std::size_t largest = 0;
  for (const auto& v : versions) largest = std::max(largest, v.size());
  std::atomic<bool> stop{false};
  std::atomic<int> bad_reads{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < readers; ++r) {
    threads.emplace_back([&] {
      std::vector<std::byte> out(largest);
      while (!stop.load()) {
        BlockDesc d;
        Status st = t.Get(key, out, &d);
        if (st.IsNotFound()) continue;
        bool matches = false;
        for (const auto& v : versions) {
          matches |= st.ok() && d == DescribeBlock(v) && std::memcmp(out.data(), v.data(), v.size()) == 0;
        }
        if (!matches) bad_reads.fetch_add(1);
      }
    });
  }
  std::exception_ptr failed;  // a REQUIRE in `writer`: stop and join the readers first, then rethrow
  try {
    writer();
  } catch (...) {
    failed = std::current_exception();
  }
  stop = true;
  for (auto& th : threads) th.join();
  if (failed) std::rethrow_exception(failed);
  return bad_reads.load();
}

}  // namespace

TEST_CASE("Host tier rejects unusable options with a message naming the field") {
  HostTierOptions o;
  o.capacity_bytes = 100;
  auto r = HostTier::Create(o);
  CHECK(r.status().IsInvalidArgument());
  CHECK(r.status().message().find("capacity_bytes") != std::string::npos);
  o.capacity_bytes = 1 * kMiB;
  o.chunk_bytes = 0;
  CHECK(HostTier::Create(o).status().message().find("chunk_bytes") != std::string::npos);
}

// The arena numbers pages with 32-bit ids: 16 TiB of 4 KiB pages would wrap them (two blocks at one
// address). Nothing is allocated up front (populate on demand), so a refused geometry costs nothing
// and an accepted one only reserves.
TEST_CASE("Host tier refuses a capacity its 32-bit page ids cannot number, and takes the largest they can") {
  HostTierOptions o;
  o.populate = HostPopulate::kOnDemand;
  o.prefault = false;
  o.pin = false;
  o.chunk_bytes = 256 * kMiB;
  o.capacity_bytes = 16ull << 40;  // 2^32 pages of 4 KiB: one more than the ids allow
  auto r = HostTier::Create(o);
  INFO(r.status().ToString());
  REQUIRE(r.status().IsInvalidArgument());
  CHECK(r.status().message().find("capacity_bytes") != std::string::npos);
  const std::uint64_t max = HostTier::MaxCapacityBytes(o.chunk_bytes);
  CHECK(max < (16ull << 40));
  CHECK(max % o.chunk_bytes == 0);
  o.capacity_bytes = max + o.chunk_bytes;
  CHECK(HostTier::Create(o).status().IsInvalidArgument());
  // Near 2^64 the chunk count's rounding wrapped to 0 chunks: the tier opened, and every put failed.
  for (std::uint64_t near_max : {~std::uint64_t{0}, ~std::uint64_t{0} - 4096, (~std::uint64_t{0}) - o.chunk_bytes + 2}) {
    o.capacity_bytes = near_max;
    INFO(near_max);
    CHECK(HostTier::Create(o).status().IsInvalidArgument());
  }
  o.capacity_bytes = max;
  auto ok = HostTier::Create(o);
  INFO(ok.status().ToString());
  CHECK(ok.ok());
}

// The advice fits the bound that refused: a chunk with more pages than the ids number is lowered
// (raising it, as the message used to say with "at most 0 bytes", can never help); too many pages
// in all means a lower capacity; too many chunks also allows larger chunks.
TEST_CASE("Host tier's refusal of a geometry says which option to change, and which way") {
  HostTierOptions o;
  o.populate = HostPopulate::kOnDemand;
  o.prefault = false;
  o.pin = false;
  o.capacity_bytes = 32ull << 40;
  o.chunk_bytes = 16ull << 40;  // one chunk: 2^32 pages
  auto huge = HostTier::Create(o);
  INFO(huge.status().ToString());
  REQUIRE(huge.status().IsInvalidArgument());
  CHECK_THAT(huge.status().message(), Catch::Contains("lower chunk_bytes"));
  CHECK_THAT(huge.status().message(), !Catch::Contains("raise chunk_bytes"));
  CHECK_THAT(huge.status().message(), !Catch::Contains("at most 0 bytes"));
  o.chunk_bytes = 256 * kMiB;
  o.capacity_bytes = 16ull << 40;  // too many pages: only a lower capacity helps
  auto pages = HostTier::Create(o);
  INFO(pages.status().ToString());
  CHECK_THAT(pages.status().message(),
             Catch::Contains("lower capacity_bytes to at most " + std::to_string(HostTier::MaxCapacityBytes(o.chunk_bytes))));
  CHECK_THAT(pages.status().message(), !Catch::Contains("raise chunk_bytes"));
  o.chunk_bytes = 4 * kKiB;
  o.capacity_bytes = 8ull << 30;  // 2 Mi chunks of one page: larger chunks help
  auto chunks = HostTier::Create(o);
  INFO(chunks.status().ToString());
  CHECK_THAT(chunks.status().message(), Catch::Contains("raise chunk_bytes to at least 12288"));
  o.chunk_bytes = 12288;
  CHECK(HostTier::Create(o).ok());
}

TEST_CASE("Host arena grows lazily in chunks and reports pinning") {
  auto t = MakeHost(8 * kMiB, 2 * kMiB);
  CHECK(t->arena_bytes() == 0);
  CHECK(t->Regions().empty());
  CHECK(t->caps().max_block_bytes == 2 * kMiB);
  auto data = TestBytes(1, 1500 * 1024);
  REQUIRE(t->Put(TestKey(1), DescribeBlock(data), data).ok());
  CHECK(t->arena_bytes() == 2 * kMiB);
  REQUIRE(t->Put(TestKey(2), DescribeBlock(data), data).ok());  // does not fit beside block 1
  CHECK(t->arena_bytes() == 4 * kMiB);
  auto regions = t->Regions();
  REQUIRE(regions.size() == 2);
  // Each resident block lies inside a registered region (what io_uring fixed buffers need).
  for (std::uint64_t i : {1, 2}) {
    const std::byte* p = t->ResidentPtr(TestKey(i));
    REQUIRE(p != nullptr);
    bool inside = false;
    for (const auto& r : regions) {
      auto* b = static_cast<const std::byte*>(r.iov_base);
      inside |= p >= b && p + data.size() <= b + r.iov_len;
    }
    CHECK(inside);
    CHECK(reinterpret_cast<std::uintptr_t>(p) % 4096 == 0);
    CHECK(std::memcmp(p, data.data(), data.size()) == 0);
  }
  auto s = t->Stats();
  CHECK(s.name == "host");
  CHECK(s.detail.find("pinned: ") != std::string::npos);
  CHECK(s.puts == 2);
  CHECK(s.bytes_written == 2 * data.size());
  auto unpinned = MakeHost(1 * kMiB, 1 * kMiB, false);
  REQUIRE(unpinned->Put(TestKey(3), DescribeBlock(data.data() == nullptr ? data : std::vector<std::byte>(10)),
                        std::vector<std::byte>(10)).ok());
  CHECK(unpinned->Stats().detail.find("pinned: no (not requested)") != std::string::npos);
}

namespace {

// Puts block `id` (300000 bytes) into `t` and flips bit 2 of its byte 123456 where the arena holds
// it (a bit flip in RAM); returns the bytes put.
std::vector<std::byte> PutDamaged(HostTier& t, int id) {
  auto data = TestBytes(id, 300000);
  REQUIRE(t.Put(TestKey(id), DescribeBlock(data), data).ok());
  auto* p = const_cast<std::byte*>(t.ResidentPtr(TestKey(id)));
  REQUIRE(p != nullptr);
  p[123456] ^= std::byte{0x04};
  return data;
}

}  // namespace

TEST_CASE("Host tier detects bytes damaged in place and drops the block") {
  auto t = MakeHost(4 * kMiB, 1 * kMiB);
  const auto data = PutDamaged(*t, 5);
  std::vector<std::byte> out(data.size());
  BlockDesc d;
  Status st = t->Get(TestKey(5), out, &d);
  CHECK(st.IsCorruption());
  CHECK(st.message().find(TestKey(5).ToString()) != std::string::npos);
  CHECK(t->Lookup(TestKey(5)).status().IsNotFound());
  CHECK(t->Stats().corruptions == 1);
  CHECK(t->used_bytes() == 0);
}

TEST_CASE("Host tier range reads copy from the arena unverified: damage shows in the range, nothing is dropped") {
  auto t = MakeHost(4 * kMiB, 1 * kMiB);
  const auto data = PutDamaged(*t, 6);  // byte 123456: inside the first range below only
  std::vector<std::byte> hit(1000), miss(1000);
  std::vector<RangeOp> ops = {{TestKey(6), 123000, 1000, hit, {}}, {TestKey(6), 200000, 1000, miss, {}}};
  const auto before = t->Stats();
  auto st = t->GetRangeBatch(ops);
  REQUIRE(st[0].ok());  // not verified: the caller checks ranges against checksums of its own
  REQUIRE(st[1].ok());
  CHECK(ops[0].desc == DescribeBlock(data));
  CHECK(std::memcmp(hit.data(), data.data() + 123000, 1000) != 0);
  CHECK((hit[456] ^ data[123456]) == std::byte{0x04});
  CHECK(std::memcmp(miss.data(), data.data() + 200000, 1000) == 0);
  const auto after = t->Stats();
  CHECK(after.corruptions == 0);
  CHECK(after.hits == before.hits + 2);
  CHECK(after.bytes_read == before.bytes_read + 2000);
  CHECK(t->Lookup(TestKey(6)).ok());  // kept: only a verified Get drops a block
  std::vector<std::byte> out(data.size());
  BlockDesc d;
  CHECK(t->Get(TestKey(6), out, &d).IsCorruption());
}

TEST_CASE("Host tier refuses to replace a pinned block") {
  auto t = MakeHost(4 * kMiB, 1 * kMiB);
  auto a = TestBytes(1, 5000), b = TestBytes(2, 7000);
  REQUIRE(t->Put(TestKey(1), DescribeBlock(a), a).ok());
  REQUIRE(t->Pin(TestKey(1)).ok());
  CHECK(t->Put(TestKey(1), DescribeBlock(b), b).IsInvalidArgument());
  CHECK(*t->Lookup(TestKey(1)) == DescribeBlock(a));
  REQUIRE(t->Unpin(TestKey(1)).ok());
  CHECK(t->Unpin(TestKey(1)).IsInvalidArgument());
  CHECK(t->Put(TestKey(1), DescribeBlock(b), b).ok());
  CHECK(*t->Lookup(TestKey(1)) == DescribeBlock(b));
  CHECK(t->Put(TestKey(9), DescribeBlock(b), a).IsInvalidArgument());  // size mismatch
  BlockDesc wrong = DescribeBlock(b);
  CHECK(t->PutDescribing(TestKey(9), &wrong, a).IsInvalidArgument());
  CHECK(t->Lookup(TestKey(9)).status().IsNotFound());
  BlockDesc empty{0, Codec::kRaw, 1};  // a 0-byte block through PutDescribing
  REQUIRE(t->PutDescribing(TestKey(10), &empty, {}).ok());
  CHECK(empty == DescribeBlock({}));
  CHECK(*t->Lookup(TestKey(10)) == empty);
}

TEST_CASE("Long random put/erase run at steady state: no OutOfCapacity, bounded arena") {
  // Capacity 32 MiB in 2 MiB chunks; the live set is kept near 40% of capacity with block sizes
  // from 1 byte to 512 KiB (not page multiples). A fragmenting allocator would fail or fill the
  // arena; this one must do neither.
  const std::uint64_t kCap = 32 * kMiB;
  auto t = MakeHost(kCap, 2 * kMiB, false);
  std::mt19937_64 rng(3);
  struct Live {
    std::uint64_t id;
    std::uint64_t size;
  };
  std::vector<Live> live;
  std::uint64_t live_bytes = 0, next_id = 0, max_arena_late = 0;
  std::vector<std::byte> buf(512 * 1024);
  const int kSteps = 20000;
  for (int step = 0; step < kSteps; ++step) {
    if (live_bytes < kCap * 4 / 10) {
      std::uint64_t size = 1 + rng() % (rng() % 4 == 0 ? 512 * 1024 : 64 * 1024);
      std::uint64_t id = next_id++;
      std::memset(buf.data(), static_cast<int>(id), size);
      std::span<const std::byte> data(buf.data(), size);
      Status st = t->Put(TestKey(id), DescribeBlock(data), data);
      INFO("step " << step << " live " << live_bytes << " used " << t->used_bytes() << ": " << st.ToString());
      REQUIRE(st.ok());
      live.push_back({id, size});
      live_bytes += size;
    } else {
      std::size_t i = rng() % live.size();
      REQUIRE(t->Erase(TestKey(live[i].id)).ok());
      live_bytes -= live[i].size;
      live[i] = live.back();
      live.pop_back();
    }
    REQUIRE(t->used_bytes() <= t->arena_bytes());
    if (step > kSteps / 2) max_arena_late = std::max(max_arena_late, t->arena_bytes());
  }
  REQUIRE(t->CheckInvariants());
  WARN("steady state: live " << (live_bytes >> 10) << " KiB in " << live.size() << " blocks, used "
                            << (t->used_bytes() >> 10) << " KiB, arena peak (second half) " << (max_arena_late >> 20)
                            << " MiB of " << (kCap >> 20) << " MiB");
  // Pages add at most 4 KiB per block to the live set; the arena holding it stays well below capacity.
  CHECK(t->used_bytes() <= live_bytes + live.size() * 4096);
  CHECK(max_arena_late <= kCap * 3 / 4);
  // Spot-check contents survived the churn.
  for (std::size_t i = 0; i < live.size(); i += 7) {
    BlockDesc d;
    REQUIRE(t->Get(TestKey(live[i].id), buf, &d).ok());
    CHECK(d.size == live[i].size);
    CHECK(buf[d.size - 1] == static_cast<std::byte>(live[i].id & 0xff));
  }
}

TEST_CASE("Readers racing overwrites and erases of one key see whole blocks") {
  auto t = MakeHost(16 * kMiB, 4 * kMiB);
  const BlockKey key = TestKey(77);
  std::vector<std::vector<std::byte>> versions;
  for (int v = 0; v < 4; ++v) versions.push_back(TestBytes(100 + v, 64 * 1024 + v * 4096 + 3));
  const int bad_reads = RacingReadersBadReads(*t, key, versions, 3, [&] {
    for (int i = 0; i < 600; ++i) {
      const auto& v = versions[i % versions.size()];
      REQUIRE(t->Put(key, DescribeBlock(v), v).ok());
      if (i % 5 == 4) (void)t->Erase(key);
    }
  });
  CHECK(bad_reads == 0);
  CHECK(t->Stats().corruptions == 0);
  REQUIRE(t->CheckInvariants());
}

TEST_CASE("Puts around the streaming-copy threshold read back byte-exact, from unaligned sources and to racing readers") {
  auto t = MakeHost(16 * kMiB, 4 * kMiB);
  const std::size_t sizes[] = {tiers::kStreamCopyMinBytes - 1, tiers::kStreamCopyMinBytes, tiers::kStreamCopyMinBytes + 1,
                               tiers::kStreamCopyMinBytes + 4096 + 17, 1 * kMiB + 13};
  std::uint64_t id = 0;
  for (std::size_t n : sizes) {
    for (std::size_t off : {0, 1, 33}) {
      auto store = TestBytes(++id, n + off);
      std::span<const std::byte> data = std::span<const std::byte>(store).subspan(off);
      REQUIRE(t->Put(TestKey(id), DescribeBlock(data), data).ok());
      std::vector<std::byte> out(n + 64);
      BlockDesc d;
      REQUIRE(t->Get(TestKey(id), std::span<std::byte>(out).subspan(off, n), &d).ok());  // checksum verified
      CHECK(d == DescribeBlock(data));
      CHECK(std::memcmp(out.data() + off, data.data(), n) == 0);
    }
  }
  // Readers racing streamed overwrites of one key see a whole version (the copy is fenced before
  // the commit publishes it).
  const BlockKey key = TestKey(1000);
  std::vector<std::vector<std::byte>> versions;
  for (int v = 0; v < 3; ++v) versions.push_back(TestBytes(200 + v, tiers::kStreamCopyMinBytes + v * 8192 + 5));
  const int rounds = terrace::testing::kSanitizedBuild ? 40 : 300;
  const int bad_reads = RacingReadersBadReads(*t, key, versions, 2, [&] {
    for (int i = 0; i < rounds; ++i) {
      const auto& v = versions[i % versions.size()];
      REQUIRE(t->Put(key, DescribeBlock(v), v).ok());
    }
  });
  CHECK(bad_reads == 0);
  CHECK(t->Stats().corruptions == 0);
  REQUIRE(t->CheckInvariants());
}

TEST_CASE("Gets stream once the destination reaches stream_get_min_bytes: a Get's buffer, a GetBatch's together") {
  HostTierOptions o;
  o.capacity_bytes = 16 * kMiB;
  o.chunk_bytes = 4 * kMiB;
  o.stream_get_min_bytes = 3 * kMiB;
  auto created = HostTier::Create(o);
  REQUIRE(created.ok());
  HostTier& t = **created;
  CHECK(t.stream_get_bytes() == 3 * kMiB);
  CHECK(t.Stats().detail.find("gets stream from 3072 KiB of destination") != std::string::npos);
  std::vector<std::vector<std::byte>> blocks;
  for (std::uint64_t i = 0; i < 4; ++i) {
    blocks.push_back(TestBytes(300 + i, 1 * kMiB - 3 + i * 4097));  // ragged sizes, 1 MiB each or so
    REQUIRE(t.Put(TestKey(300 + i), DescribeBlock(blocks.back()), blocks.back()).ok());
  }
  // Buffers one byte off a line, so the streaming kernel's unaligned head is taken.
  std::vector<std::vector<std::byte>> stores(blocks.size(), std::vector<std::byte>(2 * kMiB, std::byte{0xEE}));
  auto read_batch = [&](std::size_t n) {
    std::vector<GetOp> ops;
    for (std::size_t i = 0; i < n; ++i) ops.push_back({TestKey(300 + i), std::span<std::byte>(stores[i]).subspan(1, kMiB + 16384), {}});
    std::vector<Status> st = t.GetBatch(ops);
    for (std::size_t i = 0; i < n; ++i) {
      INFO("op " << i << " of " << n);
      REQUIRE(st[i].ok());
      CHECK(ops[i].desc == DescribeBlock(blocks[i]));
      CHECK(std::memcmp(stores[i].data() + 1, blocks[i].data(), blocks[i].size()) == 0);
      CHECK(stores[i][1 + blocks[i].size()] == std::byte{0xEE});  // nothing past the block
    }
  };
  read_batch(2);  // about 2 MiB of buffers: cached stores
  CHECK(t.streamed_gets() == 0);
  read_batch(4);  // about 4 MiB: every op streams
  CHECK(t.streamed_gets() == 4);
  std::vector<std::byte> small(kMiB + 16384), large(4 * kMiB);
  BlockDesc d;
  REQUIRE(t.Get(TestKey(300), small, &d).ok());  // one Get below the threshold
  CHECK(t.streamed_gets() == 4);
  REQUIRE(t.Get(TestKey(300), large, &d).ok());  // one Get whose buffer reaches it
  CHECK(t.streamed_gets() == 5);
  CHECK(std::memcmp(large.data(), blocks[0].data(), blocks[0].size()) == 0);
  // A streamed get still verifies: a bit flipped at rest is caught and the block dropped.
  auto* p = const_cast<std::byte*>(t.ResidentPtr(TestKey(301)));
  REQUIRE(p != nullptr);
  p[777777] ^= std::byte{0x10};
  Status st = t.Get(TestKey(301), large, &d);
  CHECK(st.IsCorruption());
  CHECK(t.streamed_gets() == 6);
  CHECK(t.Lookup(TestKey(301)).status().IsNotFound());
}

TEST_CASE("Gets stream by default only from a quarter of the last-level cache, and never when told") {
  HostTierOptions o;
  o.capacity_bytes = 4 * kMiB;
  o.chunk_bytes = 1 * kMiB;
  auto by_default = HostTier::Create(o);
  REQUIRE(by_default.ok());
  const std::uint64_t llc = tiers::LastLevelCacheBytes();
  CHECK((*by_default)->stream_get_bytes() == (llc > 0 ? llc / 4 : UINT64_MAX));
  o.stream_get_min_bytes = UINT64_MAX;
  auto never = HostTier::Create(o);
  REQUIRE(never.ok());
  CHECK((*never)->stream_get_bytes() == UINT64_MAX);
  CHECK((*never)->Stats().detail.find("gets: cached stores") != std::string::npos);
  auto data = TestBytes(7, 512 * 1024);
  REQUIRE((*never)->Put(TestKey(7), DescribeBlock(data), data).ok());
  std::vector<std::byte> out(data.size());
  BlockDesc d;
  REQUIRE((*never)->Get(TestKey(7), out, &d).ok());
  CHECK((*never)->streamed_gets() == 0);
  CHECK(out == data);
}

TEST_CASE("Puts stream only into pages already faulted in; the bytes are exact either way") {
  // Unpinned, no prefaulter: a fresh chunk's pages fault on first touch, so the first puts copy
  // with cached stores; once every page has been written, puts (and PutDescribing) stream.
  HostTierOptions o;
  o.capacity_bytes = 4 * kMiB;
  o.chunk_bytes = 4 * kMiB;
  o.pin = false;
  o.prefault = false;
  auto r = HostTier::Create(o);
  REQUIRE(r.ok());
  auto t = std::move(r).value();
  auto check = [&](std::uint64_t id, const std::vector<std::byte>& v) {
    std::vector<std::byte> out(v.size());
    BlockDesc d;
    REQUIRE(t->Get(TestKey(id), out, &d).ok());
    CHECK(d == DescribeBlock(v));
    CHECK(std::memcmp(out.data(), v.data(), v.size()) == 0);
  };
  for (std::uint64_t id = 1; id <= 4; ++id) {  // fills the whole chunk
    auto v = TestBytes(id, 1 * kMiB);
    REQUIRE(t->Put(TestKey(id), DescribeBlock(v), v).ok());
    check(id, v);
  }
  CHECK(t->streamed_puts() == 0);
  for (std::uint64_t id = 1; id <= 4; ++id) REQUIRE(t->Erase(TestKey(id)).ok());
  for (std::uint64_t id = 11; id <= 14; ++id) {  // every page has been written: these stream
    auto v = TestBytes(id, 1 * kMiB);
    if (id % 2 == 0) {
      BlockDesc d{v.size(), Codec::kRaw, 0};
      REQUIRE(t->PutDescribing(TestKey(id), &d, v).ok());
      CHECK(d == DescribeBlock(v));
    } else {
      REQUIRE(t->Put(TestKey(id), DescribeBlock(v), v).ok());
    }
    check(id, v);
  }
  CHECK(t->streamed_puts() == 4);

  // Populated at open: the first put already streams.
  o.populate = HostPopulate::kAtOpen;
  auto r2 = HostTier::Create(o);
  REQUIRE(r2.ok());
  t = std::move(r2).value();
  auto v = TestBytes(21, 1 * kMiB);
  REQUIRE(t->Put(TestKey(21), DescribeBlock(v), v).ok());
  check(21, v);
  CHECK(t->streamed_puts() == 1);
}
