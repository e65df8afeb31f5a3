// GroupCommitter ordering contract: a mutation's released extents are back in the allocator before
// any WaitDurable / Flush covering that mutation returns, whichever thread led the commit; the
// descriptors of a commit's puts reach the data file only after the index holds them; the redo
// record round-trips and refuses damage.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <thread>

#include "tests/test_util.h"
#include "tests/thread_limit.h"
#include "tiers/nvme/group_commit.h"
#include "tiers/nvme/index_store.h"
#include "tiers/nvme/io_engine.h"

namespace terrace::nvme {
namespace {

// Completes every request in full without touching any file.
class NullEngine final : public IoEngine {
 public:
  void Execute(std::span<IoRequest> reqs, const IoCompletion* on_complete) override {
    for (std::size_t i = 0; i < reqs.size(); ++i) {
      reqs[i].result = static_cast<int>(reqs[i].len);
      if (on_complete != nullptr) (*on_complete)(i);
    }
  }
  int SyncData() override { return 0; }
  Status RegisterBuffers(std::span<const iovec>) override { return Status::Ok(); }
  bool fixed_buffers() const override { return false; }
  unsigned queue_depth() const override { return 8; }
  std::string_view name() const override { return "null"; }
};

// A new, empty index in dir/index.
std::unique_ptr<IndexStore> NewIndex(const std::filesystem::path& dir) {
  IndexOpenOptions io;
  io.create = true;
  auto index = IndexStore::Open(dir / "index", io);
  REQUIRE(index.ok());
  return std::move(index).value();
}

TEST_CASE("group commit: a Flush that waits on another leader returns after the release", "[nvme]") {
  terrace::testing::TempDir dir("group-commit");
  auto index = NewIndex(dir.path());
  NullEngine engine;

  std::atomic<bool> in_release{false};
  std::atomic<bool> released{false};
  std::atomic<std::size_t> released_extents{0};
  auto created = GroupCommitter::Create(
      &engine, index.get(),
      [&](std::vector<Extent>&& extents) {
        released_extents += extents.size();  // counted, not asserted: Catch is not thread-safe
        in_release = true;
        // Long enough for a waiter woken too early to return and observe `released == false`.
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        released = true;
      },
      nullptr, /*commit=*/0, std::chrono::microseconds(0));
  REQUIRE(created.ok());
  GroupCommitter& committer = **created;

  Descriptor d;
  d.key.layer = 1;
  d.rec.offset = 4 * kUnit;
  d.rec.length = 100;
  const std::uint64_t seq = committer.StagePut(d, Extent{kUnit, 2 * kUnit});
  std::atomic<bool> leader_ok{false};
  std::thread leader([&] { leader_ok = committer.WaitDurable(seq).ok(); });
  while (!in_release) std::this_thread::yield();
  // The leader is inside the release callback; this Flush must not return before it finishes.
  REQUIRE(committer.Flush().ok());
  CHECK(released);
  leader.join();
  CHECK(leader_ok);
  CHECK(released_extents == 1);
}

// Records every write (offset, the first byte, the index's commit counter at that moment) and sync.
class RecordingEngine final : public IoEngine {
 public:
  explicit RecordingEngine(IndexStore* index) : index_(index) {}
  struct Write {
    std::uint64_t offset;
    std::byte first;
    std::uint64_t index_commit;
  };
  void Execute(std::span<IoRequest> reqs, const IoCompletion* on_complete) override {
    for (std::size_t i = 0; i < reqs.size(); ++i) {
      if (reqs[i].op == IoOp::kWrite) writes.push_back({reqs[i].offset, reqs[i].src[0], index_->ReadCommit().value()});
      reqs[i].result = static_cast<int>(reqs[i].len);
      if (on_complete != nullptr) (*on_complete)(i);
    }
  }
  int SyncData() override {
    ++syncs;
    return 0;
  }
  Status RegisterBuffers(std::span<const iovec>) override { return Status::Ok(); }
  bool fixed_buffers() const override { return false; }
  unsigned queue_depth() const override { return 8; }
  std::string_view name() const override { return "recording"; }
  std::vector<Write> writes;  // single-threaded use: the test's commits run on its thread
  int syncs = 0;

