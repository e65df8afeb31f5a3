// Shared test helpers: scratch directories and deterministic block contents.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "terrace/block.h"

namespace terrace::testing {

// True in ASan/UBSan and TSan builds (GCC's macros; clang defines them too for these flags). Tests
// that repeat a randomized scenario many times run fewer rounds there: the instrumented code is
// 5-20x slower, and every round still runs in the normal build.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
inline constexpr bool kSanitizedBuild = true;
#else
inline constexpr bool kSanitizedBuild = false;
#endif

// True in TSan builds only. TSan checks interleavings, not inputs: a sweep over inputs (prefix
// lengths, policies, damage sites) keeps a few representative points there, since every point runs
// in the normal and ASan builds and TSan's tests are CI's longest test step.
#if defined(__SANITIZE_THREAD__)
inline constexpr bool kThreadSanitizedBuild = true;
#else
inline constexpr bool kThreadSanitizedBuild = false;
#endif

// A fresh directory under $TERRACE_TEST_TMPDIR (or the system temp dir), removed on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "t") {
    const char* base = std::getenv("TERRACE_TEST_TMPDIR");
    std::filesystem::path root = base ? base : std::filesystem::temp_directory_path();
    std::filesystem::create_directories(root);
    std::random_device rd;
    path_ = root / (tag + "-" + std::to_string(rd()) + "-" + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

inline BlockKey TestKey(std::uint64_t i, BlockKind kind = BlockKind::kKv, std::uint32_t ns = 1) {
  return BlockKey{ns, kind, static_cast<std::uint32_t>(i % 7), ContentId{i * 0x9E3779B97F4A7C15ull, i}};
}

// Deterministic pseudo-random bytes derived from (seed, i).
inline std::vector<std::byte> TestBytes(std::uint64_t i, std::size_t size, std::uint64_t seed = 42) {
  std::vector<std::byte> out(size);
  std::mt19937_64 rng(seed * 1000003u + i);
  for (std::size_t j = 0; j < size; j += 8) {
    std::uint64_t v = rng();
    for (std::size_t b = 0; b < 8 && j + b < size; ++b) out[j + b] = static_cast<std::byte>(v >> (8 * b));
  }
  return out;
}

}  // namespace terrace::testing
