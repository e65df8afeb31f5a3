#include "tiers/nvme/format.h"

#include <xxhash.h>

#include <cstring>

#include <fmt/format.h>

namespace terrace::nvme {
namespace {

constexpr char kMagic[8] = {'T', 'R', 'R', 'C', 'N', 'V', 'M', 'E'};

void PutLe(std::byte* out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}

std::uint64_t GetLe(const std::byte* in, int bytes) {
  std::uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<std::uint8_t>(in[i]);
  return v;
}

}  // namespace

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
  std::memcpy(out, kMagic, sizeof kMagic);
  PutLe(out + 8, format_version, 4);
  PutLe(out + 12, unit, 4);
  PutLe(out + 16, capacity_bytes, 8);
  std::memcpy(out + 24, uuid.data(), uuid.size());
  PutLe(out + 40, data_start, 8);
  PutLe(out + 48, XXH3_64bits(out, 48), 8);
}

Result<Superblock> Superblock::Decode(std::span<const std::byte> in, const std::string& where) {
  if (in.size() < kSuperblockHeaderBytes) {
    return Status::InvalidArgument(fmt::format(
        "{}: not a Terrace store: superblock has {} bytes, expected {}", where, in.size(), kSuperblockHeaderBytes));
  }
  if (std::memcmp(in.data(), kMagic, sizeof kMagic) != 0) {
    return Status::InvalidArgument(fmt::format(
        "{}: not a Terrace store (magic bytes do not read 'TRRCNVME'); point the NVMe tier at an empty "
        "directory or at an existing Terrace store",
        where));
  }
  if (GetLe(in.data() + 48, 8) != XXH3_64bits(in.data(), 48)) {
    return Status::Corruption(fmt::format(
        "{}: Terrace superblock checksum mismatch; the store header is damaged, restore it from a backup "
        "or delete the directory to start empty",
        where));
  }
  Superblock sb;
  sb.format_version = static_cast<std::uint32_t>(GetLe(in.data() + 8, 4));
  sb.unit = static_cast<std::uint32_t>(GetLe(in.data() + 12, 4));
  sb.capacity_bytes = GetLe(in.data() + 16, 8);
  std::memcpy(sb.uuid.data(), in.data() + 24, sb.uuid.size());
  sb.data_start = GetLe(in.data() + 40, 8);
  if (sb.format_version != kFormatVersion) {
    return Status::InvalidArgument(fmt::format(
        "{}: Terrace store format version {} is not supported by this build (supports {}); open it with a "
        "matching Terrace version",
        where, sb.format_version, kFormatVersion));
  }
  if (sb.unit != kUnit || sb.data_start != kDataStart || sb.capacity_bytes < kDataStart + kUnit ||
      sb.capacity_bytes % kUnit != 0) {
    return Status::Corruption(fmt::format("{}: superblock has an invalid geometry (unit {}, data start {}, capacity {})",
                                          where, sb.unit, sb.data_start, sb.capacity_bytes));
  }
  return sb;
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
  if (static_cast<std::uint8_t>(in[0]) != kRecordVersion) {
    return Status::Corruption(fmt::format("index record version {} is unknown (expected {})",
                                          static_cast<unsigned>(in[0]), kRecordVersion));
  }
  if (GetLe(in.data() + 40, 8) != XXH3_64bits(in.data(), 40)) {
    return Status::Corruption("index record checksum mismatch");
  }
  Record r;
  r.codec = static_cast<Codec>(GetLe(in.data() + 2, 2));
  r.offset = GetLe(in.data() + 8, 8);
  r.length = GetLe(in.data() + 16, 8);
  r.checksum = GetLe(in.data() + 24, 8);
  r.generation = GetLe(in.data() + 32, 8);
  return r;
}

}  // namespace terrace::nvme
