// The Status API of the device codec (codec_cuda.h): checks the spec, the shape and the buffers,
// then queues kernel_bodies.h's plans through codec_cuda.cu (launch.h).
#include "src/codec/cuda/codec_cuda.h"

#include <cstdint>
#include <limits>
#include <string>

#include "src/codec/cuda/launch.h"
#include "src/codec/format.h"
#include "src/codec/spec_check.h"

namespace terrace::codec::cuda {
namespace {

static_assert(static_cast<int>(CodecKind::kF32) == kKindF32 && static_cast<int>(CodecKind::kBf16) == kKindBf16 &&
              static_cast<int>(CodecKind::kF16) == kKindF16 && static_cast<int>(CodecKind::kFp8E4M3) == kKindFp8 &&
              static_cast<int>(CodecKind::kInt8) == kKindInt8 && static_cast<int>(CodecKind::kInt4) == kKindInt4);
static_assert(static_cast<int>(ScaleMode::kNone) == kScaleNone && static_cast<int>(ScaleMode::kPerBlock) == kScalePerBlock &&
              static_cast<int>(ScaleMode::kPerChannel) == kScalePerChannel && static_cast<int>(ScaleMode::kGroup) == kScaleGroup);

Layout LayoutOf(const CodecSpec& spec) {
  return Layout{static_cast<std::uint8_t>(spec.kind), static_cast<std::uint8_t>(spec.scales),
                static_cast<std::uint16_t>(spec.group)};
}

Status CudaStatus(const CodecSpec& spec, const char* what, cudaError_t e) {
  if (e == cudaSuccess) return Status::Ok();
  return Status::Unavailable("codec " + spec.Name() + ": " + what + " on the CUDA device failed: " +
                             cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

bool Aligned4(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 4 == 0; }

// The common checks of EncodeOnDevice / DecodeOnDevice: spec, shape, and the buffers the sizes need.
Status CheckCall(const CodecSpec& spec, std::int64_t rows, std::int64_t cols, const void* x, const void* scales,
                 const void* payload, const char* x_name) {
  auto sizes = DeviceSizes(spec, rows, cols);
  if (!sizes.ok()) return sizes.status();
  const std::uint64_t n = static_cast<std::uint64_t>(rows) * static_cast<std::uint64_t>(cols);
  if (n > 0 && x == nullptr) return Status::InvalidArgument("codec " + spec.Name() + " on the device: " + x_name + " is null");
  if (sizes->scale_count > 0 && scales == nullptr)
    return Status::InvalidArgument("codec " + spec.Name() + " on the device: scales is null; the block has " +
                                   std::to_string(sizes->scale_count) + " scales");
  if (sizes->payload_bytes > 0 && (payload == nullptr || !Aligned4(payload)))
    return Status::InvalidArgument("codec " + spec.Name() + " on the device: the payload pointer is null or not "
                                   "4-byte aligned (it lies at offset 64 + 4 * scale_count of a block)");
  return Status::Ok();
}

}  // namespace

Status CheckDeviceSupport(const CodecSpec& spec) {
  if (const std::string p = detail::SpecProblem(spec.kind, spec.scales, spec.group, spec.lossless); !p.empty())
    return Status::InvalidArgument("codec spec is not valid: " + p + "; build specs with CodecSpec::Parse");
  if (spec.lossless != Lossless::kNone) {
    CodecSpec plain = spec;
    plain.lossless = Lossless::kNone;
    return Status::InvalidArgument("codec " + spec.Name() + ": its lossless stage (" +
                                   (spec.lossless == Lossless::kZstd ? "zstd" : "lz4") +
                                   ") has no CUDA kernel, so the device codec cannot write or read '" + spec.Name() +
                                   "' blocks; encode / decode them on the CPU with terrace::codec::Encode / Decode, "
                                   "or use '" + plain.Name() + "' on the device");
  }
  return Status::Ok();
}

Result<DeviceBlockSizes> DeviceSizes(const CodecSpec& spec, std::int64_t rows, std::int64_t cols) {
  TERRACE_RETURN_IF_ERROR(CheckDeviceSupport(spec));
  if (rows < 0 || cols < 0)
    return Status::InvalidArgument("codec " + spec.Name() + " on the device: shape " + std::to_string(rows) + " x " +
                                   std::to_string(cols) + " has a negative dimension");
  const auto r = static_cast<std::uint64_t>(rows), c = static_cast<std::uint64_t>(cols);
  if (c != 0 && r > (std::numeric_limits<std::uint64_t>::max() / 8) / c)
    return Status::InvalidArgument("codec " + spec.Name() + " on the device: shape " + std::to_string(rows) + " x " +
                                   std::to_string(cols) + " is too large");
  DeviceBlockSizes s;
  s.scale_count = detail::ScaleCount(spec, r, c);
  if (s.scale_count > std::numeric_limits<std::uint32_t>::max())
    return Status::InvalidArgument("codec " + spec.Name() + " on the device: shape " + std::to_string(rows) + " x " +
                                   std::to_string(cols) + " needs more scales than a block holds (2^32 - 1)");
  s.payload_bytes = detail::RawPayloadBytes(spec.kind, r * c);
  s.scratch_words = static_cast<std::uint64_t>(ScratchWords(LayoutOf(spec), rows, cols));
  return s;
}

Status EncodeOnDevice(const CodecSpec& spec, const float* x, std::int64_t rows, std::int64_t cols,
                      const DeviceEncodeBuffers& out, cudaStream_t stream) {
  TERRACE_RETURN_IF_ERROR(CheckCall(spec, rows, cols, x, out.scales, out.payload, "the input x"));
  if (out.nonfinite == nullptr)
    return Status::InvalidArgument("codec " + spec.Name() + " on the device: the nonfinite flag pointer is null");
  if (ScratchWords(LayoutOf(spec), rows, cols) > 0 && out.scratch == nullptr)
    return Status::InvalidArgument("codec " + spec.Name() + " on the device: scratch is null; see DeviceSizes");
  return CudaStatus(spec, "encode",
                    LaunchEncode(LayoutOf(spec), x, rows, cols, out.scales, out.payload, out.scratch, out.nonfinite, stream));
}

Status DecodeOnDevice(const CodecSpec& spec, const float* scales, const std::uint8_t* payload, std::int64_t rows,
                      std::int64_t cols, float* out, cudaStream_t stream) {
  TERRACE_RETURN_IF_ERROR(CheckCall(spec, rows, cols, out, scales, payload, "the output"));
  return CudaStatus(spec, "decode", LaunchDecode(LayoutOf(spec), scales, payload, rows, cols, out, stream));
}

}  // namespace terrace::codec::cuda
