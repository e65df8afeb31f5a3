// A single Store::Get of a block that lives only on NVMe, over the real tiers: where the read
// lands (straight in the caller's buffer, or once through an aligned bounce buffer), what
// StoreStats counts for it, and that concurrent and corrupt reads stay correct.
#include <catch2/catch.hpp>

#include <latch>
#include <thread>

#include "host_nvme.h"

namespace terrace::testing {
namespace {

constexpr int kN = 12;  // blocks, of SizeOf(i) bytes: whole 4 KiB units and ragged sizes

StoreOptions NoPromote() {
  StoreOptions o = Quiet();
  o.promote_on_get = false;
  return o;
}

TEST_CASE("Single Get without promotion: NVMe reads into a buffer that allows it directly, else staged once") {
  const Shape shape = GENERATE(Shape::kAlignedRoom, Shape::kUnaligned, Shape::kAlignedExact);
  INFO(ShapeName(shape));
  TempDir dir("get-nomove");
  HostNvme s(dir.path(), NoPromote());
  const auto keys = PutInNvme(*s.store, kN);
  const StoreStats before = s.store->Stats();
  const std::uint64_t staged_ios = s.nvme->staged_ios();
  std::uint64_t direct = 0, direct_bytes = 0, staged = 0, staged_bytes = 0;
  for (int i = 0; i < kN; ++i) {
    const std::size_t size = SizeOf(i);
    ShapedBuffer buf(shape, size);
    auto r = s.store->Get(keys[i], buf.out());
    INFO(i << " (" << size << " bytes): " << r.status().ToString());
    REQUIRE(r.ok());
    CHECK(r->size == size);
    CHECK(buf.First(size) == TestBytes(static_cast<std::uint64_t>(i), size));
    CHECK(TierOf(*s.store, keys[i]) == TierId::kNvme);  // nothing moved
    (NvmeReadsInPlace(shape, size) ? direct : staged) += 1;
    (NvmeReadsInPlace(shape, size) ? direct_bytes : staged_bytes) += size;
  }
  const StoreStats after = s.store->Stats();
  CHECK(after.direct_transfers - before.direct_transfers == direct);
  CHECK(after.direct_transfer_bytes - before.direct_transfer_bytes == direct_bytes);
  CHECK(after.staged_transfers - before.staged_transfers == staged);
  CHECK(after.staged_transfer_bytes - before.staged_transfer_bytes == staged_bytes);
  CHECK(after.lower_tier_reads - before.lower_tier_reads == kN);
  CHECK(after.promotions == before.promotions);
  // Either way the NVMe tier read into aligned memory with room: the caller's buffer or the
  // store's bounce buffer, never a staging buffer of its own.
  CHECK(s.nvme->staged_ios() == staged_ios);
  // The bounce pool is touched only by the staged reads.
  CHECK((after.bounce_memory == "none") == (staged == 0));
}

TEST_CASE("Single Get without promotion: a buffer too small is refused, naming the size, and nothing is counted") {
  TempDir dir("get-small");
  HostNvme s(dir.path(), NoPromote());
  const auto keys = PutInNvme(*s.store, 2);
  std::vector<std::byte> small(SizeOf(1) - 1);
  const StoreStats before = s.store->Stats();
  auto r = s.store->Get(keys[1], small);
  CHECK(r.status().IsInvalidArgument());
  CHECK_THAT(r.status().message(), Catch::Contains(std::to_string(SizeOf(1))));
  const StoreStats after = s.store->Stats();
  CHECK(after.direct_transfers + after.staged_transfers == before.direct_transfers + before.staged_transfers);
}

TEST_CASE("Single Get: concurrent Gets of the same NVMe blocks all get the right bytes") {
  const bool promote = GENERATE(false, true);
  INFO("promote_on_get " << promote);
  TempDir dir("get-concurrent");
  StoreOptions o = Quiet();
  o.promote_on_get = promote;
  HostNvme s(dir.path(), o);
  const auto keys = PutInNvme(*s.store, kN);
  const StoreStats before = s.store->Stats();
  constexpr int kThreads = 6;
  std::latch start(kThreads);
  std::vector<int> good(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const Shape shape = static_cast<Shape>(t % 3);  // every buffer shape, leader or follower
      start.arrive_and_wait();
      for (int i = 0; i < kN; ++i) {
        const std::size_t size = SizeOf(i);
        ShapedBuffer buf(shape, size);
        auto r = s.store->Get(keys[i], buf.out());
        good[t] += r.ok() && r->size == size && buf.First(size) == TestBytes(static_cast<std::uint64_t>(i), size);
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) CHECK(good[t] == kN);
  const StoreStats after = s.store->Stats();
  const std::uint64_t transfers = after.direct_transfers + after.staged_transfers -
                                  before.direct_transfers - before.staged_transfers;
  const std::uint64_t joined = after.dedup_hits - before.dedup_hits;
  if (promote) {
    // Each block is promoted once, by the first Get; the rest joined that read or hit the host tier.
    CHECK(after.promotions - before.promotions == kN);
    CHECK(transfers == kN);
  } else {
    // Every Get either read NVMe itself (one transfer into its buffer) or joined another's read.
    CHECK(transfers + joined == static_cast<std::uint64_t>(kThreads) * kN);
    CHECK(after.lower_tier_reads - before.lower_tier_reads == transfers);
    CHECK(after.promotions == before.promotions);
  }
}

TEST_CASE("Single Get without promotion: a corrupt NVMe copy is Corruption, into any buffer, then and later") {
  const Shape shape = GENERATE(Shape::kAlignedRoom, Shape::kUnaligned);
  INFO(ShapeName(shape));
  TempDir dir("get-corrupt");
  HostNvme s(dir.path(), NoPromote());
  const auto keys = PutInNvme(*s.store, kN);
  REQUIRE(s.store->Flush().ok());
  constexpr int kBad = 4;  // a ragged size
  REQUIRE(CorruptOnDisk(dir.path(), TestBytes(kBad, SizeOf(kBad))));
  for (int attempt = 0; attempt < 2; ++attempt) {
    ShapedBuffer buf(shape, SizeOf(kBad));
    auto r = s.store->Get(keys[kBad], buf.out());
    INFO(r.status().ToString());
    CHECK(r.status().IsCorruption());
    CHECK_THAT(r.status().message(), Catch::Contains(keys[kBad].ToString()) && Catch::Contains("nvme"));
  }
  for (int i = 0; i < kN; ++i) {
    if (i == kBad) continue;
    ShapedBuffer buf(shape, SizeOf(i));
    REQUIRE(s.store->Get(keys[i], buf.out()).ok());
    CHECK(buf.First(SizeOf(i)) == TestBytes(static_cast<std::uint64_t>(i), SizeOf(i)));
  }
  CHECK(s.store->Stats().corruptions_dropped == 1);
}

TEST_CASE("Single Get without promotion: bits flipped after the NVMe tier's own check are caught by the store") {
  const Shape shape = GENERATE(Shape::kAlignedRoom, Shape::kUnaligned);
  INFO(ShapeName(shape));
  TempDir dir("get-flip");
  HostNvme s(dir.path(), NoPromote(), /*fault_wrapped=*/true);
  const auto keys = PutInNvme(*s.store, kN);
  const StoreStats before = s.store->Stats();
  s.fault->FlipBitInNextGets(1);
  ShapedBuffer bad(shape, SizeOf(2));
  auto r = s.store->Get(keys[2], bad.out());
  INFO(r.status().ToString());
  CHECK(r.status().IsCorruption());
  CHECK(s.fault->injected().bit_flips == 1);
  ShapedBuffer good(shape, SizeOf(3));
  REQUIRE(s.store->Get(keys[3], good.out()).ok());
  CHECK(good.First(SizeOf(3)) == TestBytes(3, SizeOf(3)));
  const StoreStats after = s.store->Stats();
  CHECK(after.corruptions_dropped - before.corruptions_dropped == 1);
  // Only the good read was delivered, so only it counts as a transfer.
  CHECK(after.direct_transfers + after.staged_transfers - before.direct_transfers - before.staged_transfers == 1);
}

}  // namespace
}  // namespace terrace::testing
