#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <bit>
#include <thread>
#include <vector>

#include "forwarding_tier.h"
#include "test_util.h"
#include "tiers/fault/fault_tier.h"
#include "tiers/hbm/emulated_hbm_tier.h"
#include "tiers/host/host_tier.h"

using namespace terrace;
using terrace::testing::TestBytes;
using terrace::testing::TestKey;

namespace {

// An 8 MiB unpinned host tier (2 MiB chunks).
std::unique_ptr<Tier> Host() {
  HostTierOptions o;
  o.capacity_bytes = 8 * kMiB;
  o.chunk_bytes = 2 * kMiB;
  o.pin = false;
  auto h = HostTier::Create(o);
  REQUIRE(h.ok());
  return std::move(h).value();
}

std::unique_ptr<FaultInjectingTier> Wrapped() { return std::make_unique<FaultInjectingTier>(Host()); }

int BitsDiffering(const std::vector<std::byte>& a, const std::vector<std::byte>& b) {
  int n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += std::popcount(static_cast<unsigned>(a[i] ^ b[i]));
  return n;
}

// A host tier that counts the GetRangeBatch calls reaching it (and forwards them to the host's own
// ranged path); every other read goes through Get.
class RangeCountingTier final : public terrace::testing::ForwardingTier {
 public:
  using ForwardingTier::ForwardingTier;
  std::vector<Status> GetRangeBatch(std::span<RangeOp> ops) override {
    ++calls;
    ops_seen += ops.size();
    return inner_->GetRangeBatch(ops);
  }
  int calls = 0;
  std::size_t ops_seen = 0;
};


}  // namespace

TEST_CASE("Armed put/get/erase failures fire exactly N times with the given Status") {
  auto t = Wrapped();
  auto data = TestBytes(1, 10000);
  t->FailNextPuts(2, FaultInjectingTier::Eio(true));
  for (int i = 0; i < 2; ++i) {
    Status st = t->Put(TestKey(1), DescribeBlock(data), data);
    CHECK(st.IsIoError());
    CHECK(st.retryable());
    CHECK(st.message().find(TestKey(1).ToString()) != std::string::npos);
  }
  CHECK(t->block_count() == 0);  // a failed put leaves nothing behind
  REQUIRE(t->Put(TestKey(1), DescribeBlock(data), data).ok());

  t->FailNextPuts(1, FaultInjectingTier::Enospc());
  CHECK(t->Put(TestKey(2), DescribeBlock(data), data).IsOutOfCapacity());

  std::vector<std::byte> out(data.size());
  BlockDesc d;
  t->FailNextGets(1, FaultInjectingTier::Eio(false));
  Status st = t->Get(TestKey(1), out, &d);
  CHECK(st.IsIoError());
  CHECK_FALSE(st.retryable());
  CHECK(t->Get(TestKey(1), out, &d).ok());
  CHECK(out == data);

  t->FailNextErases(1, FaultInjectingTier::Eio(true));
  CHECK(t->Erase(TestKey(1)).IsIoError());
  CHECK(t->Lookup(TestKey(1)).ok());
  CHECK(t->Erase(TestKey(1)).ok());

  auto n = t->injected();
  CHECK(n.put_errors == 3);
  CHECK(n.get_errors == 1);
  CHECK(n.erase_errors == 1);
}

TEST_CASE("A flipped Get returns OK with the recorded desc, and the checksum exposes it") {
  auto t = Wrapped();
  auto data = TestBytes(2, 70001);
  REQUIRE(t->Put(TestKey(2), DescribeBlock(data), data).ok());
  t->FlipBitInNextGets(1);
  std::vector<std::byte> out(data.size());
  BlockDesc d;
  REQUIRE(t->Get(TestKey(2), out, &d).ok());
  CHECK(d == DescribeBlock(data));         // the recorded desc, not one made to match the bytes
  CHECK(BitsDiffering(out, data) == 1);
  CHECK(Checksum(out) != d.checksum);      // what the Store checks
  // ...and it does check: the wrapper never claims its Gets are verified, whatever the inner tier says.
  CHECK(t->inner().caps().verifies_gets);
  CHECK_FALSE(t->caps().verifies_gets);
  CHECK(t->caps().capacity_bytes == t->inner().caps().capacity_bytes);
  REQUIRE(t->Get(TestKey(2), out, &d).ok());  // disarmed after one
  CHECK(out == data);
  CHECK(t->injected().bit_flips == 1);
}

TEST_CASE("A corrupted put is caught by the wrapped tier's Get and the block is dropped") {
  auto t = Wrapped();
  auto data = TestBytes(3, 4097);
  t->CorruptNextPuts(1);
  REQUIRE(t->Put(TestKey(3), DescribeBlock(data), data).ok());
  std::vector<std::byte> out(data.size());
  BlockDesc d;
  CHECK(t->Get(TestKey(3), out, &d).IsCorruption());
  CHECK(t->Lookup(TestKey(3)).status().IsNotFound());
  CHECK(t->Stats().corruptions == 1);
  CHECK(t->injected().corrupted_puts == 1);
}

TEST_CASE("Random faults are reproducible for a seed and near the asked rate") {
  auto run = [](std::uint64_t seed) {
    auto t = Wrapped();
    auto data = TestBytes(4, 512);
    RandomFaults f;
    f.put_error = 0.25;
    f.seed = seed;
    t->SetRandom(f);
    std::vector<bool> pattern;
    for (int i = 0; i < 400; ++i) pattern.push_back(t->Put(TestKey(i), DescribeBlock(data), data).ok());
    t->Disarm();
    CHECK(t->Put(TestKey(1000), DescribeBlock(data), data).ok());
    return pattern;
  };
  auto a = run(9), b = run(9), c = run(10);
  CHECK(a == b);
  CHECK(a != c);
  auto failures = std::count(a.begin(), a.end(), false);
  CHECK(failures > 60);   // expected 100; binomial sd ~8.7
  CHECK(failures < 140);
}

