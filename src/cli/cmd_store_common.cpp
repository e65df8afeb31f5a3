// Helpers shared by the `terrace store` subcommands (declared in cmd_store.h).
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cctype>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "src/cli/cli_util.h"
#include "src/cli/cmd_store.h"
#include "src/cli/demo_dir.h"
#include "src/cli/owned_dirs.h"
#include "src/cli/safe_files.h"
#include "tiers/nvme/format.h"
#include "tiers/nvme/lock_holders.h"
#include "tiers/nvme/nvme_paths.h"
#include "tiers/nvme/nvme_tier.h"

namespace terrace::cli::store_cmd {

namespace fs = std::filesystem;

constexpr std::uint64_t kMaxExpectBytes = 4 * kGiB;

namespace {

// The words of the store the running `store` command opens (ExistingStoreOptions records them).
StoreWords& CommandWords() {
  static StoreWords words;
  return words;
}

// `message` with every `from` that stands as a word of its own replaced by `to`: not inside a path
// or another name ('/data/index_dir/', 'my_capacity_bytes'), which the message quotes as given.
void ReplaceWords(std::string& out, std::string_view from, std::string_view to) {
  auto in_word = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '/' || c == '-';
  };
  for (std::size_t pos = 0; (pos = out.find(from, pos)) != std::string::npos;) {
    const std::size_t end = pos + from.size();
    const bool starts_word = pos == 0 || !in_word(out[pos - 1]) || !in_word(from.front());
    const bool ends_word = end == out.size() || !in_word(out[end]) || !in_word(from.back());
    if (!starts_word || !ends_word) {
      pos = end;
      continue;
    }
    out.replace(pos, from.size(), to);
    pos += to.size();
  }
}

// The flags ExistingStoreOptions checks.
constexpr std::string_view kStoreFlags[] = {"--dir", "--index-dir", "--capacity"};

// The CLI's advice for a store another process holds locked (the library says "close that process").
constexpr std::string_view kWaitForHolder = "wait for it to finish, then run the command again";

}  // namespace

StoreWords CommandDirWords(std::string dir_flag, std::string path_words, std::string start_over) {
  StoreWords w;
  w.new_dir = w.new_dir_or_existing = w.new_index_dir = fmt::format("give a new {} directory", dir_flag);
  w.dir_flag = std::move(dir_flag);
  w.path_words = std::move(path_words);
  w.start_over = std::move(start_over);
  return w;
}

StoreWords StoreCommandWords(const std::string& dir) {
  StoreWords w;
  const fs::path d(NormalizePath(dir));
  const fs::path parent = d.parent_path().empty() ? fs::path(".") : d.parent_path();
  const std::string name = d.filename().string();
  if (name != "kv" && name != "state") return w;
  std::error_code ec;
  const std::string lose = "(or, to start over with an empty pool and lose every block in it, ";
  if (fs::is_regular_file(d / kDemoMarker, ec)) {
    w.start_over = lose + fmt::format("run 'terrace demo --dir {} --fresh', which starts the demo anew)", parent.string());
  } else if (fs::is_directory(parent / "kv", ec) && fs::is_directory(parent / "state", ec)) {
    // Only the folder names say it is a pool of 'model run --store' (which marks nothing): name both
    // ways, and delete nothing but the store's own data file.
    w.start_over = lose + fmt::format("give 'terrace model run' a new --store directory if it made this pool with "
                                      "--store {}; if 'terrace store fill' made it, delete {} and run 'terrace store "
                                      "fill')",
                                      parent.string(), (d / "terrace.data").string());
  }
  return w;
}

std::optional<Status> DirInUse(std::string_view dir_flag, std::string_view what, const fs::path& store_dir,
                               std::chrono::milliseconds waited, const Status& e) {
  constexpr std::string_view kBy = "is in use by ", kLocked = " (its data file is locked";
  const std::string& m = e.message();
  const std::size_t by = m.find(kBy);
  if (e.code() != Code::kUnavailable || by == std::string::npos) return std::nullopt;
  const std::size_t from = by + kBy.size(), to = m.find(kLocked, from);
  if (to == std::string::npos) return std::nullopt;
  return Status::Unavailable(fmt::format(
      "{}: {} is using this {} directory (its {} {} stayed locked for the {:.0f} s this run waited); wait for it to "
      "finish or give another {} directory",
      dir_flag, m.substr(from, to - from), dir_flag, what, store_dir.string(),
      std::chrono::duration<double>(waited).count(), dir_flag));
}

