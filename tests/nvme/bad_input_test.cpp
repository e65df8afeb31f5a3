// Bad input: each gets a clear error naming the path, and nothing acknowledged is lost.
#include <catch2/catch.hpp>

#include <rocksdb/db.h>

#include <fstream>
#include <iterator>
#include <map>

#include "nvme_test_util.h"
#include "tiers/nvme/format.h"
#include "tiers/nvme/index_store.h"

using namespace terrace;
using namespace terrace::testing;
namespace fs = std::filesystem;

namespace {
bool Mentions(const Status& s, const fs::path& p) { return s.message().find(p.string()) != std::string::npos; }

void WriteFile(const fs::path& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << text;
}

// Every file of `dir` (not recursive) by name, with its bytes.
std::map<std::string, std::string> DirSnapshot(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::ifstream f(e.path(), std::ios::binary);
    out[e.path().filename().string()] = std::string(std::istreambuf_iterator<char>(f), {});
  }
  return out;
}

// Creates a store holding blocks [0, n).
void MakeStore(const NvmeTierOptions& opts, int n) {
  auto t = NvmeTier::Open(opts);
  REQUIRE(t.ok());
  for (int i = 0; i < n; ++i) REQUIRE(PutTestBlock(**t, i).ok());
}
}  // namespace

TEST_CASE("nvme bad input: missing directory without create_if_missing", "[nvme][bad]") {
  TempDir dir("nvme");
  auto opts = SmallNvmeOptions(dir.path() / "nope");
  opts.create_if_missing = false;
  auto t = NvmeTier::Open(opts);
  REQUIRE(t.status().IsNotFound());
  CHECK(Mentions(t.status(), opts.path));
  CHECK(t.status().message().find("create_if_missing") != std::string::npos);
  CHECK_FALSE(fs::exists(opts.path));
  // An existing empty directory is not a store either.
  opts.path = dir.path();
  CHECK(NvmeTier::Open(opts).status().IsNotFound());
}

TEST_CASE("nvme bad input: unwritable directory (a path below a regular file)", "[nvme][bad]") {
  TempDir dir("nvme");
  WriteFile(dir.path() / "plain", "x");
  auto opts = SmallNvmeOptions(dir.path() / "plain" / "sub");
  auto t = NvmeTier::Open(opts);
  REQUIRE_FALSE(t.ok());
  CHECK(t.status().IsIoError());
  CHECK(Mentions(t.status(), opts.path));
  opts.path = "/proc/terrace-nvme-test";
  t = NvmeTier::Open(opts);
  REQUIRE_FALSE(t.ok());
  CHECK(Mentions(t.status(), opts.path));
}

TEST_CASE("nvme bad input: an index directory that cannot be made refuses the creation and leaves no data file",
          "[nvme][bad]") {
  TempDir dir("nvme");
  WriteFile(dir.path() / "plain", "x");
  auto opts = SmallNvmeOptions(dir.path() / "store");
  opts.index_dir = dir.path() / "plain" / "index";  // below a regular file
  auto t = NvmeTier::Open(opts);
  REQUIRE_FALSE(t.ok());
  CHECK(t.status().IsIoError());
  CHECK(Mentions(t.status(), opts.index_dir));
  // Nothing of a creation is left behind (no preallocated terrace.data.creating to leak).
  CHECK_FALSE(fs::exists(dir.path() / "store" / "terrace.data.creating"));
  CHECK_FALSE(fs::exists(dir.path() / "store" / "terrace.data"));
}

