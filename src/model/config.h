// Forwarding header: the declarations moved to the public terrace/model_config.h (see docs/model.md, "Public API").
#pragma once

#include "terrace/model_config.h"

namespace terrace::model {

// Upper limits of config.json's float keys (each must also be > 0), shared with the `terrace ref`
// flags that stand for them: rms_norm_eps, routed_scaling_factor, activation_situ_{,linear_}beta.
inline constexpr double kMaxRmsEps = 0.1;
inline constexpr double kMaxScaling = 1000.0;
inline constexpr double kMaxSituBeta = 1e4;

}  // namespace terrace::model
