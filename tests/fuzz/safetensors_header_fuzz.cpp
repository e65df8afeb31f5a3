// libFuzzer target for the safetensors header parser: any input must yield OK, a Corruption, or an
// InvalidArgument (a defined dtype Terrace cannot compute with), never a crash, hang or sanitizer report; on OK every tensor range lies inside the data section
// and no two ranges overlap.
#include <cstddef>
#include <cstdint>
#include <span>

#include "src/model/safetensors_header.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace terrace::model;
  SafetensorsHeader header;
  const terrace::Status s =
      ParseSafetensorsHeader(std::span<const std::byte>(reinterpret_cast<const std::byte*>(data), size), "fuzz", &header);
  if (!s.ok()) {
    if (!(s.IsCorruption() || s.IsInvalidArgument()) || !header.entries.empty()) __builtin_trap();
    return 0;
  }
  if (header.data_start + header.data_size != size) __builtin_trap();
  for (const auto& e : header.entries) {
    if (e.begin > e.end || e.end > header.data_size) __builtin_trap();
    std::uint64_t bytes = DTypeSize(e.dtype);  // the parser guarantees this product does not overflow
    for (std::int64_t d : e.shape) bytes *= static_cast<std::uint64_t>(d);
    if (e.end - e.begin != bytes) __builtin_trap();
  }
  return 0;
}
