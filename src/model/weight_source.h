// Where the reference model's weights come from. The forward pass reads every tensor through this
// interface, so a later layer can serve weights (cold experts above all) from the Terrace store
// instead of from a safetensors directory, and prove the results identical.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "src/model/tensor.h"
#include "terrace/status.h"

namespace terrace::model {

// Thread-safety: const methods may be called concurrently. Returned views stay valid for the
// lifetime of the source.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // NotFound naming the tensor if absent.
  virtual Result<TensorView> Get(std::string_view name) const = 0;
  virtual bool Has(std::string_view name) const = 0;
  virtual std::vector<std::string> Names() const = 0;
};

}  // namespace terrace::model
