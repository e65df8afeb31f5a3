#include "src/model/expert_provider.h"

#include <fmt/format.h>

#include "src/model/mxfp4.h"
#include "src/model/names.h"

namespace terrace::model {
namespace {

Status ExpectView(const TensorView& v, DType dtype, std::vector<std::int64_t> shape, const std::string& name) {
  if (v.dtype != dtype || v.shape != shape) {
    return Status::InvalidArgument(fmt::format("{}: expected {} {}, got {} {}", name, DTypeName(dtype),
                                               ShapeString(shape), DTypeName(v.dtype), ShapeString(v.shape)));
  }
  return Status::Ok();
}

Result<Tensor> LoadProj(const WeightSource& source, const std::string& base, std::int64_t rows, std::int64_t cols) {
  const std::string packed_name = base + ".weight_packed";
  if (source.Has(packed_name)) {
    const std::string scale_name = base + ".weight_scale";
    if (cols % kMxfp4BlockSize != 0)
      return Status::InvalidArgument(fmt::format("{}: MXFP4 needs the column count ({}) to be a multiple of {}",
                                                 packed_name, cols, kMxfp4BlockSize));
    TERRACE_ASSIGN_OR_RETURN(TensorView packed, source.Get(packed_name));
    TERRACE_ASSIGN_OR_RETURN(TensorView scale, source.Get(scale_name));
    TERRACE_RETURN_IF_ERROR(ExpectView(packed, DType::kU8, {rows, cols / 2}, packed_name));
    TERRACE_RETURN_IF_ERROR(ExpectView(scale, DType::kU8, {rows, cols / kMxfp4BlockSize}, scale_name));
    Tensor out({rows, cols});
    const auto as_u8 = [](std::span<const std::byte> b) {
      return std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(b.data()), b.size());
    };
    TERRACE_RETURN_IF_ERROR(DequantizeMxfp4(as_u8(packed.data), as_u8(scale.data), rows, cols, out.data)
                                .WithContext(packed_name));
    TERRACE_RETURN_IF_ERROR(CheckFinite(out, packed_name));
    return out;
  }
  const std::string name = base + ".weight";
  TERRACE_ASSIGN_OR_RETURN(TensorView view, source.Get(name));
  if (view.shape != std::vector<std::int64_t>{rows, cols})
    return Status::InvalidArgument(fmt::format("{}: expected shape {}, got {}", name,
                                               ShapeString(std::vector<std::int64_t>{rows, cols}),
                                               ShapeString(view.shape)));
  TERRACE_ASSIGN_OR_RETURN(Tensor out, ToFloat(view, name));
  TERRACE_RETURN_IF_ERROR(CheckFinite(out, name));
  return out;
}

}  // namespace

Result<ExpertWeights> LoadExpert(const WeightSource& source, std::string_view prefix, std::int64_t latent,
                                 std::int64_t intermediate) {
  ExpertWeights e;
  const std::string p(prefix);
  TERRACE_ASSIGN_OR_RETURN(e.w1, LoadProj(source, p + "w1", intermediate, latent));
  TERRACE_ASSIGN_OR_RETURN(e.w2, LoadProj(source, p + "w2", latent, intermediate));
  TERRACE_ASSIGN_OR_RETURN(e.w3, LoadProj(source, p + "w3", intermediate, latent));
  return e;
}

Result<std::unique_ptr<ResidentExpertProvider>> ResidentExpertProvider::Create(const WeightSource& source,
                                                                               const ModelConfig& config) {
  std::unique_ptr<ResidentExpertProvider> p(new ResidentExpertProvider());
  p->num_layers_ = config.num_hidden_layers;
  p->num_experts_ = config.num_experts;
  p->experts_.resize(static_cast<std::size_t>(config.num_hidden_layers) * static_cast<std::size_t>(config.num_experts));
  for (int l = 0; l < config.num_hidden_layers; ++l) {
    if (config.IsDenseLayer(l)) continue;
    for (int e = 0; e < config.num_experts; ++e) {
      // "...experts.E.w1.weight_packed" minus "w1.weight_packed".
      std::string prefix = ExpertTensorName(l, e, "w1", "weight_packed");
      prefix.resize(prefix.size() - std::string_view("w1.weight_packed").size());
      TERRACE_ASSIGN_OR_RETURN(p->experts_[static_cast<std::size_t>(l * config.num_experts + e)],
                               LoadExpert(source, prefix, config.routed_expert_hidden_size,
                                          config.moe_intermediate_size));
    }
  }
  return p;
}

Result<const ExpertWeights*> ResidentExpertProvider::Acquire(int layer, int expert) {
  if (layer < 0 || layer >= num_layers_ || expert < 0 || expert >= num_experts_)
    return Status::InvalidArgument(fmt::format("expert {} of layer {} is out of range ({} layers x {} experts)", expert,
                                               layer, num_layers_, num_experts_));
  const ExpertWeights& e = experts_[static_cast<std::size_t>(layer * num_experts_ + expert)];
  if (e.w1.data.empty())
    return Status::NotFound(fmt::format("layer {} has no routed experts (it is a dense layer)", layer));
  return &e;
}

void ResidentExpertProvider::Release(int layer, int expert) {
  (void)layer;
  (void)expert;
}

std::size_t ResidentExpertProvider::bytes() const {
  std::size_t b = 0;
  for (const auto& e : experts_) b += (e.w1.data.size() + e.w2.data.size() + e.w3.data.size()) * sizeof(float);
  return b;
}

}  // namespace terrace::model