std::string InCliWords(std::string_view message, const StoreWords& w) {
  const std::string new_bigger = fmt::format("use a new {} directory with a larger {}", w.dir_flag, w.capacity_flag);
  const std::string wait_for_holder(kWaitForHolder);
  // The replacements own their text: several are built here, and a view of a temporary would dangle.
  const std::pair<std::string_view, std::string> kWords[] = {
      {"set options.index_dir to", "give --index-dir"},
      {"point --index-dir at an empty directory", w.new_index_dir},
      {"point the NVMe tier at an empty directory or at an existing Terrace store", w.new_dir_or_existing},
      {"point the NVMe tier at an empty directory or an existing store", w.new_dir_or_existing},
      {"point the NVMe tier at an empty directory", w.new_dir},
      {"options.index_dir", "--index-dir"},
      {"index_dir", "--index-dir"},
      {"options.path", w.path_words},
      {"or set create_if_missing=true", "or run 'terrace store fill' to create one"},
      {"and create_if_missing is false", ""},
      // The CLI erases no blocks, and a store's capacity is fixed when it is created.
      {"erase blocks, or move to a new store with a larger capacity_bytes", new_bigger},
      {"Erase or unpin blocks, or add capacity", "A store's size is fixed when it is created: " + new_bigger},
      {"or use a new store with a larger capacity_bytes", "or " + new_bigger},
      {"capacity_bytes=", w.capacity_flag + " "},
      {"capacity_bytes", w.capacity_flag},
      {"without read_only", "with 'store check --repair'"},
      {"the store is open read-only, so the block was kept (open it read-write to drop it)",
       // The same words with and without --repair, which drops the block only after the check.
       "the check itself only reads ('terrace store check --repair' drops corrupt blocks after the check)"},
      {" (set hbm.mode = kOff to run without it)", ""},
      {"or lower the capacity",
       "or " + (w.lower_capacity.empty() ? fmt::format("give a smaller {}", w.capacity_flag) : w.lower_capacity)},
      // The library's reformat option has no flag: say what a CLI user does instead.
      {"(or reformat the data area to start an empty store: every block in it is lost)", w.start_over},
      // A data area another process holds locked: the advice `store check` gives for it too.
      {"close that process first (one writer per data area; read-only opens may share it)", wait_for_holder},
      {"close that process first", wait_for_holder},
  };
  std::string out(message);
  for (const auto& [from, to] : kWords) ReplaceWords(out, from, to);
  // The store's thread count has no flag: the CLI keeps the count and drops the option's name.
  constexpr std::string_view kThreadsOption = " (StoreOptions::background_threads ";
  if (std::size_t pos = out.find(kThreadsOption); pos != std::string::npos) {
    if (std::size_t end = out.find(')', pos); end != std::string::npos) out.erase(pos, end + 1 - pos);
  }
  // A missing or empty index was not damaged, and nothing of it is kept aside.
  if (out.find("' is missing:") != std::string::npos || out.find("' is an empty directory:") != std::string::npos)
    ReplaceWords(out, " (the damaged index is kept aside)", "");
  return out;
}

std::string InCliWords(std::string_view message) { return InCliWords(message, CommandWords()); }

int FailStatus(const Status& status) { return Fail(InCliWords(status.ToString())); }

int FailStoreOptions(const Status& status) {
  // ExistingStoreOptions' usage errors name the flag first ("--capacity 1MiB does not match ...");
  // its other InvalidArgument errors start with a path, which may itself begin with "--".
  const std::string_view m = status.message();
  const bool names_flag = std::any_of(std::begin(kStoreFlags), std::end(kStoreFlags), [&](std::string_view flag) {
    return m.starts_with(flag) && m.size() > flag.size() && (m[flag.size()] == ' ' || m[flag.size()] == ':');
  });
  if (status.IsInvalidArgument() && names_flag) return FailUsage(m);
  return FailStatus(status);
}

