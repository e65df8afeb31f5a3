// Internal part of the reference model (the public part is terrace/model.h): a layer's fp32
// weights, as Model::Load converts them.
#pragma once

#include "src/model/config.h"
#include "src/model/expert_provider.h"
#include "src/model/kda.h"
#include "src/model/mla.h"
#include "src/model/moe.h"
#include "src/model/profile.h"
#include "src/model/sequence_state.h"
#include "src/model/tensor.h"
#include "src/model/weight_source.h"
#include "terrace/model.h"
#include "terrace/status.h"

namespace terrace::model {

struct LayerWeights {
  bool is_mla = false, dense = false;
  Tensor input_norm, post_norm;                  // [d]
  Tensor attn_res_w, attn_res_n, mlp_res_w, mlp_res_n;  // [1, d] / [d] (attn_res_block_size > 0)
  KdaWeights kda;
  MlaWeights mla;
  Weight mlp_gate, mlp_up, mlp_down;             // dense SiTU-GLU (dense layers)
  MoeWeights moe;
};

}  // namespace terrace::model
