// The io_uring engine's completion order: the CQEs of a wake-up are recorded, the ring is refilled
// and submitted, and only then do the completion callbacks (the tier's checksums) run, so the
// device is never left idle while the CPU verifies what landed.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "nvme_test_util.h"
#include "tiers/nvme/nvme_tier.h"

using namespace terrace;
using namespace terrace::testing;

TEST_CASE("uring engine: each wake-up refills the ring before its completion callbacks run", "[nvme][engine]") {
  TempDir dir("uring");
  constexpr std::size_t kReqs = 24, kBytes = 4096;
  constexpr unsigned kDepth = 2;
  const std::vector<std::byte> content = TestBytes(7, kReqs * kBytes, 3);
  const std::string path = (dir.path() / "data").string();
  {
    const int wfd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    REQUIRE(wfd >= 0);
    REQUIRE(::pwrite(wfd, content.data(), content.size(), 0) == static_cast<ssize_t>(content.size()));
    ::close(wfd);
  }
  const int fd = ::open(path.c_str(), O_RDONLY);
  REQUIRE(fd >= 0);
  auto engine = nvme::OpenUringEngine(nvme::IoEngineConfig{fd, kDepth, 1});
  REQUIRE(engine.ok());

  std::vector<std::byte> out(kReqs * kBytes);
  std::vector<nvme::IoRequest> reqs(kReqs);
  for (std::size_t i = 0; i < kReqs; ++i) {
    // Reverse file order, so the request index and the file offset are independent.
    reqs[i].op = nvme::IoOp::kRead;
    reqs[i].offset = (kReqs - 1 - i) * kBytes;
    reqs[i].buf = out.data() + i * kBytes;
    reqs[i].len = kBytes;
  }
  std::vector<int> calls(kReqs, 0);
  std::size_t completed = 0, too_early = 0;
  nvme::IoCompletion on_complete = [&](std::size_t i) {
    ++calls[i];
    ++completed;
    // Queued so far (the engine stamps submit_ns when it queues a request): the ring was refilled
    // for every completion of this wake-up, this one included, before any callback of it ran.
    const auto queued = static_cast<std::size_t>(
        std::count_if(reqs.begin(), reqs.end(), [](const nvme::IoRequest& r) { return r.submit_ns != 0; }));
    if (queued < std::min(kReqs, completed + kDepth)) ++too_early;
  };
  (*engine)->Execute(reqs, &on_complete);
  ::close(fd);

  CHECK(too_early == 0);
  for (std::size_t i = 0; i < kReqs; ++i) {
    INFO("request " << i);
    CHECK(calls[i] == 1);
    CHECK(reqs[i].result == static_cast<int>(kBytes));
    CHECK(std::memcmp(out.data() + i * kBytes, content.data() + reqs[i].offset, kBytes) == 0);
  }
}

TEST_CASE("nvme tier: a failed re-registration of external buffers leaves I/O into them working", "[nvme][engine]") {
  // The table was put back to the staging buffers alone while the tier kept the old external list,
  // so I/O into those regions named fixed-buffer indices past the table's end: every put and get
  // through them failed with EFAULT ("Bad address").
  TempDir dir("nvme-reg");
  auto opened = NvmeTier::Open(SmallNvmeOptions(dir.path(), 16 * kMiB, Durability::kSync));
  REQUIRE(opened.ok());
  NvmeTier& tier = **opened;
  constexpr std::size_t kRegion = 1 << 20;
  void* a = ::mmap(nullptr, kRegion, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  void* bad = ::mmap(nullptr, 2 * kRegion, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);  // cannot be pinned
  REQUIRE(a != MAP_FAILED);
  REQUIRE(bad != MAP_FAILED);
  auto* region = static_cast<std::byte*>(a);
  const auto data = TestBytes(1, 64 * 1024);
  std::memcpy(region, data.data(), data.size());
  std::span<std::byte> first[] = {{region, kRegion}};
  const Status registered = tier.RegisterIoRegions(first);
  if (!registered.ok()) {
    WARN("fixed buffers unavailable here (" << registered.ToString() << "); nothing to re-register");
  } else {
    const std::span<const std::byte> in_region(region, data.size());
    REQUIRE(tier.Put(TestKey(1), DescribeBlock(in_region), in_region).ok());
    std::span<std::byte> grown[] = {{region, kRegion}, {static_cast<std::byte*>(bad), 2 * kRegion}};
    CHECK_FALSE(tier.RegisterIoRegions(grown).ok());
  }
  const std::span<const std::byte> in_region(region, data.size());
  const Status put = tier.Put(TestKey(2), DescribeBlock(in_region), in_region);
  INFO(put.ToString());
  CHECK(put.ok());
  std::span<std::byte> out(region + 128 * 1024, data.size());
  BlockDesc d;
  const Status got = tier.Get(TestKey(registered.ok() ? 1 : 2), out, &d);
  INFO(got.ToString());
  CHECK(got.ok());
  CHECK(std::memcmp(out.data(), data.data(), data.size()) == 0);
  ::munmap(a, kRegion);
  ::munmap(bad, 2 * kRegion);
}