TEST_CASE("nvme bad input: reformat overwrites only a Terrace store, never a terrace.data something else wrote",
          "[nvme][bad]") {
  TempDir dir("nvme");
  auto opts = SmallNvmeOptions(dir.path() / "store", 4 * kMiB);
  fs::create_directories(opts.path);
  const fs::path data = opts.path / "terrace.data";
  WriteFile(data, "a user's own file that happens to be named terrace.data");
  fs::resize_file(data, opts.capacity_bytes);  // large enough for the capacity asked for
  const auto before = DirSnapshot(opts.path);
  opts.reformat = true;
  auto t = NvmeTier::Open(opts);
  REQUIRE_FALSE(t.ok());
  INFO(t.status().ToString());
  CHECK(t.status().message().find("reformat refused") != std::string::npos);
  CHECK(DirSnapshot(opts.path) == before);  // nothing written, no index made

  // Zeros in the first 4 KiB are not enough: a file system image may start with them.
  std::string image(opts.capacity_bytes, '\0');
  image.replace(64 * 1024 + 64, 8, "_BHRfS_M");
  WriteFile(data, image);
  const auto image_before = DirSnapshot(opts.path);
  auto again = NvmeTier::Open(opts);
  REQUIRE_FALSE(again.ok());
  INFO(again.status().ToString());
  CHECK(again.status().message().find("reformat refused") != std::string::npos);
  CHECK(DirSnapshot(opts.path) == image_before);
}

TEST_CASE("nvme bad input: paths that are not Terrace stores", "[nvme][bad]") {
  TempDir dir("nvme");
  SECTION("a regular file") {
    WriteFile(dir.path() / "file", "hello");
    auto t = NvmeTier::Open(SmallNvmeOptions(dir.path() / "file"));
    REQUIRE(t.status().IsInvalidArgument());
    CHECK(Mentions(t.status(), dir.path() / "file"));
  }
  SECTION("a non-empty directory of other files") {
    WriteFile(dir.path() / "notes.txt", "mine");
    auto t = NvmeTier::Open(SmallNvmeOptions(dir.path()));
    REQUIRE(t.status().IsInvalidArgument());
    CHECK(t.status().message().find("not empty") != std::string::npos);
    CHECK(fs::exists(dir.path() / "notes.txt"));
    CHECK_FALSE(fs::exists(dir.path() / "terrace.data"));
  }
  SECTION("terrace.data with foreign content") {
    WriteFile(dir.path() / "terrace.data", std::string(8192, 'z'));
    auto t = NvmeTier::Open(SmallNvmeOptions(dir.path()));
    REQUIRE(t.status().IsInvalidArgument());
    CHECK(t.status().message().find("not a Terrace store") != std::string::npos);
    CHECK(Mentions(t.status(), dir.path() / "terrace.data"));
  }
  SECTION("an index without a data file") {
    auto opts = SmallNvmeOptions(dir.path());
    MakeStore(opts, 1);
    fs::remove(dir.path() / "terrace.data");
    auto t = NvmeTier::Open(opts);
    REQUIRE(t.status().IsCorruption());
    CHECK(t.status().message().find("terrace.data") != std::string::npos);
  }
}

