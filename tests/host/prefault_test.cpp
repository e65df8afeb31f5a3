// HostTierOptions::prefault: faulting chunks in on a background thread changes where the kernel's
// page work happens, never what the tier stores or counts.
#include <catch2/catch.hpp>

#include <sys/mman.h>

#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "host_test_util.h"
#include "test_util.h"
#include "thread_limit.h"
#include "tiers/host/host_tier.h"

using namespace terrace;
using terrace::testing::ResidentPages;
using terrace::testing::TestBytes;
using terrace::testing::TestKey;

namespace {

std::unique_ptr<HostTier> MakeHost(bool prefault, bool pin, std::uint64_t capacity, std::uint64_t chunk) {
  HostTierOptions o;
  o.capacity_bytes = capacity;
  o.chunk_bytes = chunk;
  o.pin = pin;
  o.prefault = prefault;
  auto t = HostTier::Create(o);
  REQUIRE(t.ok());
  return std::move(t).value();
}

struct Outcome {
  std::map<std::uint64_t, std::vector<std::byte>> contents;  // key id -> bytes read back
  std::uint64_t puts = 0, bytes_written = 0, blocks = 0, used = 0, arena = 0;
};

// Puts, overwrites and erases (seeded, identical for every configuration) starting right after
// the tier is created, so the puts race the prefaulter over the same chunks; then reads all back.
Outcome Exercise(bool prefault, bool pin) {
  auto t = MakeHost(prefault, pin, 48 * kMiB, 4 * kMiB);
  std::mt19937_64 rng(11);
  std::map<std::uint64_t, std::vector<std::byte>> expect;
  const int steps = terrace::testing::kSanitizedBuild ? 60 : 200;
  for (int i = 0; i < steps; ++i) {
    const std::uint64_t id = rng() % 40;
    if (rng() % 6 == 0) {
      Status st = t->Erase(TestKey(id));
      CHECK((st.ok() || st.IsNotFound()));
      expect.erase(id);
      continue;
    }
    auto data = TestBytes(id * 1000 + static_cast<std::uint64_t>(i), 1 + rng() % (900 * 1024));
    REQUIRE(t->Put(TestKey(id), DescribeBlock(data), data).ok());
    expect[id] = std::move(data);
  }
  Outcome out;
  for (const auto& [id, want] : expect) {
    std::vector<std::byte> got(want.size());
    BlockDesc d;
    REQUIRE(t->Get(TestKey(id), got, &d).ok());
    CHECK(d == DescribeBlock(want));
    CHECK(got == want);
    out.contents[id] = std::move(got);
  }
  const auto s = t->Stats();
  out.puts = s.puts;
  out.bytes_written = s.bytes_written;
  out.blocks = s.blocks;
  out.used = t->used_bytes();
  out.arena = t->arena_bytes();
  REQUIRE(t->CheckInvariants());
  return out;
}

}  // namespace

TEST_CASE("Host tier prefault on and off give identical contents and counts") {
  for (bool pin : {false, true}) {
    INFO("pin " << pin);
    const Outcome off = Exercise(false, pin), on = Exercise(true, pin);
    CHECK(off.contents == on.contents);
    CHECK(off.puts == on.puts);
    CHECK(off.bytes_written == on.bytes_written);
    CHECK(off.blocks == on.blocks);
    CHECK(off.used == on.used);
    CHECK(off.arena == on.arena);
    CHECK(!on.contents.empty());
  }
}

TEST_CASE("Host tier prefault faults a new chunk in ahead of the puts that fill it") {
  // Unpinned, so that only the prefaulter (not mlock) can fault pages nobody has written.
  const std::uint64_t kChunk = 8 * kMiB;
  auto ahead = MakeHost(true, false, 2 * kChunk, kChunk);
  auto lazy = MakeHost(false, false, 2 * kChunk, kChunk);
  auto data = TestBytes(1, 4096);
  for (HostTier* t : {ahead.get(), lazy.get()}) REQUIRE(t->Put(TestKey(1), DescribeBlock(data), data).ok());
  ahead->WaitForPrefault();
  lazy->WaitForPrefault();  // no-op
  REQUIRE(ahead->Regions().size() == 1);
  REQUIRE(lazy->Regions().size() == 1);
  const auto a = ahead->Regions()[0], l = lazy->Regions()[0];
  CHECK(ResidentPages(a.iov_base, a.iov_len) == kChunk / 4096);
  CHECK(ResidentPages(l.iov_base, l.iov_len) < kChunk / 4096 / 2);  // only what the put touched
  CHECK(ahead->Stats().detail.find("faulted ahead 8 MiB") != std::string::npos);
  CHECK(lazy->Stats().detail.find("faulted ahead") == std::string::npos);
  // The block written while the chunk was being faulted reads back intact.
  std::vector<std::byte> out(data.size());
  REQUIRE(ahead->Get(TestKey(1), out, nullptr).ok());
  CHECK(out == data);
}

TEST_CASE("HostTier::Create returns Unavailable when the prefault thread cannot be started") {
  for (const bool background : {false, true}) {
    CAPTURE(background);
    HostTierOptions o;
    o.capacity_bytes = 16 * kMiB;
    o.chunk_bytes = 4 * kMiB;
    o.pin = false;
    o.prefault = !background;  // either option starts the prefaulter
    if (background) {
      o.populate = HostPopulate::kBackground;
      o.populate_bytes = 8 * kMiB;
    }
    {
      terrace::testing::FailThreadStarts fail(0);
      auto t = HostTier::Create(o);
      REQUIRE_FALSE(t.ok());
      CHECK(t.status().code() == Code::kUnavailable);
      CHECK(t.status().message().find("cannot start the host tier's prefault thread") == 0);
    }
    CHECK(HostTier::Create(o).ok());
  }
  HostTierOptions none;
  none.capacity_bytes = 16 * kMiB;
  none.chunk_bytes = 4 * kMiB;
  none.pin = false;
  none.prefault = false;
  terrace::testing::FailThreadStarts fail(0);
  CHECK(HostTier::Create(none).ok());  // no prefaulter, no thread
}

TEST_CASE("HostTier::Create with prefault returns Unavailable, not std::terminate, when the OS refuses the thread") {
  if (terrace::testing::kSanitizedBuild) return;  // the sanitizers' runtimes map memory of their own
  const int end = terrace::testing::RunWithNoRoomForThreads([] { return 0; }, [] {
    HostTierOptions o;
    o.capacity_bytes = 16 * kMiB;
    o.chunk_bytes = 4 * kMiB;
    o.pin = false;
    o.prefault = true;
    auto t = HostTier::Create(o);
    if (t.ok()) return 3;
    return t.status().code() == Code::kUnavailable ? 0 : 4;
  });
  INFO(terrace::testing::DescribeChildEnd(end));
  CHECK(end == 0);
}
