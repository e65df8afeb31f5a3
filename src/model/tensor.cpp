#include "src/model/tensor.h"

#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>

#include <fmt/format.h>

namespace terrace::model {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  std::size_t size;
};

constexpr std::array<DTypeInfo, 13> kDTypes{{
    {DType::kF32, "F32", 4},   {DType::kF16, "F16", 2},   {DType::kBF16, "BF16", 2},
    {DType::kF64, "F64", 8},   {DType::kU8, "U8", 1},     {DType::kI8, "I8", 1},
    {DType::kI16, "I16", 2},   {DType::kI32, "I32", 4},   {DType::kI64, "I64", 8},
    {DType::kU16, "U16", 2},   {DType::kU32, "U32", 4},   {DType::kU64, "U64", 8},
    {DType::kBool, "BOOL", 1},
}};

const DTypeInfo& Info(DType dtype) {
  for (const auto& info : kDTypes) {
    if (info.dtype == dtype) return info;
  }
  return kDTypes[0];  // unreachable for valid enum values
}

}  // namespace

std::size_t DTypeSize(DType dtype) { return Info(dtype).size; }
std::string_view DTypeName(DType dtype) { return Info(dtype).name; }

Result<DType> ParseDType(std::string_view name) {
  for (const auto& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  return Status::InvalidArgument(fmt::format(
      "unknown dtype '{}'; Terrace reads F32, F16, BF16, F64, U8, I8, I16, I32, I64, U16, U32, U64, BOOL",
      name));
}

std::int64_t NumElements(std::span<const std::int64_t> shape) {
  bool empty = false;
  for (std::int64_t d : shape) {
    if (d < 0) return -1;
    empty |= d == 0;
  }
  if (empty) return 0;
  std::int64_t n = 1;
  for (std::int64_t d : shape) {
    if (n > std::numeric_limits<std::int64_t>::max() / d) return -1;  // the product passes int64
    n *= d;
  }
  return n;
}

std::string ShapeString(std::span<const std::int64_t> shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

float Bf16ToFloat(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

std::uint16_t FloatToBf16(float value) {
  std::uint32_t u = std::bit_cast<std::uint32_t>(value);
  if (std::isnan(value)) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // keep it a quiet NaN
  const std::uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<std::uint16_t>((u + rounding) >> 16);
}

float F16ToFloat(std::uint16_t bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exp = (bits >> 10) & 0x1Fu;
  const std::uint32_t mant = bits & 0x3FFu;
  float magnitude;
  if (exp == 0) {
    magnitude = std::ldexp(static_cast<float>(mant), -24);  // zero or subnormal
  } else if (exp == 31) {
    magnitude = mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    magnitude = std::bit_cast<float>(((exp + 112u) << 23) | (mant << 13));
  }
  return std::bit_cast<float>(std::bit_cast<std::uint32_t>(magnitude) | sign);
}

std::uint16_t FloatToF16(float value) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(value);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const float a = std::fabs(value);
  if (std::isnan(value)) return static_cast<std::uint16_t>(sign | 0x7E00u);
  if (a >= 65520.0f) return static_cast<std::uint16_t>(sign | 0x7C00u);  // rounds to infinity
  if (a < 6.103515625e-05f) {
    // Subnormal (or zero): the value in units of 2^-24, rounded to nearest even by the FPU.
    const float scaled = a * 16777216.0f;  // exact: power-of-two scaling of a small float
    const auto q = static_cast<std::uint32_t>(std::nearbyint(scaled));
    return static_cast<std::uint16_t>(sign | q);  // q == 0x400 becomes the smallest normal: correct
  }
  const std::uint32_t ua = std::bit_cast<std::uint32_t>(a);
  const std::uint32_t rounding = 0xFFFu + ((ua >> 13) & 1u);
  const std::uint32_t r = ua + rounding;
  const std::uint32_t exp = (r >> 23) - 112u;
  const std::uint32_t mant = (r >> 13) & 0x3FFu;
  return static_cast<std::uint16_t>(sign | (exp << 10) | mant);
}

Result<Tensor> ToFloat(const TensorView& view, std::string_view what) {
  for (std::int64_t d : view.shape) {
    if (d < 0) return Status::InvalidArgument(fmt::format("{}: negative dimension in shape {}", what, ShapeString(view.shape)));
  }
  const std::int64_t n = view.numel();
  // Element and byte counts are checked: a shape whose count wraps would otherwise match a short
  // (even empty) span and then ask for an impossible allocation.
  if (n < 0 || static_cast<std::uint64_t>(n) > std::numeric_limits<std::size_t>::max() / sizeof(float) ||
      static_cast<std::uint64_t>(n) > std::numeric_limits<std::size_t>::max() / DTypeSize(view.dtype)) {
    return Status::InvalidArgument(fmt::format(
        "{}: shape {} has more elements than this machine can address; check the tensor's shape", what,
        ShapeString(view.shape)));
  }
  const std::size_t count = static_cast<std::size_t>(n);
  if (view.data.size() != count * DTypeSize(view.dtype)) {
    return Status::InvalidArgument(fmt::format("{}: {} bytes for {} {} (expected {})", what, view.data.size(),
                                               DTypeName(view.dtype), ShapeString(view.shape),
                                               count * DTypeSize(view.dtype)));
  }
  if (view.dtype != DType::kF32 && view.dtype != DType::kBF16 && view.dtype != DType::kF16) {
    return Status::InvalidArgument(fmt::format(
        "{}: dtype {} cannot be read as floats; expected F32, BF16 or F16", what, DTypeName(view.dtype)));
  }
  Tensor out;
  try {
    out = Tensor(view.shape);
  } catch (const std::exception&) {  // bad_alloc, or length_error from the allocator's own limit
    return Status::OutOfCapacity(fmt::format("{}: could not allocate {} floats for shape {} (out of memory)", what,
                                             count, ShapeString(view.shape)));
  }
  const std::byte* src = view.data.data();
  switch (view.dtype) {
    case DType::kF32:
      if (count) std::memcpy(out.data.data(), src, count * 4);  // views need not be aligned
      break;
    case DType::kBF16:
    case DType::kF16:
      for (std::size_t i = 0; i < count; ++i) {
        std::uint16_t bits;
        std::memcpy(&bits, src + 2 * i, 2);
        out.data[i] = view.dtype == DType::kBF16 ? Bf16ToFloat(bits) : F16ToFloat(bits);
      }
      break;
    default:
      return Status::InvalidArgument(fmt::format(
          "{}: dtype {} cannot be read as floats; expected F32, BF16 or F16", what, DTypeName(view.dtype)));
  }
  return out;
}

Status CheckFinite(const Tensor& t, std::string_view name) {
  for (std::size_t i = 0; i < t.data.size(); ++i) {
    if (!std::isfinite(t.data[i])) {
      return Status::Corruption(fmt::format("tensor '{}' holds {} at element {}; the checkpoint is damaged (see "
                                            "'terrace model inspect')",
                                            name, std::isnan(t.data[i]) ? "NaN" : "an infinity", i));
    }
  }
  return Status::Ok();
}

Status ExpectShape(const Tensor& t, const std::vector<std::int64_t>& want, std::string_view where,
                   std::string_view name) {
  if (t.shape == want) return Status::Ok();
  return Status::InvalidArgument(fmt::format("{}{}: expected shape {}, got {}; check the checkpoint against config.json",
                                             where, name, ShapeString(want), ShapeString(t.shape)));
}

}  // namespace terrace::model
