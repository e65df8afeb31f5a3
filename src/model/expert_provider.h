// The default ExpertProvider (declared in the public terrace/model_weights.h): ResidentExpertProvider
// dequantises every expert from a WeightSource once and keeps it; LoadExpert reads one expert.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "src/model/config.h"
#include "src/model/tensor.h"
#include "terrace/model_weights.h"
#include "terrace/status.h"

namespace terrace::model {

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
