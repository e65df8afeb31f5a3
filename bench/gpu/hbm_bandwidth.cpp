// Host<->device copy bandwidth, pinned vs pageable host memory, 64 KiB .. 256 MiB.
// Depends only on the CUDA runtime and the C++ standard library, so bench/gpu/check.sh can build it
// with nvcc alone when the project's other dependencies are missing.
//
// Output: a table, then one machine-readable line per measurement:
//   RESULT <pinned|pageable> <h2d|d2h> <bytes> <GB/s>      (GB = 10^9 bytes)
// Exit status: 0 on success, 2 when no CUDA device is usable, 1 on a CUDA error.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

bool Ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "hbm_bandwidth: %s failed: %s\n", what, cudaGetErrorString(e));
  return false;
}

// Average GB/s of `iters` copies of `bytes`, timed with events on one stream after one warm-up copy.
double Time(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, cudaStream_t s, bool* ok) {
  const int iters = static_cast<int>(std::clamp<std::size_t>((std::size_t{1} << 30) / bytes, 3, 200));
  cudaEvent_t a, b;
  *ok = Ok(cudaEventCreate(&a), "cudaEventCreate") && Ok(cudaEventCreate(&b), "cudaEventCreate") &&
        Ok(cudaMemcpyAsync(dst, src, bytes, kind, s), "cudaMemcpyAsync (warm-up)") &&
        Ok(cudaEventRecord(a, s), "cudaEventRecord");
  for (int i = 0; *ok && i < iters; ++i) *ok = Ok(cudaMemcpyAsync(dst, src, bytes, kind, s), "cudaMemcpyAsync");
  float ms = 0;
  *ok = *ok && Ok(cudaEventRecord(b, s), "cudaEventRecord") && Ok(cudaEventSynchronize(b), "cudaEventSynchronize") &&
        Ok(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
  (void)cudaEventDestroy(a);
  (void)cudaEventDestroy(b);
  return *ok && ms > 0 ? static_cast<double>(bytes) * iters / (ms / 1e3) / 1e9 : 0;
}

}  // namespace

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 2;
  }
  cudaDeviceProp prop{};
  if (!Ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties")) return 1;
  std::printf("device 0: %s, %.1f GiB\n", prop.name, static_cast<double>(prop.totalGlobalMem) / (1 << 30));
  const std::size_t kMax = std::size_t{256} << 20;
  void* dev = nullptr;
  void* pinned = nullptr;
  cudaStream_t s = nullptr;
  if (!Ok(cudaMalloc(&dev, kMax), "cudaMalloc") || !Ok(cudaHostAlloc(&pinned, kMax, cudaHostAllocDefault), "cudaHostAlloc") ||
      !Ok(cudaStreamCreate(&s), "cudaStreamCreate")) {
    return 1;
  }
  std::vector<unsigned char> pageable(kMax);
  std::memset(pinned, 1, kMax);
  std::memset(pageable.data(), 1, kMax);
  std::printf("%10s %14s %14s %14s %14s   (GB/s)\n", "size", "pinned H2D", "pinned D2H", "pageable H2D", "pageable D2H");
  std::vector<char> lines;
  bool ok = true;
  for (std::size_t bytes = 64 << 10; ok && bytes <= kMax; bytes *= 4) {
    double r[4];
    r[0] = Time(dev, pinned, bytes, cudaMemcpyHostToDevice, s, &ok);
    if (ok) r[1] = Time(pinned, dev, bytes, cudaMemcpyDeviceToHost, s, &ok);
    if (ok) r[2] = Time(dev, pageable.data(), bytes, cudaMemcpyHostToDevice, s, &ok);
    if (ok) r[3] = Time(pageable.data(), dev, bytes, cudaMemcpyDeviceToHost, s, &ok);
    if (!ok) break;
    std::printf("%7zu KiB %14.2f %14.2f %14.2f %14.2f\n", bytes >> 10, r[0], r[1], r[2], r[3]);
    const char* kinds[4][2] = {{"pinned", "h2d"}, {"pinned", "d2h"}, {"pageable", "h2d"}, {"pageable", "d2h"}};
    for (int k = 0; k < 4; ++k) {
      char buf[128];
      int len = std::snprintf(buf, sizeof buf, "RESULT %s %s %zu %.3f\n", kinds[k][0], kinds[k][1], bytes, r[k]);
      lines.insert(lines.end(), buf, buf + len);
    }
  }
  lines.push_back('\0');
  std::fputs(lines.data(), stdout);
  (void)cudaStreamDestroy(s);
  (void)cudaFreeHost(pinned);
  (void)cudaFree(dev);
  return ok ? 0 : 1;
}