TEST_CASE("Faults under concurrency: every mismatch is an injected flip, nothing else") {
  auto t = Wrapped();
  const int kKeys = 32;
  std::vector<std::vector<std::byte>> blocks;
  for (int i = 0; i < kKeys; ++i) {
    blocks.push_back(TestBytes(i, 3000 + i * 100));
    REQUIRE(t->Put(TestKey(i), DescribeBlock(blocks[i]), blocks[i]).ok());
  }
  RandomFaults f;
  f.get_error = 0.1;
  f.get_bit_flip = 0.1;
  f.seed = 5;
  t->SetRandom(f);
  std::atomic<std::uint64_t> mismatches{0}, errors{0};
  std::vector<std::thread> threads;
  for (int th = 0; th < 4; ++th) {
    threads.emplace_back([&, th] {
      std::vector<std::byte> out(8192);
      for (int i = 0; i < 300; ++i) {
        int k = (i * 7 + th) % kKeys;
        BlockDesc d;
        Status st = t->Get(TestKey(k), out, &d);
        if (!st.ok()) {
          errors.fetch_add(1);
          continue;
        }
        if (Checksum(std::span(out.data(), d.size)) != d.checksum) mismatches.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  auto n = t->injected();
  CHECK(n.bit_flips == mismatches.load());
  CHECK(n.get_errors == errors.load());
  CHECK(n.bit_flips > 0);
  CHECK(n.get_errors > 0);
}

TEST_CASE("Device buffers pass through the wrapper to a tier that takes them, with armed failures") {
  HbmTierOptions o;
  o.mode = HbmMode::kEmulated;
  o.capacity_bytes = 8 * kMiB;
  auto inner = EmulatedHbmTier::Create(o);
  REQUIRE(inner.ok());
  FaultInjectingTier t(std::move(inner).value());
  REQUIRE(t.caps().device_buffers);
  auto data = TestBytes(5, 3 * 4096 + 7);
  t.FailNextPuts(1, FaultInjectingTier::Eio(true));
  CHECK(t.PutDevice(TestKey(5), Codec::kRaw, data).status().IsIoError());
  CHECK(t.Lookup(TestKey(5)).status().IsNotFound());
  auto put = t.PutDevice(TestKey(5), Codec::kRaw, data);
  REQUIRE(put.ok());
  std::vector<std::byte> out(data.size());
  BlockDesc d;
  t.FailNextGets(1, FaultInjectingTier::Eio(false));
  CHECK(t.GetDevice(TestKey(5), out, &d).IsIoError());
  REQUIRE(t.GetDevice(TestKey(5), out, &d).ok());
  CHECK(d == *put);
  CHECK(out == data);
  CHECK(t.injected().put_errors == 1);
  CHECK(t.injected().get_errors == 1);
}

TEST_CASE("Range reads take armed get failures and bit flips (inside the range), the rest in one inner call") {
  RangeCountingTier counting(Host());
  FaultInjectingTier t(counting);
  const auto a = TestBytes(6, 10000), b = TestBytes(7, 5000);
  REQUIRE(t.Put(TestKey(6), DescribeBlock(a), a).ok());
  REQUIRE(t.Put(TestKey(7), DescribeBlock(b), b).ok());
  constexpr std::byte kFill{0x5A};
  std::vector<std::vector<std::byte>> outs(4, std::vector<std::byte>(3000, kFill));
  std::vector<RangeOp> ops = {{TestKey(6), 100, 2000, outs[0], {}},
                              {TestKey(7), 10, 300, outs[1], {}},
                              {TestKey(6), 5000, 10, outs[2], {}},
                              {TestKey(8), 0, 10, outs[3], {}}};
  t.FailNextGets(1, FaultInjectingTier::Eio(false));
  t.FlipBitInNextGets(1);
  auto st = t.GetRangeBatch(ops);
  REQUIRE(st.size() == 4);
  CHECK(st[0].IsIoError());  // the armed failure: the first op, not read
  CHECK_THAT(st[0].message(), Catch::Contains(TestKey(6).ToString()));
  CHECK(outs[0] == std::vector<std::byte>(3000, kFill));
  REQUIRE(st[1].ok());  // the flip: the first op the inner tier returned
  CHECK(ops[1].desc == DescribeBlock(b));
  const std::vector<std::byte> want1(b.begin() + 10, b.begin() + 310);
  CHECK(BitsDiffering(std::vector<std::byte>(outs[1].begin(), outs[1].begin() + 300), want1) == 1);
  CHECK(std::all_of(outs[1].begin() + 300, outs[1].end(), [&](std::byte x) { return x == kFill; }));
  REQUIRE(st[2].ok());
  CHECK(std::equal(a.begin() + 5000, a.begin() + 5010, outs[2].begin()));
  CHECK(st[3].IsNotFound());
  CHECK(counting.calls == 1);  // the ops not failed here, together, through the inner ranged path
  CHECK(counting.ops_seen == 3);
  CHECK(t.injected().get_errors == 1);
  CHECK(t.injected().bit_flips == 1);

  t.Disarm();
  st = t.GetRangeBatch(ops);  // nothing armed: the whole batch forwarded as is
  CHECK(counting.calls == 2);
  CHECK(counting.ops_seen == 7);
  REQUIRE(st[0].ok());
  CHECK(std::equal(a.begin() + 100, a.begin() + 2100, outs[0].begin()));
  REQUIRE(st[1].ok());
  CHECK(std::equal(want1.begin(), want1.end(), outs[1].begin()));
}
