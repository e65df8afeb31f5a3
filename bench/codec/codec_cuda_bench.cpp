// CUDA codec kernels (src/codec/cuda/codec_cuda.h): encode / decode throughput of every device codec
// in GB/s of fp32 values, input and output resident on the device, next to a device-to-device
// cudaMemcpy of the same fp32 bytes in the same run (median of repeats; each repeat is one
// EncodeOnDevice / DecodeOnDevice call, timed with CUDA events on the default stream).
// Usage: bench_codec_cuda [--rows R] [--cols C] [--repeats K]   (defaults 65536 x 576, 20 repeats)
// Output: a table, then "RESULT codec_cuda <codec> <encode|decode|memcpy> <median GB/s>".
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include <cuda_runtime.h>

#include "src/codec/cuda/codec_cuda.h"
#include "src/common/median.h"
#include "terrace/codec.h"

using namespace terrace::codec;

namespace {

void CheckOk(const terrace::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "bench_codec_cuda: %s\n", s.ToString().c_str());
    std::exit(1);
  }
}

#define CHECK_CUDA(expr)                                                                    \
  do {                                                                                      \
    cudaError_t e_ = (expr);                                                                \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "bench_codec_cuda: %s: %s\n", #expr, cudaGetErrorString(e_));    \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

template <typename Fn>
double MedianGbs(int repeats, double bytes, Fn fn) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  fn();
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<double> v;
  for (int r = 0; r < repeats; ++r) {
    CHECK_CUDA(cudaEventRecord(a));
    fn();
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    v.push_back(bytes / (ms * 1e-3) / 1e9);
  }
  return terrace::Median(std::move(v));
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t rows = 65536, cols = 576;
  int repeats = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view k = argv[i];
    const long long v = std::atoll(argv[i + 1]);
    if (v < 1) { std::fprintf(stderr, "bench_codec_cuda: %s must be >= 1\n", argv[i]); return 2; }
    if (k == "--rows") rows = v;
    else if (k == "--cols") cols = v;
    else if (k == "--repeats") repeats = static_cast<int>(v);
    else { std::fprintf(stderr, "bench_codec_cuda: unknown flag %s; flags: --rows --cols --repeats\n", argv[i]); return 2; }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "bench_codec_cuda: no CUDA device\n");
    return 1;
  }
  const char* const names[] = {"f32", "bf16", "f16", "fp8", "fp8-block", "int8", "int4-g32", "int4-g64"};
  std::vector<CodecSpec> specs;
  cuda::DeviceBlockSizes most;  // the largest buffers any codec needs
  for (const char* name : names) {
    auto spec = CodecSpec::Parse(name);
    CheckOk(spec.status());
    auto sizes = cuda::DeviceSizes(*spec, rows, cols);
    CheckOk(sizes.status());
    most.scale_count = std::max(most.scale_count, sizes->scale_count);
    most.payload_bytes = std::max(most.payload_bytes, sizes->payload_bytes);
    most.scratch_words = std::max(most.scratch_words, sizes->scratch_words);
    specs.push_back(*spec);
  }
  const std::size_t n = static_cast<std::size_t>(rows * cols);
  const double bytes = 4.0 * static_cast<double>(n);
  std::vector<float> x(n);
  for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<float>((i * 2654435761u) % 20011) / 1000.0f - 10.0f;
  float *dx, *dout, *dscales;
  std::uint8_t* dpayload;
  std::uint32_t *dscratch, *dflag;
  CHECK_CUDA(cudaMalloc(&dx, 4 * n));
  CHECK_CUDA(cudaMalloc(&dout, 4 * n));
  CHECK_CUDA(cudaMalloc(&dpayload, most.payload_bytes));
  CHECK_CUDA(cudaMalloc(&dscales, 4 * most.scale_count));
  CHECK_CUDA(cudaMalloc(&dscratch, 4 * std::max<std::uint64_t>(most.scratch_words, 1)));
  CHECK_CUDA(cudaMalloc(&dflag, 4));
  CHECK_CUDA(cudaMemcpy(dx, x.data(), 4 * n, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(dflag, 0, 4));
  std::printf("bench_codec_cuda: [%lld, %lld] fp32 (%.0f MiB), device-resident, median of %d\n",
              static_cast<long long>(rows), static_cast<long long>(cols), bytes / (1 << 20), repeats);
  const double mc = MedianGbs(repeats, bytes, [&] { CHECK_CUDA(cudaMemcpyAsync(dout, dx, 4 * n, cudaMemcpyDeviceToDevice)); });
  std::printf("%-10s %12s %12s\n%-10s %12.1f\nRESULT codec_cuda memcpy memcpy %.3f\n", "codec", "encode GB/s", "decode GB/s",
              "memcpy", mc, mc);
  const cuda::DeviceEncodeBuffers buf{dscales, dpayload, dscratch, dflag};
  for (const CodecSpec& spec : specs) {
    const double e = MedianGbs(repeats, bytes, [&] { CheckOk(cuda::EncodeOnDevice(spec, dx, rows, cols, buf, 0)); });
    const double d = MedianGbs(repeats, bytes, [&] { CheckOk(cuda::DecodeOnDevice(spec, dscales, dpayload, rows, cols, dout, 0)); });
    const std::string name = spec.Name();
    std::printf("%-10s %12.1f %12.1f\n", name.c_str(), e, d);
    std::printf("RESULT codec_cuda %s encode %.3f\nRESULT codec_cuda %s decode %.3f\n", name.c_str(), e, name.c_str(), d);
  }
  std::uint32_t flag = 0;
  CHECK_CUDA(cudaMemcpy(&flag, dflag, 4, cudaMemcpyDeviceToHost));
  if (flag != 0) {
    std::fprintf(stderr, "bench_codec_cuda: an encoder flagged non-finite input, which this input does not hold\n");
    return 1;
  }
  return 0;
}
