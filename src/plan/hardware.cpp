#include "src/plan/hardware.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/common/json_text.h"
#include "src/common/json_unique.h"

namespace terrace::plan {
namespace {

using json = nlohmann::json;

// Sources of the figures: HBM capacity is what the driver reports as each GPU's total memory
// (nvidia-smi --query-gpu=memory.total: 143771 MiB on an H200, 81559 MiB on an H100 80GB SXM; the
// data sheets' "141 GB" and "80 GB" are neither these nor what a process can allocate, which is
// lower again: docs/plan.md, "Hardware files"); vendor data sheets for the rest (H200 HBM3e at
// 4.8 TB/s; H100 SXM at 3.35 TB/s, 989 TFLOP/s dense bf16 both) and measured copy rates (pinned
// PCIe Gen5 x16 ~55 GB/s, Gen4 ~25 GB/s per direction; Gen5 NVMe ~13 GB/s read per drive, Gen4
// ~7 GB/s).
constexpr std::uint64_t kHardwareMiB = 1ull << 20;
Hardware H200Gen5() {
  Hardware h;
  h.name = "h200-gen5";
  h.gpus = 8;
  h.hbm_bytes_per_gpu = 143'771 * kHardwareMiB;
  h.hbm_bandwidth_per_gpu = 4.8e12;
  h.gpu_flops_per_gpu = 989e12;
  h.mfu = 0.4;
  h.pcie_bandwidth_per_gpu = 55e9;
  h.host_bytes = 2ull << 40;
  h.nvme_bytes = 8 * 7'680'000'000'000ull;
  h.nvme_read_bandwidth = 8 * 13e9;
  h.nvme_write_bandwidth = 8 * 8e9;
  return h;
}

Hardware H100Gen4() {
  Hardware h;
  h.name = "h100-gen4";
  h.gpus = 8;
  h.hbm_bytes_per_gpu = 81'559 * kHardwareMiB;
  h.hbm_bandwidth_per_gpu = 3.35e12;
  h.gpu_flops_per_gpu = 989e12;
  h.mfu = 0.4;
  h.pcie_bandwidth_per_gpu = 25e9;
  h.host_bytes = 2ull << 40;
  h.nvme_bytes = 8 * 3'840'000'000'000ull;
  h.nvme_read_bandwidth = 8 * 7e9;
  h.nvme_write_bandwidth = 8 * 4e9;
  return h;
}

}  // namespace

std::vector<std::string> HardwarePresetNames() { return {"h200-gen5", "h100-gen4"}; }

Result<Hardware> HardwarePreset(std::string_view name) {
  if (name == "h200-gen5") return H200Gen5();
  if (name == "h100-gen4") return H100Gen4();
  return Status::InvalidArgument(fmt::format("unknown hardware preset '{}'; choose one of {} or give a JSON file",
                                             name, fmt::join(HardwarePresetNames(), ", ")));
}

Status ValidateHardware(const Hardware& h, std::string_view source) {
  auto bad = [&](std::string_view key, std::string_view rule) {
    return Status::InvalidArgument(fmt::format("{}: \"{}\" {}", source, key, rule));
  };
  // Rates must be positive, finite and below a bound no node comes near (a typo like 1e308 would
  // otherwise become inf in the node totals and a decode speed of 0).
  auto rate = [&](std::string_view key, double v, double min, double max, std::string_view unit) -> Status {
    if (!(v > 0)) return bad(key, "must be positive");
    if (!(v <= max)) return bad(key, fmt::format("is {:g}, over the {:g} {} a GPU or node can have; check the units", v, max, unit));
    if (v < min) {
      return bad(key, fmt::format("is {:g}, under the {:g} {} any GPU or node has; check the units (rates are in {}: "
                                  "55 G{} is 55e9)",
                                  v, min, unit, unit, unit));
    }
    return Status::Ok();
  };
  auto bytes = [&](std::string_view key, std::uint64_t v) -> Status {
    if (v == 0) return bad(key, "must be positive");
    if (v > kMaxHardwareBytes) return bad(key, fmt::format("is {}, over the limit 2^62 bytes; check the units", v));
    if (v < kMinHardwareBytes) {
      return bad(key, fmt::format("is {}, under the 1 MiB ({} bytes) any GPU or node has; check the units (sizes are "
                                  "in bytes: 141 GB is 141e9)",
                                  v, kMinHardwareBytes));
    }
    return Status::Ok();
  };
  if (h.gpus < 1 || h.gpus > 4096) return bad("gpus", "must be 1 to 4096");
  TERRACE_RETURN_IF_ERROR(bytes("hbm_bytes_per_gpu", h.hbm_bytes_per_gpu));
  if (h.hbm_bytes_per_gpu > UINT64_MAX / static_cast<std::uint64_t>(h.gpus))
    return bad("hbm_bytes_per_gpu", fmt::format("times gpus ({}) exceeds 2^64 bytes", h.gpus));
  TERRACE_RETURN_IF_ERROR(bytes("host_bytes", h.host_bytes));
  TERRACE_RETURN_IF_ERROR(bytes("nvme_bytes", h.nvme_bytes));
  TERRACE_RETURN_IF_ERROR(rate("hbm_bandwidth_per_gpu", h.hbm_bandwidth_per_gpu, kMinHardwareBandwidth, kMaxHardwareBandwidth, "bytes/s"));
  TERRACE_RETURN_IF_ERROR(rate("gpu_flops_per_gpu", h.gpu_flops_per_gpu, kMinHardwareFlops, kMaxHardwareFlops, "FLOP/s"));
  if (!(h.mfu > 0 && h.mfu <= 1)) return bad("mfu", "must be in (0, 1]");
  TERRACE_RETURN_IF_ERROR(rate("pcie_bandwidth_per_gpu", h.pcie_bandwidth_per_gpu, kMinHardwareBandwidth, kMaxHardwareBandwidth, "bytes/s"));
  TERRACE_RETURN_IF_ERROR(rate("nvme_read_bandwidth", h.nvme_read_bandwidth, kMinHardwareBandwidth, kMaxHardwareBandwidth, "bytes/s"));
  TERRACE_RETURN_IF_ERROR(rate("nvme_write_bandwidth", h.nvme_write_bandwidth, kMinHardwareBandwidth, kMaxHardwareBandwidth, "bytes/s"));
  return Status::Ok();
}

Result<Hardware> ParseHardwareJson(std::string_view text, std::string_view source) {
  auto parsed = ParseJsonUniqueKeys(text);
  if (!parsed.ok()) {
    return Status::InvalidArgument(
        fmt::format("{}: {} (see docs/plan.md, \"Hardware files\")", source, parsed.status().message()));
  }
  const json& j = *parsed;
  if (!j.is_object()) {
    return Status::InvalidArgument(
        fmt::format("{}: not a JSON object but {} (see docs/plan.md, \"Hardware files\")", source, j.type_name()));
  }
  Hardware h;
  h.name = std::string(source);
  const auto base = j.find("base");
  if (base != j.end()) {
    if (!base->is_string()) return Status::InvalidArgument(fmt::format("{}: \"base\" must be a preset name", source));
    const std::string name = base->get<std::string>();
    auto preset = HardwarePreset(name);
    if (!preset.ok()) {
      return Status::InvalidArgument(fmt::format("{}: \"base\" is {}, which is not a hardware preset; choose one of {}",
                                                 source, JsonText(*base), fmt::join(HardwarePresetNames(), ", ")));
    }
    h = *std::move(preset);
  }
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == "base") continue;
    if (key == "name") {
      if (!v.is_string()) return Status::InvalidArgument(fmt::format("{}: \"name\" must be a string", source));
      h.name = v.get<std::string>();
      continue;
    }
    if (!v.is_number()) {
      return Status::InvalidArgument(fmt::format("{}: \"{}\" must be a number, got {}", source, key, v.type_name()));
    }
    const double d = v.get<double>();
    auto as_bytes = [&](std::uint64_t* out) -> Status {
      if (!(d > 0) || d != std::floor(d) || d > static_cast<double>(kMaxHardwareBytes)) {
        return Status::InvalidArgument(fmt::format(
            "{}: \"{}\" must be a whole, positive number of bytes up to 2^62, got {}", source, key, v.dump()));
      }
      *out = static_cast<std::uint64_t>(d);
      return Status::Ok();
    };
    if (key == "gpus") {
      if (!v.is_number_integer()) return Status::InvalidArgument(fmt::format("{}: \"gpus\" must be an integer", source));
      const auto g = v.get<std::int64_t>();
      h.gpus = g < 0 || g > 1'000'000 ? -1 : static_cast<int>(g);
    } else if (key == "hbm_bytes_per_gpu") {
      TERRACE_RETURN_IF_ERROR(as_bytes(&h.hbm_bytes_per_gpu));
    } else if (key == "host_bytes") {
      TERRACE_RETURN_IF_ERROR(as_bytes(&h.host_bytes));
    } else if (key == "nvme_bytes") {
      TERRACE_RETURN_IF_ERROR(as_bytes(&h.nvme_bytes));
    } else if (key == "hbm_bandwidth_per_gpu") {
      h.hbm_bandwidth_per_gpu = d;
    } else if (key == "gpu_flops_per_gpu") {
      h.gpu_flops_per_gpu = d;
    } else if (key == "mfu") {
      h.mfu = d;
    } else if (key == "pcie_bandwidth_per_gpu") {
      h.pcie_bandwidth_per_gpu = d;
    } else if (key == "nvme_read_bandwidth") {
      h.nvme_read_bandwidth = d;
    } else if (key == "nvme_write_bandwidth") {
      h.nvme_write_bandwidth = d;
    } else {
      return Status::InvalidArgument(fmt::format(
          "{}: unknown key \"{}\"; known keys: base, name, gpus, hbm_bytes_per_gpu, hbm_bandwidth_per_gpu, "
          "gpu_flops_per_gpu, mfu, pcie_bandwidth_per_gpu, host_bytes, nvme_bytes, nvme_read_bandwidth, "
          "nvme_write_bandwidth",
          source, key));
    }
  }
  if (base == j.end()) {
    // Without a preset to start from, every size and rate without a default must be given (checked
    // after the unknown keys, so a misspelt key is named as such, not as its missing twin).
    for (const char* key : {"hbm_bytes_per_gpu", "hbm_bandwidth_per_gpu", "gpu_flops_per_gpu", "pcie_bandwidth_per_gpu",
                            "host_bytes", "nvme_bytes", "nvme_read_bandwidth", "nvme_write_bandwidth"}) {
      if (!j.contains(key)) {
        return Status::InvalidArgument(fmt::format(
            "{}: \"{}\" is missing; give it, or start from a preset with \"base\": one of {} (see docs/plan.md, "
            "\"Hardware files\")",
            source, key, fmt::join(HardwarePresetNames(), ", ")));
      }
    }
  }
  TERRACE_RETURN_IF_ERROR(ValidateHardware(h, source));
  return h;
}

