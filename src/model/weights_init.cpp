#include "src/model/weights_init.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <numbers>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/common/list_dir.h"
#include "src/model/mxfp4.h"
#include "src/model/names.h"
#include "src/model/safetensors.h"

namespace terrace::model {
namespace {

// A deterministic stream per (seed, tensor name): splitmix64 for bits, Box-Muller for normals.
class Rng {
 public:
  Rng(std::uint64_t seed, std::string_view name) {
    std::uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a of the name
    for (char c : name) h = (h ^ static_cast<std::uint8_t>(c)) * 0x100000001b3ull;
    state_ = h ^ (seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull);
  }
  std::uint64_t Next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double Uniform() { return static_cast<double>((Next() >> 11) + 1) * 0x1.0p-53; }  // (0, 1]
  double Uniform(double lo, double hi) { return lo + (hi - lo) * Uniform(); }
  double Normal() {
    if (have_spare_) {
      have_spare_ = false;
      return spare_;
    }
    const double r = std::sqrt(-2.0 * std::log(Uniform()));
    const double t = 2.0 * std::numbers::pi * Uniform();
    spare_ = r * std::sin(t);
    have_spare_ = true;
    return r * std::cos(t);
  }

 private:
  std::uint64_t state_;
  double spare_ = 0;
  bool have_spare_ = false;
};

// The fp32 values of one tensor (for MXFP4 tensors: the unpacked [rows, cols] matrix).
std::vector<float> Generate(const ModelConfig& c, const std::string& name, const std::vector<std::int64_t>& shape,
                            std::uint64_t seed, double residual_scale) {
  Rng rng(seed, name);
  const auto n = static_cast<std::size_t>(NumElements(shape));
  std::vector<float> v(n);
  auto fill = [&](auto f) {
    for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(f(i));
  };
  const bool bounded = c.kda.gate_lower_bound.has_value();
  const double out_scale = residual_scale / std::sqrt(2.0 * c.num_hidden_layers);
  const double fan_in = static_cast<double>(shape.back());

  if (name.ends_with(".A_log")) {  // exp(A_log) in [0.5, 1.5] (bounded gate) or [1, 4] (unbounded)
    fill([&](std::size_t) { return bounded ? std::log(rng.Uniform(0.5, 1.5)) : std::log(rng.Uniform(1.0, 4.0)); });
  } else if (name.ends_with(".dt_bias")) {
    // Bounded: g = -5 sigmoid(~-3) ~ -0.25; unbounded: softplus(dt_bias) in [0.02, 0.1].
    fill([&](std::size_t) { return bounded ? rng.Uniform(-4.0, -2.0) : std::log(std::expm1(rng.Uniform(0.02, 0.1))); });
  } else if (name.ends_with("e_score_correction_bias")) {
    fill([&](std::size_t) { return 0.02 * rng.Normal(); });
  } else if (name.ends_with("_res_proj.weight")) {  // AttnRes pseudo-query: score std ~ 0.5
    fill([&](std::size_t) { return 0.5 / std::sqrt(fan_in) * rng.Normal(); });
  } else if (name.ends_with("norm.weight")) {
    // Without a latent up-projection the routed experts' norm is the last op before the residual
    // stream: its weights set the size of the MoE update, so the residual scale applies to them.
    const double s = name.ends_with("routed_expert_norm.weight") && !c.HasLatentProjection() ? residual_scale : 1.0;
    fill([&](std::size_t) { return s * (1.0 + 0.02 * rng.Normal()); });
  } else if (name.ends_with("embed_tokens.weight")) {
    fill([&](std::size_t) { return rng.Normal(); });
  } else if (name.ends_with("_conv1d.weight")) {  // [C, 1, K]: mostly the current token
    const std::size_t k = static_cast<std::size_t>(shape.back());
    fill([&](std::size_t i) { return (i % k == k - 1 ? 1.0 : 0.0) + 0.2 * rng.Normal(); });
  } else {
    // Linear [out, in]: N(0, 1/in); projections writing into the residual stream are scaled down.
    const bool residual_write = name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") ||
                                name.ends_with("routed_expert_up_proj.weight");
    const bool low_rank_second = name.ends_with("f_b_proj.weight");
    const double scale = (residual_write ? out_scale : 1.0) * (low_rank_second ? 0.5 : 1.0) / std::sqrt(fan_in);
    fill([&](std::size_t) { return scale * rng.Normal(); });
  }
  return v;
}

// InitOptions::random_expert_codes: packed [rows, cols/2] of uniform random codes, scales [rows,
// cols/32] all equal. Uniform E2M1 codes have rms sqrt(68.5/8) = 2.93.
void RandomMxfp4(const std::string& name, std::int64_t rows, std::int64_t cols, std::uint64_t seed,
                 std::vector<std::uint8_t>* packed, std::vector<std::uint8_t>* scales) {
  Rng rng(seed, name);
  packed->resize(static_cast<std::size_t>(rows * cols / 2));
  for (std::size_t i = 0; i < packed->size(); i += 8) {
    const std::uint64_t bits = rng.Next();
    std::memcpy(packed->data() + i, &bits, std::min<std::size_t>(8, packed->size() - i));
  }
  const double want = 1.0 / std::sqrt(static_cast<double>(cols));
  const int e = static_cast<int>(std::lround(std::log2(want / std::sqrt(68.5 / 8.0))));
  scales->assign(static_cast<std::size_t>(rows * (cols / kMxfp4BlockSize)), static_cast<std::uint8_t>(127 + e));
}

std::vector<std::byte> Encode(const std::vector<float>& v, DType dtype) {
  std::vector<std::byte> out(v.size() * DTypeSize(dtype));
  if (dtype == DType::kF32) {
    if (!v.empty()) std::memcpy(out.data(), v.data(), out.size());
    return out;
  }
  for (std::size_t i = 0; i < v.size(); ++i) {
    const std::uint16_t b = FloatToBf16(v[i]);
    std::memcpy(out.data() + 2 * i, &b, 2);
  }
  return out;
}

std::string ShardName(std::size_t i, std::size_t n) {
  return fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, n);
}

// "model-NNNNN-of-NNNNN.safetensors", as ShardName writes it.
bool IsShardName(std::string_view f) {
  constexpr std::string_view kPattern = "model-#####-of-#####.safetensors";
  if (f.size() != kPattern.size()) return false;
  for (std::size_t i = 0; i < f.size(); ++i) {
    if (kPattern[i] == '#' ? (f[i] < '0' || f[i] > '9') : f[i] != kPattern[i]) return false;
  }
  return true;
}

Status RemoveOldModelFiles(const std::filesystem::path& dir) {
  std::error_code list_ec, ec;
  for (const auto& entry : ListDir(dir, &list_ec)) {
    const std::string f = entry.path().filename().string();
    if (f == kSingleFileName || f == kIndexFileName || IsShardName(f)) {
      std::filesystem::remove(entry.path(), ec);
      if (ec) return Status::IoError(fmt::format("cannot remove old model file '{}': {}", entry.path().string(), ec.message()));
    }
  }
  if (list_ec) return Status::IoError(fmt::format("cannot list '{}': {}", dir.string(), list_ec.message()));
  return Status::Ok();
}

// config.json as a checkpoint writes it: the config, plus a quantization_config naming the routed
// experts' MXFP4 (compressed-tensors) format when the checkpoint stores them so, as K3's published
// config.json does; a tool that reads only config.json (`terrace plan --model FILE`) then sizes them right.
std::string CheckpointConfigJson(const ModelConfig& config, const std::vector<TensorSpec>& specs) {
  const bool mxfp4 = std::any_of(specs.begin(), specs.end(), [](const TensorSpec& s) { return s.mxfp4; });
  if (!mxfp4) return ToConfigJson(config);
  nlohmann::json j = nlohmann::json::parse(ToConfigJson(config));
  j["quantization_config"] = {{"quant_method", "compressed-tensors"}, {"format", "mxfp4-pack-quantized"}};
  return j.dump(2) + "\n";
}

}  // namespace

