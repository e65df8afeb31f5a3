#include "src/cli/demo_dir.h"

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <vector>

#include <fmt/format.h>

#include "src/cli/owned_dirs.h"
#include "src/cli/safe_files.h"
#include "src/common/generator_mark.h"
#include "src/common/list_dir.h"

namespace terrace::cli {
namespace {

namespace fs = std::filesystem;

// The checkpoint files `model init` writes for a single-file model (in DIR/model.tmp, also the
// temporary files of a stopped write there: "<name>.tmp.<pid>").
bool IsModelFile(std::string_view f, bool partial = false) {
  for (std::string_view name : {"config.json", "model.safetensors"}) {
    if (f == name) return true;
    if (!partial || !f.starts_with(name)) continue;
    std::string_view rest = f.substr(name.size());
    if (!rest.starts_with(".tmp.") || rest.size() == 5) continue;
    rest.remove_prefix(5);
    if (std::all_of(rest.begin(), rest.end(), [](char c) { return c >= '0' && c <= '9'; })) return true;
  }
  return false;
}

// Whether `path` is a safetensors file of a checkpoint Terrace wrote (IsTerraceCheckpoint).
bool IsTerraceCheckpointFile(const fs::path& path) {
  const std::optional<std::string> head = MarkedTerraceFileHead(path, OutputFormat::kSafetensors);
  return head && IsTerraceCheckpoint(*head);
}

// Entries of DIR/model that are not checkpoint files init writes, as "model/<name>". In the finished
// model folder (not `partial`) the names are not enough: model.safetensors must carry the mark of a
// checkpoint Terrace wrote, and config.json (which has no mark) counts as the demo's only beside it.
void ForeignInModelDir(const fs::path& dir, std::vector<std::string>* foreign, bool partial = false) {
  std::error_code ec;
  const std::string folder = dir.filename().string();
  const bool checkpoint = !partial && IsTerraceCheckpointFile(dir / "model.safetensors");
  for (const auto& e : ListDir(dir, &ec)) {
    const std::string name = e.path().filename().string();
    if (!IsModelFile(name, partial) || !IsKind(e.path(), S_IFREG)) {
      foreign->push_back(folder + "/" + name);
    } else if (!partial && name == "model.safetensors" && !checkpoint) {
      foreign->push_back(folder + "/" + name + " (not a checkpoint Terrace wrote; if it is the demo's, damaged, "
                         "delete the folder " + folder + " yourself and run again)");
    } else if (!partial && name == "config.json" && !checkpoint) {
      foreign->push_back(folder + "/" + name + " (not beside a checkpoint Terrace wrote)");
    }
  }
  if (ec) foreign->push_back(folder + " (cannot list it: " + ec.message() + ")");
}

// An index folder that Terrace's own recovery set aside beside a store's index/: the old index
// `terrace store recover` moved aside (index.damaged-<time>[-n]), one a reformatting open moved
// aside (index.reformatted-<time>[-n]), or the new index a stopped recover was building
// (index.rebuilding, which the next recover removes or puts in place); a real directory holding only
// index files (ForeignIndexEntry). The store opens with them beside it; --fresh removes them. A
// moved-aside index must carry the exact name its mover gives it (<time> as yyyymmddThhmmss) and hold
// a RocksDB database's own files, so that a user's folder of a similar name (index.damaged-notes,
// holding notes.log) is never taken for one and removed.
bool IsMovedAsideSuffix(std::string_view rest) {
  constexpr std::size_t kStamp = 15;  // yyyymmddThhmmss
  if (rest.size() < kStamp) return false;
  for (std::size_t i = 0; i < kStamp; ++i) {
    if (i == 8 ? rest[i] != 'T' : !std::isdigit(static_cast<unsigned char>(rest[i]))) return false;
  }
  rest.remove_prefix(kStamp);
  if (rest.empty()) return true;
  return rest.size() > 1 && rest.front() == '-' &&
         std::all_of(rest.begin() + 1, rest.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
}
bool IsSetAsideIndexName(std::string_view name) {
  if (name == "index.rebuilding") return true;
  for (std::string_view prefix : {"index.damaged-", "index.reformatted-"}) {
    if (name.starts_with(prefix)) return IsMovedAsideSuffix(name.substr(prefix.size()));
  }
  return false;
}
bool HoldsRocksDbFiles(const fs::path& p) {
  std::error_code ec;
  for (const auto& e : ListDir(p, &ec)) {
    const std::string n = e.path().filename().string();
    if (n == "CURRENT" || n == "IDENTITY" || n.starts_with("MANIFEST-") || n.starts_with("OPTIONS-")) return true;
  }
  return false;
}
bool IsSetAsideIndex(const fs::path& p) {
  const std::string name = p.filename().string();
  return IsSetAsideIndexName(name) && IsKind(p, S_IFDIR) && !ForeignIndexEntry(p) &&
         (name == "index.rebuilding" || HoldsRocksDbFiles(p));
}

// The set-aside index folders (IsSetAsideIndex) in the store folder `dir`.
std::vector<fs::path> SetAsideIndexes(const fs::path& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  if (!IsKind(dir, S_IFDIR)) return out;
  for (const auto& e : ListDir(dir, &ec))
    if (IsSetAsideIndex(e.path())) out.push_back(e.path());
  return out;
}

// A store folder a stopped demo run left before writing its marker (the marker follows the store's
// creation, which needs an empty folder): nothing but terrace.data (a Terrace data file:
// IsStoreDataFile), terrace.data.creating (regular files) and index/ (holding only index files).
// Only trusted inside a DIR that holds the demo's own marker.
bool IsStoppedDemoStore(const fs::path& dir) {
  if (!IsKind(dir, S_IFDIR)) return false;
  std::error_code ec;
  std::size_t n = 0;
  for (const auto& e : ListDir(dir, &ec)) {
    ++n;
    const std::string name = e.path().filename().string();
    const bool ok = (name == "terrace.data" && IsKind(e.path(), S_IFREG) && IsStoreDataFile(e.path())) ||
                    (name == "terrace.data.creating" && IsKind(e.path(), S_IFREG)) ||
                    (name == "index" && !ForeignIndexEntry(e.path()));
    if (!ok) return false;
  }
  return !ec && n > 0;
}

// What makes DIR/<store> not a store the demo created, as "kv/<name>" entries. The demo's are its
// marked store, or what a stopped creation or removal of one left with the marker (index files,
// terrace.data.creating: IsOwnedStoreOrLeftover; the run completes or clears it, --fresh removes
// it). `dir_marked`: DIR holds the demo's marker, so a stopped run's unmarked store in it is the
// demo's too.
void ForeignInStore(const fs::path& dir, std::vector<std::string>* foreign, bool dir_marked) {
  if (IsOwnedStoreOrLeftover(dir, kDemoMarker) || (dir_marked && IsStoppedDemoStore(dir))) return;
  std::error_code ec;
  std::size_t n = 0, before = foreign->size();
  bool marked = false, aside = false, data = false;
  for (const auto& e : ListDir(dir, &ec)) {
    ++n;
    const std::string name = e.path().filename().string();
    if (IsSetAsideIndexName(name) && IsKind(e.path(), S_IFDIR)) {  // store recover's, beside the store
      if (auto f = ForeignIndexEntry(e.path())) {
        foreign->push_back((dir.filename() / f->lexically_relative(dir)).string());
      } else if (!IsSetAsideIndex(e.path())) {
        foreign->push_back((dir.filename() / name).string());  // no database of Terrace's in it
      }
      aside = true;
    } else if (name == "terrace.data.creating" && IsKind(e.path(), S_IFREG)) {
      // a creation a stopped run left: a store's own
    } else if (name == kDemoMarker && IsKind(e.path(), S_IFREG)) {
      marked = true;
    } else if (name == "index" && IsKind(e.path(), S_IFDIR)) {
      if (auto f = ForeignIndexEntry(e.path())) {
        foreign->push_back((dir.filename() / f->lexically_relative(dir)).string());
      }
    } else if (name == "terrace.data" && IsKind(e.path(), S_IFREG)) {
      data = true;
    } else {
      foreign->push_back(dir.filename().string() + "/" + name);
    }
  }
  if (n == 0 || foreign->size() != before) return;  // empty: a pool folder a run stopped before creating it
  // A store (or what a stopped run left of one, as above) with index folders that Terrace's recovery
  // set aside beside it: the demo's when marked, or in the demo's marked DIR (a --fresh stopped after
  // the store's marker went leaves the set-aside folders alone).
  const bool data_ok = !data || IsStoreDataFile(dir / "terrace.data");
  if (aside && !ec && data_ok && (marked || dir_marked)) return;
  // Every entry is a store's own, yet IsOwnedStoreOrLeftover said no: unmarked, or a terrace.data
  // that is not Terrace's (or the folder could not be listed).
  const std::string name = dir.filename().string();
  if (!marked) {
    foreign->push_back(name + " (a store without " + kDemoMarker + ")");
  } else if (IsKind(dir / "terrace.data", S_IFREG) && !IsStoreDataFile(dir / "terrace.data")) {
    foreign->push_back(name + "/terrace.data (not a Terrace data file)");
  } else {
    foreign->push_back(name + (ec ? " (cannot list it: " + ec.message() + ")" : std::string(" (unreadable)")));
  }
}

constexpr std::string_view kDemoWho = "terrace demo";

// The output rule of DIR/demo-run.json or DIR/report.html: replaced only when it carries the mark
// of its format.
OutputRules DemoFileRules(const fs::path& path) {
  return {.format = path.filename() == kDemoRunJson ? OutputFormat::kJson : OutputFormat::kHtml};
}

// Why the entry `path` (DIR/demo-run.json or DIR/report.html) is not one the demo wrote, as
// "<name> (<why>)"; empty when it is absent or carries the demo's mark.
std::string WhyNotDemoFile(const fs::path& path) {
  const std::string name = path.filename().string();
  if (!IsKind(path, S_IFREG)) {
    const std::string kind = DescribePathKind(path);
    return kind == "missing" ? "" : fmt::format("{} ({})", name, kind);
  }
  if (CheckOutputFile(path, "--dir", DemoFileRules(path)).ok()) return "";
  return path.filename() == kDemoRunJson
             ? fmt::format("{} (it does not start with the \"{}\": \"{}\" member the demo writes; one from a Terrace "
                           "before that mark has none either: move it out or delete it)",
                           name, kJsonGeneratorKey, kJsonGeneratorValue)
             : fmt::format("{} (it lacks the {} the demo's report has: move it out or delete it)", name,
                           kHtmlGeneratorMeta);
}

}  // namespace

std::string WhyNotDemoDir(const fs::path& dir, std::string_view flag) {
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) return "";  // absent: created
  if (S_ISLNK(st.st_mode))
    return fmt::format("{} {} is a symbolic link; give the data directory itself", flag, dir.string());
  if (!S_ISDIR(st.st_mode)) return fmt::format("{} {} is {}; give a directory", flag, dir.string(), DescribePathKind(dir));
  std::error_code ec;
  std::vector<fs::path> entries;
  for (const auto& e : ListDir(dir, &ec)) entries.push_back(e.path());
  if (ec) return fmt::format("{} {}: cannot list it: {}", flag, dir.string(), ec.message());
  if (entries.empty()) return "";
  std::sort(entries.begin(), entries.end());
  const bool dir_marked = IsKind(dir / kDemoMarker, S_IFREG);
  bool marked = false;
  std::vector<std::string> foreign;
  for (const fs::path& p : entries) {
    const std::string name = p.filename().string();
    const bool is_store = std::find(std::begin(kDemoStores), std::end(kDemoStores), name) != std::end(kDemoStores);
    if (name == kDemoMarker && IsKind(p, S_IFREG)) {
      marked = true;
    } else if (name == kDemoRunJson || name == kDemoReportHtml) {
      if (std::string why = WhyNotDemoFile(p); !why.empty()) foreign.push_back(why);
    } else if (name == "terrace.data" && IsKind(p, S_IFREG)) {  // a store of an earlier demo version, in DIR
      if (!IsStoreDataFile(p)) foreign.push_back(name + " (not a Terrace data file)");
    } else if (name == "index" && IsKind(p, S_IFDIR)) {  // that store's index
      if (auto f = ForeignIndexEntry(p)) foreign.push_back(f->lexically_relative(dir).string());
    } else if (name == kDemoModelDir && IsKind(p, S_IFDIR)) {
      ForeignInModelDir(p, &foreign);
    } else if (name == kDemoModelTmpDir && IsKind(p, S_IFDIR)) {  // a model build that was stopped
      ForeignInModelDir(p, &foreign, /*partial=*/true);
    } else if (is_store && IsKind(p, S_IFDIR)) {
      ForeignInStore(p, &foreign, dir_marked);
    } else {
      foreign.push_back(name);
    }
  }
  if (!foreign.empty()) {
    constexpr std::size_t kShown = 8;
    std::vector<std::string> shown;
    for (std::size_t i = 0; i < std::min(kShown, foreign.size()); ++i) shown.push_back("'" + foreign[i] + "'");
    return fmt::format("{} {} holds {}{}, which the demo did not create", flag, dir.string(), fmt::join(shown, ", "),
                       foreign.size() > kShown ? fmt::format(" and {} more", foreign.size() - kShown) : "");
  }
  if (!marked)
    return fmt::format("{} {} holds files that '{}' did not create (no {} in it)", flag, dir.string(), kDemoWho, kDemoMarker);
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
    // The index folders Terrace's recovery set aside beside the store go first (each holds only index
    // files, checked above), once no process uses the store (a recover running there holds its lock).
    if (const std::vector<fs::path> aside = SetAsideIndexes(dir / s); !aside.empty()) {
      if (const std::optional<std::string> user = StoreInUse(dir / s)) {
        return Status::InvalidArgument(fmt::format(
            "{} {} holds a store that {} is using right now; '{}' removes only a store no process uses, so nothing "
            "was removed (wait for that process to finish, or give another {})",
            flag, (dir / s).string(), *user, "terrace demo --fresh", flag));
      }
      for (const fs::path& a : aside) {
        for (const auto& e : ListDir(a, &ec))
          if (!ec) fs::remove(e.path(), ec);
        if (!ec) fs::remove(a, ec);
        if (ec) return Status::IoError(fmt::format("{} {}: cannot remove {}: {}", flag, dir.string(), a.string(), ec.message()));
      }
      removed = true;
    }
    if (!IsOwnedStore(dir / s, kDemoMarker) && IsStoppedDemoStore(dir / s)) {  // DIR is marked (checked above)
      TERRACE_RETURN_IF_ERROR(RemoveStoreFiles(dir / s, kDemoMarker, flag));
      fs::remove(dir / s, ec);
      if (ec) return Status::IoError(fmt::format("{} {}: cannot remove the demo's {}: {}", flag, dir.string(), s, ec.message()));
      removed = true;
      continue;
    }
    auto r = RemoveOwnedStore(dir / s, kDemoMarker, flag, kDemoWho);
    if (!r.ok()) return r.status();
    std::error_code gone;
    fs::remove(dir / s, gone);  // only when empty (removed above, or a pool a stopped run left empty)
    removed = removed || *r;
  }
  const fs::path model = dir / kDemoModelDir;
  if (IsKind(model, S_IFDIR)) {
    for (const char* f : {"config.json", "model.safetensors"}) fs::remove(model / f, ec);
    fs::remove(model, ec);
    removed = true;
  }
  if (IsKind(dir / kDemoModelTmpDir, S_IFDIR)) {
    TERRACE_RETURN_IF_ERROR(RemoveStoppedModelBuild(dir));
    removed = true;
  }
  for (const char* f : {kDemoRunJson, kDemoReportHtml}) {
    if (!ec && IsKind(dir / f, S_IFREG)) removed = fs::remove(dir / f, ec) || removed;
  }
  if (ec) return Status::IoError(fmt::format("{} {}: cannot remove the demo's files: {}", flag, dir.string(), ec.message()));
  // The marker goes last (an earlier version's store in DIR takes it with it), so a removal that
  // fails midway leaves a folder a later --fresh still recognises.
  if (IsKind(dir / "terrace.data", S_IFREG) || IsKind(dir / "index", S_IFDIR)) {  // an earlier version's store
    TERRACE_RETURN_IF_ERROR(RemoveStoreFiles(dir, kDemoMarker, flag));
    removed = true;
  }
  if (IsKind(dir / kDemoMarker, S_IFREG)) removed = fs::remove(dir / kDemoMarker, ec) || removed;
  if (ec) return Status::IoError(fmt::format("{} {}: cannot remove the demo's marker: {}", flag, dir.string(), ec.message()));
  return removed;
}

