// NvmeTier::GetRangeBatch: only the units around each range are read, a batch goes to the device
// in one submission, and a range read holds its extent so an Erase racing it cannot hand the
// extent to another block under the read.
#include <catch2/catch.hpp>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "nvme_test_util.h"
#include "src/common/aligned_buffer.h"

using namespace terrace;
using namespace terrace::testing;

namespace {

// Wraps the io_uring engine: counts the Execute calls that carry reads, and can hold the next one
// (Arm) until Open, so a test can act while a read is in flight. Thread-safe.
class GatedEngine final : public nvme::IoEngine {
 public:
  explicit GatedEngine(std::unique_ptr<nvme::IoEngine> base) : base_(std::move(base)) {}

  void Arm() {
    std::lock_guard<std::mutex> l(mu_);
    armed_ = true;
  }
  void WaitHeld() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return held_; });
  }
  void Open() {
    std::lock_guard<std::mutex> l(mu_);
    open_ = true;
    cv_.notify_all();
  }
  std::uint64_t read_executes() const { return read_executes_.load(); }

  void Execute(std::span<nvme::IoRequest> reqs, const nvme::IoCompletion* on_complete) override {
    bool reads = false;
    for (const nvme::IoRequest& r : reqs) reads |= r.op == nvme::IoOp::kRead;
    if (reads) {
      read_executes_.fetch_add(1);
      std::unique_lock<std::mutex> l(mu_);
      if (armed_) {
        armed_ = false;
        held_ = true;
        cv_.notify_all();
        cv_.wait(l, [&] { return open_; });
      }
    }
    base_->Execute(reqs, on_complete);
  }
  int SyncData() override { return base_->SyncData(); }
  Status RegisterBuffers(std::span<const iovec> bufs) override { return base_->RegisterBuffers(bufs); }
  bool fixed_buffers() const override { return base_->fixed_buffers(); }
  unsigned queue_depth() const override { return base_->queue_depth(); }
  std::string_view name() const override { return "gated"; }

 private:
  std::unique_ptr<nvme::IoEngine> base_;
  std::atomic<std::uint64_t> read_executes_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool armed_ = false, held_ = false, open_ = false;
};

Result<std::unique_ptr<NvmeTier>> OpenGated(const NvmeTierOptions& options, GatedEngine** gate) {
  return NvmeTier::OpenWithEngine(options, [gate](const nvme::IoEngineConfig& cfg)
                                               -> Result<std::unique_ptr<nvme::IoEngine>> {
    TERRACE_ASSIGN_OR_RETURN(auto base, nvme::OpenUringEngine(cfg));
    auto g = std::make_unique<GatedEngine>(std::move(base));
    *gate = g.get();
    return std::unique_ptr<nvme::IoEngine>(std::move(g));
  });
}

Status PutBlock(Tier& t, std::uint64_t k, const std::vector<std::byte>& bytes) {
  return t.Put(TestKey(k), DescribeBlock(bytes), bytes);
}

bool SameBytes(std::span<const std::byte> got, const std::vector<std::byte>& whole, std::uint64_t offset) {
  return std::memcmp(got.data(), whole.data() + offset, got.size()) == 0;
}

}  // namespace

