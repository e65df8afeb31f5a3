// The device codec (src/codec/cuda/codec_cuda.h) on a GPU writes the same scales and payload bytes
// as the CPU Encode for every codec, and its decode equals the CPU Decode bit for bit
// (device_codec_cases.h; the same cases run on the CPU through the kernel bodies in test_codec).
// Without a usable device each GPU case prints "SKIPPED: no CUDA device" and ctest reports the
// test as skipped; the API checks that need no device (lossless specs refused, sizes; tag
// [cuda-api]) also run as test_codec_cuda_api, which is never skipped.
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include <catch2/catch.hpp>

#include "src/codec/cuda/codec_cuda.h"
#include "tests/codec/device_codec_cases.h"

using namespace terrace;
namespace cases = terrace_device_codec_cases;

namespace {

bool HaveDevice() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::cout << "SKIPPED: no CUDA device" << std::endl;
    return false;
  }
  return true;
}

template <typename T>
struct Dev {
  T* p = nullptr;
  explicit Dev(std::size_t n) { REQUIRE(cudaMalloc(&p, sizeof(T) * (n ? n : 1)) == cudaSuccess); }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
};

template <typename T>
void ToDevice(T* d, const std::vector<T>& h) {
  if (!h.empty()) REQUIRE(cudaMemcpy(d, h.data(), sizeof(T) * h.size(), cudaMemcpyHostToDevice) == cudaSuccess);
}
template <typename T>
void ToHost(std::vector<T>* h, const T* d) {
  if (!h->empty()) REQUIRE(cudaMemcpy(h->data(), d, sizeof(T) * h->size(), cudaMemcpyDeviceToHost) == cudaSuccess);
}

class Gpu final : public cases::Backend {
 public:
  const char* Name() const override { return "CUDA kernels"; }
  cases::Encoded Encode(const codec::CodecSpec& spec, const std::vector<float>& x, std::int64_t rows,
                        std::int64_t cols) override {
    auto sizes = codec::cuda::DeviceSizes(spec, rows, cols);
    REQUIRE(sizes.ok());
    Dev<float> dx(x.size()), dscales(sizes->scale_count);
    Dev<std::uint8_t> dpayload(sizes->payload_bytes);
    Dev<std::uint32_t> dscratch(sizes->scratch_words), dflag(1);
    ToDevice(dx.p, x);
    // Garbage in the outputs and the scratch first, as reused device buffers hold.
    REQUIRE(cudaMemset(dscales.p, 0xA5, 4 * (sizes->scale_count ? sizes->scale_count : 1)) == cudaSuccess);
    REQUIRE(cudaMemset(dpayload.p, 0xA5, sizes->payload_bytes ? sizes->payload_bytes : 1) == cudaSuccess);
    REQUIRE(cudaMemset(dscratch.p, 0xA5, 4 * (sizes->scratch_words ? sizes->scratch_words : 1)) == cudaSuccess);
    REQUIRE(cudaMemset(dflag.p, 0, 4) == cudaSuccess);
    const Status st = codec::cuda::EncodeOnDevice(spec, dx.p, rows, cols, {dscales.p, dpayload.p, dscratch.p, dflag.p}, 0);
    INFO(st.ToString());
    REQUIRE(st.ok());
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    cases::Encoded e;
    e.scales.resize(sizes->scale_count);
    e.payload.resize(sizes->payload_bytes);
    ToHost(&e.scales, dscales.p);
    ToHost(&e.payload, dpayload.p);
    std::vector<std::uint32_t> flag(1);
    ToHost(&flag, dflag.p);
    e.nonfinite = flag[0] != 0;
    return e;
  }
  std::vector<float> Decode(const codec::CodecSpec& spec, const std::vector<float>& scales,
                            const std::vector<std::uint8_t>& payload, std::int64_t rows, std::int64_t cols) override {
    const std::size_t n = static_cast<std::size_t>(rows * cols);
    Dev<float> dscales(scales.size()), dout(n);
    Dev<std::uint8_t> dpayload(payload.size());
    ToDevice(dscales.p, scales);
    ToDevice(dpayload.p, payload);
    const Status st = codec::cuda::DecodeOnDevice(spec, dscales.p, dpayload.p, rows, cols, dout.p, 0);
    INFO(st.ToString());
    REQUIRE(st.ok());
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    std::vector<float> out(n);
    ToHost(&out, dout.p);
    return out;
  }
};

