// GroupCommitter ordering contract: a mutation's released extents are back in the allocator before
// any WaitDurable / Flush covering that mutation returns, whichever thread led the commit.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <thread>

#include "tests/test_util.h"
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

TEST_CASE("group commit: a Flush that waits on another leader returns after the release", "[nvme]") {
  terrace::testing::TempDir dir("group-commit");
  IndexOpenOptions io;
  io.create = true;
  auto index = IndexStore::Open(dir.path() / "index", io);
  REQUIRE(index.ok());
  NullEngine engine;

  std::atomic<bool> in_release{false};
  std::atomic<bool> released{false};
  std::atomic<std::size_t> released_extents{0};
  GroupCommitter committer(
      &engine, index->get(),
      [&](std::vector<Extent>&& extents) {
        released_extents += extents.size();  // counted, not asserted: Catch is not thread-safe
        in_release = true;
        // Long enough for a waiter woken too early to return and observe `released == false`.
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        released = true;
      },
      nullptr, /*commit=*/0, std::chrono::microseconds(0));

  BlockKey key;
  key.layer = 1;
  const std::uint64_t seq = committer.StagePut(IndexStore::EncodeKey(key), "record", Extent{kUnit, 2 * kUnit});
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

}  // namespace
}  // namespace terrace::nvme