void AddStorePathOptions(CLI::App* app, StorePaths* p, bool dir_created_if_missing, bool with_capacity) {
  app->add_option("--dir", p->dir,
                  dir_created_if_missing
                      ? "Store directory (created if missing) or block device (its contents are overwritten; needs "
                        "--index-dir)"
                      : "Store directory or block device")
      ->required()->transform(NormalizedPath());
  app->add_option("--index-dir", p->index_dir,
                  "NVMe index directory on a persistent file system; required when --dir is a block device "
                  "(default: <dir>/index)")->transform(NormalizedPath());
  if (with_capacity) {
    AddSizeOption(app, "--capacity", &p->capacity,
                  dir_created_if_missing
                      ? "Capacity of a new store; 0 = 1GiB for a new store, the store's own for an existing one"
                      : "Capacity of the store, checked against it; 0 = read it from the store");
  }
}

std::string StorePathFlags(const StorePaths& p) {
  return p.index_dir.empty() ? fmt::format("--dir {}", p.dir) : fmt::format("--dir {} --index-dir {}", p.dir, p.index_dir);
}

std::string DataFilePath(const std::string& dir) {
  return IsBlockDevice(dir) ? dir : (fs::path(dir) / "terrace.data").string();
}

Result<std::optional<SuperblockInfo>> ReadSuperblock(const std::string& dir) {
  const std::string path = DataFilePath(dir);
  auto unit = ReadSuperblockUnit(path, /*follow_symlinks=*/true);
  if (!unit.ok() && unit.status().code() == Code::kNotFound) return std::optional<SuperblockInfo>();
  TERRACE_ASSIGN_OR_RETURN(std::vector<std::byte> buf, std::move(unit));
  if (std::all_of(buf.begin(), buf.end(), [](std::byte b) { return b == std::byte{0}; })) {
    return std::optional<SuperblockInfo>();  // a blank device or a file whose creation never finished
  }
  TERRACE_ASSIGN_OR_RETURN(nvme::Superblock sb, nvme::Superblock::DecodeUnit(buf, path));
  return std::optional<SuperblockInfo>(SuperblockInfo{sb.capacity_bytes, sb.format_version, sb.UuidString()});
}

namespace {

// "--dir D/kv, --dir D/state or --dir D/experts": the stores of a `model run --store D` (or `demo
// --dir D`) directory that `dir` holds; empty when it holds none of them.
std::string SubStoreFlags(const fs::path& dir) {
  std::vector<std::string> found;
  std::error_code ec;
  for (const char* name : kDemoStores) {
    if (fs::is_directory(dir / name, ec)) found.push_back(fmt::format("--dir {}", (dir / name).string()));
  }
  if (found.size() < 2) return found.empty() ? std::string() : found.front();
  return fmt::format("{} or {}", fmt::join(found.begin(), found.end() - 1, ", "), found.back());
}

// Why the store directory of `p`, which holds no data file with a superblock, is no store, and what
// to give instead: wait for a live creation, complete or discard a stopped one, or name one of the
// stores of a `model run --store` directory.
Status NoStoreIn(const StorePaths& p) {
  const fs::path index = p.index_dir.empty() ? fs::path(p.dir) / "index" : fs::path(p.index_dir);
  switch (CreationIn(p.dir)) {
    case Creation::kLive:
      return Status::Unavailable(fmt::format(
          "--dir '{}' holds no Terrace store yet: another process is creating one there right now (it holds the lock "
          "on {}); wait for that process to finish, then run this command again",
          p.dir, (fs::path(p.dir) / kCreatingFile).string()));
    case Creation::kStopped: {
      auto cap = InterruptedCreationCapacity(p.dir);
      return Status::NotFound(fmt::format(
          "--dir '{}' holds no Terrace store yet, only a creation{} that a stopped run left unfinished "
          "(terrace.data.creating); run the command that was creating it again on this directory (e.g. 'terrace "
          "store fill --dir {}', or 'terrace model run' with the same --store), which completes it, or delete that "
          "file and the index folder {} to start anew",
          p.dir, cap.ok() ? fmt::format(" of {}", FormatBytes(static_cast<double>(*cap))) : "", p.dir,
          index.string()));
    }
    case Creation::kNone: break;
  }
  if (const std::string stores = SubStoreFlags(p.dir); !stores.empty()) {
    return Status::NotFound(fmt::format(
        "--dir '{}' holds no Terrace store itself: it looks like the --store directory of 'terrace model run' (or the "
        "--dir of 'terrace demo'), which keeps each store in a folder of its own; give {}",
        p.dir, stores));
  }
  return Status::NotFound(fmt::format("--dir '{}' holds no Terrace store (no data file with a superblock)", p.dir));
}

}  // namespace