 private:
  IndexStore* index_;
};

TEST_CASE("group commit: descriptors are written after the index holds them; a put released by the same commit gets none",
          "[nvme]") {
  terrace::testing::TempDir dir("group-commit");
  auto index = NewIndex(dir.path());
  RecordingEngine engine(index.get());
  std::vector<Extent> released;
  auto created = GroupCommitter::Create(&engine, index.get(), [&](std::vector<Extent>&& e) { released = e; },
                                        nullptr, /*commit=*/0, std::chrono::microseconds(0));
  REQUIRE(created.ok());
  GroupCommitter& committer = **created;
  Descriptor a, b, c;
  a.key.layer = 1;
  a.rec = {.offset = 4 * kUnit, .length = 100, .checksum = 1, .generation = 1};
  b.key.layer = 2;
  b.rec = {.offset = 8 * kUnit, .length = 5000, .checksum = 2, .generation = 2};
  c.key.layer = 1;  // overwrites a in the same commit: a's extent is released, and gets zeros only
  c.rec = {.offset = 12 * kUnit, .length = 10, .checksum = 3, .generation = 3};
  committer.StagePut(a, {});
  committer.StagePut(b, {});
  const Extent a_extent{a.rec.offset, a.rec.extent_bytes()};
  REQUIRE(committer.WaitDurable(committer.StagePut(c, a_extent)).ok());
  REQUIRE(committer.durable_commit() == 1);
  // b's and c's descriptors and a's zeroed unit, each written once the index held commit 1.
  std::map<std::uint64_t, RecordingEngine::Write> by_offset;
  for (const auto& w : engine.writes) by_offset[w.offset] = w;
  REQUIRE(engine.writes.size() == 3);
  REQUIRE(by_offset.count(b.rec.descriptor_offset()) == 1);
  REQUIRE(by_offset.count(c.rec.descriptor_offset()) == 1);
  REQUIRE(by_offset.count(a.rec.descriptor_offset()) == 1);
  for (const auto& w : engine.writes) CHECK(w.index_commit == 1);
  CHECK(by_offset[b.rec.descriptor_offset()].first != std::byte{0});  // a descriptor (its magic)
  CHECK(by_offset[a.rec.descriptor_offset()].first == std::byte{0});  // zeroed
  CHECK(engine.syncs == 2);  // the data before the index, the descriptors after it
  REQUIRE(released.size() == 1);
  CHECK(released[0].offset == a_extent.offset);
  // The redo record names what step 3 wrote.
  auto redo_bytes = [&]() {
    std::string v;
    REQUIRE(index->Scan([&](std::string_view k, std::string_view val) {
      if (k == kRedoKey) v = std::string(val);
    }).ok());
    return v;
  }();
  auto redo = GroupCommitter::DecodeRedo(redo_bytes);
  REQUIRE(redo.ok());
  REQUIRE(redo->keys.size() == 3);
  CHECK(redo->keys[1] == b.key);
  REQUIRE(redo->released.size() == 1);
  CHECK(redo->released[0].offset == a_extent.offset);
  CHECK(redo->released[0].length == a_extent.length);
}

TEST_CASE("group commit: the redo record round-trips and refuses damage", "[nvme]") {
  GroupCommitter::Redo r;
  for (int i = 0; i < 5; ++i) {
    BlockKey k;
    k.layer = static_cast<std::uint32_t>(i);
    k.id.lo = 1000 + static_cast<std::uint64_t>(i);
    r.keys.push_back(k);
  }
  r.released = {{kUnit, 2 * kUnit}, {16 * kUnit, kUnit}};
  const std::string bytes = GroupCommitter::EncodeRedo(r);
  auto back = GroupCommitter::DecodeRedo(bytes);
  REQUIRE(back.ok());
  CHECK(back->keys == r.keys);
  REQUIRE(back->released.size() == 2);
  CHECK(back->released[1].offset == 16 * kUnit);
  CHECK(GroupCommitter::DecodeRedo(bytes.substr(0, bytes.size() - 1)).status().IsCorruption());
  CHECK(GroupCommitter::DecodeRedo(bytes + "x").status().IsCorruption());
  CHECK(GroupCommitter::DecodeRedo("").status().IsCorruption());
  std::string bad_magic = bytes;
  bad_magic[0] ^= 1;
  CHECK(GroupCommitter::DecodeRedo(bad_magic).status().IsCorruption());
  std::string bad_extent = bytes;
  bad_extent[bad_extent.size() - 16] = 1;  // the last extent's offset no longer a whole unit
  CHECK(GroupCommitter::DecodeRedo(bad_extent).status().IsCorruption());
}

TEST_CASE("group commit: Create returns Unavailable when the async committer's thread cannot be started", "[nvme]") {
  terrace::testing::TempDir dir("group-commit-thread");
  auto index = NewIndex(dir.path());
  NullEngine engine;
  {
    terrace::testing::FailThreadStarts fail(0);
    auto sync = GroupCommitter::Create(&engine, index.get(), [](std::vector<Extent>&&) {}, nullptr, 0,
                                       std::chrono::microseconds(0));
    CHECK(sync.ok());  // sync mode starts no thread
    auto async = GroupCommitter::Create(&engine, index.get(), [](std::vector<Extent>&&) {}, nullptr, 0,
                                        std::chrono::microseconds(5000));
    REQUIRE_FALSE(async.ok());
    CHECK(async.status().code() == Code::kUnavailable);
    CHECK(async.status().message().find("cannot start the NVMe tier's group-commit thread") == 0);
  }
  CHECK(GroupCommitter::Create(&engine, index.get(), [](std::vector<Extent>&&) {}, nullptr, 0,
                               std::chrono::microseconds(5000))
            .ok());
}

TEST_CASE("group commit: every commit that carries new data syncs it before the index write, not only the first", "[nvme]") {
  terrace::testing::TempDir dir("group-commit-sync");
  auto index = NewIndex(dir.path());
  RecordingEngine engine(index.get());
  auto created = GroupCommitter::Create(&engine, index.get(), [](std::vector<Extent>&&) {}, nullptr, /*commit=*/0,
                                        std::chrono::microseconds(0));
  REQUIRE(created.ok());
  GroupCommitter& committer = **created;
  for (std::uint64_t g = 1; g <= 3; ++g) {
    Descriptor d;
    d.key.layer = static_cast<decltype(d.key.layer)>(g);
    d.rec = {.offset = 4 * g * kUnit, .length = 100, .checksum = g, .generation = g};
    const int before = engine.syncs;
    REQUIRE(committer.WaitDurable(committer.StagePut(d, {})).ok());
    INFO("commit " << g);
    CHECK(engine.syncs - before == 2);  // the data before the index, the descriptors after it
  }
}

}  // namespace
}  // namespace terrace::nvme
