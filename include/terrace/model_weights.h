// Public model API (docs/model.md, "Public API"): where the reference model's weights come from.
// The forward pass reads every dense tensor through a WeightSource (a checkpoint directory, or any
// other source such as the Terrace store) and asks an ExpertProvider for each routed expert it uses,
// so a store-backed provider can serve cold experts from HBM / host / NVMe and prove the results
// identical.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "terrace/model_config.h"
#include "terrace/model_tensor.h"
#include "terrace/status.h"

namespace terrace::model {

// Thread-safety: const methods may be called concurrently. Returned views stay valid for the
// lifetime of the source.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // NotFound naming the tensor if absent. Names are Terrace's (docs/model-format.md section 4).
  virtual Result<TensorView> Get(std::string_view name) const = 0;
  virtual bool Has(std::string_view name) const = 0;
  virtual std::vector<std::string> Names() const = 0;
};

// One routed expert in fp32. w1 (gate) and w3 (up) are [intermediate, latent]; w2 (down) is
// [latent, intermediate].
struct ExpertWeights {
  Tensor w1, w2, w3;
};

// Thread-safety: implementations must allow concurrent calls from different threads.
class ExpertProvider {
 public:
  virtual ~ExpertProvider() = default;
  // The expert's weights, valid until the matching Release(layer, expert). Every successful Acquire
  // is paired with exactly one Release. Errors name the layer and expert.
  virtual Result<const ExpertWeights*> Acquire(int layer, int expert) = 0;
  virtual void Release(int layer, int expert) = 0;
  // A hint: these experts of `layer` will be acquired soon. Must not block on I/O. Default: no-op.
  virtual void Prefetch(int layer, std::span<const int> experts) {
    (void)layer;
    (void)experts;
  }
};

// A checkpoint directory (config.json + model.safetensors, or an index and shards), opened and
// validated: the config, the keys it read and ignored, and the weights. Every tensor the config
// implies is checked for presence, shape and dtype; values are checked when the model loads.
struct Checkpoint {
  ModelConfig config;
  ConfigKeys config_keys;
  std::unique_ptr<WeightSource> weights;  // valid as long as it lives; thread-safe reads
};
// InvalidArgument / NotFound / Corruption naming the file, key or tensor (docs/errors.md).
Result<Checkpoint> OpenCheckpoint(const std::filesystem::path& dir);

}  // namespace terrace::model