TEST_CASE("nvme range reads: a range reads only the 4 KiB units around it, a batch in one submission", "[nvme]") {
  TempDir dir("nvme-range");
  GatedEngine* engine = nullptr;
  auto t = OpenGated(SmallNvmeOptions(dir.path()), &engine);
  REQUIRE(t.ok());
  NvmeTier& tier = **t;
  constexpr std::uint64_t kBlock = 2 * kMiB + 100;
  const auto whole = TestBytes(1, kBlock);
  REQUIRE(PutBlock(tier, 1, whole).ok());

  struct Case {
    std::uint64_t offset, length;
    bool aligned_out;
    std::uint64_t device_bytes;  // the units covering the range
    bool staged;
  };
  const std::vector<Case> cases = {
      {5000, 100, false, 4096, true},                     // inside one unit
      {4090, 20, false, 8192, true},                      // across a unit boundary
      {8192, 4096, true, 4096, false},                    // one aligned unit into aligned memory: direct
      {8192, 4096, false, 4096, true},                    // the same into unaligned memory: staged
      {kBlock - 1, 1, false, 4096, true},                 // the last byte: the tail unit only
      {12288, 5000, true, 8192, false},                   // aligned, room for the rounded-up tail: direct
      {3, 1536 * 1024, false, 1536 * 1024 + 4096, true},  // longer than a staging buffer
  };
  for (const Case& c : cases) {
    INFO("range [" << c.offset << ", +" << c.length << ") into " << (c.aligned_out ? "aligned" : "unaligned")
                   << " memory");
    AlignedBuffer mem(RoundUp(c.length, 4096) + 1);
    REQUIRE(mem.ok());
    std::span<std::byte> out =
        c.aligned_out ? mem.span().first(RoundUp(c.length, 4096)) : mem.span().subspan(1, c.length);
    const std::uint64_t bytes0 = tier.device_read_bytes(), staged0 = tier.staged_ios(), read0 = tier.Stats().bytes_read;
    RangeOp op{TestKey(1), c.offset, c.length, out, {}};
    auto st = tier.GetRangeBatch(std::span<RangeOp>(&op, 1));
    REQUIRE(st[0].ok());
    CHECK(op.desc == DescribeBlock(whole));
    CHECK(SameBytes(out.first(c.length), whole, c.offset));
    CHECK(tier.device_read_bytes() - bytes0 == c.device_bytes);
    CHECK((tier.staged_ios() > staged0) == c.staged);
    CHECK(tier.Stats().bytes_read - read0 == c.length);
  }

  // The prefix cache's shape: K per-layer ranges of one block. They read only the units around
  // them (not K blocks) and go to the device in one Execute; a whole Get reads the whole block.
  constexpr std::uint64_t kLayers = 16, kLayerBytes = kBlock / kLayers;
  std::vector<std::vector<std::byte>> outs(kLayers, std::vector<std::byte>(kLayerBytes));
  std::vector<RangeOp> ops;
  std::uint64_t covering = 0;
  for (std::uint64_t l = 0; l < kLayers; ++l) {
    ops.push_back(RangeOp{TestKey(1), 100 + l * kLayerBytes, 300, outs[l], {}});
    covering += (100 + l * kLayerBytes + 300 - 1) / 4096 - (100 + l * kLayerBytes) / 4096 + 1;
  }
  const std::uint64_t bytes0 = tier.device_read_bytes(), executes0 = engine->read_executes();
  auto st = tier.GetRangeBatch(ops);
  for (std::uint64_t l = 0; l < kLayers; ++l) {
    INFO("layer " << l << ": " << st[l].ToString());
    REQUIRE(st[l].ok());
    CHECK(SameBytes(std::span<const std::byte>(outs[l]).first(300), whole, ops[l].offset));
  }
  CHECK(tier.device_read_bytes() - bytes0 == covering * 4096);
  CHECK(covering * 4096 < kBlock);
  CHECK(engine->read_executes() - executes0 == 1);

  std::vector<std::byte> all(kBlock);
  const std::uint64_t before_get = tier.device_read_bytes();
  REQUIRE(tier.Get(TestKey(1), all, nullptr).ok());
  CHECK(tier.device_read_bytes() - before_get == RoundUp(kBlock, 4096));
}

TEST_CASE("nvme range reads: an Erase racing a range read cannot give its extent to another block", "[nvme]") {
  TempDir dir("nvme-range-race");
  GatedEngine* engine = nullptr;
  auto t = OpenGated(SmallNvmeOptions(dir.path()), &engine);
  REQUIRE(t.ok());
  NvmeTier& tier = **t;
  constexpr std::size_t kSize = 64 * 1024;
  const auto a = TestBytes(1, kSize), fence = TestBytes(2, kSize);
  REQUIRE(PutBlock(tier, 1, a).ok());
  REQUIRE(PutBlock(tier, 2, fence).ok());  // after a's extent: a freed, a's extent is the best fit for its size
  REQUIRE(tier.Flush().ok());

  std::vector<std::byte> out(20000);
  RangeOp op{TestKey(1), 5000, out.size(), out, {}};
  std::vector<Status> st;
  engine->Arm();
  std::thread reader([&] { st = tier.GetRangeBatch(std::span<RangeOp>(&op, 1)); });
  engine->WaitHeld();  // the read has taken its extent and waits to go to the device
  REQUIRE(tier.Erase(TestKey(1)).ok());
  REQUIRE(tier.Flush().ok());  // the erase is durable: the extent is released (to its reader)
  for (std::uint64_t k = 10; k < 14; ++k) REQUIRE(PutBlock(tier, k, TestBytes(k, kSize)).ok());
  REQUIRE(tier.Flush().ok());
  engine->Open();
  reader.join();
  REQUIRE(st.size() == 1);
  INFO(st[0].ToString());
  REQUIRE(st[0].ok());
  CHECK(op.desc == DescribeBlock(a));
  CHECK(SameBytes(out, a, 5000));
  // Every block written meanwhile is intact, and the tier keeps working.
  for (std::uint64_t k = 10; k < 14; ++k) CHECK(CheckTestBlock(tier, k, 42, kSize).ok());
  REQUIRE(PutBlock(tier, 20, TestBytes(20, kSize)).ok());
  CHECK(CheckTestBlock(tier, 20, 42, kSize).ok());
}

