// bench_mxfp4: the fused MXFP4 dequantise-and-multiply kernel (Mxfp4Linear) against a plain fp32
// GEMV / GEMM (OpenBLAS, ops::Linear) over the same weights dequantised, one thread, same run.
// For each shape and T (tokens per call) it times both over a pool of distinct matrices (`--pool-mib`
// of fp32 weights, so the fp32 side streams from memory the way a decode step does, or a single
// matrix with --hot), median of --repeats, and prints weights/s, weight bytes/s in each format's own
// bytes (MXFP4: 0.53125 B per weight incl. scales; fp32: 4 B) and the time ratio. Times are the
// thread's CPU time (CLOCK_THREAD_CPUTIME_ID).
#include <algorithm>
#include <ctime>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "src/common/clock.h"
#include "src/common/median.h"
#include "src/model/mxfp4.h"
#include "src/model/mxfp4_matmul.h"
#include "src/model/ops.h"

namespace {

using namespace terrace::model;
struct Args {
  std::vector<std::string> shapes{"256x256", "3072x3584"};
  std::vector<int> tokens{1, 32};
  int repeats = 7;
  double min_seconds = 0.15;  // per repeat
  double pool_mib = 256.0;
  bool hot = false;
  std::string kernel = "auto";
};

struct Pool {
  std::int64_t rows = 0, cols = 0;
  std::vector<std::vector<std::uint8_t>> packed, scales;
  std::vector<std::vector<float>> dense;
};

Pool MakePool(std::int64_t rows, std::int64_t cols, int count) {
  Pool p;
  p.rows = rows;
  p.cols = cols;
  std::mt19937_64 rng(1);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  std::vector<float> w(static_cast<std::size_t>(rows * cols));
  for (int i = 0; i < count; ++i) {
    for (auto& v : w) v = nd(rng);
    std::vector<std::uint8_t> pk, sc;
    (void)QuantizeMxfp4(w, rows, cols, &pk, &sc);
    std::vector<float> dq(w.size());
    (void)DequantizeMxfp4(pk, sc, rows, cols, dq);
    p.packed.push_back(std::move(pk));
    p.scales.push_back(std::move(sc));
    p.dense.push_back(std::move(dq));
  }
  return p;
}

// Median seconds per call of fn(i) for i cycling over the pool.
template <typename F>
double MedianSecondsPerCall(int repeats, double min_seconds, int pool, F&& fn) {
  std::vector<double> per_call;
  for (int r = 0; r < repeats; ++r) {
    long calls = 0;
    const double start = terrace::ThreadCpuSeconds();
    double elapsed = 0.0;
    do {
      for (int i = 0; i < pool; ++i) fn(i);
      calls += pool;
      elapsed = terrace::ThreadCpuSeconds() - start;
    } while (elapsed < min_seconds);
    per_call.push_back(elapsed / static_cast<double>(calls));
  }
  return terrace::Median(std::move(per_call));
}

int Run(const Args& a) {
  ops::SetBlasThreads(1);
  Mxfp4Kernel kernel = Mxfp4Kernel::kAuto;
  if (a.kernel == "scalar") kernel = Mxfp4Kernel::kScalar;
  if (a.kernel == "avx2") kernel = Mxfp4Kernel::kAvx2;
  fmt::print("# one thread; kernel {}; {}; median of {} repeats of >= {} s of thread CPU time\n", Mxfp4KernelName(kernel),
             a.hot ? "one hot matrix" : fmt::format("a pool of ~{} MiB of fp32 weights", a.pool_mib), a.repeats,
             a.min_seconds);
  fmt::print("{:>10} {:>3} {:>7} | {:>10} {:>10} {:>10} | {:>10} {:>10} {:>10} | {:>6}\n", "shape", "T", "pool",
             "mxfp4 us", "Gw/s", "GB/s", "fp32 us", "Gw/s", "GB/s", "speedup");
  for (const auto& shape : a.shapes) {
    std::int64_t rows = 0, cols = 0;
    if (std::sscanf(shape.c_str(), "%ldx%ld", &rows, &cols) != 2 || rows <= 0 || cols <= 0 || cols % 32 != 0) {
      fmt::print(stderr, "bench_mxfp4: --shape {} must be ROWSxCOLS with COLS a multiple of 32\n", shape);
      return 2;
    }
    const double fp32_bytes = 4.0 * static_cast<double>(rows * cols);
    const int count = a.hot ? 1 : std::max(1, static_cast<int>(a.pool_mib * 1048576.0 / fp32_bytes));
    const Pool pool = MakePool(rows, cols, count);
    for (int T : a.tokens) {
      std::vector<float> x(static_cast<std::size_t>(T * cols)), y(static_cast<std::size_t>(T * rows));
      std::mt19937 rng(2);
      std::uniform_real_distribution<float> ud(-1.0f, 1.0f);
      for (auto& v : x) v = ud(rng);
      const double tq = MedianSecondsPerCall(a.repeats, a.min_seconds, count, [&](int i) {
        const Mxfp4Matrix m{pool.packed[static_cast<std::size_t>(i)].data(), pool.scales[static_cast<std::size_t>(i)].data(),
                            rows, cols};
        Mxfp4Linear(m, x.data(), T, y.data(), false, kernel);
      });
      const double tf = MedianSecondsPerCall(a.repeats, a.min_seconds, count, [&](int i) {
        ops::Linear(x.data(), T, cols, pool.dense[static_cast<std::size_t>(i)].data(), rows, y.data());
      });
      const double weights = static_cast<double>(rows * cols);
      fmt::print("{:>10} {:>3} {:>7} | {:>10.2f} {:>10.2f} {:>10.2f} | {:>10.2f} {:>10.2f} {:>10.2f} | {:>6.2f}x\n",
                 shape, T, count, tq * 1e6, weights / tq * 1e-9, weights * 0.53125 / tq * 1e-9, tf * 1e6,
                 weights / tf * 1e-9, fp32_bytes / tf * 1e-9, tf / tq);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"bench_mxfp4: fused MXFP4 kernel vs fp32 GEMV/GEMM over the dequantised weights (one thread)"};
  app.add_option("--shape", a.shapes, "ROWSxCOLS of the weight (repeatable; default 256x256 and 3072x3584)");
  app.add_option("--tokens", a.tokens, "tokens per call, T (repeatable; default 1 and 32)");
  app.add_option("--repeats", a.repeats, "repeats; the median is reported")->check(CLI::PositiveNumber);
  app.add_option("--min-seconds", a.min_seconds, "minimum seconds per repeat")->check(CLI::PositiveNumber);
  app.add_option("--pool-mib", a.pool_mib, "fp32 MiB of distinct matrices cycled through")->check(CLI::PositiveNumber);
  app.add_flag("--hot", a.hot, "time one matrix over and over (cache-resident) instead of a pool");
  app.add_option("--kernel", a.kernel, "auto, scalar or avx2")->check(CLI::IsMember({"auto", "scalar", "avx2"}));
  CLI11_PARSE(app, argc, argv);
  return Run(a);
}
