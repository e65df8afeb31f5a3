// Hardware descriptions for the planner: one node (GPUs with HBM, host RAM, NVMe drives, links).
// Presets are compiled in; a JSON file describes your own (docs/plan.md, "Hardware files"). Units:
// bytes, bytes per second, FLOP/s. Pure values, thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "terrace/status.h"

namespace terrace::plan {

struct Hardware {
  std::string name;
  int gpus = 8;                             // GPUs per node
  std::uint64_t hbm_bytes_per_gpu = 0;
  double hbm_bandwidth_per_gpu = 0;         // bytes/s, HBM <-> SMs
  double gpu_flops_per_gpu = 0;             // dense bf16 FLOP/s
  double mfu = 0.4;                         // share of gpu_flops prefill achieves
  double pcie_bandwidth_per_gpu = 0;        // bytes/s per direction, pinned host <-> one GPU
  std::uint64_t host_bytes = 0;             // pinned host RAM per node usable for Terrace
  std::uint64_t nvme_bytes = 0;             // NVMe capacity per node
  double nvme_read_bandwidth = 0;           // bytes/s, all drives of the node together
  double nvme_write_bandwidth = 0;

  std::uint64_t hbm_bytes() const { return hbm_bytes_per_gpu * static_cast<std::uint64_t>(gpus); }
  double pcie_bandwidth() const { return pcie_bandwidth_per_gpu * gpus; }
  double hbm_bandwidth() const { return hbm_bandwidth_per_gpu * gpus; }
  double gpu_flops() const { return gpu_flops_per_gpu * gpus; }
};

// Bounds ValidateHardware puts on every size and rate: far above any node (an H200 has 1.5e11
// bytes and 4.8e12 bytes/s of HBM, 9.9e14 FLOP/s), so only a mistake reaches them, and far enough
// below the double and uint64 ranges that the node totals (x gpus <= 4096) stay finite.
inline constexpr std::uint64_t kMaxHardwareBytes = 1ull << 62;
inline constexpr double kMaxHardwareBandwidth = 1e16;  // bytes/s, per GPU or per node
inline constexpr double kMaxHardwareFlops = 1e19;      // FLOP/s per GPU
// And below: far under any node, so a size or rate given in GB or GB/s (141 for an H200's HBM)
// is refused as a units mistake, not planned as 141 bytes (it planned 1e12 % utilisation).
inline constexpr std::uint64_t kMinHardwareBytes = 1ull << 20;
inline constexpr double kMinHardwareBandwidth = 1e6;  // bytes/s
inline constexpr double kMinHardwareFlops = 1e9;      // FLOP/s per GPU

std::vector<std::string> HardwarePresetNames();  // "h200-gen5", "h100-gen4"
// InvalidArgument listing the presets for an unknown name.
Result<Hardware> HardwarePreset(std::string_view name);
// Parses a hardware JSON document (docs/plan.md): an object whose optional "base" names a preset to
// start from and whose other keys are the fields above by name. Unknown or repeated keys, wrong
// types, zero or negative sizes, values over the bounds above are InvalidArgument naming `source`
// and the key; a number no double holds (1e400) is named as out of range.
Result<Hardware> ParseHardwareJson(std::string_view text, std::string_view source);
// A preset name, or else a path to a JSON file.
Result<Hardware> LoadHardware(std::string_view name_or_path);
// Checks every field is positive and within the bounds above, and mfu in (0, 1].
Status ValidateHardware(const Hardware& hw, std::string_view source);
std::string HardwareToJson(const Hardware& hw);  // the same keys ParseHardwareJson reads

}  // namespace terrace::plan
