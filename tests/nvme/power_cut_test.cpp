// Simulated power loss (tiers/nvme/power_cut.h): the simulator itself, then the NVMe tier under
// hundreds of seeded random cut points. After each cut the store is reopened without the
// simulator: every block acknowledged in sync mode must read back exactly, and no Get may return
// bytes that were never written for its key.
//
// TERRACE_POWER_CUT_ROUNDS scales the number of cut points (default 200, about 50 s here;
// the sanitizer builds may lower it).
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <rocksdb/db.h>
#include <rocksdb/options.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "nvme_test_util.h"
#include "terrace/log.h"
#include "tiers/nvme/power_cut.h"

using namespace terrace;
using namespace terrace::testing;

namespace {

constexpr std::uint64_t kCapacity = 32 * kMiB;

struct AlignedFile {
  explicit AlignedFile(const std::filesystem::path& p, std::size_t bytes) {
    fd = ::open(p.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    REQUIRE(fd >= 0);
    REQUIRE(::ftruncate(fd, static_cast<off_t>(bytes)) == 0);
  }
  ~AlignedFile() { ::close(fd); }
  std::vector<std::byte> Read(std::uint64_t off, std::size_t n) const {
    std::vector<std::byte> out(n);
    REQUIRE(::pread(fd, out.data(), n, static_cast<off_t>(off)) == static_cast<ssize_t>(n));
    return out;
  }
  int fd = -1;
};

// Writes `data` at `off` through `engine`; returns the request's error (0 when complete).
int EngineWrite(nvme::IoEngine& engine, std::uint64_t off, std::vector<std::byte>& data) {
  nvme::IoRequest r;
  r.op = nvme::IoOp::kWrite;
  r.offset = off;
  r.src = data.data();
  r.len = static_cast<std::uint32_t>(data.size());
  int err = 1;
  nvme::RunToCompletion(engine, std::span(&r, 1), [&](std::size_t, int e) { err = e; });
  return err;
}

std::vector<std::byte> Fill(std::size_t n, std::uint8_t v) { return std::vector<std::byte>(n, std::byte{v}); }

}  // namespace

TEST_CASE("PowerCut engine: a write is durable only after a later sync; Cut undoes the rest", "[nvme][power_cut]") {
  TempDir dir("powercut-engine");
  AlignedFile file(dir.path() / "data", 64 * 1024);
  for (auto mode : {nvme::LostWrite::kRevert, nvme::LostWrite::kKeep, nvme::LostWrite::kTorn, nvme::LostWrite::kGarbage}) {
    auto zero = Fill(64 * 1024, 0);
    REQUIRE(::pwrite(file.fd, zero.data(), zero.size(), 0) == static_cast<ssize_t>(zero.size()));
    nvme::PowerCut cut(7, mode);
    auto engine = cut.WrapEngine(nvme::OpenUringEngine)(nvme::IoEngineConfig{file.fd, 4, 1});
    REQUIRE(engine.ok());
    auto a = Fill(8192, 0xAA), b = Fill(8192, 0xBB), c = Fill(4096, 0xCC);
    REQUIRE(EngineWrite(**engine, 0, a) == 0);
    REQUIRE((*engine)->SyncData() == 0);              // a is durable
    REQUIRE(EngineWrite(**engine, 0, b) == 0);        // overwrites a, never synced
    REQUIRE(EngineWrite(**engine, 16384, c) == 0);    // never synced
    REQUIRE(file.Read(0, 8192) == b);                 // the wrapper really wrote it
    engine->reset();
    auto rep = cut.Cut();
    REQUIRE(rep.ok());
    INFO(rep->ToString());
    CHECK(rep->data_writes_lost == 2);
    if (mode == nvme::LostWrite::kRevert) {
      CHECK(file.Read(0, 8192) == a);
      CHECK(file.Read(16384, 4096) == Fill(4096, 0));
    } else if (mode == nvme::LostWrite::kKeep) {
      CHECK(file.Read(0, 8192) == b);
      CHECK(file.Read(16384, 4096) == c);
    } else if (mode == nvme::LostWrite::kTorn) {
      CHECK(rep->data_units_torn == 3);
      auto got = file.Read(0, 8192);
      int old_sectors = 0;
      for (std::size_t sec = 0; sec < 8192; sec += 512) {  // each sector wholly old (a) or new (b)
        auto first = got.begin() + static_cast<std::ptrdiff_t>(sec);
        bool is_a = std::all_of(first, first + 512, [](std::byte v) { return v == std::byte{0xAA}; });
        bool is_b = std::all_of(first, first + 512, [](std::byte v) { return v == std::byte{0xBB}; });
        CHECK((is_a || is_b));
        old_sectors += is_a;
      }
      CHECK(old_sectors > 0);   // 16 fair coins: all-new or all-old is a 1-in-32768 event (seeded: it is not)
      CHECK(old_sectors < 16);
    } else {
      CHECK(rep->data_units_garbage == 3);
      CHECK(file.Read(0, 8192) != a);
      CHECK(file.Read(0, 8192) != b);
    }
    CHECK(file.Read(8192, 8192) == Fill(8192, 0));  // never written: untouched
  }
}

TEST_CASE("PowerCut engine: after the cut point every write and sync fails and changes nothing", "[nvme][power_cut]") {
  TempDir dir("powercut-off");
  AlignedFile file(dir.path() / "data", 64 * 1024);
  nvme::PowerCut cut(1, nvme::LostWrite::kRevert);
  auto engine = cut.WrapEngine(nvme::OpenUringEngine)(nvme::IoEngineConfig{file.fd, 4, 1});
  REQUIRE(engine.ok());
  cut.CutAfter(2);  // events: write, sync; the third fails
  auto a = Fill(4096, 1), b = Fill(4096, 2);
  REQUIRE(EngineWrite(**engine, 4096, a) == 0);
  REQUIRE((*engine)->SyncData() == 0);
  CHECK(EngineWrite(**engine, 4096, b) == -EIO);
  CHECK((*engine)->SyncData() == -EIO);
  CHECK(cut.powered_off());
  CHECK(cut.events() == 2);
  CHECK(file.Read(4096, 4096) == a);
  engine->reset();
  REQUIRE(cut.Cut().ok());
  CHECK(file.Read(4096, 4096) == a);
}

TEST_CASE("PowerCut env: RocksDB keeps what a synced WAL write covered and loses the rest", "[nvme][power_cut]") {
  TempDir dir("powercut-env");
  const std::string db_path = (dir.path() / "db").string();
  nvme::PowerCut cut(3);
  {
    rocksdb::Options o;
    o.create_if_missing = true;
    o.env = cut.index_env();
    rocksdb::DB* raw = nullptr;
    REQUIRE(rocksdb::DB::Open(o, db_path, &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    rocksdb::WriteOptions sync_w, async_w;
    sync_w.sync = true;
    REQUIRE(db->Put(sync_w, "a", "1").ok());
    REQUIRE(db->Put(async_w, "b", "2").ok());  // in the WAL file, not synced
    REQUIRE(db->Put(sync_w, "c", "3").ok());   // syncs b too (same WAL)
    REQUIRE(db->Put(async_w, "d", "4").ok());  // lost at the cut
    cut.PowerOff();
    CHECK(!db->Put(sync_w, "e", "5").ok());    // the device is gone
    db.reset();
  }
  auto rep = cut.Cut();
  INFO(rep.status().ToString());
  REQUIRE(rep.ok());
  INFO(rep->ToString());
  CHECK(rep->index_files_truncated + rep->index_files_dropped >= 1);
  rocksdb::Options o;
  rocksdb::DB* raw = nullptr;
  rocksdb::Status st = rocksdb::DB::Open(o, db_path, &raw);
  REQUIRE(st.ok());
  std::unique_ptr<rocksdb::DB> db(raw);
  std::string v;
  CHECK(db->Get(rocksdb::ReadOptions(), "a", &v).ok());
  CHECK(db->Get(rocksdb::ReadOptions(), "b", &v).ok());
  CHECK(db->Get(rocksdb::ReadOptions(), "c", &v).ok());
  CHECK(db->Get(rocksdb::ReadOptions(), "d", &v).IsNotFound());
  CHECK(db->Get(rocksdb::ReadOptions(), "e", &v).IsNotFound());
}

TEST_CASE("PowerCut env: a cut while RocksDB reopens its log never loses what was synced before", "[nvme][power_cut]") {
  // RocksDB reopens the live WAL of an unflushed database for writing; the bytes it already held
  // were durable before this PowerCut existed and must survive a cut at any point of the reopen.
  for (std::uint64_t cut_at = 0; cut_at < 24; ++cut_at) {
    INFO("cut at event " << cut_at);
    TempDir dir("powercut-reopen");
    const std::string db_path = (dir.path() / "db").string();
    auto open = [&](rocksdb::Env* env, std::unique_ptr<rocksdb::DB>* db) {
      rocksdb::Options o;
      o.create_if_missing = true;
      o.avoid_flush_during_recovery = true;  // keep the log live across the reopen
      o.wal_recovery_mode = rocksdb::WALRecoveryMode::kTolerateCorruptedTailRecords;
      if (env) o.env = env;
      rocksdb::DB* raw = nullptr;
      rocksdb::Status st = rocksdb::DB::Open(o, db_path, &raw);
      db->reset(raw);
      return st;
    };
    rocksdb::WriteOptions sync_w;
    sync_w.sync = true;
    {
      nvme::PowerCut first(1);
      std::unique_ptr<rocksdb::DB> db;
      REQUIRE(open(first.index_env(), &db).ok());
      REQUIRE(db->Put(sync_w, "a", "1").ok());
      first.PowerOff();  // no flush at close: "a" lives only in the log
      db.reset();
      REQUIRE(first.Cut().ok());
    }
    {
      nvme::PowerCut second(2);
      second.CutAfter(cut_at);
      std::unique_ptr<rocksdb::DB> db;
      if (open(second.index_env(), &db).ok()) {
        (void)db->Put(sync_w, "b", "2");
        second.PowerOff();
        db.reset();
      }
      auto rep = second.Cut();
      REQUIRE(rep.ok());
    }
    std::unique_ptr<rocksdb::DB> db;
    rocksdb::Status st = open(nullptr, &db);
    INFO(st.ToString());
    REQUIRE(st.ok());
    std::string v;
    CHECK(db->Get(rocksdb::ReadOptions(), "a", &v).ok());
  }
}

namespace {

constexpr int kThreads = 2;
constexpr int kKeysPerThread = 6;
constexpr int kOpsPerThread = 8;

std::size_t CutBlockSize(std::uint64_t id) {
  static constexpr std::size_t kSizes[] = {1, 4096, 5000, 12288 + 17, 65536, 200000};
  return kSizes[id % (sizeof kSizes / sizeof kSizes[0])];
}

// Key k's versions: every put writes a fresh id; the model keeps which ids are acceptable now.
struct KeyModel {
  std::optional<std::uint64_t> acked;  // the last acknowledged (or verified-present) id
  std::vector<std::uint64_t> since;    // ids attempted after it, not acknowledged
  std::vector<std::uint64_t> all;      // every id ever written
};

std::vector<std::byte> VersionBytes(std::uint64_t id) { return TestBytes(id, CutBlockSize(id), 99); }

NvmeTierOptions CutOptions(const std::filesystem::path& dir) {
  auto o = SmallNvmeOptions(dir, kCapacity, Durability::kSync);
  o.io_threads = 2;
  o.logger = StderrLogger(LogLevel::kError);  // hundreds of opens and cuts: only errors are news
  return o;
}

Result<std::unique_ptr<NvmeTier>> OpenUnderCut(NvmeTierOptions o, nvme::PowerCut& cut) {
  o.logger = NullLogger();  // its errors after the cut are the point of the exercise
  NvmeOpenHooks hooks;
  hooks.engine = cut.WrapEngine(nvme::OpenUringEngine);
  hooks.index_env = cut.index_env();
  return NvmeTier::OpenWithHooks(o, hooks);
}

// One round's workload: kThreads writers overwrite their own keys until kOpsPerThread puts each
// or the first failure (the power went off).
void Workload(NvmeTier& tier, std::map<int, KeyModel>& model, std::uint64_t* next_id, std::mt19937_64& rng) {
  std::mutex mu;
  std::vector<std::vector<std::pair<int, std::uint64_t>>> plan(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    for (int n = 0; n < kOpsPerThread; ++n) {
      int key = t * kKeysPerThread + static_cast<int>(rng() % kKeysPerThread);
      plan[t].emplace_back(key, (*next_id)++);
    }
  }
  auto worker = [&](int t) {
    for (auto [key, id] : plan[t]) {
      auto data = VersionBytes(id);
      {
        std::lock_guard<std::mutex> l(mu);
        model[key].since.push_back(id);
        model[key].all.push_back(id);
      }
      Status s = tier.Put(TestKey(static_cast<std::uint64_t>(key)), DescribeBlock(data), data);
      if (!s.ok()) return;
      std::lock_guard<std::mutex> l(mu);
      KeyModel& m = model[key];
      m.acked = id;
      m.since.clear();
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
}

struct Tally {
  std::uint64_t rounds = 0, acked_checked = 0, refused_then_rebuilt = 0, open_failed_under_cut = 0;
};

// Reopens without the simulator and checks every key; updates the model to what is now stored.
// A read-only reopen leaves RocksDB's log unflushed, so the next round's open under the simulator
// replays and reopens it (a path a read-write reopen, which flushes, never takes).
void Verify(const std::filesystem::path& dir, std::map<int, KeyModel>& model, Tally& tally, const std::string& where,
            bool read_only = false) {
  INFO(where << (read_only ? " (read-only check)" : ""));
  NvmeTierOptions vo = CutOptions(dir);
  vo.read_only = read_only;
  auto t = NvmeTier::Open(vo);
  if (!t.ok()) {
    INFO("open after the cut: " << t.status().ToString());
    // Allowed only as a clear refusal that points at recovery, which then brings everything back.
    REQUIRE(t.status().ToString().find("store recover") != std::string::npos);
    NvmeTierOptions ro = CutOptions(dir);
    auto rebuilt = NvmeTier::RebuildIndex(ro);
    INFO("rebuild: " << (rebuilt.ok() ? rebuilt->ToString() : rebuilt.status().ToString()));
    REQUIRE(rebuilt.ok());
    ++tally.refused_then_rebuilt;
    t = NvmeTier::Open(vo);
    REQUIRE(t.ok());
  }
  NvmeTier& tier = **t;
  std::vector<std::byte> buf(256 * 1024);
  for (auto& [key, m] : model) {
    BlockDesc d;
    Status s = tier.Get(TestKey(static_cast<std::uint64_t>(key)), buf, &d);
    INFO("key " << key << ": " << s.ToString());
    if (!s.ok()) {
      REQUIRE(!m.acked.has_value());  // an acknowledged block must be there, intact
      REQUIRE(s.IsNotFound());        // a never-acknowledged one may be absent, never "corrupt"
      m.since.clear();
      continue;
    }
    std::optional<std::uint64_t> matched;
    auto try_id = [&](std::uint64_t id) {
      auto want = VersionBytes(id);
      if (!matched && d.size == want.size() && std::equal(want.begin(), want.end(), buf.begin())) matched = id;
    };
    if (m.acked) try_id(*m.acked);
    for (std::uint64_t id : m.since) try_id(id);
    if (!matched) {
      // Distinguish "an older acknowledged version came back" (lost ack) from garbage.
      bool older = false;
      for (std::uint64_t id : m.all) {
        auto want = VersionBytes(id);
        older |= d.size == want.size() && std::equal(want.begin(), want.end(), buf.begin());
      }
      FAIL((older ? "an acknowledged overwrite was lost: an older version came back"
                  : "Get returned bytes that were never written for this key"));
    }
    if (m.acked) ++tally.acked_checked;
    m.acked = matched;
    m.since.clear();
  }
  std::uint64_t extra = 0;
  tier.ForEach([&](const BlockKey& k, const BlockDesc&) {
    bool known = false;
    for (const auto& [key, m] : model) known |= TestKey(static_cast<std::uint64_t>(key)) == k;
    if (!known) ++extra;
  });
  CHECK(extra == 0);
  CHECK(tier.Stats().corruptions == 0);
  if (read_only) return;
  // The data file says what the index says: its descriptors name exactly the indexed blocks (no
  // put that never committed, no erased or overwritten version), so a rebuild loses and
  // resurrects nothing. A read-write open finished any commit the cut left between its index
  // write and its descriptors.
  std::map<BlockKey, std::uint64_t> indexed, described;
  tier.ForEach([&](const BlockKey& k, const BlockDesc& d) { indexed[k] = d.checksum; });
  t = Status::Internal("closed");
  auto scan = NvmeTier::ScanDataFile(vo, [&](const BlockKey& k, const BlockDesc& d, std::uint64_t, std::uint64_t) {
    described[k] = d.checksum;
  });
  INFO("scan: " << (scan.ok() ? scan->ToString() : scan.status().ToString()));
  REQUIRE(scan.ok());
  CHECK(described == indexed);
}

}  // namespace

TEST_CASE("power cut at random moments: acknowledged sync puts survive, nothing corrupt is returned",
          "[nvme][power_cut]") {
  std::uint64_t rounds = 200;
  if (const char* e = std::getenv("TERRACE_POWER_CUT_ROUNDS")) rounds = std::max<std::uint64_t>(1, std::strtoull(e, nullptr, 10));
  constexpr int kRoundsPerStore = 6;  // later rounds recover a store an earlier cut left behind
  std::mt19937_64 rng(20261201);

  // Calibrate: the events of one uncut round on a fresh store (creation included).
  std::uint64_t calibrated = 0;
  {
    TempDir dir("powercut-cal");
    std::map<int, KeyModel> model;
    std::uint64_t next_id = 1;
    nvme::PowerCut cut(1);
    {
      auto t = OpenUnderCut(CutOptions(dir.path()), cut);
      REQUIRE(t.ok());
      Workload(**t, model, &next_id, rng);
      cut.PowerOff();
    }
    calibrated = cut.events();
    REQUIRE(cut.Cut().ok());
    Tally tally;
    Verify(dir.path(), model, tally, "calibration");
  }
  REQUIRE(calibrated > 10);

  Tally tally;
  std::uint64_t done = 0;
  for (std::uint64_t store = 0; done < rounds; ++store) {
    TempDir dir("powercut");
    std::map<int, KeyModel> model;
    std::uint64_t next_id = 1;
    for (int r = 0; r < kRoundsPerStore && done < rounds; ++r, ++done) {
      const std::uint64_t cut_at = rng() % (calibrated + calibrated / 4);
      const auto mode = static_cast<nvme::LostWrite>(rng() % 4);  // revert, keep, torn or mixed
      nvme::PowerCut cut(rng(), mode);
      cut.CutAfter(cut_at);
      {
        auto t = OpenUnderCut(CutOptions(dir.path()), cut);
        if (t.ok()) {
          Workload(**t, model, &next_id, rng);
          cut.PowerOff();  // before the close: the close's own commit never reaches the disk
        } else {
          REQUIRE(cut.powered_off());  // only the cut may make the open fail
          ++tally.open_failed_under_cut;
        }
      }
      auto rep = cut.Cut();
      REQUIRE(rep.ok());
      Verify(dir.path(), model, tally,
             "store " + std::to_string(store) + " round " + std::to_string(r) + " cut at event " +
                 std::to_string(cut_at) + ": " + rep->ToString(),
             /*read_only=*/r % 2 == 1);
      ++tally.rounds;
    }
  }
  WARN("power cut: " << tally.rounds << " cut points (calibrated " << calibrated << " events per round), "
                     << tally.acked_checked << " acknowledged blocks verified, " << tally.open_failed_under_cut
                     << " cuts during open, " << tally.refused_then_rebuilt << " refused opens rebuilt");
  CHECK(tally.acked_checked > rounds);
}

TEST_CASE("power cut while an open finishes a cut-short commit: the next open still leaves the data file equal to the index",
          "[nvme][power_cut]") {
  TempDir base("powercut-redo");
  const std::filesystem::path src = base.path() / "src";
  std::filesystem::create_directories(src);
  auto opts = SmallNvmeOptions(src, 16 * kMiB, Durability::kAsync);
  opts.group_commit_interval = std::chrono::seconds(60);
  opts.logger = NullLogger();
  // A commit whose index write lands and whose descriptor writes all fail: the open must redo it.
  REQUIRE(LeaveCommitCutAfterIndexWrite(opts, 4096).IsIoError());
  int trials = 0;
  for (std::uint64_t cut_at = 0; cut_at < 8; ++cut_at) {
    for (std::uint64_t seed = 1; seed <= 5; ++seed) {
      INFO("power cut at event " << cut_at << " of the redoing open, seed " << seed);
      const std::filesystem::path d = base.path() / ("t" + std::to_string(cut_at) + "-" + std::to_string(seed));
      std::filesystem::copy(src, d, std::filesystem::copy_options::recursive);
      auto o = opts;
      o.path = d;
      o.durability = Durability::kSync;
      {
        nvme::PowerCut cut(seed, nvme::LostWrite::kMixed);
        cut.CutAfter(cut_at);
        NvmeOpenHooks hooks;
        hooks.engine = cut.WrapEngine(nvme::OpenUringEngine);
        { auto t = NvmeTier::OpenWithHooks(o, hooks); }  // the redo, cut short (or done)
        REQUIRE(cut.Cut().ok());
      }
      std::map<BlockKey, std::uint64_t> indexed, described;
      {
        auto t = NvmeTier::Open(o);
        INFO(t.status().ToString());
        REQUIRE(t.ok());
        const Status state = CheckCutCommitState(**t, 4096);
        INFO(state.ToString());
        CHECK(state.ok());
        (*t)->ForEach([&](const BlockKey& k, const BlockDesc& desc) { indexed[k] = desc.checksum; });
      }
      auto scan = NvmeTier::ScanDataFile(o, [&](const BlockKey& k, const BlockDesc& desc, std::uint64_t, std::uint64_t) {
        described[k] = desc.checksum;
      });
      REQUIRE(scan.ok());
      CHECK(described == indexed);
      std::error_code ec;
      std::filesystem::remove_all(d, ec);
      ++trials;
    }
  }
  CHECK(trials == 40);
}
