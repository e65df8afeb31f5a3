#include "tiers/nvme/format.h"

#include <xxhash.h>

#include <array>
#include <cstring>

#include <fmt/format.h>

namespace terrace::nvme {
namespace {

constexpr char kDescMagic[8] = {'T', 'R', 'R', 'C', 'D', 'E', 'S', 'C'};
constexpr std::size_t kSbCheckAt = 80;
constexpr std::size_t kDescCheckAt = 96;

// True when `slot` (at least kSuperblockHeaderBytes) carries a matching slot_check.
bool SlotCheckMatches(std::span<const std::byte> slot) {
  return GetLe(slot.data() + kSbCheckAt, 8) == XXH3_64bits(slot.data(), kSbCheckAt);
}

// True when a slot reading version 1 is a slot of this version with a damaged version field: its
// slot_check matches once the field reads kFormatVersion (a real version-1 slot has no slot_check).
bool DamagedVersionField(std::span<const std::byte> slot) {
  if (slot.size() < kSuperblockHeaderBytes) return false;
  std::array<std::byte, kSuperblockHeaderBytes> copy;
  std::memcpy(copy.data(), slot.data(), copy.size());
  PutLe(copy.data() + 8, kFormatVersion, 4);
  return SlotCheckMatches(copy);
}

// True when a slot was written whole: its magic, and a matching slot_check (or version 1, whose
// check lies elsewhere). Only a slot that is not intact (absent or torn) may be passed over.
bool SlotIntact(std::span<const std::byte> slot) {
  if (std::memcmp(slot.data(), kSuperblockMagic, sizeof kSuperblockMagic) != 0) return false;
  return (GetLe(slot.data() + 8, 4) == 1 && !DamagedVersionField(slot)) || SlotCheckMatches(slot);
}

// True when a descriptor unit (at least kDescriptorBytes) carries a matching desc_check.
bool DescCheckMatches(std::span<const std::byte> desc) {
  return GetLe(desc.data() + kDescCheckAt, 8) == XXH3_64bits(desc.data(), kDescCheckAt);
}

}  // namespace

void PutLe(std::byte* out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}

std::uint64_t GetLe(const std::byte* in, int bytes) {
  std::uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<std::uint8_t>(in[i]);
  return v;
}

std::string Superblock::UuidString() const {
  std::string s;
  for (std::size_t i = 0; i < uuid.size(); ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) s += '-';
    s += fmt::format("{:02x}", uuid[i]);
  }
  return s;
}

void Superblock::EncodeTo(std::byte* out) const {
  std::memset(out, 0, kSuperblockHeaderBytes);
  std::memcpy(out, kSuperblockMagic, sizeof kSuperblockMagic);
  PutLe(out + 8, format_version, 4);
  PutLe(out + 12, unit, 4);
  PutLe(out + 16, capacity_bytes, 8);
  std::memcpy(out + 24, uuid.data(), uuid.size());
  PutLe(out + 40, data_start, 8);
  PutLe(out + 48, sequence, 8);
  PutLe(out + 56, indexed_commit, 8);
  PutLe(out + 64, generation_limit, 8);
  PutLe(out + kSbCheckAt, XXH3_64bits(out, kSbCheckAt), 8);
}

