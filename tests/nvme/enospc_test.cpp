// Full file systems: ENOSPC under the index or the data file is a Status error naming the file
// system, never an abort; a read-only open works on a full file system; nothing acknowledged is
// lost. Needs mount (root); skips with a WARN otherwise.
#include <catch2/catch.hpp>

#include <sys/mount.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>

#include "nvme_test_util.h"

using namespace terrace;
using namespace terrace::testing;
namespace fs = std::filesystem;

namespace {

// A tmpfs of a fixed size mounted on `dir` for the scope of the object.
class TinyFs {
 public:
  TinyFs(fs::path dir, const std::string& size) : dir_(std::move(dir)) {
    fs::create_directories(dir_);
    const std::string opts = "size=" + size;
    mounted_ = ::mount("tmpfs", dir_.c_str(), "tmpfs", 0, opts.c_str()) == 0;
    if (!mounted_) error_ = std::strerror(errno);
  }
  ~TinyFs() {
    if (mounted_) ::umount2(dir_.c_str(), MNT_DETACH);
  }
  bool mounted() const { return mounted_; }
  const std::string& error() const { return error_; }
  const fs::path& dir() const { return dir_; }

  // Fills the file system with `filler` until fewer than `leave` bytes are free.
  void Fill(std::uint64_t leave) {
    std::ofstream f(dir_ / "filler", std::ios::binary | std::ios::app);
    std::string chunk(4096, 'f');
    while (fs::space(dir_).available > leave + chunk.size()) {
      f.write(chunk.data(), static_cast<std::streamsize>(chunk.size()));
      f.flush();
      if (!f) break;
    }
  }
  void Unfill() { fs::remove(dir_ / "filler"); }

 private:
  fs::path dir_;
  bool mounted_ = false;
  std::string error_;
};

#define TINY_FS_OR_SKIP(var, dir, size)                                                                 \
  TinyFs var(dir, size);                                                                                \
  if (!var.mounted()) {                                                                                 \
    WARN("skipped: cannot mount a tmpfs at " << (dir) << " (" << var.error() << "); run as root to test " \
                                             "full file systems");                                       \
    return;                                                                                             \
  }

// Overwrites keys [0, 500) in batches of 64 sync puts until a batch fails; returns the
// acknowledged version (batch number) of each key.
std::map<int, int> FillUntilError(NvmeTier& t, Status* failure, int max_batches = 4000) {
  std::map<int, int> acked;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  for (int b = 0; b < max_batches && std::chrono::steady_clock::now() < deadline; ++b) {
    std::vector<std::vector<std::byte>> data;
    std::vector<PutOp> ops;
    for (int j = 0; j < 64; ++j) {
      const int key = (b * 64 + j) % 500;
      data.push_back(TestBytes(static_cast<std::uint64_t>(key), 4096, static_cast<std::uint64_t>(b)));
    }
    for (int j = 0; j < 64; ++j) {
      const int key = (b * 64 + j) % 500;
      ops.push_back(PutOp{TestKey(static_cast<std::uint64_t>(key)), DescribeBlock(data[j]), data[j]});
    }
    std::vector<Status> st = t.PutBatch(ops);
    for (int j = 0; j < 64; ++j) {
      if (st[j].ok()) {
        acked[(b * 64 + j) % 500] = b;
      } else if (failure->ok()) {
        *failure = st[j];
      }
    }
    if (!failure->ok()) break;
  }
  return acked;
}

void CheckAcked(NvmeTier& t, const std::map<int, int>& acked) {
  std::vector<std::byte> buf(4096);
  for (const auto& [key, batch] : acked) {
    BlockDesc d;
    Status s = t.Get(TestKey(static_cast<std::uint64_t>(key)), buf, &d);
    INFO("key " << key << ": " << s.ToString());
    REQUIRE(s.ok());
    // The acknowledged version, or a newer one whose put failed only at its commit.
    bool match = false;
    for (int b = batch; b < batch + 16 && !match; ++b) {
      match = buf == TestBytes(static_cast<std::uint64_t>(key), 4096, static_cast<std::uint64_t>(b));
    }
    CHECK(match);
  }
}

}  // namespace

