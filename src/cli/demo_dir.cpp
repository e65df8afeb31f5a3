#include "src/cli/demo_dir.h"

#include <sys/stat.h>

#include <algorithm>
#include <vector>

#include <fmt/format.h>

#include "src/cli/owned_dirs.h"
#include "src/cli/safe_files.h"

namespace terrace::cli {
namespace {

namespace fs = std::filesystem;

bool IsKind(const fs::path& p, mode_t kind) {
  struct stat st {};
  return ::lstat(p.c_str(), &st) == 0 && (st.st_mode & S_IFMT) == kind;
}

// The checkpoint files `model init` writes for a single-file model.
bool IsModelFile(std::string_view f) { return f == "config.json" || f == "model.safetensors"; }

std::string WhyNotModelDir(const fs::path& dir, std::string_view flag) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!IsModelFile(name) || !IsKind(e.path(), S_IFREG))
      return fmt::format("{} {} holds '{}', which the demo did not create", flag, dir.string(), name);
  }
  if (ec) return fmt::format("{} {}: cannot list it: {}", flag, dir.string(), ec.message());
  return "";
}

constexpr std::string_view kWho = "terrace demo";

}  // namespace

std::string WhyNotDemoDir(const fs::path& dir, std::string_view flag) {
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) return "";  // absent: created
  if (S_ISLNK(st.st_mode))
    return fmt::format("{} {} is a symbolic link; give the data directory itself", flag, dir.string());
  if (!S_ISDIR(st.st_mode)) return fmt::format("{} {} is {}; give a directory", flag, dir.string(), DescribePathKind(dir));
  std::error_code ec;
  std::vector<fs::path> entries;
  for (const auto& e : fs::directory_iterator(dir, ec)) entries.push_back(e.path());
  if (ec) return fmt::format("{} {}: cannot list it: {}", flag, dir.string(), ec.message());
  if (entries.empty()) return "";
  std::sort(entries.begin(), entries.end());
  bool marked = false;
  for (const fs::path& p : entries) {
    const std::string name = p.filename().string();
    const bool is_store = std::find(std::begin(kDemoStores), std::end(kDemoStores), name) != std::end(kDemoStores);
    if (name == kDemoMarker && IsKind(p, S_IFREG)) {
      marked = true;
    } else if (name == kDemoRunJson && IsKind(p, S_IFREG)) {
    } else if ((name == "terrace.data" && IsKind(p, S_IFREG)) || (name == "index" && IsKind(p, S_IFDIR))) {
      // a store of an earlier demo version, directly in DIR
    } else if (name == kDemoModelDir && IsKind(p, S_IFDIR)) {
      if (std::string why = WhyNotModelDir(p, flag); !why.empty()) return why;
    } else if (is_store && IsKind(p, S_IFDIR)) {
      std::size_t n = 0;
      for (const auto& e : fs::directory_iterator(p, ec)) (void)e, ++n;
      if (n > 0 && !IsOwnedStore(p, kDemoMarker))
        return fmt::format("{} {} holds '{}', which is not a store the demo created (it has other files in it, or no "
                           "{})",
                           flag, dir.string(), name, kDemoMarker);
    } else {
      return fmt::format("{} {} holds '{}', which the demo did not create", flag, dir.string(), name);
    }
  }
  if (!marked)
    return fmt::format("{} {} holds files that '{}' did not create (no {} in it)", flag, dir.string(), kWho, kDemoMarker);
  return "";
}

Result<bool> RemoveDemoDir(const fs::path& dir, std::string_view flag) {
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) return false;
  if (const std::string why = WhyNotDemoDir(dir, flag); !why.empty()) {
    return Status::InvalidArgument(fmt::format(
        "{}; 'terrace demo --fresh' removes only what the demo created, so nothing was removed (delete the folder "
        "yourself if you mean to, or give another {})",
        why, flag));
  }
  std::error_code ec;
  bool removed = false;
  for (const char* s : kDemoStores) {
    auto r = RemoveOwnedStore(dir / s, kDemoMarker, flag, kWho);
    if (!r.ok()) return r.status();
    if (*r) fs::remove(dir / s, ec);  // now empty
    removed = removed || *r;
  }
  const fs::path model = dir / kDemoModelDir;
  if (IsKind(model, S_IFDIR)) {
    for (const char* f : {"config.json", "model.safetensors"}) fs::remove(model / f, ec);
    fs::remove(model, ec);
    removed = true;
  }
  for (const char* f : {"terrace.data", kDemoRunJson, kDemoMarker}) {
    if (IsKind(dir / f, S_IFREG)) removed = fs::remove(dir / f, ec) || removed;
  }
  if (IsKind(dir / "index", S_IFDIR)) removed = fs::remove_all(dir / "index", ec) > 0 || removed;
  if (ec) return Status::IoError(fmt::format("{} {}: cannot remove the demo's files: {}", flag, dir.string(), ec.message()));
  return removed;
}

}  // namespace terrace::cli
