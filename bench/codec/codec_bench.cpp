// Codec encode / decode throughput on one thread, in GB/s (10^9 bytes/s) of fp32 values (the
// input of Encode, the output of Decode), next to memcpy of the same fp32 bytes in the same run.
// Each repeat walks a working set of `blocks` blocks of [rows, cols] (default 64 x 1 MiB: beyond
// the CPU caches, as a KV write-back or restore stream is); the median repeat is reported, with
// the min and max, because the machine may be shared.
//
// Usage: bench_codec [--codecs fp8,int8,...] [--rows R] [--cols C] [--blocks N] [--repeats K]
// Defaults: every codec, rows 455, cols 576 (one 1 MiB fp32 block of 455 tokens of a 576-wide MLA
// latent), 64 blocks, 9 repeats. TERRACE_CODEC_KERNELS=scalar measures the scalar kernels.
// Output: a table, then "RESULT codec <name> <encode|decode|memcpy> <median GB/s>" lines.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "src/codec/kernels.h"
#include "src/common/median.h"
#include "terrace/codec.h"

using namespace terrace;

namespace {

struct Args {
  std::vector<std::string> codecs = {"f32", "bf16", "f16", "fp8", "fp8-block", "int8", "int4-g32", "int4-g64",
                                     "fp8+lz4", "int8+zstd"};
  std::int64_t rows = 455, cols = 576;
  int blocks = 64, repeats = 9;
};

[[noreturn]] void Usage(std::string_view why) {
  fmt::print(stderr, "bench_codec: {}\nflags: --codecs a,b,... --rows R --cols C --blocks N --repeats K\n", why);
  std::exit(2);
}

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; i += 2) {
    const std::string_view k = argv[i];
    if (i + 1 >= argc) Usage(fmt::format("{} needs a value", k));
    const std::string v = argv[i + 1];
    if (k == "--codecs") {
      a.codecs.clear();
      for (std::size_t p = 0; p <= v.size();) {
        const std::size_t q = std::min(v.find(',', p), v.size());
        if (q > p) a.codecs.push_back(v.substr(p, q - p));
        p = q + 1;
      }
    } else if (k == "--rows" || k == "--cols" || k == "--blocks" || k == "--repeats") {
      const long long n = std::atoll(v.c_str());
      if (n < 1 || n > (1 << 24)) Usage(fmt::format("{} {} is not in 1..16777216", k, v));
      if (k == "--rows") a.rows = n;
      if (k == "--cols") a.cols = n;
      if (k == "--blocks") a.blocks = static_cast<int>(n);
      if (k == "--repeats") a.repeats = static_cast<int>(n);
    } else {
      Usage(fmt::format("unknown flag {}", k));
    }
  }
  return a;
}

// Runs fn(block) over every block, `repeats` times; GB/s of `bytes_per_block` per repeat.
template <typename Fn>
MedianSpread Measure(const Args& a, double bytes_per_block, Fn fn) {
  std::vector<double> gbs;
  for (int b = 0; b < a.blocks; ++b) fn(b);  // warm-up: page faults, allocations
  for (int r = 0; r < a.repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int b = 0; b < a.blocks; ++b) fn(b);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    gbs.push_back(bytes_per_block * a.blocks / s / 1e9);
  }
  return MedianSpreadOf(gbs);
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = Parse(argc, argv);
  const std::size_t n = static_cast<std::size_t>(a.rows * a.cols);
  const double bytes = 4.0 * static_cast<double>(n);
  // KV-like data: per-channel magnitudes spread over 2^-4..2^4, normal values.
  std::mt19937_64 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> colmag(static_cast<std::size_t>(a.cols));
  for (auto& m : colmag) m = std::exp2(std::uniform_real_distribution<float>(-4, 4)(rng));
  std::vector<std::vector<float>> in(static_cast<std::size_t>(a.blocks), std::vector<float>(n));
  for (auto& blk : in)
    for (std::size_t i = 0; i < n; ++i) blk[i] = nd(rng) * colmag[i % static_cast<std::size_t>(a.cols)];
  std::vector<std::vector<float>> out(static_cast<std::size_t>(a.blocks), std::vector<float>(n));

  fmt::print("bench_codec: {} blocks of [{}, {}] fp32 ({:.1f} MiB each, {:.0f} MiB in all), {} repeats, "
             "kernels {}, 1 thread\n",
             a.blocks, a.rows, a.cols, bytes / (1 << 20), bytes * a.blocks / (1 << 20), a.repeats,
             codec::detail::Kernels().name);
  const MedianSpread mc = Measure(a, bytes, [&](int b) { std::memcpy(out[b].data(), in[b].data(), 4 * n); });
  fmt::print("{:<12} {:>22} {:>22} {:>8}\n", "codec", "encode GB/s (min-max)", "decode GB/s (min-max)", "ratio");
  fmt::print("{:<12} {:>7.2f} ({:5.2f}-{:5.2f}) {:>22} {:>8}\n", "memcpy", mc.median, mc.min, mc.max, "", "1.000");
  fmt::print("RESULT codec memcpy memcpy {:.3f}\n", mc.median);
  int failed = 0;
  for (const std::string& name : a.codecs) {
    auto spec = codec::CodecSpec::Parse(name);
    if (!spec.ok()) Usage(spec.status().message());
    std::vector<std::vector<std::byte>> enc(static_cast<std::size_t>(a.blocks));
    Status st;
    const MedianSpread e = Measure(a, bytes, [&](int b) {
      Status s = codec::Encode(*spec, in[b], a.rows, a.cols, &enc[b]);
      if (!s.ok()) st = s;
    });
    const MedianSpread d = Measure(a, bytes, [&](int b) {
      Status s = codec::Decode(enc[b], a.rows, a.cols, out[b]);
      if (!s.ok()) st = s;
    });
    if (!st.ok()) {
      fmt::print(stderr, "bench_codec: {}: {}\n", name, st.ToString());
      ++failed;
      continue;
    }
    fmt::print("{:<12} {:>7.2f} ({:5.2f}-{:5.2f}) {:>7.2f} ({:5.2f}-{:5.2f}) {:>8.3f}\n", name, e.median, e.min, e.max,
               d.median, d.min, d.max, bytes / static_cast<double>(enc[0].size()));
    fmt::print("RESULT codec {} encode {:.3f}\nRESULT codec {} decode {:.3f}\n", name, e.median, name, d.median);
  }
  fmt::print("(ratio: fp32 bytes / encoded bytes of block 0, scales and header included)\n");
  return failed ? 1 : 0;
}
