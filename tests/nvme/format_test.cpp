#include <catch2/catch.hpp>

#include <cstring>
#include <random>

#include "tiers/nvme/format.h"

using namespace terrace;
using namespace terrace::nvme;

TEST_CASE("nvme record: encode/decode round-trips and detects damage", "[nvme][format]") {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 200; ++i) {
    Record r;
    r.offset = (rng() % (1ull << 30)) * kUnit;
    r.length = rng() % (1ull << 32);
    r.checksum = rng();
    r.generation = rng();
    r.codec = static_cast<Codec>(rng() % 6);
    std::byte buf[kRecordBytes];
    r.EncodeTo(buf);
    auto back = Record::Decode(buf);
    REQUIRE(back.ok());
    REQUIRE(*back == r);
    // Any single flipped bit is caught by the record checksum (or the version byte).
    int bit = static_cast<int>(rng() % (kRecordBytes * 8));
    buf[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
    auto damaged = Record::Decode(buf);
    REQUIRE_FALSE(damaged.ok());
    REQUIRE(damaged.status().IsCorruption());
  }
  std::byte small[10]{};
  REQUIRE(Record::Decode(small).status().IsCorruption());
}

TEST_CASE("nvme record: an intact record of another record_version is another version, not damage", "[nvme][format]") {
  Record r{kDataStart, 100, 5, 9, Codec::kRaw};
  std::byte buf[kRecordBytes];
  r.EncodeTo(buf);
  buf[0] = std::byte{3};
  PutLe(buf + 40, Checksum(std::span<const std::byte>(buf, 40)), 8);  // a valid record_check
  auto other = Record::Decode(buf);
  REQUIRE(other.status().IsInvalidArgument());
  CHECK(other.status().message().find("version 3") != std::string::npos);
  buf[20] ^= std::byte{1};  // now its check fails: damaged, whatever its version byte says
  CHECK(Record::Decode(buf).status().IsCorruption());
}

TEST_CASE("nvme descriptor: an intact descriptor of another desc_version is another version, not damage",
          "[nvme][format]") {
  Descriptor d;
  d.uuid.fill(0x5a);
  d.key = BlockKey{1, BlockKind::kKv, 2, ContentId{3, 4}};
  d.rec = Record{kDataStart, 100, 5, 9, Codec::kRaw};
  std::vector<std::byte> unit(kUnit, std::byte{0});
  d.EncodeTo(unit.data());
  CHECK_FALSE(Descriptor::OtherVersion(unit).has_value());  // this build's own version
  PutLe(unit.data() + 8, 2, 2);
  PutLe(unit.data() + 96, Checksum(std::span<const std::byte>(unit.data(), 96)), 8);  // a valid desc_check
  CHECK_FALSE(Descriptor::Decode(unit).has_value());
  REQUIRE(Descriptor::OtherVersion(unit).has_value());
  CHECK(Descriptor::OtherVersion(unit)->version == 2);
  CHECK(Descriptor::OtherVersion(unit)->uuid == d.uuid);  // at offset 16 in every desc_version
  unit[40] ^= std::byte{1};  // now its check fails: damaged, whatever its version field says
  CHECK_FALSE(Descriptor::OtherVersion(unit).has_value());
  CHECK(Descriptor::HasMagic(unit));
}

TEST_CASE("nvme record: documented byte layout", "[nvme][format]") {
  Record r;
  r.offset = 0x1000;
  r.length = 0x0102030405060708ull;
  r.checksum = 0xAABBCCDDEEFF0011ull;
  r.generation = 9;
  r.codec = Codec::kBf16;
  std::byte b[kRecordBytes];
  r.EncodeTo(b);
  REQUIRE(static_cast<int>(b[0]) == 2);                // record version
  REQUIRE(static_cast<int>(b[2]) == 2);                // codec, little-endian u16
  REQUIRE(static_cast<int>(b[9]) == 0x10);             // offset 0x1000 little-endian at 8
  REQUIRE(static_cast<int>(b[16]) == 0x08);            // length low byte first at 16
  REQUIRE(static_cast<int>(b[23]) == 0x01);
  REQUIRE(static_cast<int>(b[24]) == 0x11);            // checksum at 24
  REQUIRE(static_cast<int>(b[32]) == 9);               // generation at 32
}

