// On-disk encodings of the NVMe tier: the data-file superblock (two slots), the extent
// descriptor, the index manifest and index records. docs/nvme-format.md is the normative
// description; this file implements it. All multi-byte integers are little-endian.
// Thread-safety: pure functions.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "src/common/aligned_buffer.h"
#include "terrace/block.h"
#include "terrace/status.h"

namespace terrace::nvme {

inline constexpr std::uint64_t kUnit = 4096;             // extent alignment and allocation unit, bytes
inline constexpr std::uint64_t kSuperblockBytes = 4096;  // data file bytes [0, 4096) hold the superblock
inline constexpr std::uint64_t kDataStart = kSuperblockBytes;
inline constexpr std::uint32_t kFormatVersion = 2;
inline constexpr std::size_t kSuperblockSlotStride = 2048;  // slot s at byte s * 2048 of the superblock
inline constexpr std::size_t kSuperblockHeaderBytes = 88;   // one encoded slot
inline constexpr std::size_t kManifestBytes = kSuperblockHeaderBytes;
inline constexpr std::size_t kDescriptorBytes = 104;        // encoded; the rest of its 4 KiB unit is zero
inline constexpr std::size_t kRecordBytes = 48;
inline constexpr std::uint8_t kRecordVersion = 2;
inline constexpr std::uint16_t kDescVersion = 1;  // the descriptor's desc_version
// The first 8 bytes of a superblock slot (and of the manifest): what marks a Terrace data file.
inline constexpr char kSuperblockMagic[8] = {'T', 'R', 'R', 'C', 'N', 'V', 'M', 'E'};
// RocksDB keys of the manifest (the store's identity) and of the commit counter. Block records
// use 25-byte keys, so neither can collide with one.
inline constexpr std::string_view kManifestKey = "!terrace-manifest";
inline constexpr std::string_view kCommitKey = "!terrace-commit";
// The last index-writing group commit's redo record (group_commit.h): the keys it put and the
// extents it released, so an open can finish writing their descriptor units after a crash.
inline constexpr std::string_view kRedoKey = "!terrace-redo";

// The formats' integers: `bytes` (1 to 8) bytes, little-endian.
void PutLe(std::byte* out, std::uint64_t v, int bytes);
std::uint64_t GetLe(const std::byte* in, int bytes);

using terrace::RoundUp;  // v rounded up to a multiple of a unit

struct Superblock {
  // Identity (fixed at creation).
  std::uint32_t format_version = kFormatVersion;
  std::uint32_t unit = static_cast<std::uint32_t>(kUnit);
  std::uint64_t capacity_bytes = 0;  // size of the data area including the superblock
  std::array<std::uint8_t, 16> uuid{};
  std::uint64_t data_start = kDataStart;
  // State (rewritten in place; the newest valid slot wins).
  std::uint64_t sequence = 0;          // +1 per superblock write; the write goes to slot sequence % 2
  std::uint64_t indexed_commit = 0;    // index commit counter known durable: the index must hold at least this
  std::uint64_t generation_limit = 0;  // every generation in any descriptor on disk is < this
  bool operator==(const Superblock&) const = default;

  // Same store: equal identity fields (the state fields may differ).
  bool SameStore(const Superblock& o) const {
    return format_version == o.format_version && unit == o.unit && capacity_bytes == o.capacity_bytes &&
           uuid == o.uuid && data_start == o.data_start;
  }
  std::string UuidString() const;
  // Writes kSuperblockHeaderBytes bytes (one slot).
  void EncodeTo(std::byte* out) const;
  // Decodes one slot. `where` names the file or index for error messages.
  static Result<Superblock> Decode(std::span<const std::byte> in, const std::string& where);
  // Writes this superblock into slot sequence % 2 of the 4 KiB superblock `unit`; the other slot's
  // bytes are left as they are (so a torn write of the unit can damage only the slot being written).
  void EncodeIntoUnit(std::byte* unit_bytes) const;
  // The newest valid slot of a 4 KiB superblock. A slot is passed over only when absent (no magic)
  // or torn (its slot_check fails); an intact slot this build cannot use refuses the unit: another
  // format version (version 1 included) with InvalidArgument, an invalid geometry with Corruption.
  static Result<Superblock> DecodeUnit(std::span<const std::byte> unit_bytes, const std::string& where);
  // True when either slot of the superblock unit starts with kSuperblockMagic: Terrace wrote it
  // (intact or damaged), as opposed to a file or device something else wrote.
  static bool SlotsHaveMagic(std::span<const std::byte> unit_bytes);
};

// One block's index entry: where its bytes live and how to validate them.
struct Record {
  std::uint64_t offset = 0;      // byte offset of the extent in the data file, multiple of kUnit
  std::uint64_t length = 0;      // block size in bytes
  std::uint64_t checksum = 0;    // XXH3-64 of the block bytes (terrace::Checksum)
  std::uint64_t generation = 0;  // store-wide put counter; higher is newer
  Codec codec = Codec::kRaw;
  bool operator==(const Record&) const = default;

  // The data units, then one descriptor unit.
  std::uint64_t data_bytes() const { return RoundUp(length, kUnit); }
  std::uint64_t extent_bytes() const { return data_bytes() + kUnit; }
  std::uint64_t descriptor_offset() const { return offset + data_bytes(); }
  // True when the whole extent is unit-aligned and inside [data_start, capacity) (no overflow for
  // any field values: an index record is untrusted input).
  bool FitsDataArea(std::uint64_t data_start, std::uint64_t capacity) const {
    return offset % kUnit == 0 && offset >= data_start && offset < capacity && length <= capacity &&
           extent_bytes() <= capacity - offset;
  }
  void EncodeTo(std::byte out[kRecordBytes]) const;
  // Corruption when the bytes are damaged (wrong size, record_check mismatch); InvalidArgument when
  // they are intact but of another record_version (written by another Terrace version).
  static Result<Record> Decode(std::span<const std::byte> in);
};

// The self-description of an extent, in the 4 KiB unit after its data. Its check is the commit
// marker: an extent whose descriptor does not decode holds no block.
struct Descriptor {
  std::array<std::uint8_t, 16> uuid{};  // the store's
  BlockKey key;
  Record rec;
  // Writes kDescriptorBytes bytes.
  void EncodeTo(std::byte* out) const;
  // nullopt unless the bytes hold a descriptor (magic, version, check) with a valid key.
  static std::optional<Descriptor> Decode(std::span<const std::byte> in);
  // True when the bytes start with the descriptor magic: with Decode failing, a damaged
  // descriptor (or, rarely, block data that happens to start with those 8 bytes).
  static bool HasMagic(std::span<const std::byte> in);
  // An intact descriptor of another desc_version: its version and the store uuid it names.
  struct OtherVersionInfo {
    std::uint16_t version = 0;
    std::array<std::uint8_t, 16> uuid{};
  };
  // An intact descriptor of another version, nullopt for anything else: the magic, a desc_version
  // other than this build's, and a desc_check over bytes [0, 96) that matches (every desc_version
  // keeps those three, and the uuid, where version 1 has them). With this store's uuid its extent
  // was written by another Terrace version: it is neither free space nor damage. With another
  // uuid it is foreign (an earlier store's, or block data that happens to look like one).
  static std::optional<OtherVersionInfo> OtherVersion(std::span<const std::byte> in);
};

}  // namespace terrace::nvme
