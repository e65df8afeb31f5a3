// `terrace model inspect`: what a model directory (or a preset, without files) holds, grouped by
// component, with every missing / wrong-shape / wrong-dtype / unexpected tensor and every tensor
// holding NaN or infinite values flagged, and the config.json keys it read and ignored. Read-only.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "src/model/config.h"
#include "src/model/names.h"
#include "terrace/status.h"

namespace terrace::model {

struct InspectedTensor {
  std::string name;
  std::string dtype;                 // safetensors spelling
  std::vector<std::int64_t> shape;
  std::uint64_t bytes = 0;
  std::string component;             // ComponentName, or "unexpected" for tensors the config does not imply
};

struct ComponentTotal {
  std::string component;
  std::uint64_t tensors = 0;
  std::uint64_t bytes = 0;
  std::uint64_t params = 0;          // logical parameters (MXFP4: 2 per packed byte, scales 0)
};

struct InspectReport {
  ModelConfig config;
  std::string source;                // directory path or "preset <name>"
  std::size_t shards = 0;
  std::vector<InspectedTensor> tensors;   // in ExpectedTensors order, then unexpected ones by name
  std::vector<ComponentTotal> totals;     // one per Component that has tensors, in enum order
  ComponentTotal all;
  std::vector<std::string> problems;      // missing, wrong shape/dtype, non-finite values, unexpected
  ConfigKeys config_keys;                 // config.json keys read and ignored (empty for a preset)
  bool unprefixed_names = false;          // the files use transformers' names (no "language_model.")
};

// Opens `dir` without requiring it to be complete, and reports on it.
Result<InspectReport> InspectModelDir(const std::filesystem::path& dir);
// The expected tensors of a config (no files): the planner's and the docs' view of a preset.
InspectReport InspectConfig(const ModelConfig& config, std::string source);

// Human-readable table (per-tensor lines when `list_tensors`), and the JSON form.
std::string FormatInspectText(const InspectReport& report, bool list_tensors);
std::string FormatInspectJson(const InspectReport& report, bool list_tensors);

}  // namespace terrace::model
