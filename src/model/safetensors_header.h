// The safetensors header: parsing and strict validation, as a pure function over the file's bytes
// (so the fuzzer can drive it without touching the file system).
//
// File layout: u64 little-endian N | N bytes of UTF-8 JSON (may be padded with trailing spaces) |
// data section. The JSON maps tensor name -> {"dtype", "shape", "data_offsets": [begin, end]} with
// offsets relative to the start of the data section, plus an optional "__metadata__" string map.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "src/model/tensor.h"
#include "terrace/status.h"

namespace terrace::model {

inline constexpr std::uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;  // refuse larger headers
inline constexpr int kMaxSafetensorsJsonDepth = 64;                      // refuse deeper nesting

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;  // relative to the data section
  std::uint64_t end = 0;
};

struct SafetensorsHeader {
  std::uint64_t data_start = 0;  // 8 + header length: file offset of the data section
  std::uint64_t data_size = 0;   // bytes after data_start
  std::vector<SafetensorsEntry> entries;  // in name order
  std::map<std::string, std::string> metadata;
};

// Validates: file >= 8 bytes; header length < kMaxSafetensorsHeaderBytes and within the file; JSON
// well-formed, an object, nesting depth <= kMaxSafetensorsJsonDepth; every entry has a known dtype, a
// shape of non-negative dims whose element and byte counts do not overflow, data_offsets with
// begin <= end inside the data section, end - begin == dtype size * numel; the tensors' byte ranges
// tile the data section exactly (no overlap, no gap, no trailing bytes); __metadata__ maps strings to
// strings. Errors are Corruption, naming `source`, the tensor and the problem, except a dtype the
// safetensors format defines that Terrace cannot compute with (F8_*, F6_*, F4, C64): InvalidArgument,
// a valid file Terrace refuses. Never throws; on an error `out` holds no entries.
Status ParseSafetensorsHeader(std::span<const std::byte> file_bytes, std::string_view source,
                              SafetensorsHeader* out);

}  // namespace terrace::model
