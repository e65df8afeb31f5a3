// Public model API (docs/model.md, "Public API"). Tensors for the reference model: a typed, shaped
// view of bytes (for weights as stored) and an owning fp32 tensor (for compute). Row-major, shape
// outermost first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "terrace/status.h"

namespace terrace::model {

enum class DType : std::uint8_t { kF32, kF16, kBF16, kF64, kU8, kI8, kI16, kI32, kI64, kU16, kU32, kU64, kBool };

std::size_t DTypeSize(DType dtype);
std::string_view DTypeName(DType dtype);             // safetensors spelling: "F32", "BF16", "U8", ...
Result<DType> ParseDType(std::string_view name);     // InvalidArgument naming the unknown dtype

// The product of the dimensions; -1 when a dimension is negative or the product passes int64.
std::int64_t NumElements(std::span<const std::int64_t> shape);
std::string ShapeString(std::span<const std::int64_t> shape);  // "[2, 3]"

// A non-owning view of a tensor's bytes (e.g. inside an mmap'ed safetensors file). The bytes must
// outlive the view.
struct TensorView {
  DType dtype = DType::kF32;
  std::vector<std::int64_t> shape;
  std::span<const std::byte> data;
  std::int64_t numel() const { return NumElements(shape); }
};

// An owning fp32 tensor.
struct Tensor {
  std::vector<std::int64_t> shape;
  std::vector<float> data;

  Tensor() = default;
  explicit Tensor(std::vector<std::int64_t> s) : shape(std::move(s)), data(static_cast<std::size_t>(NumElements(shape)), 0.0f) {}
  std::int64_t numel() const { return static_cast<std::int64_t>(data.size()); }
  std::int64_t dim(int i) const { return shape[static_cast<std::size_t>(i)]; }
  float* ptr() { return data.data(); }
  const float* ptr() const { return data.data(); }
  TensorView view() const {
    return TensorView{DType::kF32, shape, std::as_bytes(std::span<const float>(data))};
  }
};

// OK if t.shape == want; else InvalidArgument "<where><name>: expected shape [..], got [..]".
Status ExpectShape(const Tensor& t, const std::vector<std::int64_t>& want, std::string_view where,
                   std::string_view name);

// Converts a F32 / BF16 / F16 view to fp32. InvalidArgument (naming `what` and the shape) for other
// dtypes, a negative dimension, an element or byte count past what the machine addresses, or a byte
// count that does not fit the shape; OutOfCapacity when the fp32 copy cannot be allocated.
Result<Tensor> ToFloat(const TensorView& view, std::string_view what = "tensor");

// OK when every value is finite; else Corruption naming `name` and the first NaN / infinity.
Status CheckFinite(const Tensor& t, std::string_view name);

// bf16 / f16 conversions (round to nearest even).
float Bf16ToFloat(std::uint16_t bits);
std::uint16_t FloatToBf16(float value);
float F16ToFloat(std::uint16_t bits);
std::uint16_t FloatToF16(float value);

}  // namespace terrace::model
