// Demand prefetch against speculation, and per-key completion: a Priority::kDemand Prefetch holds
// back the store's speculative items as a demand Get does (so under a slow single-queue tier it is
// served before the speculative batch's remaining keys), and PrefetchOptions::on_item reports each
// key as soon as it is done, before the rest of its batch.
#include <catch2/catch.hpp>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "forwarding_tier.h"
#include "store_test_util.h"

namespace terrace::testing {
namespace {

constexpr std::size_t kDemandBlock = 4096;

// One device queue: a Get queues one read, a GetBatch queues all of its reads at once (as an NVMe
// submission does); reads are served one at a time in queue order, each taking `delay`. Records
// the keys in the order served. Thread-safe.
class QueuedSlowTier final : public ForwardingTier {
 public:
  QueuedSlowTier(std::shared_ptr<Tier> inner, std::chrono::milliseconds delay)
      : ForwardingTier(std::move(inner)), delay_(delay) {}

  Status Get(const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) override {
    return Serve(Take(1), key, out, desc);
  }
  std::vector<Status> GetBatch(std::span<GetOp> ops) override {
    const std::uint64_t first = Take(ops.size());
    std::vector<Status> st;
    for (std::size_t k = 0; k < ops.size(); ++k) st.push_back(Serve(first + k, ops[k].key, ops[k].out, &ops[k].desc));
    return st;
  }
  std::vector<BlockKey> served() const {
    std::lock_guard lock(mu_);
    return served_;
  }
  void set_delay(std::chrono::milliseconds d) {
    std::lock_guard lock(mu_);
    delay_ = d;
  }

