// The NVMe tier on a block device: a loop device over a sparse temporary file stands in for an
// NVMe namespace. Needs root, /dev/loop-control and losetup; without them every case WARNs
// "skipped: ..." and returns.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "nvme_test_util.h"

using namespace terrace;
using namespace terrace::testing;
namespace fs = std::filesystem;

namespace {

// Runs `cmd` through the shell; returns its exit status and, in *out, what it printed (stdout and
// stderr).
int RunShell(const std::string& cmd, std::string* out) {
  out->clear();
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return -1;
  std::array<char, 256> buf{};
  while (std::fgets(buf.data(), static_cast<int>(buf.size()), p)) *out += buf.data();
  int rc = ::pclose(p);
  while (!out->empty() && (out->back() == '\n' || out->back() == ' ')) out->pop_back();
  return rc;
}

std::string Quote(const fs::path& p) { return "'" + p.string() + "'"; }

// A loop device over a sparse file in a TempDir. The destructor detaches the device, then the
// TempDir removes the file. ok() is false (and skip_reason() says why) where no loop device can be
// set up on this machine.
class LoopDevice {
 public:
  explicit LoopDevice(std::uint64_t bytes) : dir_("nvme-blockdev") {
    if (::geteuid() != 0) {
      why_ = "not running as root (loop devices need root)";
      return;
    }
    if (::access("/dev/loop-control", F_OK) != 0) {
      why_ = "no /dev/loop-control";
      return;
    }
    std::string out;
    if (RunShell("command -v losetup", &out) != 0) {
      why_ = "losetup is not installed";
      return;
    }
    file_ = dir_.path() / "backing.img";
    {
      std::ofstream f(file_, std::ios::binary);
    }
    std::error_code ec;
    fs::resize_file(file_, bytes, ec);  // sparse: reads as zeros, a blank device
    if (ec) {
      why_ = "cannot create a " + std::to_string(bytes) + "-byte sparse file: " + ec.message();
      return;
    }
    if (RunShell("losetup --find --show --direct-io=on " + Quote(file_), &out) != 0) {
      const std::string first = out;
      if (RunShell("losetup --find --show " + Quote(file_), &out) != 0) {
        why_ = "losetup failed: '" + first + "', then without --direct-io: '" + out + "'";
        return;
      }
    }
    if (out.rfind("/dev/", 0) != 0 || out.find('\n') != std::string::npos) {
      why_ = "unexpected losetup output: '" + out + "'";
      return;
    }
    dev_ = out;
    std::error_code sec;
    if (!fs::is_block_file(dev_, sec)) {
      why_ = "losetup printed '" + dev_.string() + "' but it is not a block device";
      Detach();
    }
  }
  ~LoopDevice() { Detach(); }
  LoopDevice(const LoopDevice&) = delete;
  LoopDevice& operator=(const LoopDevice&) = delete;

  bool ok() const { return !dev_.empty(); }
  const std::string& skip_reason() const { return why_; }
  const fs::path& device() const { return dev_; }
  const fs::path& backing_file() const { return file_; }
  // A scratch directory next to the backing file (for index directories).
  const fs::path& scratch() const { return dir_.path(); }

 private:
  // Detaches the device. The kernel may defer the detach (autoclear) while a reference is still
  // held, e.g. by an io_uring instance being torn down; wait for it so that no device outlives the
  // test.
  void Detach() {
    if (dev_.empty()) return;
    std::string out;
    if (RunShell("losetup -d " + Quote(dev_), &out) != 0) {
      std::fprintf(stderr, "block_device_test: 'losetup -d %s' failed: %s\n", dev_.c_str(), out.c_str());
    } else {
      const fs::path backing = fs::path("/sys/block") / dev_.filename() / "loop" / "backing_file";
      std::error_code ec;
      for (int i = 0; i < 500 && fs::exists(backing, ec); ++i) ::usleep(10 * 1000);
      if (fs::exists(backing, ec)) {
        std::fprintf(stderr, "block_device_test: %s is still attached 5 s after 'losetup -d'\n", dev_.c_str());
      }
    }
    dev_.clear();
  }