TEST_CASE("nvme superblock: round trip, bad magic, bad checksum", "[nvme][format]") {
  Superblock sb;
  sb.capacity_bytes = 64 * kUnit;
  for (std::size_t i = 0; i < sb.uuid.size(); ++i) sb.uuid[i] = static_cast<std::uint8_t>(i * 17);
  std::byte buf[kSuperblockHeaderBytes];
  sb.EncodeTo(buf);
  REQUIRE(std::memcmp(buf, "TRRCNVME", 8) == 0);
  auto back = Superblock::Decode(buf, "x");
  REQUIRE(back.ok());
  REQUIRE(*back == sb);
  REQUIRE(back->UuidString().size() == 36);

  std::byte bad[kSuperblockHeaderBytes];
  std::memcpy(bad, buf, sizeof bad);
  bad[0] = std::byte{'X'};
  auto s = Superblock::Decode(bad, "/some/terrace.data").status();
  REQUIRE(s.IsInvalidArgument());
  REQUIRE(s.message().find("/some/terrace.data") != std::string::npos);
  REQUIRE(s.message().find("not a Terrace store") != std::string::npos);

  std::memcpy(bad, buf, sizeof bad);
  bad[20] ^= std::byte{1};
  REQUIRE(Superblock::Decode(bad, "y").status().IsCorruption());
}

TEST_CASE("nvme superblock unit: the newest valid slot wins; a torn slot falls back to the other", "[nvme][format]") {
  std::vector<std::byte> unit(kSuperblockBytes, std::byte{0});
  Superblock sb;
  sb.capacity_bytes = 64 * kUnit;
  sb.uuid[3] = 7;
  std::mt19937_64 rng(11);
  Superblock last_complete = sb;
  for (std::uint64_t seq = 1; seq <= 40; ++seq) {
    sb.sequence = seq;
    sb.indexed_commit = seq * 3;
    sb.generation_limit = seq * 1000;
    std::vector<std::byte> before = unit;
    sb.EncodeIntoUnit(unit.data());
    auto got = Superblock::DecodeUnit(unit, "u");
    REQUIRE(got.ok());
    CHECK(*got == sb);
    // Tear the write: only a prefix of the new slot's bytes reached the disk.
    std::vector<std::byte> torn = before;
    const std::size_t slot = (seq % 2) * kSuperblockSlotStride;
    const std::size_t cut = rng() % kSuperblockHeaderBytes;
    std::copy(unit.begin() + static_cast<std::ptrdiff_t>(slot), unit.begin() + static_cast<std::ptrdiff_t>(slot + cut),
              torn.begin() + static_cast<std::ptrdiff_t>(slot));
    if (seq > 1) {
      auto back = Superblock::DecodeUnit(torn, "u");
      REQUIRE(back.ok());
      CHECK(back->SameStore(sb));
      CHECK((*back == sb || *back == last_complete));  // never anything else
    }
    last_complete = sb;
  }
}

TEST_CASE("nvme superblock: a version-1 store is refused with a clear message", "[nvme][format]") {
  std::vector<std::byte> unit(kSuperblockBytes, std::byte{0});
  Superblock sb;
  sb.capacity_bytes = 64 * kUnit;
  sb.EncodeTo(unit.data());
  unit[8] = std::byte{1};  // format_version 1, as the previous release wrote it
  // Version 1 kept no slot_check at bytes [80, 88): with the v2 one left there, the slot would read
  // as a version-2 slot whose version field alone was damaged (and be passed over).
  PutLe(unit.data() + 80, 0x0123456789abcdefull, 8);
  auto s = Superblock::DecodeUnit(unit, "/d/terrace.data").status();
  REQUIRE(s.IsInvalidArgument());
  CHECK(s.message().find("version 1") != std::string::npos);
  CHECK(s.message().find("/d/terrace.data") != std::string::npos);
}

namespace {
// Sets `slot`'s u32 at `at` to `v` and, with `reseal`, gives it a matching slot_check again.
void PatchSlot(std::byte* slot, std::size_t at, std::uint32_t v, bool reseal) {
  PutLe(slot + at, v, 4);
  if (reseal) PutLe(slot + 80, Checksum(std::span<const std::byte>(slot, 80)), 8);
}
}  // namespace

