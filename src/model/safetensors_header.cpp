#include "src/model/safetensors_header.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "src/common/json_unique.h"

namespace terrace::model {
namespace {

using Json = nlohmann::json;

Status Bad(std::string_view source, std::string_view what) {
  return Status::Corruption(fmt::format("safetensors file '{}': {}; the file is damaged or not safetensors",
                                        source, what));
}

Status BadTensor(std::string_view source, std::string_view tensor, std::string_view what) {
  return Status::Corruption(
      fmt::format("safetensors file '{}': tensor '{}': {}; the file is damaged or not safetensors", source,
                  tensor, what));
}

// Dtype names the safetensors format defines (the Rust crate's Dtype enum and the Python
// package's names) that Terrace has no arithmetic for: a valid file, refused as such rather than
// called damaged.
bool IsUncomputableSafetensorsDtype(std::string_view name) {
  static constexpr std::array<std::string_view, 9> kNames = {
      "F4", "F6_E2M3", "F6_E3M2", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "C64"};
  return std::find(kNames.begin(), kNames.end(), name) != kNames.end();
}

// "F32, F16, ...": every dtype Terrace reads.
std::string ReadableDtypes() {
  std::vector<std::string_view> names;
  for (int d = 0; d <= static_cast<int>(DType::kBool); ++d) names.push_back(DTypeName(static_cast<DType>(d)));
  return fmt::format("{}", fmt::join(names, ", "));
}

Status ParseEntry(std::string_view source, const std::string& name, const Json& v, std::uint64_t data_size,
                  SafetensorsEntry* e) {
  e->name = name;
  if (!v.is_object()) return BadTensor(source, name, "entry is not a JSON object");
  const auto dt = v.find("dtype");
  const auto sh = v.find("shape");
  const auto off = v.find("data_offsets");
  if (dt == v.end() || !dt->is_string()) return BadTensor(source, name, "missing or non-string 'dtype'");
  if (sh == v.end() || !sh->is_array()) return BadTensor(source, name, "missing or non-array 'shape'");
  if (off == v.end() || !off->is_array() || off->size() != 2) {
    return BadTensor(source, name, "'data_offsets' must be an array [begin, end]");
  }
  auto dtype = ParseDType(dt->get_ref<const std::string&>());
  if (!dtype.ok()) {
    if (IsUncomputableSafetensorsDtype(dt->get_ref<const std::string&>())) {
      return Status::InvalidArgument(fmt::format(
          "safetensors file '{}': tensor '{}' has dtype {}; Terrace cannot compute with {} (it reads {}); convert "
          "the tensor to BF16 or F32",
          source, name, dt->get_ref<const std::string&>(), dt->get_ref<const std::string&>(), ReadableDtypes()));
    }
    return BadTensor(source, name, dtype.status().message());
  }
  e->dtype = *dtype;

  // numel and bytes in 128-bit-safe steps: stop as soon as either exceeds the int64 range.
  constexpr std::uint64_t kMax = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  std::uint64_t numel = 1;
  bool zero = false;
  for (const auto& d : *sh) {
    if (!d.is_number_integer()) return BadTensor(source, name, fmt::format("shape {} has a non-integer dim", sh->dump()));
    if (d.is_number_unsigned() ? false : d.get<std::int64_t>() < 0) {
      return BadTensor(source, name, fmt::format("shape {} has a negative dim", sh->dump()));
    }
    const std::uint64_t dim = d.get<std::uint64_t>();
    if (dim > kMax) return BadTensor(source, name, fmt::format("shape {} has a dim beyond 2^63", sh->dump()));
    e->shape.push_back(static_cast<std::int64_t>(dim));
    if (dim == 0) zero = true;
    if (!zero && numel > kMax / dim) {
      return BadTensor(source, name, fmt::format("shape {} overflows the element count", sh->dump()));
    }
    numel = zero ? 0 : numel * dim;
  }
  if (zero) numel = 0;
  const std::uint64_t esize = DTypeSize(e->dtype);
  if (numel > kMax / esize) {
    return BadTensor(source, name, fmt::format("shape {} of {} overflows the byte count", sh->dump(), dt->get_ref<const std::string&>()));
  }
  const std::uint64_t nbytes = numel * esize;

  for (const auto& o : *off) {
    if (!o.is_number_unsigned()) {
      return BadTensor(source, name, fmt::format("data_offsets {} must be non-negative integers", off->dump()));
    }
  }
  e->begin = (*off)[0].get<std::uint64_t>();
  e->end = (*off)[1].get<std::uint64_t>();
  if (e->begin > e->end) return BadTensor(source, name, fmt::format("data_offsets {} has begin > end", off->dump()));
  if (e->end > data_size) {
    return BadTensor(source, name, fmt::format("data_offsets {} run past the data section ({} bytes)", off->dump(),
                                               data_size));
  }
  if (e->end - e->begin != nbytes) {
    return BadTensor(source, name,
                     fmt::format("data_offsets {} span {} bytes but {} {} needs {}", off->dump(), e->end - e->begin,
                                 DTypeName(e->dtype), ShapeString(e->shape), nbytes));
  }
  return Status::Ok();
}

Status ParseImpl(std::span<const std::byte> file_bytes, std::string_view source, SafetensorsHeader* out) {
  if (file_bytes.size() < 8) {
    return Bad(source, fmt::format("{} bytes is too short for the 8-byte header length", file_bytes.size()));
  }
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<std::uint8_t>(file_bytes[static_cast<std::size_t>(i)]);
  if (n >= kMaxSafetensorsHeaderBytes) {
    return Bad(source, fmt::format("header length {} is over the {} byte limit", n, kMaxSafetensorsHeaderBytes));
  }
  if (n > file_bytes.size() - 8) {
    return Bad(source, fmt::format("header length {} runs past the end of the file ({} bytes)", n, file_bytes.size()));
  }
  if (n < 2) return Bad(source, fmt::format("header length {} is too short for a JSON object", n));
  const std::string_view text(reinterpret_cast<const char*>(file_bytes.data() + 8), static_cast<std::size_t>(n));
  if (text.front() != '{') return Bad(source, "header does not start with '{'");
  if (JsonNestingDepth(text) > kMaxSafetensorsJsonDepth) {  // checked before parsing: a linear scan
    return Bad(source, fmt::format("header JSON nests deeper than {} levels", kMaxSafetensorsJsonDepth));
  }
  Result<Json> parsed = ParseJsonUniqueKeys(text);  // a tensor named twice: refused, not last-wins
  if (!parsed.ok()) return Bad(source, fmt::format("header: {}", parsed.status().message()));
  Json root = std::move(*parsed);
  if (!root.is_object()) return Bad(source, "header JSON is not an object");

  out->data_start = 8 + n;
  out->data_size = file_bytes.size() - out->data_start;
  for (const auto& [key, value] : root.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) return Bad(source, "__metadata__ is not an object");
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) return Bad(source, fmt::format("__metadata__ value for '{}' is not a string", mk));
        out->metadata.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    SafetensorsEntry entry;
    TERRACE_RETURN_IF_ERROR(ParseEntry(source, key, value, out->data_size, &entry));
    out->entries.push_back(std::move(entry));
  }