Status CheckMxfp4ExpertDims(const ModelConfig& config, std::string_view how) {
  if (config.num_experts == 0 || config.first_k_dense_replace >= config.num_hidden_layers) return Status::Ok();
  struct Column {
    std::string_view key;
    int value;
    std::string_view note;
  };
  const std::array<Column, 2> columns = {{
      {"moe_intermediate_size", config.moe_intermediate_size, ""},
      config.HasLatentProjection()
          ? Column{"routed_expert_hidden_size", config.routed_expert_hidden_size, ""}
          : Column{"hidden_size", config.hidden_size, " (the routed experts' width: routed_expert_hidden_size is "
                                                      "absent or equal)"},
  }};
  for (const Column& c : columns) {
    if (c.value % kMxfp4BlockSize != 0) {
      return Status::InvalidArgument(fmt::format(
          "config field '{}' is {}{}; {}, whose rows are blocks of {} values, so it must be a multiple of {}", c.key,
          c.value, c.note, how, kMxfp4BlockSize, kMxfp4BlockSize));
    }
  }
  return Status::Ok();
}

Status CheckInitConfig(const ModelConfig& config) {
  return CheckMxfp4ExpertDims(config, "model init writes the routed experts in MXFP4");
}

std::uint64_t WeightBytes(const ModelConfig& config) {
  std::uint64_t total = 0;
  for (const auto& s : ExpectedTensors(config)) total += s.bytes();
  return total;
}