TEST_CASE("nvme bad input: capacity mismatch and superblock damage", "[nvme][bad]") {
  TempDir dir("nvme");
  auto opts = SmallNvmeOptions(dir.path(), 32 * kMiB);
  MakeStore(opts, 4);
  auto other = opts;
  other.capacity_bytes = 64 * kMiB;
  auto t = NvmeTier::Open(other);
  REQUIRE(t.status().IsInvalidArgument());
  CHECK(t.status().message().find("capacity") != std::string::npos);
  // The superblock has two slots (at 0 and 2048): either one alone still opens the store.
  for (std::size_t slot : {std::size_t{0}, nvme::kSuperblockSlotStride}) {
    std::string saved(8, '\0');
    {
      std::fstream f(dir.path() / "terrace.data", std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(static_cast<std::streamoff>(slot));
      f.read(saved.data(), 8);
      f.seekp(static_cast<std::streamoff>(slot));
      f.write("BADMAGIC", 8);
    }
    t = NvmeTier::Open(opts);
    INFO(t.status().ToString());
    REQUIRE(t.ok());
    CHECK((*t)->block_count() == 4);
    t = Status::Internal("closed");
    std::fstream f(dir.path() / "terrace.data", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(slot));
    f.write(saved.data(), 8);
  }
  {
    std::fstream f(dir.path() / "terrace.data", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(0);
    f.write("BADMAGIC", 8);
    f.seekp(static_cast<std::streamoff>(nvme::kSuperblockSlotStride));
    f.write("BADMAGIC", 8);
  }
  t = NvmeTier::Open(opts);
  REQUIRE(t.status().IsInvalidArgument());
  CHECK(t.status().message().find("not a Terrace store") != std::string::npos);
}

TEST_CASE("nvme bad input: an intact superblock slot of another version refuses the open and is kept",
          "[nvme][bad]") {
  TempDir dir("nvme");
  auto opts = SmallNvmeOptions(dir.path());
  MakeStore(opts, 2);
  const fs::path data = dir.path() / "terrace.data";
  std::string unit(nvme::kSuperblockBytes, '\0');
  {
    std::ifstream f(data, std::ios::binary);
    f.read(unit.data(), static_cast<std::streamsize>(unit.size()));
  }
  auto* b = reinterpret_cast<std::byte*>(unit.data());
  // The newer slot, as a later format version would write it (its slot_check valid).
  std::byte* newer = nvme::GetLe(b + 48, 8) > nvme::GetLe(b + nvme::kSuperblockSlotStride + 48, 8)
                         ? b
                         : b + nvme::kSuperblockSlotStride;
  nvme::PutLe(newer + 8, 3, 4);
  nvme::PutLe(newer + 80, Checksum(std::span<const std::byte>(newer, 80)), 8);
  {
    std::fstream f(data, std::ios::in | std::ios::out | std::ios::binary);
    f.write(unit.data(), static_cast<std::streamsize>(unit.size()));
  }
  for (bool read_only : {false, true}) {
    auto o = opts;
    o.read_only = read_only;
    auto t = NvmeTier::Open(o);
    REQUIRE(t.status().IsInvalidArgument());
    CHECK(t.status().message().find("format version 3") != std::string::npos);
    CHECK(Mentions(t.status(), data));
  }
  std::string after(unit.size(), '\0');
  std::ifstream f(data, std::ios::binary);
  f.read(after.data(), static_cast<std::streamsize>(after.size()));
  CHECK(after == unit);  // neither slot rewritten
}

TEST_CASE("nvme bad input: corrupt index", "[nvme][bad]") {
  TempDir dir("nvme");
  auto opts = SmallNvmeOptions(dir.path());
  MakeStore(opts, 4);
  SECTION("garbage in the RocksDB files") {
    for (const auto& e : fs::directory_iterator(dir.path() / "index")) {
      std::string name = e.path().filename().string();
      if (name == "CURRENT" || name.rfind("MANIFEST", 0) == 0) WriteFile(e.path(), "garbage garbage garbage\n");
    }
    auto t = NvmeTier::Open(opts);
    REQUIRE_FALSE(t.ok());
    CHECK((t.status().IsCorruption() || t.status().IsIoError()));
    CHECK(Mentions(t.status(), dir.path() / "index"));
  }
  SECTION("a manifest with a wrong magic") {
    {
      rocksdb::DB* db = nullptr;
      REQUIRE(rocksdb::DB::Open(rocksdb::Options(), (dir.path() / "index").string(), &db).ok());
      std::string v(nvme::kSuperblockHeaderBytes, 'q');
      REQUIRE(db->Put(rocksdb::WriteOptions(), std::string(nvme::kManifestKey), v).ok());
      delete db;
    }
    auto t = NvmeTier::Open(opts);
    REQUIRE(t.status().IsCorruption());
    CHECK(t.status().message().find("manifest") != std::string::npos);
    CHECK(t.status().message().find("store recover") != std::string::npos);
  }
  SECTION("records of another record_version refuse the open and are kept") {
    const std::string k0 = nvme::IndexStore::EncodeKey(TestKey(0));
    std::string v;
    {
      rocksdb::DB* db = nullptr;
      REQUIRE(rocksdb::DB::Open(rocksdb::Options(), (dir.path() / "index").string(), &db).ok());
      REQUIRE(db->Get(rocksdb::ReadOptions(), k0, &v).ok());
      auto* b = reinterpret_cast<std::byte*>(v.data());
      b[0] = std::byte{3};  // as another Terrace version would write it, with a valid record_check
      nvme::PutLe(b + 40, Checksum(std::span<const std::byte>(b, 40)), 8);
      REQUIRE(db->Put(rocksdb::WriteOptions(), k0, v).ok());
      delete db;
    }
    const auto files_before = DirSnapshot(dir.path() / "index");
    for (bool read_only : {true, false}) {
      auto o = opts;
      o.read_only = read_only;
      auto t = NvmeTier::Open(o);
      REQUIRE(t.status().IsInvalidArgument());
      // "changed nothing": the read-write open rewrote RocksDB's files before it refused
      CHECK(DirSnapshot(dir.path() / "index") == files_before);
      CHECK(t.status().message().find("another Terrace version") != std::string::npos);
      CHECK(t.status().message().find("version 3") != std::string::npos);
      CHECK(t.status().message().find(TestKey(0).ToString()) != std::string::npos);
      CHECK(Mentions(t.status(), dir.path() / "index"));
    }
    rocksdb::DB* db = nullptr;
    REQUIRE(rocksdb::DB::Open(rocksdb::Options(), (dir.path() / "index").string(), &db).ok());
    std::string after;
    CHECK(db->Get(rocksdb::ReadOptions(), k0, &after).ok());  // not dropped
    CHECK(after == v);
    delete db;
  }
  SECTION("damaged records refuse a read-write open and change nothing; a rebuild keeps every block") {
    const std::string k1 = nvme::IndexStore::EncodeKey(TestKey(1));
    std::string damaged;
    {
      rocksdb::DB* db = nullptr;
      REQUIRE(rocksdb::DB::Open(rocksdb::Options(), (dir.path() / "index").string(), &db).ok());
      // Block 1's record with one bit flipped (record_check no longer matches: its extent is
      // unknown, yet its data and descriptor are intact), a record pointing past the end, and junk.
      REQUIRE(db->Get(rocksdb::ReadOptions(), k1, &damaged).ok());
      damaged[10] = static_cast<char>(damaged[10] ^ 0x01);
      REQUIRE(db->Put(rocksdb::WriteOptions(), k1, damaged).ok());
      nvme::Record far{opts.capacity_bytes, 100, 0, 1, Codec::kRaw};
      std::string kf(BlockKey::kEncodedSize, '\0'), rf(nvme::kRecordBytes, '\0');
      TestKey(900).EncodeTo(reinterpret_cast<std::byte*>(kf.data()));
      far.EncodeTo(reinterpret_cast<std::byte*>(rf.data()));
      REQUIRE(db->Put(rocksdb::WriteOptions(), kf, rf).ok());
      REQUIRE(db->Put(rocksdb::WriteOptions(), std::string(25, 'k'), "short").ok());
      delete db;
    }
    // Before this refusal the open dropped block 1's record and freed its extent: the next put
    // wrote over an acknowledged block.
    const auto files_before = DirSnapshot(dir.path() / "index");
    auto t = NvmeTier::Open(opts);
    REQUIRE(t.status().IsCorruption());
    CHECK(DirSnapshot(dir.path() / "index") == files_before);  // "nothing was changed": no file either
    CHECK(t.status().message().find("3 damaged block records (malformed 2, out of range 1") != std::string::npos);
    CHECK(t.status().message().find(TestKey(1).ToString()) != std::string::npos);
    CHECK(t.status().message().find("nothing was changed") != std::string::npos);
    CHECK(t.status().message().find("terrace store recover --dir") != std::string::npos);
    {
      rocksdb::DB* db = nullptr;
      REQUIRE(rocksdb::DB::Open(rocksdb::Options(), (dir.path() / "index").string(), &db).ok());
      std::string after;
      CHECK(db->Get(rocksdb::ReadOptions(), k1, &after).ok());  // not dropped
      CHECK(after == damaged);
      delete db;
    }
    auto ro_opts = opts;
    ro_opts.read_only = true;
    {
      auto ro = NvmeTier::Open(ro_opts);  // read-only: reported, and the rest readable
      REQUIRE(ro.ok());
      const RecoveryReport& r = (*ro)->recovery_report();
      CHECK(r.dropped_malformed == 2);
      CHECK(r.dropped_out_of_range == 1);
      CHECK(r.blocks_recovered == 3);
      for (int i : {0, 2, 3}) CHECK(CheckTestBlock(**ro, i).ok());
    }
    auto rebuilt = NvmeTier::RebuildIndex(opts);
    REQUIRE(rebuilt.ok());
    auto again = NvmeTier::Open(opts);
    REQUIRE(again.ok());
    CHECK((*again)->recovery_report().dropped() == 0);
    for (int i = 0; i < 4; ++i) CHECK(CheckTestBlock(**again, i).ok());  // block 1 included
  }
  SECTION("one key's record copied over another's (overlapping records) refuses a read-write open; a rebuild keeps both blocks") {
    {
      rocksdb::DB* db = nullptr;
      REQUIRE(rocksdb::DB::Open(rocksdb::Options(), (dir.path() / "index").string(), &db).ok());
      std::string v0;
      REQUIRE(db->Get(rocksdb::ReadOptions(), nvme::IndexStore::EncodeKey(TestKey(0)), &v0).ok());
      REQUIRE(db->Put(rocksdb::WriteOptions(), nvme::IndexStore::EncodeKey(TestKey(1)), v0).ok());  // a valid record
      delete db;
    }
    // The open dropped one of the two at random, and so could free block 1's intact extent (its only
    // record now named block 0's) for the next put.
    const auto files_before = DirSnapshot(dir.path() / "index");
    auto t = NvmeTier::Open(opts);
    REQUIRE(t.status().IsCorruption());
    CHECK(t.status().message().find("1 damaged block record (malformed 0, out of range 0, overlapping 1") !=
          std::string::npos);
    CHECK(DirSnapshot(dir.path() / "index") == files_before);
    auto ro_opts = opts;
    ro_opts.read_only = true;
    {
      auto ro = NvmeTier::Open(ro_opts);
      REQUIRE(ro.ok());
      CHECK((*ro)->recovery_report().dropped_overlap == 1);
    }
    REQUIRE(NvmeTier::RebuildIndex(opts).ok());
    auto again = NvmeTier::Open(opts);
    REQUIRE(again.ok());
    CHECK((*again)->recovery_report().dropped() == 0);
    for (int i = 0; i < 4; ++i) CHECK(CheckTestBlock(**again, i).ok());
  }
}

TEST_CASE("nvme bad input: full tier and oversized blocks", "[nvme][bad]") {
  TempDir dir("nvme");
  auto opts = SmallNvmeOptions(dir.path(), 4 * kMiB, Durability::kSync);
  auto t = NvmeTier::Open(opts);
  REQUIRE(t.ok());
  NvmeTier& tier = **t;
  auto big = TestBytes(1, 8 * kMiB);
  Status s = tier.Put(TestKey(1), DescribeBlock(big), big);
  REQUIRE(s.IsOutOfCapacity());
  CHECK(s.message().find(TestKey(1).ToString()) != std::string::npos);
  CHECK(s.message().find(std::to_string(8 * kMiB)) != std::string::npos);
  int stored = 0;
  for (int i = 0; i < 100; ++i) {
    Status p = PutTestBlock(tier, 10 + i, 42, 256 * 1024);
    if (!p.ok()) {
      REQUIRE(p.IsOutOfCapacity());
      CHECK(p.message().find("free") != std::string::npos);
      break;
    }
    ++stored;
  }
  CHECK(stored == 15);  // (4 MiB - 4 KiB superblock) / 256 KiB
  for (int i = 0; i < stored; ++i) REQUIRE(CheckTestBlock(tier, 10 + i, 42, 256 * 1024).ok());
  // Freeing one makes room again.
  REQUIRE(tier.Erase(TestKey(10)).ok());
  REQUIRE(PutTestBlock(tier, 500, 42, 256 * 1024).ok());
  t->reset();
  auto again = NvmeTier::Open(opts);
  REQUIRE(again.ok());
  for (int i = 1; i < stored; ++i) REQUIRE(CheckTestBlock(**again, 10 + i, 42, 256 * 1024).ok());
  REQUIRE(CheckTestBlock(**again, 500, 42, 256 * 1024).ok());
}

TEST_CASE("nvme bad input: a disk too small for the capacity", "[nvme][bad]") {
  TempDir dir("nvme");
  auto opts = SmallNvmeOptions(dir.path(), std::uint64_t{1} << 50);  // 1 PiB
  auto t = NvmeTier::Open(opts);
  REQUIRE(t.status().IsOutOfCapacity());
  CHECK(Mentions(t.status(), dir.path() / "terrace.data"));
  CHECK_FALSE(fs::exists(dir.path() / "terrace.data"));
  opts.capacity_bytes = 12345;
  CHECK(NvmeTier::Open(opts).status().IsInvalidArgument());
  opts.capacity_bytes = 4 * kMiB;
  opts.queue_depth = 0;
  CHECK(NvmeTier::Open(opts).status().IsInvalidArgument());
  opts.queue_depth = 32;
  opts.durability = static_cast<Durability>(7);  // was taken as one of the two, silently
  const auto bad_durability = NvmeTier::Open(opts);
  CHECK(bad_durability.status().IsInvalidArgument());
  CHECK(bad_durability.status().message().find("durability 7") != std::string::npos);
}

TEST_CASE("a damaged record of the newest block refuses the open; after a rebuild a new version outranks the old descriptor (newest generation wins; generations never repeat)", "[nvme][bad]") {
  TempDir dir("nvme-gen-after-drop");
  auto opts = SmallNvmeOptions(dir.path());
  {
    auto t = NvmeTier::Open(opts);
    REQUIRE(t.ok());
    REQUIRE(PutTestBlock(**t, 10, 1, 4096).ok());  // a hole-to-be
    REQUIRE(PutTestBlock(**t, 11, 1, 4096).ok());  // a fence after it
    REQUIRE((*t)->Erase(TestKey(10)).ok());
    REQUIRE((*t)->Flush().ok());
    REQUIRE(PutTestBlock(**t, 3, 1, 4096).ok());  // into the hole: the newest generation, below the fence
  }
  {  // damage key 3's index record (the newest generation); its descriptor stays intact
    rocksdb::DB* db = nullptr;
    REQUIRE(rocksdb::DB::Open(rocksdb::Options(), (dir.path() / "index").string(), &db).ok());
    const std::string k3 = nvme::IndexStore::EncodeKey(TestKey(3));
    std::string v;
    REQUIRE(db->Get(rocksdb::ReadOptions(), k3, &v).ok());
    v[20] = static_cast<char>(v[20] ^ 0x5a);
    REQUIRE(db->Put(rocksdb::WriteOptions(), k3, v).ok());
    delete db;
  }
  REQUIRE(NvmeTier::Open(opts).status().IsCorruption());  // dropping the record would free an intact block
  REQUIRE(NvmeTier::RebuildIndex(opts).ok());
  {
    auto t = NvmeTier::Open(opts);
    REQUIRE(t.ok());
    REQUIRE(CheckTestBlock(**t, 3, 1, 4096).ok());  // the rebuild kept it
    REQUIRE(PutTestBlock(**t, 3, 2, 8192).ok());  // a new version, in a new extent
  }
  fs::remove_all(dir.path() / "index");
  auto rebuilt = NvmeTier::RebuildIndex(opts);
  INFO((rebuilt.ok() ? rebuilt->ToString() : rebuilt.status().ToString()));
  REQUIRE(rebuilt.ok());
  auto t = NvmeTier::Open(opts);
  REQUIRE(t.ok());
  const Status s = CheckTestBlock(**t, 3, 2, 8192);
  INFO(s.ToString());
  CHECK(s.ok());
}

TEST_CASE("a rebuild names the blocks the old index listed whose data is intact nowhere", "[nvme][bad]") {
  TempDir dir("nvme-lost");
  auto opts = SmallNvmeOptions(dir.path());
  MakeStore(opts, 4);
  nvme::Record r1;
  {
    rocksdb::DB* db = nullptr;
    REQUIRE(rocksdb::DB::Open(rocksdb::Options(), (dir.path() / "index").string(), &db).ok());
    std::string v;
    REQUIRE(db->Get(rocksdb::ReadOptions(), nvme::IndexStore::EncodeKey(TestKey(1)), &v).ok());
    delete db;
    auto rec = nvme::Record::Decode(std::as_bytes(std::span(v.data(), v.size())));
    REQUIRE(rec.ok());
    r1 = *rec;
  }
  {  // block 1's whole extent, data and descriptor, zeroed: the scan cannot find it
    std::fstream f(dir.path() / "terrace.data", std::ios::in | std::ios::out | std::ios::binary);
    const std::string zeros(r1.extent_bytes(), '\0');
    f.seekp(static_cast<std::streamoff>(r1.offset));
    f.write(zeros.data(), static_cast<std::streamsize>(zeros.size()));
  }
  auto rebuilt = NvmeTier::RebuildIndex(opts);
  REQUIRE(rebuilt.ok());
  // It used to say only "3 blocks indexed": block 1 vanished, and a check of the new index was clean.
  CHECK(rebuilt->blocks_indexed == 3);
  CHECK(rebuilt->lost_from_old_index == 1);
  REQUIRE(rebuilt->lost_keys.size() == 1);
  CHECK(rebuilt->lost_keys[0] == TestKey(1).ToString());
  CHECK(rebuilt->ToString().find("1 blocks the old index listed are lost") != std::string::npos);
  auto again = NvmeTier::RebuildIndex(opts);  // the old index is now the rebuilt one: nothing more is lost
  REQUIRE(again.ok());
  CHECK(again->lost_from_old_index == 0);
}

TEST_CASE("a superblock slot whose version field reads 1 but whose check matches version 2 is a damaged slot, passed over", "[nvme][bad]") {
  TempDir dir("nvme-sb-version");
  auto opts = SmallNvmeOptions(dir.path());
  MakeStore(opts, 4);
  for (int slot : {0, 1}) {
    const auto at = static_cast<std::streamoff>(slot * nvme::kSuperblockSlotStride + 8);
    char was = 0;
    {
      std::fstream f(dir.path() / "terrace.data", std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(at);
      f.read(&was, 1);
      REQUIRE(was == static_cast<char>(nvme::kFormatVersion));
      const char one = 1;
      f.seekp(at);
      f.write(&one, 1);
    }
    INFO("slot " << slot);
    // It was refused as "format version 1, which this build no longer opens ... delete the store
    // directory", though the other slot is intact and the store whole.
    auto t = NvmeTier::Open(opts);
    REQUIRE(t.ok());
    for (int i = 0; i < 4; ++i) CHECK(CheckTestBlock(**t, i).ok());
    t->reset();
    std::fstream f(dir.path() / "terrace.data", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(at);
    f.write(&was, 1);
  }
}