  // The tensors must tile the data section exactly: sorted by offset, each begins where the previous
  // one ended, the first at 0 and the last at the end of the file. A gap, an overlap or trailing bytes
  // mean the header and the data disagree (e.g. a header length off by one shifts every tensor).
  std::vector<const SafetensorsEntry*> by_offset;
  for (const auto& e : out->entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const SafetensorsEntry* a, const SafetensorsEntry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  std::uint64_t covered = 0;
  const SafetensorsEntry* prev = nullptr;
  for (const SafetensorsEntry* e : by_offset) {
    if (e->begin < covered) {
      return Bad(source, fmt::format("tensors '{}' [{}, {}) and '{}' [{}, {}) overlap", prev->name, prev->begin,
                                     prev->end, e->name, e->begin, e->end));
    }
    if (e->begin > covered) {
      return Bad(source, fmt::format("bytes [{}, {}) of the data section belong to no tensor (before '{}'); the "
                                     "tensors must cover the data section exactly",
                                     covered, e->begin, e->name));
    }
    covered = e->end;
    prev = e;
  }
  if (covered != out->data_size) {
    return Bad(source, fmt::format("the tensors cover {} bytes but the data section after the {}-byte header holds "
                                   "{}; the header length or the file size is wrong",
                                   covered, n, out->data_size));
  }
  return Status::Ok();
}

}  // namespace

Status ParseSafetensorsHeader(std::span<const std::byte> file_bytes, std::string_view source,
                              SafetensorsHeader* out) {
  *out = SafetensorsHeader{};
  try {  // nlohmann::json may still throw (e.g. bad_alloc); no exception leaves this function
    Status s = ParseImpl(file_bytes, source, out);
    if (!s.ok()) *out = SafetensorsHeader{};
    return s;
  } catch (const std::exception& e) {
    *out = SafetensorsHeader{};
    return Bad(source, fmt::format("header could not be parsed ({})", e.what()));
  }
}

}  // namespace terrace::model