// Runs fn on a device backend, or reports the case as skipped.
template <typename Fn>
void OnDevice(Fn fn) {
  if (!HaveDevice()) {
    SUCCEED("SKIPPED: no CUDA device");
    return;
  }
  Gpu g;
  fn(g);
}

}  // namespace

TEST_CASE("CUDA codec kernels encode and decode like the CPU codec, bit for bit", "[codec][gpu]") {
  OnDevice([](Gpu& g) { cases::CheckMatchesCpu(g); });
}

TEST_CASE("CUDA codec kernels match the CPU codec on a large block (many thread blocks)", "[codec][gpu]") {
  // An odd count; rows and int4 groups ending mid-byte.
  const std::pair<std::int64_t, std::int64_t> shape[] = {{4099, 577}};
  OnDevice([&](Gpu& g) { cases::CheckMatchesCpu(g, shape); });
}

TEST_CASE("CUDA codec kernels decode any valid payload like the CPU codec", "[codec][gpu]") {
  OnDevice([](Gpu& g) { cases::CheckDecodesAnyValidPayload(g); });
}

TEST_CASE("CUDA codec kernels flag every input the CPU codec refuses", "[codec][gpu]") {
  OnDevice([](Gpu& g) { cases::CheckFlagsWhatCpuRefuses(g); });
}

// No device needed: these are refused before any CUDA call.
TEST_CASE("the device codec refuses lossless stages, naming the codec and the CPU path", "[codec][cuda-api]") {
  float* x = nullptr;  // never dereferenced: the spec is refused first
  for (const char* name : {"fp8+lz4", "int4-g32+zstd", "f16+lz4", "f32+zstd"}) {
    INFO(name);
    const auto spec = cases::SpecOf(name);
    const Status s = codec::cuda::CheckDeviceSupport(spec);
    REQUIRE(s.IsInvalidArgument());
    CHECK(s.message().find(std::string("codec ") + name) != std::string::npos);
    CHECK(s.message().find("codec::Encode") != std::string::npos);
    CHECK(s.message().find(spec.lossless == codec::Lossless::kZstd ? "zstd" : "lz4") != std::string::npos);
    CHECK(codec::cuda::DeviceSizes(spec, 4, 4).status().IsInvalidArgument());
    std::uint32_t flag = 0;
    CHECK(codec::cuda::EncodeOnDevice(spec, x, 4, 4, {nullptr, nullptr, nullptr, &flag}, 0).IsInvalidArgument());
    CHECK(codec::cuda::DecodeOnDevice(spec, nullptr, nullptr, 4, 4, x, 0).IsInvalidArgument());
  }
  codec::CodecSpec bad = cases::SpecOf("int4-g32");
  bad.group = 48;
  CHECK(codec::cuda::CheckDeviceSupport(bad).IsInvalidArgument());
}

TEST_CASE("device block sizes equal the CPU block's scale count and payload size", "[codec][cuda-api]") {
  for (const char* name : cases::kCodecs) {
    for (auto [rows, cols] : cases::kShapes) {
      INFO(name << " [" << rows << ", " << cols << "]");
      const auto spec = cases::SpecOf(name);
      const auto sizes = codec::cuda::DeviceSizes(spec, rows, cols);
      REQUIRE(sizes.ok());
      std::vector<std::byte> cpu;
      REQUIRE(codec::Encode(spec, cases::CaseInput(spec, rows, cols, 1), rows, cols, &cpu).ok());
      std::uint32_t nscales = 0;
      std::memcpy(&nscales, cpu.data() + 12, 4);
      CHECK(sizes->scale_count == nscales);
      CHECK(cpu.size() == cases::kHeaderBytes + 4 * sizes->scale_count + sizes->payload_bytes);
      const bool amax = spec.kind == codec::CodecKind::kFp8E4M3 || spec.kind == codec::CodecKind::kInt8;
      CHECK(sizes->scratch_words ==
            (amax ? (spec.scales == codec::ScaleMode::kPerChannel ? static_cast<std::uint64_t>(rows == 0 ? 0 : cols) : 1u)
                  : 0u));  // a block with no rows has no per-channel scales
    }
  }
  CHECK(codec::cuda::DeviceSizes(cases::SpecOf("fp8"), -1, 4).status().IsInvalidArgument());
}
