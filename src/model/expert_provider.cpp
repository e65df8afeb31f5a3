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

std::span<const std::uint8_t> AsU8(std::span<const std::byte> b) {
  return {reinterpret_cast<const std::uint8_t*>(b.data()), b.size()};
}

// One projection: MXFP4 (a validated view into `source`'s bytes) or fp32.
struct Proj {
  bool mxfp4 = false;
  Mxfp4Matrix q;
  Tensor f;
};

Result<Proj> LoadProj(const WeightSource& source, const std::string& base, std::int64_t rows, std::int64_t cols) {
  Proj out;
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
    out.mxfp4 = true;
    out.q = Mxfp4Matrix{AsU8(packed.data).data(), AsU8(scale.data).data(), rows, cols};
    TERRACE_RETURN_IF_ERROR(ValidateMxfp4(out.q, packed_name));
    return out;
  }
  const std::string name = base + ".weight";
  TERRACE_ASSIGN_OR_RETURN(TensorView view, source.Get(name));
  if (view.shape != std::vector<std::int64_t>{rows, cols})
    return Status::InvalidArgument(fmt::format("{}: expected shape {}, got {}", name,
                                               ShapeString(std::vector<std::int64_t>{rows, cols}),
                                               ShapeString(view.shape)));
  TERRACE_ASSIGN_OR_RETURN(out.f, ToFloat(view, name));
  TERRACE_RETURN_IF_ERROR(CheckFinite(out.f, name));
  return out;
}

Tensor Dequantized(const Proj& p) {
  if (!p.mxfp4) return p.f;
  Tensor t({p.q.rows, p.q.cols});
  // Validated by LoadProj: cannot fail.
  (void)DequantizeMxfp4({p.q.packed, static_cast<std::size_t>(p.q.packed_bytes())},
                        {p.q.scales, static_cast<std::size_t>(p.q.scale_bytes())}, p.q.rows, p.q.cols, t.data);
  return t;
}

}  // namespace

Result<ExpertWeights> LoadExpert(const WeightSource& source, std::string_view prefix, std::int64_t latent,
                                 std::int64_t intermediate) {
  const std::string p(prefix);
  TERRACE_ASSIGN_OR_RETURN(Proj w1, LoadProj(source, p + "w1", intermediate, latent));
  TERRACE_ASSIGN_OR_RETURN(Proj w2, LoadProj(source, p + "w2", latent, intermediate));
  TERRACE_ASSIGN_OR_RETURN(Proj w3, LoadProj(source, p + "w3", intermediate, latent));
  ExpertWeights e;
  if (w1.mxfp4 && w2.mxfp4 && w3.mxfp4) {
    e.format = ExpertFormat::kMxfp4;
    e.q1 = w1.q;
    e.q2 = w2.q;
    e.q3 = w3.q;
    return e;
  }
  // A mix of MXFP4 and float projections: all fp32.
  e.format = ExpertFormat::kF32;
  e.w1 = Dequantized(w1);
  e.w2 = Dequantized(w2);
  e.w3 = Dequantized(w3);
  return e;
}

Result<std::unique_ptr<ResidentExpertProvider>> ResidentExpertProvider::Create(const WeightSource& source,
                                                                               const ModelConfig& config) {
  std::unique_ptr<ResidentExpertProvider> p(new ResidentExpertProvider());
  p->num_layers_ = config.num_hidden_layers;
  p->num_experts_ = config.num_experts;
  const std::size_t n = static_cast<std::size_t>(config.num_hidden_layers) * static_cast<std::size_t>(config.num_experts);
  p->experts_.resize(n);
  p->blocks_.resize(n);
  const std::int64_t L = config.routed_expert_hidden_size, I = config.moe_intermediate_size;
  for (int l = 0; l < config.num_hidden_layers; ++l) {
    if (config.IsDenseLayer(l)) continue;
    for (int e = 0; e < config.num_experts; ++e) {
      // "...experts.E.w1.weight_packed" minus "w1.weight_packed".
      std::string prefix = ExpertTensorName(l, e, "w1", "weight_packed");
      prefix.resize(prefix.size() - std::string_view("w1.weight_packed").size());
      const auto i = static_cast<std::size_t>(l * config.num_experts + e);
      TERRACE_ASSIGN_OR_RETURN(ExpertWeights w, LoadExpert(source, prefix, L, I));
      if (w.format == ExpertFormat::kMxfp4) {
        // Owned copy in the expert block format: the same bytes (and kernel) a store-backed
        // provider serves, so resident and offloaded runs are bitwise identical.
        p->blocks_[i] = SerializeExpertBlock(w);
        TERRACE_ASSIGN_OR_RETURN(w, ParseExpertBlock(p->blocks_[i], L, I));
      }
      p->experts_[i] = std::move(w);
    }
  }
  return p;
}

Result<const ExpertWeights*> ResidentExpertProvider::Acquire(int layer, int expert) {
  if (layer < 0 || layer >= num_layers_ || expert < 0 || expert >= num_experts_)
    return Status::InvalidArgument(fmt::format("expert {} of layer {} is out of range ({} layers x {} experts)", expert,
                                               layer, num_layers_, num_experts_));
  const auto i = static_cast<std::size_t>(layer * num_experts_ + expert);
  const ExpertWeights& e = experts_[i];
  if (e.w1.data.empty() && blocks_[i].empty())
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
  for (const auto& blk : blocks_) b += blk.size();
  return b;
}

}  // namespace terrace::model