TEST_CASE("nvme enospc: a full index file system fails puts with a Status, never an abort", "[nvme][enospc]") {
  TempDir dir("nvme-enospc");
  TINY_FS_OR_SKIP(fsys, dir.path() / "indexfs", "2m");
  auto o = SmallNvmeOptions(dir.path() / "store", 32 * kMiB, Durability::kSync);
  o.index_dir = fsys.dir() / "index";
  std::map<int, int> acked;
  {
    auto t = NvmeTier::Open(o);
    INFO(t.status().ToString());
    REQUIRE(t.ok());
    fsys.Fill(48 * 1024);
    Status failure;
    acked = FillUntilError(**t, &failure);
    INFO(failure.ToString());
    REQUIRE_FALSE(failure.ok());
    CHECK(failure.IsIoError());
    CHECK(failure.message().find(o.index_dir.string()) != std::string::npos);
    CHECK(failure.message().find("full") != std::string::npos);
    // The tier stays failed (and alive): later writes fail at once, reads keep working.
    CHECK_FALSE(PutTestBlock(**t, 9999).ok());
    CheckAcked(**t, acked);
  }  // closing must not abort either
  REQUIRE_FALSE(acked.empty());
  {
    // A read-only open needs no space.
    auto ro = o;
    ro.read_only = true;
    auto t = NvmeTier::Open(ro);
    INFO(t.status().ToString());
    REQUIRE(t.ok());
    CheckAcked(**t, acked);
  }
  fsys.Unfill();
  auto t = NvmeTier::Open(o);
  INFO(t.status().ToString());
  REQUIRE(t.ok());
  CheckAcked(**t, acked);
  REQUIRE(PutTestBlock(**t, 1).ok());
}

TEST_CASE("nvme enospc: data and index on one full file system", "[nvme][enospc]") {
  TempDir dir("nvme-enospc");
  TINY_FS_OR_SKIP(fsys, dir.path() / "fs", "24m");
  auto o = SmallNvmeOptions(fsys.dir() / "store", 16 * kMiB, Durability::kSync);
  std::map<int, int> acked;
  {
    auto t = NvmeTier::Open(o);
    INFO(t.status().ToString());
    REQUIRE(t.ok());
    fsys.Fill(48 * 1024);
    Status failure;
    acked = FillUntilError(**t, &failure);
    INFO(failure.ToString());
    REQUIRE_FALSE(failure.ok());
    CHECK(failure.IsIoError());
    CHECK(failure.message().find("full") != std::string::npos);
  }
  auto ro = o;
  ro.read_only = true;
  {
    auto t = NvmeTier::Open(ro);
    INFO(t.status().ToString());
    REQUIRE(t.ok());
    CheckAcked(**t, acked);
  }
  fsys.Unfill();
  auto t = NvmeTier::Open(o);
  REQUIRE(t.ok());
  CheckAcked(**t, acked);
}

TEST_CASE("nvme enospc: a data file larger than its file system is refused cleanly", "[nvme][enospc]") {
  TempDir dir("nvme-enospc");
  TINY_FS_OR_SKIP(fsys, dir.path() / "fs", "4m");
  auto o = SmallNvmeOptions(fsys.dir() / "store", 64 * kMiB, Durability::kSync);
  auto t = NvmeTier::Open(o);
  REQUIRE_FALSE(t.ok());
  INFO(t.status().ToString());
  CHECK(t.status().IsOutOfCapacity());
  CHECK(t.status().message().find("file system") != std::string::npos);
  CHECK(t.status().message().find("terrace.data") != std::string::npos);
  CHECK_FALSE(fs::exists(o.path / "terrace.data"));
  CHECK_FALSE(fs::exists(o.path / "terrace.data.creating"));
  o.capacity_bytes = 2 * kMiB;  // fits: the same directory now takes a store
  auto ok = NvmeTier::Open(o);
  INFO(ok.status().ToString());
  CHECK(ok.ok());
}

TEST_CASE("nvme enospc: a store on tmpfs says durability is weaker", "[nvme][enospc]") {
  TempDir dir("nvme-enospc");
  TINY_FS_OR_SKIP(fsys, dir.path() / "fs", "16m");
  auto t = NvmeTier::Open(SmallNvmeOptions(fsys.dir() / "store", 8 * kMiB));
  REQUIRE(t.ok());
  const auto& w = (*t)->recovery_report().warnings;
  REQUIRE_FALSE(w.empty());
  CHECK(w[0].find("tmpfs") != std::string::npos);
  CHECK((*t)->Stats().detail.find("tmpfs") != std::string::npos);
}
