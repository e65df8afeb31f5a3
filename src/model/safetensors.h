// safetensors files: a validating mmap reader, an atomic writer, and ModelDir, a WeightSource over a
// model directory (config.json + model.safetensors, or model.safetensors.index.json + shards).
// Layout and naming: docs/model-format.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "src/model/config.h"
#include "src/model/safetensors_header.h"
#include "src/model/tensor.h"
#include "src/model/weight_source.h"
#include "terrace/status.h"

namespace terrace::model {

inline constexpr std::string_view kSingleFileName = "model.safetensors";
inline constexpr std::string_view kIndexFileName = "model.safetensors.index.json";
inline constexpr std::string_view kConfigFileName = "config.json";

// A read-only, memory-mapped safetensors file whose header has passed ParseSafetensorsHeader.
// Tensor views point into the mapping: they stay valid while the SafetensorsFile lives. Tensor data
// is NOT guaranteed aligned (files from other writers pack tensors back to back): read through memcpy
// or ToFloat. Thread-safety: immutable after Open; all methods may be called concurrently.
class SafetensorsFile {
 public:
  // NotFound / IoError for the file system, Corruption for a bad header (message names the path).
  static Result<std::unique_ptr<SafetensorsFile>> Open(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  Result<TensorView> Get(std::string_view name) const;  // NotFound naming the tensor and the file
  bool Has(std::string_view name) const;
  std::vector<std::string> Names() const;               // sorted
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  const std::filesystem::path& path() const { return path_; }
  std::uint64_t file_size() const { return size_; }

 private:
  SafetensorsFile() = default;
  std::filesystem::path path_;
  const std::byte* base_ = nullptr;
  std::uint64_t size_ = 0;
  SafetensorsHeader header_;
  std::map<std::string, std::size_t, std::less<>> index_;  // name -> header_.entries position
};

// Collects tensors and writes one safetensors file. Tensors are laid out in order of decreasing
// element size, then name, so every tensor starts at a multiple of its element size; the header is
// padded with spaces so the data section starts at a multiple of 8. The result loads in Python's
// `safetensors` (which wants back-to-back tensors). Not thread-safe.
class SafetensorsWriter {
 public:
  // Copies `bytes`. InvalidArgument if the name repeats, is empty or "__metadata__", or
  // bytes.size() != DTypeSize(dtype) * numel(shape).
  Status Add(std::string name, DType dtype, std::vector<std::int64_t> shape, std::span<const std::byte> bytes);
  Status AddF32(std::string name, const Tensor& tensor);
  // A "__metadata__" entry. Write always adds "generator": "terrace" (src/common/generator_mark.h:
  // the CLI's mark that Terrace wrote the file), replacing a value set for that key here.
  void SetMetadata(std::string key, std::string value);
  std::size_t data_bytes() const { return data_bytes_; }
  std::size_t size() const { return tensors_.size(); }
  // Writes to `path` atomically: a temporary file in the same directory, fsync, then rename.
  Status Write(const std::filesystem::path& path) const;

 private:
  struct Pending {
    std::string name;
    DType dtype;
    std::vector<std::int64_t> shape;
    std::vector<std::byte> bytes;
  };
  std::vector<Pending> tensors_;
  std::map<std::string, std::string> metadata_;
  std::size_t data_bytes_ = 0;
};

// Writes `text` to `path` atomically (temporary file + fsync + rename).
Status WriteFileAtomically(const std::filesystem::path& path, std::string_view text);

// A model directory: config.json plus either model.safetensors or model.safetensors.index.json
// (whose "weight_map" maps tensor name -> shard file in the same directory). Tensors are served under
// Terrace's names (docs/model-format.md section 4) whatever layout stored them: names without the
// "language_model." prefix (transformers' KimiLinearForCausalLM) gain it, and a dense layer's MLP
// stored under "block_sparse_moe." is served as "mlp.". Thread-safety: immutable after Open; all
// methods may be called concurrently.
class ModelDir : public WeightSource {
 public:
  // check_tensors: also verify that every tensor ExpectedTensors(config) lists is present with its
  // shape and dtype (see ValidateWeights in names.h).
  static Result<std::unique_ptr<ModelDir>> Open(const std::filesystem::path& dir, bool check_tensors = true);

  Result<TensorView> Get(std::string_view name) const override;
  bool Has(std::string_view name) const override;
  std::vector<std::string> Names() const override;  // sorted

  const ModelConfig& config() const { return config_; }
  const std::filesystem::path& dir() const { return dir_; }
  std::size_t num_shards() const { return shards_.size(); }
  // The shard holding `name` (nullptr if absent).
  const SafetensorsFile* ShardOf(std::string_view name) const;
  // The name `name` has inside its shard (differs from `name` for transformers' layout).
  std::string StoredName(std::string_view name) const;
  // True when the files name tensors without the "language_model." prefix.
  bool unprefixed_names() const { return unprefixed_; }
  // The config.json keys read and ignored (see ParseConfigJson).
  const ConfigKeys& config_keys() const { return config_keys_; }

 private:
  struct Location {
    std::size_t shard;
    std::string stored;  // the name inside the shard
  };
  ModelDir() = default;
  Status AddNames(const std::vector<std::pair<std::string, std::size_t>>& stored);
  std::filesystem::path dir_;
  ModelConfig config_;
  ConfigKeys config_keys_;
  bool unprefixed_ = false;
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;
  std::map<std::string, Location, std::less<>> where_;  // Terrace's tensor name -> where it is stored
};

}  // namespace terrace::model