Result<Superblock> Superblock::Decode(std::span<const std::byte> in, const std::string& where) {
  if (in.size() < 16) {
    return Status::InvalidArgument(fmt::format(
        "{}: not a Terrace store: superblock has {} bytes, expected {}", where, in.size(), kSuperblockHeaderBytes));
  }
  if (std::memcmp(in.data(), kSuperblockMagic, sizeof kSuperblockMagic) != 0) {
    return Status::InvalidArgument(fmt::format(
        "{}: not a Terrace store (magic bytes do not read 'TRRCNVME'); point the NVMe tier at an empty "
        "directory or at an existing Terrace store",
        where));
  }
  const auto version = static_cast<std::uint32_t>(GetLe(in.data() + 8, 4));
  if (version == 1 && !DamagedVersionField(in)) {  // before the slot_check: version 1 kept its check elsewhere
    return Status::InvalidArgument(fmt::format(
        "{}: this Terrace store has on-disk format version 1, which this build no longer opens (it needs "
        "version {}: extents that describe themselves, so the index can be rebuilt); read its blocks out with "
        "the Terrace release that wrote it, or delete the store directory to start empty",
        where, kFormatVersion));
  }
  if (in.size() < kSuperblockHeaderBytes) {
    return Status::InvalidArgument(fmt::format(
        "{}: not a Terrace store: superblock has {} bytes, expected {}", where, in.size(), kSuperblockHeaderBytes));
  }
  if (!SlotCheckMatches(in)) {
    return Status::Corruption(fmt::format(
        "{}: Terrace superblock checksum mismatch: the store header is damaged. Do not delete the store: the "
        "header holds no block, every block's extent carries a descriptor a scan finds, and the index manifest "
        "keeps the store's identity; keep the data file and the index as they are (copy them first) and restore "
        "the data file's first 4 KiB from a backup if you have one (Terrace does not rebuild a header itself)",
        where));
  }
  if (version != kFormatVersion) {
    return Status::InvalidArgument(fmt::format(
        "{}: Terrace store format version {} is not supported by this build (supports {}); open it with a "
        "matching Terrace version",
        where, version, kFormatVersion));
  }
  Superblock sb;
  sb.format_version = version;
  sb.unit = static_cast<std::uint32_t>(GetLe(in.data() + 12, 4));
  sb.capacity_bytes = GetLe(in.data() + 16, 8);
  std::memcpy(sb.uuid.data(), in.data() + 24, sb.uuid.size());
  sb.data_start = GetLe(in.data() + 40, 8);
  sb.sequence = GetLe(in.data() + 48, 8);
  sb.indexed_commit = GetLe(in.data() + 56, 8);
  sb.generation_limit = GetLe(in.data() + 64, 8);
  if (sb.unit != kUnit || sb.data_start != kDataStart || sb.capacity_bytes < kDataStart + 2 * kUnit ||
      sb.capacity_bytes % kUnit != 0) {
    return Status::Corruption(fmt::format(
        "{}: superblock has an invalid geometry (unit {}, data start {}, capacity {}; this build writes unit {} and "
        "data start {}, and a capacity that is a multiple of {} and at least {}) although its slot_check matches: "
        "it was not written by this Terrace version; open it with the Terrace version that wrote it",
        where, sb.unit, sb.data_start, sb.capacity_bytes, kUnit, kDataStart, kUnit, kDataStart + 2 * kUnit));
  }
  return sb;
}

void Superblock::EncodeIntoUnit(std::byte* unit_bytes) const {
  EncodeTo(unit_bytes + (sequence % 2) * kSuperblockSlotStride);
}

Result<Superblock> Superblock::DecodeUnit(std::span<const std::byte> unit_bytes, const std::string& where) {
  if (unit_bytes.size() < kSuperblockBytes) {
    return Status::InvalidArgument(fmt::format("{}: not a Terrace store: {} bytes, shorter than a superblock", where,
                                               unit_bytes.size()));
  }
  const auto slot_a = unit_bytes.subspan(0, kSuperblockHeaderBytes);
  const auto slot_b = unit_bytes.subspan(kSuperblockSlotStride, kSuperblockHeaderBytes);
  Result<Superblock> a = Decode(slot_a, where);
  Result<Superblock> b = Decode(slot_b, where);
  // An intact slot this build cannot use (another version, a bad geometry) refuses the unit: falling
  // back to the other slot would let a read-write open overwrite it.
  if (!a.ok() && SlotIntact(slot_a)) return a.status();
  if (!b.ok() && SlotIntact(slot_b)) return b.status();
  if (a.ok() && b.ok()) {
    if (!a->SameStore(*b)) {
      return Status::Corruption(fmt::format("{}: the two superblock slots describe different stores; the header is "
                                            "damaged",
                                            where));
    }
    return a->sequence >= b->sequence ? a : b;
  }
  if (a.ok()) return a;
  if (b.ok()) return b;
  // Neither slot is intact. Slot 0 decides what to say: not a store, or a damaged header.
  if (!a.status().IsCorruption() && b.status().IsCorruption()) return b.status();
  return a.status();
}

bool Superblock::SlotsHaveMagic(std::span<const std::byte> unit_bytes) {
  for (const std::size_t at : {std::size_t{0}, kSuperblockSlotStride}) {
    if (unit_bytes.size() >= at + sizeof kSuperblockMagic &&
        std::memcmp(unit_bytes.data() + at, kSuperblockMagic, sizeof kSuperblockMagic) == 0)
      return true;
  }
  return false;
}