  TempDir dir_;  // destroyed after Detach() ran
  fs::path file_;
  fs::path dev_;
  std::string why_;
};

NvmeTierOptions DeviceOptions(const LoopDevice& loop, std::uint64_t capacity, const fs::path& index_dir,
                              Durability durability = Durability::kAsync) {
  NvmeTierOptions o = SmallNvmeOptions(loop.device(), capacity, durability);
  o.index_dir = index_dir;
  return o;
}

// The first `n` bytes of the backing file (what the tier wrote through the loop device).
std::vector<char> BackingBytes(const LoopDevice& loop, std::size_t n) {
  std::vector<char> b(n, 0);
  std::ifstream f(loop.backing_file(), std::ios::binary);
  f.read(b.data(), static_cast<std::streamsize>(n));
  return b;
}

// Writes `text` at `offset` of the device (through it, synced), as another program's data would be.
void WriteDevice(const LoopDevice& loop, std::uint64_t offset, std::string_view text) {
  const int fd = ::open(loop.device().c_str(), O_WRONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  REQUIRE(::pwrite(fd, text.data(), text.size(), static_cast<off_t>(offset)) == static_cast<ssize_t>(text.size()));
  REQUIRE(::fsync(fd) == 0);
  ::close(fd);
}

// `n` bytes of the backing file at `offset`.
std::string BackingAt(const LoopDevice& loop, std::uint64_t offset, std::size_t n) {
  std::string b(n, '\0');
  std::ifstream f(loop.backing_file(), std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  f.read(b.data(), static_cast<std::streamsize>(n));
  return b;
}

bool AllZero(const std::vector<char>& b) {
  return std::all_of(b.begin(), b.end(), [](char c) { return c == 0; });
}

constexpr int kBlocks = 16;  // NvmeTestSize(i): 1 byte .. 1.5 MiB + 3, most not multiples of 4 KiB

}  // namespace

#define TERRACE_LOOP_OR_SKIP(var, bytes)                  \
  LoopDevice var(bytes);                                  \
  if (!var.ok()) {                                        \
    WARN("skipped: no loop device: " << var.skip_reason()); \
    return;                                               \
  }

TEST_CASE("nvme block device: put/get, close, reopen recovers from the index", "[nvme][blockdev]") {
  auto mode = GENERATE(Durability::kAsync, Durability::kSync);
  TERRACE_LOOP_OR_SKIP(loop, 256 * kMiB);
  const fs::path index = loop.scratch() / "index";
  const auto opts = DeviceOptions(loop, 256 * kMiB, index, mode);
  INFO("device " << loop.device() << ", durability " << (mode == Durability::kSync ? "sync" : "async"));
  {
    auto t = NvmeTier::Open(opts);
    REQUIRE(t.ok());
    NvmeTier& tier = **t;
    CHECK(tier.recovery_report().created);
    CHECK(tier.caps().capacity_bytes == 256 * kMiB);
    for (int i = 0; i < kBlocks; ++i) REQUIRE(PutTestBlock(tier, i).ok());
    for (int i = 0; i < kBlocks; ++i) {
      INFO("block " << i << " (" << NvmeTestSize(i) << " bytes)");
      Status s = CheckTestBlock(tier, i);
      REQUIRE(s.ok());
    }
    CHECK(tier.block_count() == kBlocks);
    REQUIRE(tier.Erase(TestKey(3)).ok());
    REQUIRE(tier.Flush().ok());
  }
  // The data went to the device (the backing file), not to a file beside it; the index to index_dir.
  CHECK_FALSE(AllZero(BackingBytes(loop, 4096)));
  CHECK(fs::is_directory(index));
  CHECK_FALSE(fs::exists(loop.device().parent_path() / "terrace.data"));
  CHECK_FALSE(fs::exists(loop.scratch() / "terrace.data"));

  for (int round = 0; round < 2; ++round) {
    INFO("reopen " << round);
    auto t = NvmeTier::Open(opts);
    REQUIRE(t.ok());
    NvmeTier& tier = **t;
    CHECK_FALSE(tier.recovery_report().created);
    CHECK(tier.recovery_report().blocks_recovered == static_cast<std::uint64_t>(kBlocks - 1 + round));
    CHECK(tier.recovery_report().dropped() == 0);
    for (int i = 0; i < kBlocks; ++i) {
      INFO("block " << i);
      if (i == 3) {
        CHECK(tier.Lookup(TestKey(i)).status().IsNotFound());
      } else {
        Status s = CheckTestBlock(tier, i);
        REQUIRE(s.ok());
      }
    }
    // A write after recovery must not land on a recovered extent.
    REQUIRE(PutTestBlock(tier, 100 + round, 7).ok());
    REQUIRE(CheckTestBlock(tier, 100 + round, 7).ok());
    for (int i = 0; i < kBlocks; ++i) {
      if (i != 3) REQUIRE(CheckTestBlock(tier, i).ok());
    }
    for (int r = 0; r < round; ++r) REQUIRE(CheckTestBlock(tier, 100 + r, 7).ok());
  }
}

TEST_CASE("nvme block device: index_dir is required", "[nvme][blockdev][bad]") {
  TERRACE_LOOP_OR_SKIP(loop, 32 * kMiB);
  auto t = NvmeTier::Open(DeviceOptions(loop, 32 * kMiB, /*index_dir=*/{}));
  REQUIRE_FALSE(t.ok());
  INFO(t.status().ToString());
  CHECK(t.status().IsInvalidArgument());
  CHECK(t.status().message().find(loop.device().string()) != std::string::npos);
  CHECK(t.status().message().find("index_dir") != std::string::npos);
  // Refused before anything was written: the device is still blank.
  CHECK(AllZero(BackingBytes(loop, 64 * 1024)));
}

TEST_CASE("nvme block device: capacity and block size beyond the device", "[nvme][blockdev][bad]") {
  constexpr std::uint64_t kDev = 32 * kMiB;
  TERRACE_LOOP_OR_SKIP(loop, kDev);
  const fs::path index = loop.scratch() / "index";
  {
    // capacity_bytes larger than the device: refused at open, nothing written.
    auto t = NvmeTier::Open(DeviceOptions(loop, 2 * kDev, loop.scratch() / "index-too-big"));
    REQUIRE_FALSE(t.ok());
    INFO(t.status().ToString());
    CHECK(t.status().IsOutOfCapacity());
    CHECK(t.status().message().find(loop.device().string()) != std::string::npos);
    CHECK(AllZero(BackingBytes(loop, 64 * 1024)));
  }
  auto t = NvmeTier::Open(DeviceOptions(loop, kDev, index));
  REQUIRE(t.ok());
  NvmeTier& tier = **t;
  {
    // A block larger than the whole device.
    std::vector<std::byte> big(kDev + 1);
    Status s = tier.Put(TestKey(1), DescribeBlock(big), big);
    INFO(s.ToString());
    CHECK(s.IsOutOfCapacity());
    CHECK(tier.Lookup(TestKey(1)).status().IsNotFound());
  }
  {
    // One byte more than the data area (capacity less the superblock).
    const std::uint64_t max = tier.caps().max_block_bytes;
    CHECK(max == kDev - nvme::kDataStart - nvme::kUnit);  // less the descriptor unit
    std::vector<std::byte> over(max + 1);
    Status s = tier.Put(TestKey(2), DescribeBlock(over), over);
    INFO(s.ToString());
    CHECK(s.IsOutOfCapacity());
  }
  // The largest block fills the device exactly and reads back; then the tier is full.
  const std::size_t max = tier.caps().max_block_bytes;
  REQUIRE(PutTestBlock(tier, 3, 42, max).ok());
  REQUIRE(CheckTestBlock(tier, 3, 42, max).ok());
  Status full = PutTestBlock(tier, 4, 42, 4096);
  INFO(full.ToString());
  CHECK(full.IsOutOfCapacity());
  CHECK(tier.free_bytes() == 0);
}

TEST_CASE("nvme block device: a used device is never paired with a missing, empty or foreign index",
          "[nvme][blockdev]") {
  constexpr std::uint64_t kDev = 64 * kMiB;
  TERRACE_LOOP_OR_SKIP(loop, kDev);
  const fs::path old_index = loop.scratch() / "index-old";
  {
    auto t = NvmeTier::Open(DeviceOptions(loop, kDev, old_index, Durability::kSync));
    REQUIRE(t.ok());
    for (int i = 0; i < kBlocks; ++i) REQUIRE(PutTestBlock(**t, i).ok());
  }
  const fs::path fresh = loop.scratch() / "index-new";
  SECTION("index_dir that does not exist") {}
  SECTION("index_dir that exists but is empty") { fs::create_directories(fresh); }
  SECTION("index_dir of another store") {
    TempDir other("nvme-other");
    auto o = SmallNvmeOptions(other.path(), kDev);
    o.index_dir = fresh;
    auto t = NvmeTier::Open(o);
    REQUIRE(t.ok());
    REQUIRE(PutTestBlock(**t, 0, /*seed=*/77).ok());
  }
  {
    auto t = NvmeTier::Open(DeviceOptions(loop, kDev, fresh, Durability::kSync));
    REQUIRE_FALSE(t.ok());
    INFO(t.status().ToString());
    CHECK(t.status().IsCorruption());
    CHECK(t.status().message().find(fresh.string()) != std::string::npos);
    CHECK(t.status().message().find("store recover") != std::string::npos);
  }
  // Nothing was overwritten: the store's own index still holds every block intact.
  {
    auto again = NvmeTier::Open(DeviceOptions(loop, kDev, old_index, Durability::kSync));
    REQUIRE(again.ok());
    for (int i = 0; i < kBlocks; ++i) REQUIRE(CheckTestBlock(**again, i).ok());
  }
  // reformat is the explicit way to start over on the device; the old index is then foreign.
  if (!fs::exists(fresh) || fs::is_empty(fresh)) {
    auto o = DeviceOptions(loop, kDev, fresh, Durability::kSync);
    o.reformat = true;
    {
      auto t = NvmeTier::Open(o);
      INFO(t.status().ToString());
      REQUIRE(t.ok());
      CHECK((*t)->recovery_report().created);
      CHECK((*t)->block_count() == 0);
    }
    auto stale = NvmeTier::Open(DeviceOptions(loop, kDev, old_index, Durability::kSync));
    REQUIRE_FALSE(stale.ok());
    CHECK(stale.status().IsCorruption());
  }
}

// An index_dir created ahead of time (empty) is where a new store puts its index.
TEST_CASE("nvme block device: a blank device with an existing empty index_dir", "[nvme][blockdev]") {
  TERRACE_LOOP_OR_SKIP(loop, 32 * kMiB);
  const fs::path index = loop.scratch() / "index";
  fs::create_directories(index);
  auto t = NvmeTier::Open(DeviceOptions(loop, 32 * kMiB, index));
  INFO((t.ok() ? std::string("opened") : t.status().ToString()));
  REQUIRE(t.ok());
  CHECK((*t)->recovery_report().created);
  REQUIRE(PutTestBlock(**t, 1).ok());
  REQUIRE(CheckTestBlock(**t, 1).ok());
}

// A device whose first 4 KiB are zero may still hold a file system (btrfs keeps its superblock at
// 64 KiB; RAID and ZFS members keep labels at the end): it is never formatted, reformat or not.
TEST_CASE("nvme block device: a device with data past its first 4 KiB is not blank and is never formatted",
          "[nvme][blockdev][bad]") {
  constexpr std::uint64_t kDev = 32 * kMiB;
  TERRACE_LOOP_OR_SKIP(loop, kDev);
  std::uint64_t at = 0;
  SECTION("a btrfs superblock magic at 64 KiB + 64") { at = 64 * 1024 + 64; }
  SECTION("a label in the last 4 KiB") { at = kDev - 4096 + 8; }
  WriteDevice(loop, at, "_BHRfS_M");
  for (const bool reformat : {false, true}) {
    auto o = DeviceOptions(loop, kDev, loop.scratch() / "index");
    o.reformat = reformat;
    auto t = NvmeTier::Open(o);
    INFO("reformat " << reformat << ": " << (t.ok() ? std::string("opened") : t.status().ToString()));
    REQUIRE_FALSE(t.ok());
    CHECK(t.status().IsInvalidArgument());
    CHECK(t.status().message().find("not blank") != std::string::npos);
    CHECK(t.status().message().find(std::to_string(at)) != std::string::npos);
    CHECK(BackingAt(loop, at, 8) == "_BHRfS_M");
    CHECK(AllZero(BackingBytes(loop, 4096)));
  }
}

TEST_CASE("nvme block device: reformat never overwrites a device that holds no Terrace store", "[nvme][blockdev][bad]") {
  constexpr std::uint64_t kDev = 32 * kMiB;
  TERRACE_LOOP_OR_SKIP(loop, kDev);
  WriteDevice(loop, 0, "XFSB and a file system's own header");
  auto o = DeviceOptions(loop, kDev, loop.scratch() / "index");
  o.reformat = true;
  auto t = NvmeTier::Open(o);
  INFO((t.ok() ? std::string("opened") : t.status().ToString()));
  REQUIRE_FALSE(t.ok());
  CHECK(t.status().message().find("reformat refused") != std::string::npos);
  CHECK(BackingAt(loop, 0, 4) == "XFSB");
}
