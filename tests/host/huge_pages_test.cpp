// HostTierOptions::huge_pages and the prefaulter's jump ahead of the puts: huge pages change how
// the kernel backs a chunk, never the bytes the tier returns.
#include <catch2/catch.hpp>

#include <sys/mman.h>

#include <atomic>
#include <cstdint>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "host_test_util.h"
#include "test_util.h"
#include "tiers/host/host_tier.h"
#include "tiers/host/pinned_memory.h"
#include "tiers/host/prefaulter.h"

using namespace terrace;
using terrace::testing::ResidentPages;
using terrace::testing::TestBytes;
using terrace::testing::TestKey;

namespace {

// VmLck of this process, bytes.
std::uint64_t LockedBytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmLck:", 0) == 0) return std::stoull(line.substr(6)) << 10;
  }
  return 0;
}

// Fills a fresh tier (three 8 MiB chunks) right after Create, so the puts race the prefaulter, with
// blocks of uneven sizes that cross from chunk to chunk; every block must read back exactly.
void FillAndCheck(bool huge_pages, bool pin) {
  HostTierOptions o;
  o.capacity_bytes = 24 * kMiB;
  o.chunk_bytes = 8 * kMiB;
  o.pin = pin;
  o.huge_pages = huge_pages;
  const std::uint64_t locked0 = LockedBytes();
  auto created = HostTier::Create(o);
  REQUIRE(created.ok());
  auto t = std::move(created).value();
  CHECK(t->huge_pages_advised() == (huge_pages && tiers::TransparentHugePages().usable));
  std::mt19937_64 rng(5);
  std::map<std::uint64_t, std::vector<std::byte>> expect;
  std::uint64_t id = 0;
  for (;;) {
    auto data = TestBytes(id + 100, 64 * 1024 + rng() % (1536 * 1024));
    BlockDesc d = DescribeBlock(data);
    // Alternate the two put paths (memcpy + trusted checksum; fused copy + checksum).
    Status st = id % 2 == 0 ? t->Put(TestKey(id), d, data) : t->PutDescribing(TestKey(id), &d, data);
    if (st.IsOutOfCapacity()) break;
    REQUIRE(st.ok());
    expect[id++] = std::move(data);
  }
  REQUIRE(t->Regions().size() == 3);
  REQUIRE(expect.size() >= 20);
  for (const auto& [k, want] : expect) {
    std::vector<std::byte> got(want.size());
    BlockDesc d;
    REQUIRE(t->Get(TestKey(k), got, &d).ok());
    CHECK(d == DescribeBlock(want));
    CHECK(got == want);
  }
  t->WaitForPrefault();
  const std::string detail = t->Stats().detail;
  INFO(detail);
  if (t->huge_pages_advised()) {
    for (const iovec& r : t->Regions()) CHECK(reinterpret_cast<std::uintptr_t>(r.iov_base) % tiers::kHugePageBytes == 0);
    CHECK(t->huge_page_bytes() >= tiers::kHugePageBytes);  // the kernel granted some
    CHECK(t->huge_page_bytes() <= t->arena_bytes());
    CHECK(detail.find("huge pages: yes") != std::string::npos);
  } else {
    CHECK(t->huge_page_bytes() == 0);
    CHECK(detail.find("huge pages: no") != std::string::npos);
    if (!huge_pages) CHECK(detail.find("HostTierOptions::huge_pages off") != std::string::npos);
  }
  if (pin && t->PinSummary() == "pinned: yes (mlock)") CHECK(LockedBytes() - locked0 >= t->arena_bytes());
  REQUIRE(t->CheckInvariants());
}

}  // namespace

TEST_CASE("Host tier with huge pages returns exactly the bytes put into a fresh tier") {
  for (bool pin : {true, false}) {
    INFO("pin " << pin);
    FillAndCheck(true, pin);
  }
}

TEST_CASE("Host tier with huge pages off uses 4 KiB pages and returns the same bytes") {
  FillAndCheck(false, true);
}

TEST_CASE("Prefaulter jumps ahead of writers and still faults the pages it jumped over") {
  const std::size_t kBytes = 32 * kMiB;
  void* m = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(m != MAP_FAILED);
  auto* p = static_cast<std::byte*>(m);
  std::atomic<std::uint64_t> frontier{10 * kMiB};  // writers "are" at 10 MiB (none wrote: nothing is resident)
  {
    auto created = tiers::Prefaulter::Create(4 * kMiB);
    REQUIRE(created.ok());
    tiers::Prefaulter& f = **created;
    f.Enqueue(p, kBytes, false, &frontier);
    f.Drain();
    CHECK(f.skipped_bytes() >= 10 * kMiB);
    CHECK(f.faulted_bytes() == kBytes);  // the jumped-over pages were queued again and faulted
  }
  CHECK(ResidentPages(p, kBytes) == kBytes / 4096);
  REQUIRE(::munmap(m, kBytes) == 0);
}