void Record::EncodeTo(std::byte out[kRecordBytes]) const {
  std::memset(out, 0, kRecordBytes);
  out[0] = static_cast<std::byte>(kRecordVersion);
  PutLe(out + 2, static_cast<std::uint16_t>(codec), 2);
  PutLe(out + 8, offset, 8);
  PutLe(out + 16, length, 8);
  PutLe(out + 24, checksum, 8);
  PutLe(out + 32, generation, 8);
  PutLe(out + 40, XXH3_64bits(out, 40), 8);
}

Result<Record> Record::Decode(std::span<const std::byte> in) {
  if (in.size() != kRecordBytes) {
    return Status::Corruption(fmt::format("index record has {} bytes, expected {}", in.size(), kRecordBytes));
  }
  // The check first: only a record whose check fails is damaged. An intact record of another
  // version was written by another Terrace version, which this build must not drop or overwrite.
  if (GetLe(in.data() + 40, 8) != XXH3_64bits(in.data(), 40)) {
    return Status::Corruption("index record checksum mismatch");
  }
  if (static_cast<std::uint8_t>(in[0]) != kRecordVersion) {
    return Status::InvalidArgument(fmt::format(
        "index record version {} (its record_check is valid) is not supported by this build (it reads version {})",
        static_cast<unsigned>(in[0]), kRecordVersion));
  }
  Record r;
  r.codec = static_cast<Codec>(GetLe(in.data() + 2, 2));
  r.offset = GetLe(in.data() + 8, 8);
  r.length = GetLe(in.data() + 16, 8);
  r.checksum = GetLe(in.data() + 24, 8);
  r.generation = GetLe(in.data() + 32, 8);
  return r;
}

void Descriptor::EncodeTo(std::byte* out) const {
  std::memset(out, 0, kDescriptorBytes);
  std::memcpy(out, kDescMagic, sizeof kDescMagic);
  PutLe(out + 8, kDescVersion, 2);
  PutLe(out + 10, static_cast<std::uint16_t>(rec.codec), 2);
  std::memcpy(out + 16, uuid.data(), uuid.size());
  key.EncodeTo(out + 32);
  PutLe(out + 64, rec.offset, 8);
  PutLe(out + 72, rec.length, 8);
  PutLe(out + 80, rec.checksum, 8);
  PutLe(out + 88, rec.generation, 8);
  PutLe(out + kDescCheckAt, XXH3_64bits(out, kDescCheckAt), 8);
}

bool Descriptor::HasMagic(std::span<const std::byte> in) {
  return in.size() >= sizeof kDescMagic && std::memcmp(in.data(), kDescMagic, sizeof kDescMagic) == 0;
}

std::optional<Descriptor::OtherVersionInfo> Descriptor::OtherVersion(std::span<const std::byte> in) {
  if (in.size() < kDescriptorBytes || !HasMagic(in) || !DescCheckMatches(in)) return std::nullopt;
  OtherVersionInfo info;
  info.version = static_cast<std::uint16_t>(GetLe(in.data() + 8, 2));
  if (info.version == kDescVersion) return std::nullopt;
  std::memcpy(info.uuid.data(), in.data() + 16, info.uuid.size());
  return info;
}

std::optional<Descriptor> Descriptor::Decode(std::span<const std::byte> in) {
  if (in.size() < kDescriptorBytes || !HasMagic(in)) return std::nullopt;
  if (GetLe(in.data() + 8, 2) != kDescVersion || !DescCheckMatches(in)) return std::nullopt;
  auto key = BlockKey::Decode(in.subspan(32, BlockKey::kEncodedSize));
  if (!key.ok()) return std::nullopt;
  Descriptor d;
  std::memcpy(d.uuid.data(), in.data() + 16, d.uuid.size());
  d.key = *key;
  d.rec.codec = static_cast<Codec>(GetLe(in.data() + 10, 2));
  d.rec.offset = GetLe(in.data() + 64, 8);
  d.rec.length = GetLe(in.data() + 72, 8);
  d.rec.checksum = GetLe(in.data() + 80, 8);
  d.rec.generation = GetLe(in.data() + 88, 8);
  return d;
}

}  // namespace terrace::nvme
