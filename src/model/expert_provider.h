// Where routed experts come from. The forward pass asks an ExpertProvider for each selected expert
// (Acquire ... Release) and tells it the router's selection as soon as it is known (Prefetch), so a
// later layer can serve experts from the Terrace store (HBM / host / NVMe) instead of keeping all of
// them resident. The default, ResidentExpertProvider, dequantises every expert from a WeightSource
// once and keeps it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "src/model/config.h"
#include "src/model/tensor.h"
#include "src/model/weight_source.h"
#include "terrace/status.h"

namespace terrace::model {

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

// Reads one expert's w1/w2/w3 at `prefix` + "{w1,w2,w3}." + ("weight_packed" + "weight_scale" as
// MXFP4, or "weight" as F32/BF16/F16) and checks the shapes against latent x intermediate.
Result<ExpertWeights> LoadExpert(const WeightSource& source, std::string_view prefix, std::int64_t latent,
                                 std::int64_t intermediate);

// Every routed expert of every MoE layer, dequantised at Create and kept. Thread-safe (read-only).
class ResidentExpertProvider : public ExpertProvider {
 public:
  static Result<std::unique_ptr<ResidentExpertProvider>> Create(const WeightSource& source,
                                                                const ModelConfig& config);
  Result<const ExpertWeights*> Acquire(int layer, int expert) override;
  void Release(int layer, int expert) override;
  std::size_t bytes() const;  // fp32 bytes held

 private:
  ResidentExpertProvider() = default;
  int num_layers_ = 0, num_experts_ = 0;
  std::vector<ExpertWeights> experts_;  // [layer * num_experts + expert]; empty for dense layers
};

}  // namespace terrace::model