Result<Hardware> LoadHardware(std::string_view name_or_path) {
  for (const std::string& n : HardwarePresetNames()) {
    if (n == name_or_path) return HardwarePreset(n);
  }
  const std::string path(name_or_path);
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return Status::InvalidArgument(fmt::format("--hardware '{}' is neither a preset ({}) nor a JSON file", path,
                                               fmt::join(HardwarePresetNames(), ", ")));
  }
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  if (!in) return Status::IoError(fmt::format("cannot read hardware file '{}'", path));
  return ParseHardwareJson(ss.str(), path);
}

std::string HardwareToJson(const Hardware& h) {
  json j;
  j["name"] = h.name;
  j["gpus"] = h.gpus;
  j["hbm_bytes_per_gpu"] = h.hbm_bytes_per_gpu;
  j["hbm_bandwidth_per_gpu"] = h.hbm_bandwidth_per_gpu;
  j["gpu_flops_per_gpu"] = h.gpu_flops_per_gpu;
  j["mfu"] = h.mfu;
  j["pcie_bandwidth_per_gpu"] = h.pcie_bandwidth_per_gpu;
  j["host_bytes"] = h.host_bytes;
  j["nvme_bytes"] = h.nvme_bytes;
  j["nvme_read_bandwidth"] = h.nvme_read_bandwidth;
  j["nvme_write_bandwidth"] = h.nvme_write_bandwidth;
  // The name may be a file path (a file without "name"), which need not be UTF-8: replaced, not thrown on.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace terrace::plan