Creation CreationIn(const fs::path& dir) {
  const int fd = ::open((dir / kCreatingFile).c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return Creation::kNone;
  // The creator holds an exclusive lock on it (nvme::LockDataArea) from its open to its rename; a
  // shared lock is refused exactly while it does.
  const bool live = ::flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);  // releases the probe's own lock at once
  return live ? Creation::kLive : Creation::kStopped;
}

Status PoolCreationSizeMismatch(const fs::path& dir, std::string_view flag, std::uint64_t bytes, std::uint64_t own) {
  const std::string given = fmt::format("{} {} ({} bytes)", flag, FormatBytes(static_cast<double>(bytes)), bytes);
  const std::string theirs = fmt::format("{} ({} bytes)", FormatBytes(static_cast<double>(own)), own);
  const std::string creating = (dir / kCreatingFile).string();
  if (CreationIn(dir) == Creation::kLive) {
    return Status::InvalidArgument(fmt::format(
        "{} does not match the pool in {}, which another process is creating right now with {} (it holds the lock "
        "on {}); wait for that process to finish, then run again without {} to use the pool's size, or give a new "
        "directory",
        given, dir.string(), theirs, creating, flag));
  }
  return Status::InvalidArgument(fmt::format(
      "{} does not match the pool in {}, whose creation with {} a stopped run left unfinished ({}); omit {} to "
      "complete it with that size, or delete that file and the folder {} to start the pool anew",
      given, dir.string(), theirs, creating, flag, (dir / "index").string()));
}

Result<NvmeTierOptions> ExistingStoreOptions(const StorePaths& p, IndexDirUse index_use) {
  TERRACE_RETURN_IF_ERROR(CheckNvmePaths(p.dir, p.index_dir));
  // The kinds of --dir and --index-dir first: a file where a directory belongs is the user's
  // mistake (exit 2, naming the flag), not something the tier should try to open.
  auto wrong_kind = [](const Status& s, std::string_view flag, const std::string& path, std::string_view what) {
    if (s.IsNotFound()) {  // the path itself exists: a symbolic link to nothing
      return Status::InvalidArgument(fmt::format("{} {} is a symbolic link to nothing; give {}", flag, path, what));
    }
    return Status::InvalidArgument(fmt::format("{} ({})", s.message(), what));
  };
  if (!IsBlockDevice(p.dir)) {
    if (Status s = CheckInputDir(p.dir, "--dir"); !s.ok()) {
      if (s.IsNotFound() && !IsKind(p.dir, S_IFLNK)) {
        return Status::NotFound(fmt::format(
            "--dir '{}' does not exist; give the directory 'store fill' used, or one of the stores 'terrace model run "
            "--store DIR' keeps (DIR/kv, DIR/state or DIR/experts)",
            p.dir));
      }
      return wrong_kind(s, "--dir", p.dir,
                        "the store directory 'store fill' used, or its block device with --index-dir");
    }
  }
  if (!p.index_dir.empty()) {
    if (Status s = CheckInputDir(p.index_dir, "--index-dir"); !s.ok()) {
      if (!s.IsNotFound() || IsKind(p.index_dir, S_IFLNK)) {
        return wrong_kind(s, "--index-dir", p.index_dir,
                          index_use == IndexDirUse::kRebuild
                              ? "the store's index directory, or a new or empty one to rebuild the index into"
                              : "the index directory 'store fill' used with this store");
      }
      if (index_use == IndexDirUse::kExisting) {
        return Status::NotFound(fmt::format(
            "--index-dir '{}' does not exist; give the index directory 'store fill' used (or run 'terrace store "
            "recover --dir {} --index-dir {}' to rebuild the index there from the data file)",
            p.index_dir, p.dir, p.index_dir));
      }
    }
  }
  CommandWords() = StoreCommandWords(p.dir);
  // An InvalidArgument here says what the data file holds is wrong (another format, not a store):
  // its message begins with the file's path, so FailStoreOptions exits 1.
  TERRACE_ASSIGN_OR_RETURN(std::optional<SuperblockInfo> sb, ReadSuperblock(p.dir));
  if (!sb) return NoStoreIn(p);
  if (p.capacity != 0 && p.capacity != sb->capacity_bytes) {
    return Status::InvalidArgument(fmt::format(
        "--capacity {} does not match the store at '{}', which was created with --capacity {} ({} bytes); omit "
        "--capacity to use the store's own",
        FormatBytes(static_cast<double>(p.capacity)), p.dir, FormatBytes(static_cast<double>(sb->capacity_bytes)),
        sb->capacity_bytes));
  }
  NvmeTierOptions o;
  o.path = p.dir;
  o.index_dir = p.index_dir;
  o.capacity_bytes = sb->capacity_bytes;
  o.create_if_missing = false;
  o.durability = Durability::kSync;
  return o;
}