TEST_CASE("nvme range reads: threads reading ranges while blocks are erased and rewritten", "[nvme][concurrency]") {
  TempDir dir("nvme-range-threads");
  auto t = NvmeTier::Open(SmallNvmeOptions(dir.path(), 32 * kMiB));
  REQUIRE(t.ok());
  NvmeTier& tier = **t;
  constexpr std::uint64_t kKeys = 8;
  const int kRounds = kSanitizedBuild ? 60 : 300;
  // Block (key k, version v): its size says v, its bytes follow from (k, v): a range of any other
  // block (another key, an older version, a reused extent) does not match what its desc says.
  auto size_of = [](std::uint64_t k, std::uint64_t v) { return 8192 + v * 64 + k; };
  auto content = [&](std::uint64_t k, std::uint64_t v) { return TestBytes(k * 100003 + v, size_of(k, v)); };
  for (std::uint64_t k = 0; k < kKeys; ++k) REQUIRE(PutBlock(tier, k, content(k, 0)).ok());

  std::atomic<bool> done{false};
  std::atomic<int> failures{0};
  std::atomic<std::uint64_t> verified{0};
  std::thread writer([&] {
    for (int r = 1; r <= kRounds; ++r) {
      const std::uint64_t k = static_cast<std::uint64_t>(r) % kKeys, v = static_cast<std::uint64_t>(r);
      Status e = tier.Erase(TestKey(k));
      if (!e.ok() && !e.IsNotFound()) failures.fetch_add(1);
      if (!PutBlock(tier, k, content(k, v)).ok()) failures.fetch_add(1);
      if (r % 16 == 0 && !tier.Flush().ok()) failures.fetch_add(1);  // releases erased extents
    }
    done = true;
  });
  std::vector<std::thread> readers;
  for (int th = 0; th < 2; ++th) {
    readers.emplace_back([&, th] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(th) + 1);
      std::vector<std::vector<std::byte>> outs(6, std::vector<std::byte>(4096));
      while (!done.load()) {
        std::vector<RangeOp> ops;
        for (std::size_t i = 0; i < outs.size(); ++i) {
          const std::uint64_t offset = rng() % 4096, length = 1 + rng() % 4096;  // within every version
          ops.push_back(RangeOp{TestKey(rng() % kKeys), offset, length, outs[i], {}});
        }
        auto st = tier.GetRangeBatch(ops);
        for (std::size_t i = 0; i < ops.size(); ++i) {
          if (st[i].IsNotFound()) continue;  // between an Erase and the Put after it
          if (!st[i].ok()) {
            failures.fetch_add(1);
            continue;
          }
          std::uint64_t key = kKeys;
          for (std::uint64_t c = 0; c < kKeys; ++c) key = ops[i].key == TestKey(c) ? c : key;
          const std::uint64_t size = ops[i].desc.size;
          const std::uint64_t v = (size - 8192 - key) / 64;
          const auto want = content(key, v);
          if (size_of(key, v) != size || DescribeBlock(want) != ops[i].desc ||
              !SameBytes(std::span<const std::byte>(outs[i]).first(ops[i].length), want, ops[i].offset)) {
            failures.fetch_add(1);
          } else {
            verified.fetch_add(1);
          }
        }
      }
    });
  }
  writer.join();
  for (auto& r : readers) r.join();
  CHECK(failures.load() == 0);
  CHECK(verified.load() > 0);
}

TEST_CASE("nvme: a read of an overwritten version that fails its checksum drops that version only, never the new one", "[nvme]") {
  TempDir dir("nvme-corrupt-race");
  GatedEngine* gate = nullptr;
  nvme::FaultInjectingIoEngine* fault = nullptr;
  auto t = NvmeTier::OpenWithEngine(SmallNvmeOptions(dir.path()), [&](const nvme::IoEngineConfig& cfg)
                                        -> Result<std::unique_ptr<nvme::IoEngine>> {
    TERRACE_ASSIGN_OR_RETURN(auto base, nvme::OpenUringEngine(cfg));
    auto f = std::make_unique<nvme::FaultInjectingIoEngine>(std::move(base), 7);
    fault = f.get();
    auto g = std::make_unique<GatedEngine>(std::move(f));
    gate = g.get();
    return std::unique_ptr<nvme::IoEngine>(std::move(g));
  });
  REQUIRE(t.ok());
  NvmeTier& tier = **t;
  constexpr std::size_t kSize = 16 * 1024;
  const auto a = TestBytes(1, kSize), b = TestBytes(2, kSize);
  REQUIRE(PutBlock(tier, 1, a).ok());
  REQUIRE(tier.Flush().ok());
  std::vector<std::byte> out(kSize);
  Status got;
  gate->Arm();
  std::thread reader([&] { got = tier.Get(TestKey(1), out, nullptr); });
  gate->WaitHeld();  // the read of version a has taken its extent
  fault->Arm(nvme::IoOp::kRead, nvme::FaultKind::kBitFlip, 2);  // it and its re-read come back flipped
  REQUIRE(PutBlock(tier, 1, b).ok());  // overwritten meanwhile
  REQUIRE(tier.Flush().ok());
  gate->Open();
  reader.join();
  fault->Disarm();
  INFO(got.ToString());
  CHECK(got.IsCorruption());
  std::vector<std::byte> again(kSize);
  const Status s = tier.Get(TestKey(1), again, nullptr);
  INFO(s.ToString());
  REQUIRE(s.ok());
  CHECK(again == b);
  REQUIRE(tier.Flush().ok());
}
