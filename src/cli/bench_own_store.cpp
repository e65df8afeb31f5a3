#include "src/cli/bench_own_store.h"

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "src/cli/owned_dirs.h"

namespace terrace::cli {
namespace fs = std::filesystem;

Result<bool> RemoveOwnStore(const fs::path& dir, std::string_view marker, std::string_view flag) {
  std::error_code ec;
  if (!fs::exists(dir, ec) || fs::is_empty(dir, ec)) return false;
  if (const std::string why = NonStoreEntry(dir, marker, flag); !why.empty()) {
    return Status::InvalidArgument(
        fmt::format("{}; nothing there was removed: delete the folder yourself once you no longer need it", why));
  }
  TERRACE_RETURN_IF_ERROR(RemoveStoreFiles(dir, marker, flag));
  return true;
}

Status MarkOwnStore(const fs::path& dir, std::string_view marker, std::string_view who) {
  std::error_code ec;
  if (fs::exists(fs::symlink_status(dir / std::string(marker), ec))) return Status::Ok();
  for (const std::string_view part : {kDataFile, kCreatingFile, kIndexDir})
    if (fs::exists(fs::symlink_status(dir / part, ec))) return WriteMarker(dir, marker, who);
  return Status::Ok();
}

Status CheckStillNew(const fs::path& dir, const fs::path& path, std::string_view flag) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(path, ec))) return Status::Ok();
  if (fs::is_directory(path, ec) && fs::is_empty(path, ec) && !ec) return Status::Ok();  // --dir may be a symlink
  const std::string which = path == dir ? "" : fmt::format(" ({} appeared)", path.string());
  return Status::Unavailable(fmt::format("{} {} gained entries while the bench ran (another process wrote into it?){}; "
                                         "nothing in it was removed; give a {} no other process uses",
                                         flag, dir.string(), which, flag));
}

void WaitAtStoreOpenGate() {
  const char* gate = std::getenv("TERRACE_TEST_STORE_OPEN_GATE");
  if (gate == nullptr || *gate == '\0') return;
  const fs::path file(gate);
  std::error_code ec;
  { std::ofstream(fs::path(file) += ".waiting"); }
  for (int i = 0; i < 6000 && !fs::exists(file, ec); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

}  // namespace terrace::cli