Result<std::vector<BlockKey>> ReadDurableLines(const std::string& path) {
  TERRACE_ASSIGN_OR_RETURN(std::string text, ReadInputFile(path, "--expect", kMaxExpectBytes));
  std::vector<BlockKey> keys;
  std::size_t pos = 0;
  for (int lineno = 1; pos < text.size(); ++lineno) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + pos, end - pos);
    pos = end + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    constexpr std::string_view kPrefix = "durable ";
    if (line.rfind(kPrefix, 0) != 0) {
      return Status::InvalidArgument(
          fmt::format("--expect {}:{}: expected 'durable <key>' as 'store fill' prints it, got '{}'", path, lineno,
                      line.substr(0, 200)));
    }
    auto key = BlockKey::Parse(line.substr(kPrefix.size()));
    if (!key.ok()) return key.status().WithContext(fmt::format("--expect {}:{}", path, lineno));
    keys.push_back(*key);
  }
  return keys;
}

namespace {

// Adds lost_from_index, index_only and pending_commit to `check`: blocks of `scan` that `tier`'s
// index does not hold, and indexed blocks, not corrupt, that the scan did not find (pending_commit
// when the index's pending commit put them).
void CountLostBlocks(const ScannedBlocks& scan, NvmeTier& tier, BlockCheck* check) {
  check->scanned = true;
  for (const auto& [key, block] : scan.blocks) {
    auto have = tier.Lookup(key);
    if (have.ok()) continue;
    if (scan.pending.released.contains(block.offset)) {
      ++check->pending_release;
      continue;
    }
    ++check->lost_from_index;
    check->lost_keys.push_back(key);
  }
  const std::unordered_set<BlockKey> corrupt(check->corrupt_keys.begin(), check->corrupt_keys.end());
  tier.ForEach([&](const BlockKey& key, const BlockDesc&) {
    if (scan.blocks.contains(key) || corrupt.contains(key)) return;
    ++(scan.pending.keys.contains(key) ? check->pending_commit : check->index_only);
  });
}

}  // namespace

