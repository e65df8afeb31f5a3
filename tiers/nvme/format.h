// On-disk encodings of the NVMe tier: the data-file superblock, the index manifest and index
// records. docs/nvme-format.md is the normative description; this file implements it.
// All multi-byte integers are little-endian. Thread-safety: pure functions.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "terrace/block.h"
#include "terrace/status.h"

namespace terrace::nvme {

inline constexpr std::uint64_t kUnit = 4096;             // extent alignment and allocation unit, bytes
inline constexpr std::uint64_t kSuperblockBytes = 4096;  // data file bytes [0, 4096) hold the superblock
inline constexpr std::uint64_t kDataStart = kSuperblockBytes;
inline constexpr std::uint32_t kFormatVersion = 1;
inline constexpr std::size_t kSuperblockHeaderBytes = 56;  // encoded header; the rest of the 4 KiB is zero
inline constexpr std::size_t kRecordBytes = 48;
inline constexpr std::uint8_t kRecordVersion = 1;
// RocksDB key of the manifest (a copy of the superblock header). Block records use 25-byte keys.
inline constexpr std::string_view kManifestKey = "!terrace-manifest";

inline constexpr std::uint64_t RoundUp(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }

struct Superblock {
  std::uint32_t format_version = kFormatVersion;
  std::uint32_t unit = static_cast<std::uint32_t>(kUnit);
  std::uint64_t capacity_bytes = 0;  // size of the data area including the superblock
  std::array<std::uint8_t, 16> uuid{};
  std::uint64_t data_start = kDataStart;
  bool operator==(const Superblock&) const = default;

  std::string UuidString() const;
  // Writes kSuperblockHeaderBytes bytes.
  void EncodeTo(std::byte* out) const;
  // `where` names the file or index for error messages.
  static Result<Superblock> Decode(std::span<const std::byte> in, const std::string& where);
};

// One block's index entry: where its bytes live and how to validate them.
struct Record {
  std::uint64_t offset = 0;      // byte offset of the extent in the data file, multiple of kUnit
  std::uint64_t length = 0;      // block size in bytes; the extent spans RoundUp(max(length,1), kUnit)
  std::uint64_t checksum = 0;    // XXH3-64 of the block bytes (terrace::Checksum)
  std::uint64_t generation = 0;  // store-wide put counter; higher is newer
  Codec codec = Codec::kRaw;
  bool operator==(const Record&) const = default;

  std::uint64_t extent_bytes() const { return RoundUp(length == 0 ? 1 : length, kUnit); }
  void EncodeTo(std::byte out[kRecordBytes]) const;
  static Result<Record> Decode(std::span<const std::byte> in);
};

}  // namespace terrace::nvme
