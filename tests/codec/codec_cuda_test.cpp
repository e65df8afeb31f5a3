// The CUDA codec kernels write the same scales and payload bytes as the CPU Encode, and their
// decode equals the CPU Decode bit for bit. Without a usable device each case prints
// "SKIPPED: no CUDA device" and ctest reports the test as skipped.
#include <cmath>
#include <cstring>
#include <iostream>
#include <random>
#include <vector>

#include <cuda_runtime.h>

#include <catch2/catch.hpp>

#include "src/codec/cuda/codec_cuda.h"
#include "terrace/codec.h"

using namespace terrace;

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
};

std::vector<float> Input(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> colmag(static_cast<std::size_t>(cols));
  for (auto& m : colmag) m = std::exp2(std::uniform_real_distribution<float>(-30, 30)(rng));
  std::vector<float> x(static_cast<std::size_t>(rows * cols));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = nd(rng) * colmag[i % cols];
  for (std::int64_t r = 0; r < rows; ++r) x[r * cols] = 0.0f;                // a zero channel
  if (cols > 1) for (std::int64_t r = 0; r < rows; r += 3) x[r * cols + 1] *= 1e-5f;  // fp8 subnormals
  return x;
}

constexpr std::size_t kHeader = 64;

}  // namespace

TEST_CASE("CUDA bf16 / fp8 / int8 kernels match the CPU codec bit for bit", "[codec][gpu]") {
  if (!HaveDevice()) {
    SUCCEED("SKIPPED: no CUDA device");
    return;
  }
  for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {37, 576}, {256, 129}, {4096, 576}}) {
    const auto x = Input(rows, cols, static_cast<std::uint64_t>(rows * 7 + cols));
    const std::size_t n = x.size();
    Dev<float> dx(n), dscales(static_cast<std::size_t>(cols)), dout(n);
    Dev<std::uint8_t> dcodes(2 * n);
    Dev<std::uint32_t> damax(static_cast<std::size_t>(cols)), dflag(1);
    REQUIRE(cudaMemcpy(dx.p, x.data(), 4 * n, cudaMemcpyHostToDevice) == cudaSuccess);
    for (const char* name : {"bf16", "fp8", "fp8-block", "int8"}) {
      INFO(name << " [" << rows << ", " << cols << "]");
      const auto spec = *codec::CodecSpec::Parse(name);
      std::vector<std::byte> cpu;
      REQUIRE(codec::Encode(spec, x, rows, cols, &cpu).ok());
      std::vector<float> cpu_dec(n);
      REQUIRE(codec::Decode(cpu, rows, cols, cpu_dec).ok());
      const std::size_t nscales = spec.scales == codec::ScaleMode::kPerChannel ? cols
                                  : spec.scales == codec::ScaleMode::kPerBlock ? 1 : 0;
      const std::size_t payload = spec.kind == codec::CodecKind::kBf16 ? 2 * n : n;
      REQUIRE(cudaMemset(dflag.p, 0, 4) == cudaSuccess);
      cudaError_t e = cudaSuccess;
      const bool per_channel = spec.scales == codec::ScaleMode::kPerChannel;
      if (spec.kind == codec::CodecKind::kBf16) {
        e = codec::cuda::EncodeBf16(dx.p, static_cast<std::int64_t>(n), reinterpret_cast<std::uint16_t*>(dcodes.p), dflag.p, 0);
      } else if (spec.kind == codec::CodecKind::kFp8E4M3) {
        e = codec::cuda::EncodeFp8(dx.p, rows, cols, per_channel, damax.p, dscales.p, dcodes.p, dflag.p, 0);
      } else {
        e = codec::cuda::EncodeInt8(dx.p, rows, cols, damax.p, dscales.p, dcodes.p, dflag.p, 0);
      }
      REQUIRE(e == cudaSuccess);
      REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
      std::vector<std::uint8_t> codes(payload);
      std::vector<float> scales(nscales);
      std::uint32_t flag = 7;
      REQUIRE(cudaMemcpy(codes.data(), dcodes.p, payload, cudaMemcpyDeviceToHost) == cudaSuccess);
      if (nscales) REQUIRE(cudaMemcpy(scales.data(), dscales.p, 4 * nscales, cudaMemcpyDeviceToHost) == cudaSuccess);
      REQUIRE(cudaMemcpy(&flag, dflag.p, 4, cudaMemcpyDeviceToHost) == cudaSuccess);
      CHECK(flag == 0);
      REQUIRE(cpu.size() == kHeader + 4 * nscales + payload);
      CHECK(std::memcmp(scales.data(), cpu.data() + kHeader, 4 * nscales) == 0);
      CHECK(std::memcmp(codes.data(), cpu.data() + kHeader + 4 * nscales, payload) == 0);
      // Decode the CPU's payload on the device.
      REQUIRE(cudaMemcpy(dcodes.p, cpu.data() + kHeader + 4 * nscales, payload, cudaMemcpyHostToDevice) == cudaSuccess);
      if (nscales) REQUIRE(cudaMemcpy(dscales.p, cpu.data() + kHeader, 4 * nscales, cudaMemcpyHostToDevice) == cudaSuccess);
      if (spec.kind == codec::CodecKind::kBf16) {
        e = codec::cuda::DecodeBf16(reinterpret_cast<const std::uint16_t*>(dcodes.p), static_cast<std::int64_t>(n), dout.p, 0);
      } else if (spec.kind == codec::CodecKind::kFp8E4M3) {
        e = codec::cuda::DecodeFp8(dcodes.p, dscales.p, rows, cols, per_channel, dout.p, 0);
      } else {
        e = codec::cuda::DecodeInt8(dcodes.p, dscales.p, rows, cols, dout.p, 0);
      }
      REQUIRE(e == cudaSuccess);
      std::vector<float> gpu_dec(n);
      REQUIRE(cudaMemcpy(gpu_dec.data(), dout.p, 4 * n, cudaMemcpyDeviceToHost) == cudaSuccess);
      CHECK(std::memcmp(gpu_dec.data(), cpu_dec.data(), 4 * n) == 0);
    }
  }
}

TEST_CASE("CUDA encoders flag non-finite input", "[codec][gpu]") {
  if (!HaveDevice()) {
    SUCCEED("SKIPPED: no CUDA device");
    return;
  }
  std::vector<float> x(64, 1.0f);
  x[37] = std::nanf("");
  Dev<float> dx(64), dscales(8);
  Dev<std::uint8_t> dcodes(128);
  Dev<std::uint32_t> damax(8), dflag(1);
  REQUIRE(cudaMemcpy(dx.p, x.data(), 256, cudaMemcpyHostToDevice) == cudaSuccess);
  for (int which = 0; which < 3; ++which) {
    REQUIRE(cudaMemset(dflag.p, 0, 4) == cudaSuccess);
    if (which == 0) REQUIRE(codec::cuda::EncodeBf16(dx.p, 64, reinterpret_cast<std::uint16_t*>(dcodes.p), dflag.p, 0) == cudaSuccess);
    if (which == 1) REQUIRE(codec::cuda::EncodeFp8(dx.p, 8, 8, true, damax.p, dscales.p, dcodes.p, dflag.p, 0) == cudaSuccess);
    if (which == 2) REQUIRE(codec::cuda::EncodeInt8(dx.p, 8, 8, damax.p, dscales.p, dcodes.p, dflag.p, 0) == cudaSuccess);
    std::uint32_t flag = 0;
    REQUIRE(cudaMemcpy(&flag, dflag.p, 4, cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(flag == 1);
  }
}