BlockCheck CheckBlocks(NvmeTier& tier, std::optional<std::uint64_t> seed, const std::vector<BlockKey>& expected,
                       const ScannedBlocks* scan, const std::function<void(const std::string&)>& report) {
  // The first kMaxBlockLines bad blocks of each kind get a line; the rest one line with their count.
  auto line = [&](std::uint64_t nth, std::string text) {
    if (report && nth <= kMaxBlockLines) report(std::move(text));
  };
  auto rest = [&](std::uint64_t count, std::string_view what) {
    if (report && count > kMaxBlockLines) {
      report(fmt::format("... and {} more {} blocks", count - kMaxBlockLines, what));
    }
  };
  BlockCheck c;
  std::vector<std::pair<BlockKey, BlockDesc>> blocks;
  tier.ForEach([&](const BlockKey& k, const BlockDesc& d) { blocks.emplace_back(k, d); });
  c.indexed = blocks.size();
  std::unordered_set<BlockKey> indexed, good;
  std::unordered_multimap<std::uint64_t, BlockKey> by_checksum;  // the scan's blocks by checksum, when needed
  std::vector<std::byte> buf, want;
  for (const auto& [key, desc] : blocks) {
    indexed.insert(key);
    buf.resize(desc.size);
    BlockDesc got;
    Status s = tier.Get(key, buf, &got);
    if (s.ok()) {
      bool same = got.size == desc.size;
      if (scan != nullptr && same) {
        // The data file describes each block in its own extent. An index entry that passes the read
        // but disagrees with the key's own descriptor, and is instead another key's, hands out that
        // block's bytes as this one's (a damaged index; an entry left behind by a put a crash cut
        // short before its index write is never another key's, unless their bytes are the same).
        const auto it = scan->blocks.find(key);
        if (it != scan->blocks.end() && !scan->pending.keys.contains(key) && !(it->second.desc == got)) {
          if (by_checksum.empty())
            for (const auto& [k, b] : scan->blocks) by_checksum.emplace(b.desc.checksum, k);
          const auto [lo, hi] = by_checksum.equal_range(got.checksum);
          const auto other = std::find_if(lo, hi, [&](const auto& e) {
            return e.second != key && scan->blocks.at(e.second).desc == got;
          });
          if (other != hi) {
            ++c.wrong_content;
            ++c.index_mismatch;
            line(c.wrong_content,
                 fmt::format("wrong content {}: its index entry describes the bytes of {} ({} bytes, checksum "
                             "{:016x}), not the block the data file holds under this key",
                             key.ToString(), other->second.ToString(), got.size, got.checksum));
            continue;
          }
        }
      }
      if (seed && same) {
        want.resize(desc.size);
        FillPattern(*seed, key, want);
        same = buf == want;
      }
      if (same) {
        ++c.ok;
        good.insert(key);
        continue;
      }
      ++c.wrong_content;
      line(c.wrong_content, seed ? fmt::format("wrong content {}: returned as good but differs from the pattern of "
                                               "--seed {}", key.ToString(), *seed)
                                 : fmt::format("wrong content {}: returned {} bytes, its index entry says {}",
                                               key.ToString(), got.size, desc.size));
      continue;
    }
    ++c.corrupt;
    c.corrupt_keys.push_back(key);
    line(c.corrupt, fmt::format("corrupt {}: {}", key.ToString(), InCliWords(s.ToString())));
  }
  rest(c.wrong_content, "wrong-content");
  rest(c.corrupt, "corrupt");
  for (const BlockKey& k : expected) {
    if (good.contains(k)) continue;
    if (indexed.contains(k)) {  // counted above as corrupt or wrong content
      c.expected_bad_keys.push_back(k);
      continue;
    }
    if (scan != nullptr && scan->blocks.contains(k)) continue;  // counted below as lost from the index
    ++c.missing;
    c.missing_keys.push_back(k);
    line(c.missing, fmt::format("missing {}", k.ToString()));
  }
  rest(c.missing, "missing");
  if (scan != nullptr) CountLostBlocks(*scan, tier, &c);
  return c;
}

Result<ScannedBlocks> ScanDataArea(const NvmeTierOptions& options) {
  ScannedBlocks out;
  auto last = std::chrono::steady_clock::now();
  auto progress = [&](std::uint64_t done, std::uint64_t total) {
    auto now = std::chrono::steady_clock::now();
    if (now - last < std::chrono::seconds(1) || total == 0) return;
    last = now;
    fmt::print(stderr, "scanning the data file: {:.0f}% ({} of {})\n", 100.0 * static_cast<double>(done) / total,
               FormatBytes(static_cast<double>(done)), FormatBytes(static_cast<double>(total)));
  };
  TERRACE_ASSIGN_OR_RETURN(
      out.report, NvmeTier::ScanDataFile(
                      options,
                      [&](const BlockKey& k, const BlockDesc& d, std::uint64_t generation, std::uint64_t offset) {
                        out.blocks.emplace(k, ScannedBlock{d, generation, offset});
                      },
                      progress));
  return out;
}

Result<SharedDataLock> SharedDataLock::Take(const NvmeTierOptions& options) {
  TERRACE_ASSIGN_OR_RETURN(nvme::StorePaths paths, nvme::ResolveStorePaths(options, /*may_create=*/false));
  const int fd = ::open(paths.data.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return Status::IoError(fmt::format("cannot open the NVMe data file '{}': {}", paths.data.string(),
                                       std::strerror(errno)));
  }
  SharedDataLock lock(fd);
  if (int err = nvme::LockDataArea(fd, LOCK_SH, options.lock_wait); err != 0) {
    if (err == EWOULDBLOCK) {
      return nvme::DataAreaInUse(paths.data, fd, "", kWaitForHolder);
    }
    return Status::IoError(fmt::format("cannot lock the NVMe data file '{}': {}", paths.data.string(),
                                       std::strerror(err)));
  }
  return lock;
}

SharedDataLock::~SharedDataLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

PendingCommit ReadPendingCommit(const NvmeTier& tier) {
  PendingCommit pending;
  const std::optional<PendingGroupCommit> p = tier.PendingCommit();
  if (!p) return pending;
  pending.keys.insert(p->keys.begin(), p->keys.end());
  pending.released.insert(p->released_offsets.begin(), p->released_offsets.end());
  return pending;
}

}  // namespace terrace::cli::store_cmd