 private:
  std::uint64_t Take(std::size_t n) {
    std::lock_guard lock(mu_);
    const std::uint64_t t = next_;
    next_ += n;
    return t;
  }
  Status Serve(std::uint64_t ticket, const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return serving_ == ticket; });
    const auto d = delay_;
    lock.unlock();
    std::this_thread::sleep_for(d);
    Status s = inner_->Get(key, out, desc);
    lock.lock();
    served_.push_back(key);
    ++serving_;
    lock.unlock();
    cv_.notify_all();
    return s;
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::chrono::milliseconds delay_;
  std::uint64_t next_ = 0, serving_ = 0;  // GUARDED_BY(mu_)
  std::vector<BlockKey> served_;          // GUARDED_BY(mu_)
};

struct Rig {
  QueuedSlowTier* slow = nullptr;  // owned by the store
  std::unique_ptr<Store> store;
};

// hbm (the prefetch target) over a slow home tier of kind `home` (kHost: a memory tier, whose items
// move one read at a time; kNvme: not addressable, read in batches).
Rig MakeRig(TierId home, unsigned background_threads) {
  FakeTiers f(4 << 20, home == TierId::kHost ? 4 << 20 : 0, home == TierId::kNvme ? 4 << 20 : 0);
  Rig rig;
  auto slow = std::make_unique<QueuedSlowTier>(std::shared_ptr<Tier>(std::move(f.tiers[static_cast<int>(home)])),
                                               std::chrono::milliseconds(0));
  rig.slow = slow.get();
  f.tiers[static_cast<int>(home)] = std::move(slow);
  StoreOptions o = Quiet();
  o.background_threads = background_threads;
  o.put_tier = home;
  rig.store = OpenFakeStore(f, o);
  return rig;
}

std::vector<BlockKey> PutKeys(Store& store, TierId home, int first, int n) {
  std::vector<BlockKey> keys;
  for (int i = first; i < first + n; ++i) {
    keys.push_back(TestKey(i));
    REQUIRE(store.Put(keys.back(), TestBytes(i, kDemandBlock), {Codec::kRaw, home}).ok());
  }
  return keys;
}

std::size_t CountServed(const std::vector<BlockKey>& served, const std::vector<BlockKey>& of) {
  std::size_t n = 0;
  for (const BlockKey& k : served) n += std::find(of.begin(), of.end(), k) != of.end() ? 1 : 0;
  return n;
}

TEST_CASE("A demand prefetch during a large speculative prefetch is served before the speculative batch's remaining keys") {
  constexpr int kSpec = 40, kDemand = 16;
  for (TierId home : {TierId::kHost, TierId::kNvme}) {
    INFO("home tier " << TierName(home));
    Rig rig = MakeRig(home, /*background_threads=*/3);  // two prefetch lane threads
    const auto spec_keys = PutKeys(*rig.store, home, 0, kSpec);
    const auto demand_keys = PutKeys(*rig.store, home, 1000, kDemand);
    rig.slow->set_delay(std::chrono::milliseconds(terrace::testing::kSanitizedBuild ? 6 : 4));

    auto spec = rig.store->Prefetch(spec_keys, TierId::kHbm, Priority::kLow);
    while (rig.slow->served().empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    auto demand = rig.store->Prefetch(demand_keys, TierId::kHbm, Priority::kDemand);
    for (const Status& s : demand.get()) CHECK(s.ok());
    const std::size_t spec_before = CountServed(rig.slow->served(), spec_keys);
    // The speculative items already started when the demand arrived may finish (at most one
    // group); no later one starts before the demand is done.
    INFO("speculative keys read before the demand prefetch completed: " << spec_before << " of " << kSpec);
    CHECK(spec_before <= Store::kSpeculativeGroup);
    CHECK(spec_before < static_cast<std::size_t>(kSpec));
    CHECK(CountServed(rig.slow->served(), demand_keys) == static_cast<std::size_t>(kDemand));
    // The speculation then goes on, complete.
    for (const Status& s : spec.get()) CHECK(s.ok());
    for (const BlockKey& k : spec_keys) CHECK(TierOf(*rig.store, k) == TierId::kHbm);
  }
}

TEST_CASE("A demand prefetch queued while every lane thread waits for demand still runs") {
  // One lane thread; a demand Get holds the gate while a speculative group waits on it; a demand
  // prefetch queued then must not wait for that group (which waits for demand: a deadlock).
  FakeTiers f(1 << 20, 1 << 20, 1 << 20);  // host: put_tier, so a Get from nvme is a demand fetch
  const BlockKey held = TestKey(1), spec_key = TestKey(2), demand_key = TestKey(3);
  GetGate gate(f.at(TierId::kNvme), held);
  StoreOptions o = Quiet();
  o.background_threads = 2;  // one lane thread
  auto store = OpenFakeStore(f, o);
  for (int i : {1, 2, 3}) REQUIRE(store->Put(TestKey(i), TestBytes(i, kDemandBlock), {Codec::kRaw, TierId::kNvme}).ok());
  std::thread get([&] { CHECK(GetBytes(*store, held).ok()); });
  gate.WaitHeld();
  auto spec = store->Prefetch({&spec_key, 1}, TierId::kHbm, Priority::kLow);
  CHECK_FALSE(spec.wait_for(std::chrono::milliseconds(30)));  // waiting for the Get
  auto demand = store->Prefetch({&demand_key, 1}, TierId::kHbm, Priority::kDemand);
  CHECK(demand.wait_for(std::chrono::seconds(5)));
  CHECK(demand.get()[0].ok());
  CHECK(gate.Started(spec_key) == 0);  // speculation still waits (for the Get)
  gate.Open();
  get.join();
  CHECK(spec.get()[0].ok());
}

TEST_CASE("Prefetch on_item reports each key as soon as it is done, before the rest of its batch") {
  constexpr int kKeys = 4;
  for (TierId home : {TierId::kHost, TierId::kNvme}) {
    INFO("home tier " << TierName(home));
    Rig rig = MakeRig(home, 2);
    const auto keys = PutKeys(*rig.store, home, 0, kKeys);
    rig.slow->set_delay(std::chrono::milliseconds(2));
    std::mutex mu;
    std::vector<std::size_t> order;
    std::vector<Status> seen(kKeys);
    std::vector<bool> last_in_hbm_then(kKeys, true);
    PrefetchOptions po;
    po.priority = Priority::kDemand;
    po.on_item = [&](std::size_t i, const Status& s) {
      const BlockKey last = keys.back();
      const auto where = rig.store->Lookup({&last, 1});  // a Store call from the callback
      std::lock_guard lock(mu);
      order.push_back(i);
      seen[i] = s;
      last_in_hbm_then[i] = where[0].found && where[0].tier == TierId::kHbm;
    };
    auto fut = rig.store->Prefetch(keys, TierId::kHbm, po);
    const std::vector<Status> st = fut.get();
    std::lock_guard lock(mu);
    REQUIRE(order.size() == static_cast<std::size_t>(kKeys));
    std::vector<std::size_t> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    for (std::size_t i = 0; i < sorted.size(); ++i) CHECK(sorted[i] == i);  // each once
    for (std::size_t i = 0; i < st.size(); ++i) {
      CHECK(st[i].ok());
      CHECK(seen[i].code() == st[i].code());
    }
    // The first key was reported while the last one was not in the target yet.
    CHECK(order.front() != static_cast<std::size_t>(kKeys - 1));
    CHECK_FALSE(last_in_hbm_then[order.front()]);
  }
}

TEST_CASE("Prefetch on_item is called for keys that fail at once") {
  FakeTiers f(0, 1 << 20, 0);
  auto store = OpenFakeStore(f);
  const BlockKey k = TestKey(7);
  int calls = 0;
  PrefetchOptions po;
  po.on_item = [&](std::size_t i, const Status& s) {
    CHECK(i == 0);
    CHECK(s.code() == Code::kInvalidArgument);
    ++calls;
  };
  auto st = store->Prefetch({&k, 1}, TierId::kHbm, po).get();  // no hbm tier
  CHECK(st[0].code() == Code::kInvalidArgument);
  CHECK(calls == 1);
}

}  // namespace
}  // namespace terrace::testing