Status WriteDemoFile(const fs::path& path, std::string_view content) {
  if (std::string why = WhyNotDemoFile(path); !why.empty()) {
    return Status::InvalidArgument(fmt::format("--dir {} holds '{}', which the demo did not write; nothing was written "
                                               "there",
                                               path.parent_path().string(), why));
  }
  return WriteOutputFile(path, "--dir", DemoFileRules(path), content);
}

Result<bool> RemoveUnfinishedDemoStore(const fs::path& store, std::string_view flag) {
  struct stat st {};
  for (const char* data : {"terrace.data", "terrace.data.creating"})
    if (::lstat((store / data).c_str(), &st) == 0) return false;  // a store, or a creation the tier completes
  std::error_code ec;
  if (!IsKind(store, S_IFDIR) || ListDir(store, &ec).empty() || ec) return false;
  if (!IsOwnedStoreOrLeftover(store, kDemoMarker) && !IsStoppedDemoStore(store)) return false;
  fmt::print(stderr, "{}: removing what a stopped run left in '{}' (a store whose creation or removal was "
                     "interrupted; it has no data file, so nothing of it can be completed)\n",
             kDemoWho, store.string());
  TERRACE_RETURN_IF_ERROR(RemoveStoreFiles(store, kDemoMarker, flag));
  return true;
}

Status RemoveStoppedModelBuild(const fs::path& dir) {
  const fs::path tmp = dir / kDemoModelTmpDir;
  std::error_code ec;
  if (!IsKind(tmp, S_IFDIR)) return Status::Ok();
  std::vector<fs::path> files;
  for (const auto& e : ListDir(tmp, &ec)) {
    if (!IsModelFile(e.path().filename().string(), /*partial=*/true) || !IsKind(e.path(), S_IFREG)) {
      return Status::InvalidArgument(fmt::format("{} holds '{}', which the demo did not create; nothing was removed "
                                                 "(move it out, or give another --dir)",
                                                 tmp.string(), e.path().filename().string()));
    }
    files.push_back(e.path());
  }
  for (const fs::path& f : files)
    if (!ec) fs::remove(f, ec);
  if (!ec) fs::remove(tmp, ec);
  if (ec) return Status::IoError(fmt::format("cannot remove the stopped model build {}: {}", tmp.string(), ec.message()));
  return Status::Ok();
}

}  // namespace terrace::cli
