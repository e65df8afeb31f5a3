// The default ExpertProvider (declared in the public terrace/model_weights.h): ResidentExpertProvider
// reads every expert from a WeightSource once and keeps it (MXFP4 experts as MXFP4, in the expert
// block format; float experts as fp32); LoadExpert reads one expert.
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
// All three MXFP4: kMxfp4, views into `source`'s bytes (valid as long as `source`), checked with
// ValidateMxfp4 (Corruption naming the tensor, row and block). Otherwise kF32 (MXFP4 projections
// of a mixed expert dequantised), every value checked finite.
Result<ExpertWeights> LoadExpert(const WeightSource& source, std::string_view prefix, std::int64_t latent,
                                 std::int64_t intermediate);

// Every routed expert of every MoE layer, read at Create and kept (owning: `source` may go away
// afterwards). MXFP4 experts stay MXFP4: each is held as one SerializeExpertBlock block and served
// as ParseExpertBlock views of it. Thread-safe (read-only).
class ResidentExpertProvider : public ExpertProvider {
 public:
  static Result<std::unique_ptr<ResidentExpertProvider>> Create(const WeightSource& source,
                                                                const ModelConfig& config);
  Result<const ExpertWeights*> Acquire(int layer, int expert) override;
  void Release(int layer, int expert) override;
  std::size_t bytes() const;  // bytes held (fp32 tensors + expert blocks)

 private:
  ResidentExpertProvider() = default;
  int num_layers_ = 0, num_experts_ = 0;
  std::vector<ExpertWeights> experts_;  // [layer * num_experts + expert]; empty for dense layers
  std::vector<std::vector<std::byte>> blocks_;  // same index; the bytes of kMxfp4 experts' views
};

}  // namespace terrace::model