Status InitWeights(const ModelConfig& config, const std::filesystem::path& dir, const InitOptions& options) {
  TERRACE_RETURN_IF_ERROR(ValidateConfig(config));
  TERRACE_RETURN_IF_ERROR(CheckInitConfig(config));
  if (options.shard_bytes == 0) return Status::InvalidArgument("shard size must be positive (--shard-bytes)");
  if (!(options.residual_scale > 0) || !std::isfinite(options.residual_scale))
    return Status::InvalidArgument(fmt::format("the residual scale must be positive and finite (--residual-scale; got {})",
                                               options.residual_scale));
  const std::vector<TensorSpec> specs = ExpectedTensors(config);
  std::uint64_t total = 0;
  for (const auto& s : specs) total += s.bytes();
  if (total > kMaxInitBytes && !options.force) {
    return Status::InvalidArgument(fmt::format(
        "model '{}' needs {:.1f} GiB of weights, over the {} GiB safety limit for random init; "
        "use a smaller preset (k3-toy, k3-small) or pass --force",
        config.model_type, static_cast<double>(total) / (1ull << 30), kMaxInitBytes >> 30));
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IoError(fmt::format("cannot create model directory '{}': {}", dir.string(), ec.message()));
  TERRACE_RETURN_IF_ERROR(RemoveOldModelFiles(dir));

  // Shard assignment by bytes, in ExpectedTensors order.
  std::vector<std::size_t> shard_of(specs.size());
  std::size_t shards = 1;
  std::uint64_t in_shard = 0;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const std::uint64_t b = specs[i].bytes();
    if (in_shard > 0 && in_shard + b > options.shard_bytes) {
      ++shards;
      in_shard = 0;
    }
    in_shard += b;
    shard_of[i] = shards - 1;
  }

  nlohmann::json weight_map = nlohmann::json::object();
  std::map<std::string, std::vector<std::uint8_t>> pending_scales;  // packed name's scales, by scale name
  std::size_t i = 0;
  for (std::size_t shard = 0; shard < shards; ++shard) {
    SafetensorsWriter w;
    w.SetMetadata("format", "pt");
    w.SetMetadata("terrace_seed", std::to_string(options.seed));
    if (options.residual_scale != 1.0) w.SetMetadata("terrace_residual_scale", fmt::format("{}", options.residual_scale));
    const std::string file = shards == 1 ? std::string(kSingleFileName) : ShardName(shard, shards);
    for (; i < specs.size() && shard_of[i] == shard; ++i) {
      const TensorSpec& s = specs[i];
      if (options.stop_check) TERRACE_RETURN_IF_ERROR(options.stop_check());
      if (s.mxfp4 && s.name.ends_with("weight_scale")) {
        auto it = pending_scales.find(s.name);
        if (it == pending_scales.end()) return Status::Internal(fmt::format("no scales computed for '{}'", s.name));
        TERRACE_RETURN_IF_ERROR(w.Add(s.name, s.dtype, s.shape, std::as_bytes(std::span(it->second))));
        pending_scales.erase(it);
      } else if (s.mxfp4 && options.random_expert_codes) {
        const std::string base = s.name.substr(0, s.name.size() - std::string_view("weight_packed").size());
        std::vector<std::uint8_t> packed, scales;
        RandomMxfp4(base + "weight", s.shape[0], s.shape[1] * 2, options.seed, &packed, &scales);
        TERRACE_RETURN_IF_ERROR(w.Add(s.name, s.dtype, s.shape, std::as_bytes(std::span(packed))));
        pending_scales[base + "weight_scale"] = std::move(scales);
      } else if (s.mxfp4) {  // weight_packed [rows, cols/2]: generate [rows, cols], quantize
        const std::vector<std::int64_t> logical{s.shape[0], s.shape[1] * 2};
        const std::string base = s.name.substr(0, s.name.size() - std::string_view("weight_packed").size());
        const std::vector<float> values = Generate(config, base + "weight", logical, options.seed, options.residual_scale);
        std::vector<std::uint8_t> packed, scales;
        TERRACE_RETURN_IF_ERROR(QuantizeMxfp4(values, logical[0], logical[1], &packed, &scales));
        TERRACE_RETURN_IF_ERROR(w.Add(s.name, s.dtype, s.shape, std::as_bytes(std::span(packed))));
        pending_scales[base + "weight_scale"] = std::move(scales);
      } else {
        const std::vector<float> values = Generate(config, s.name, s.shape, options.seed, options.residual_scale);
        TERRACE_RETURN_IF_ERROR(w.Add(s.name, s.dtype, s.shape, Encode(values, s.dtype)));
      }
      weight_map[s.name] = file;
    }
    TERRACE_RETURN_IF_ERROR(w.Write(dir / file));
  }
  if (shards > 1) {
    const nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    TERRACE_RETURN_IF_ERROR(WriteFileAtomically(dir / kIndexFileName, index.dump(2) + "\n"));
  }
  return WriteFileAtomically(dir / kConfigFileName, CheckpointConfigJson(config, specs));
}

}  // namespace terrace::model
