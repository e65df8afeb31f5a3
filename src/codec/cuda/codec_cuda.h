// The KV codecs on a CUDA device (docs/kv-codecs.md, "CUDA kernels"): encode a device-resident fp32
// matrix into exactly the scales and raw payload bytes that terrace::codec::Encode writes after its
// 64-byte header (same scale rule, same nearest-even rounding, same int4 nibble order), and decode
// them back to exactly what terrace::codec::Decode returns. So a block encoded on the GPU decodes
// on the CPU and back: the block is the CPU header, then `scales`, then `payload`.
//
// Codecs: f32, bf16, f16, fp8, fp8-block, int8, int4-g32, int4-g64. A lossless stage (+zstd, +lz4)
// has no device kernel: every call refuses such a spec with InvalidArgument naming the codec (encode
// on the host with codec::Encode, or use the spec without the suffix on the device); the device
// codec never writes a different format than the spec names.
//
// Every pointer is a device pointer; x and out hold rows * cols fp32 values, row-major. Calls are
// asynchronous on `stream` (they return once the kernels are queued); the Status reports a refused
// argument or a failed launch (Unavailable, with CUDA's message). Non-finite input (NaN, +-Inf, and
// for bf16 / f16 a value that rounds past the format's largest finite value: what codec::Encode
// refuses) sets *nonfinite to 1, and the block must then be discarded; the caller zeroes the flag
// and reads it after the stream synchronises. DecodeOnDevice does not validate the payload (stored
// NaN / Inf values, fp8 NaN codes, a non-zero int4 padding nibble, out-of-range scales decode as
// they are): blocks from anywhere but EncodeOnDevice or codec::Encode go through codec::Decode.
// Internal to Terrace (not installed); CUDA builds only. Thread-safety: as the CUDA stream.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "terrace/codec.h"
#include "terrace/status.h"

namespace terrace::codec::cuda {

// The device buffers of one block of (spec, rows, cols).
struct DeviceBlockSizes {
  std::uint64_t scale_count = 0;    // fp32 scales (the header's scale count)
  std::uint64_t payload_bytes = 0;  // raw payload bytes (no lossless stage on the device)
  std::uint64_t scratch_words = 0;  // uint32 scratch the encoder needs (fp8 / int8 amax)
};

// Ok when the device codec can write and read `spec`: InvalidArgument for a spec Parse cannot
// produce and for a lossless stage (the message names the codec and the CPU path).
Status CheckDeviceSupport(const CodecSpec& spec);
// CheckDeviceSupport, then the sizes; InvalidArgument for a negative or too large shape.
Result<DeviceBlockSizes> DeviceSizes(const CodecSpec& spec, std::int64_t rows, std::int64_t cols);

struct DeviceEncodeBuffers {
  float* scales = nullptr;            // scale_count values (may be null when 0)
  std::uint8_t* payload = nullptr;    // payload_bytes, 4-byte aligned
  std::uint32_t* scratch = nullptr;   // scratch_words (may be null when 0); overwritten
  std::uint32_t* nonfinite = nullptr; // one flag, zeroed by the caller; set to 1 on non-finite input
};
Status EncodeOnDevice(const CodecSpec& spec, const float* x, std::int64_t rows, std::int64_t cols,
                      const DeviceEncodeBuffers& out, cudaStream_t stream);
// scales: scale_count values; payload: payload_bytes, 4-byte aligned; out: rows * cols floats.
Status DecodeOnDevice(const CodecSpec& spec, const float* scales, const std::uint8_t* payload, std::int64_t rows,
                      std::int64_t cols, float* out, cudaStream_t stream);

}  // namespace terrace::codec::cuda
