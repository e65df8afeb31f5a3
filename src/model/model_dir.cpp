// ModelDir (declared in safetensors.h): a WeightSource over a model directory.
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/common/json_unique.h"

#include "src/model/names.h"
#include "src/model/safetensors.h"

namespace terrace::model {
namespace {

// A shard named by an index must be a plain file name inside the model directory.
bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

// Terrace's name for a stored tensor (docs/model-format.md section 4): names without the
// "language_model." prefix (as transformers' KimiLinearForCausalLM saves them) gain it, and a dense
// layer's MLP that transformers saves under "block_sparse_moe." is read as "mlp.".
std::string CanonicalName(std::string_view stored, bool add_prefix) {
  std::string name = add_prefix ? "language_model." + std::string(stored) : std::string(stored);
  static constexpr std::string_view kMoe = ".block_sparse_moe.";
  const std::size_t at = name.find(kMoe);
  if (at != std::string::npos) {
    const std::string_view rest = std::string_view(name).substr(at + kMoe.size());
    if (rest == "gate_proj.weight" || rest == "up_proj.weight" || rest == "down_proj.weight") {
      name = name.substr(0, at) + ".mlp." + std::string(rest);
    }
  }
  return name;
}

struct IndexedShards {
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::vector<std::pair<std::string, std::size_t>> stored;  // stored tensor name, position in files
};

// weight_map grouped by shard file: file -> the tensors mapped to it, in name order.
Result<std::map<std::string, std::vector<std::string>>> GroupByShard(const std::filesystem::path& index,
                                                                     const nlohmann::json& weight_map) {
  std::map<std::string, std::vector<std::string>> names_of_file;
  for (const auto& [name, file] : weight_map.items()) {
    if (!file.is_string() || !IsPlainFileName(file.get<std::string>())) {
      return Status::Corruption(fmt::format("'{}': weight_map entry for '{}' must be a file name in the same directory",
                                            index.string(), name));
    }
    names_of_file[file.get<std::string>()].push_back(name);
  }
  return names_of_file;
}

// Opens every shard the index names. The index and the shards must agree exactly: every tensor
// the index maps to a shard is in it, and every tensor a shard holds is mapped to that shard (a
// tensor the index does not list, or a second copy in another shard, would otherwise never be
// checked). Errors name the index, the shard file and the tensor.
Result<IndexedShards> OpenIndexedShards(const std::filesystem::path& dir, const std::filesystem::path& index,
                                        const nlohmann::json& weight_map) {
  TERRACE_ASSIGN_OR_RETURN(const auto names_of_file, GroupByShard(index, weight_map));
  for (const auto& [file, names] : names_of_file) {  // first: a shard missing is named as such, not as a mismatch
    std::error_code ec;
    if (!std::filesystem::exists(dir / file, ec)) {
      return Status::NotFound(fmt::format("'{}' maps {} tensor(s) (e.g. '{}') to shard '{}', which is not in '{}'; "
                                          "copy that shard into the directory, or regenerate the index",
                                          index.string(), names.size(), names.front(), file, dir.string()));
    }
  }
  IndexedShards out;
  for (const auto& [file, names] : names_of_file) {
    TERRACE_ASSIGN_OR_RETURN(auto shard, SafetensorsFile::Open(dir / file));
    for (const std::string& name : names) {
      if (!shard->Has(name)) {
        return Status::Corruption(fmt::format("'{}' maps tensor '{}' to shard '{}', which does not hold it",
                                              index.string(), name, file));
      }
      out.stored.emplace_back(name, out.files.size());
    }
    for (const std::string& name : shard->Names()) {
      const auto mapped = weight_map.find(name);
      if (mapped == weight_map.end()) {
        return Status::Corruption(fmt::format("shard '{}' holds tensor '{}', which '{}' does not list; add it to the "
                                              "index's weight_map, or remove it from the shard",
                                              (dir / file).string(), name, index.string()));
      }
      if (mapped->get<std::string>() != file) {
        return Status::Corruption(fmt::format("tensor '{}' is stored in both shard '{}' and shard '{}' (the one '{}' "
                                              "maps it to); keep one copy",
                                              name, file, mapped->get<std::string>(), index.string()));
      }
    }
    out.files.push_back(std::move(shard));
  }
  return out;
}

}  // namespace

Status ModelDir::AddNames(const std::vector<std::pair<std::string, std::size_t>>& stored) {
  bool any_prefixed = false;
  for (const auto& [name, shard] : stored) any_prefixed = any_prefixed || name.starts_with("language_model.");
  unprefixed_ = !any_prefixed;
  for (const auto& [name, shard] : stored) {
    std::string canonical = CanonicalName(name, unprefixed_);
    const auto [it, inserted] = where_.emplace(canonical, Location{shard, name});
    if (!inserted) {
      return Status::Corruption(fmt::format("model '{}': tensors '{}' and '{}' are two copies of '{}'; keep one",
                                            dir_.string(), it->second.stored, name, canonical));
    }
  }
  return Status::Ok();
}

std::string ModelDir::StoredName(std::string_view name) const {
  const auto it = where_.find(name);
  return it == where_.end() ? std::string(name) : it->second.stored;
}

Result<std::unique_ptr<ModelDir>> ModelDir::Open(const std::filesystem::path& dir, bool check_tensors) {
  std::unique_ptr<ModelDir> md(new ModelDir());
  md->dir_ = dir;
  TERRACE_ASSIGN_OR_RETURN(md->config_, LoadConfig(dir / kConfigFileName, &md->config_keys_));
  std::vector<std::pair<std::string, std::size_t>> stored;

  const std::filesystem::path single = dir / kSingleFileName;
  const std::filesystem::path index = dir / kIndexFileName;
  std::error_code ec;
  if (std::filesystem::exists(index, ec)) {
    std::ifstream in(index, std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    if (!in) return Status::IoError(fmt::format("cannot read '{}'", index.string()));
    Result<nlohmann::json> parsed = ParseJsonUniqueKeys(text.str());  // a tensor mapped twice: refused
    if (!parsed.ok()) {
      return Status::Corruption(fmt::format("'{}': {}; regenerate the index", index.string(), parsed.status().message()));
    }
    const nlohmann::json j = std::move(*parsed);
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
      return Status::Corruption(fmt::format(
          "'{}' is not a JSON object with a \"weight_map\" object; regenerate the index", index.string()));
    }
    TERRACE_ASSIGN_OR_RETURN(IndexedShards shards, OpenIndexedShards(dir, index, j["weight_map"]));
    md->shards_ = std::move(shards.files);
    stored = std::move(shards.stored);
  } else if (std::filesystem::exists(single, ec)) {
    TERRACE_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(single));
    for (const std::string& name : file->Names()) stored.emplace_back(name, 0);
    md->shards_.push_back(std::move(file));
  } else {
    return Status::NotFound(fmt::format("model directory '{}' has neither {} nor {}; create one with "
                                        "'terrace model init'",
                                        dir.string(), kSingleFileName, kIndexFileName));
  }
  TERRACE_RETURN_IF_ERROR(md->AddNames(stored));
  if (check_tensors) {
    TERRACE_RETURN_IF_ERROR(ValidateWeights(*md, md->config_).WithContext(fmt::format("model '{}'", dir.string())));
  }
  return md;
}

Result<Checkpoint> OpenCheckpoint(const std::filesystem::path& dir) {
  TERRACE_ASSIGN_OR_RETURN(auto md, ModelDir::Open(dir, /*check_tensors=*/true));
  Checkpoint c;
  c.config = md->config();
  c.config_keys = md->config_keys();
  c.weights = std::move(md);
  return c;
}

Result<TensorView> ModelDir::Get(std::string_view name) const {
  const auto it = where_.find(name);
  if (it == where_.end()) {
    return Status::NotFound(fmt::format("tensor '{}' is not in model '{}'", name, dir_.string()));
  }
  return shards_[it->second.shard]->Get(it->second.stored);
}

bool ModelDir::Has(std::string_view name) const { return where_.find(name) != where_.end(); }

std::vector<std::string> ModelDir::Names() const {
  std::vector<std::string> names;
  names.reserve(where_.size());
  for (const auto& [name, loc] : where_) names.push_back(name);
  return names;
}

const SafetensorsFile* ModelDir::ShardOf(std::string_view name) const {
  const auto it = where_.find(name);
  return it == where_.end() ? nullptr : shards_[it->second.shard].get();
}

}  // namespace terrace::model