TEST_CASE("nvme superblock unit: an intact slot of another version or geometry refuses it, never falls back",
          "[nvme][format]") {
  struct Case {
    std::size_t at;  // field offset in the slot
    std::uint32_t value;
    bool invalid_argument;  // else Corruption
    const char* says;
  };
  const Case cases[] = {{8, 3, true, "version 3"}, {8, 1, true, "version 1"}, {12, 8192, false, "geometry"}};
  for (const Case& c : cases) {
    for (std::uint64_t newer_seq : {2, 3}) {  // the patched (newer) slot is slot 0, then slot 1
      INFO("field at " << c.at << " = " << c.value << ", patched slot " << newer_seq % 2);
      std::vector<std::byte> unit(kSuperblockBytes, std::byte{0});
      Superblock sb;
      sb.capacity_bytes = 64 * kUnit;
      sb.sequence = newer_seq - 1;
      sb.EncodeIntoUnit(unit.data());
      sb.sequence = newer_seq;
      sb.EncodeIntoUnit(unit.data());
      std::byte* patched = unit.data() + (newer_seq % 2) * kSuperblockSlotStride;
      std::vector<std::byte> torn = unit;
      PatchSlot(patched, c.at, c.value, /*reseal=*/true);
      auto s = Superblock::DecodeUnit(unit, "/d/terrace.data").status();
      REQUIRE_FALSE(s.ok());
      CHECK(s.IsInvalidArgument() == c.invalid_argument);
      CHECK(s.IsCorruption() == !c.invalid_argument);
      CHECK(s.message().find(c.says) != std::string::npos);
      CHECK(s.message().find("/d/terrace.data") != std::string::npos);
      if (c.value == 1) continue;  // version 1 has no slot_check at 80: it is never torn
      // The same bytes with a slot_check that fails: torn, so the older slot is used.
      PatchSlot(torn.data() + (newer_seq % 2) * kSuperblockSlotStride, c.at, c.value, /*reseal=*/false);
      auto back = Superblock::DecodeUnit(torn, "u");
      REQUIRE(back.ok());
      CHECK(back->sequence == newer_seq - 1);
    }
  }
}

TEST_CASE("nvme superblock: a damaged slot is reported damaged whatever its version field reads", "[nvme][format]") {
  Superblock sb;
  sb.capacity_bytes = 64 * kUnit;
  std::byte buf[kSuperblockHeaderBytes];
  sb.EncodeTo(buf);
  PatchSlot(buf, 8, 7, /*reseal=*/false);
  auto s = Superblock::Decode(buf, "x").status();
  CHECK(s.IsCorruption());
  CHECK(s.message().find("checksum mismatch") != std::string::npos);
}

TEST_CASE("nvme descriptor: round trip; any flipped bit or a wrong magic is no descriptor", "[nvme][format]") {
  std::mt19937_64 rng(5);
  for (int i = 0; i < 300; ++i) {
    Descriptor d;
    for (auto& b : d.uuid) b = static_cast<std::uint8_t>(rng());
    d.key = BlockKey{static_cast<std::uint32_t>(rng()), BlockKind::kKv, static_cast<std::uint32_t>(rng()),
                     ContentId{rng(), rng()}};
    d.rec.offset = (rng() % (1ull << 30)) * kUnit;
    d.rec.length = rng() % (1ull << 32);
    d.rec.checksum = rng();
    d.rec.generation = rng();
    d.rec.codec = static_cast<Codec>(rng() % 6);
    std::vector<std::byte> unit(kUnit, std::byte{0});
    d.EncodeTo(unit.data());
    auto back = Descriptor::Decode(unit);
    REQUIRE(back.has_value());
    CHECK(back->uuid == d.uuid);
    CHECK(back->key == d.key);
    CHECK(back->rec == d.rec);
    const std::size_t bit = rng() % (kDescriptorBytes * 8);
    unit[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
    CHECK_FALSE(Descriptor::Decode(unit).has_value());
  }
  std::vector<std::byte> zeros(kUnit, std::byte{0});
  CHECK_FALSE(Descriptor::Decode(zeros).has_value());
}
