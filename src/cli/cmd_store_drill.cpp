// terrace store drill: the recovery drill to run on one's own hardware before production.
//
// For each fault kind it keeps one store under --dir and runs rounds. A round starts `terrace store
// fill` (this very binary, /proc/self/exe) as a child process in sync durability, reads the
// "durable <key>" lines it prints (each an acknowledged put), and SIGKILLs it after a random number
// of them; the child injects its own fault (EIO, ENOSPC or short writes through the fault engine,
// or a simulated power cut, tiers/nvme/power_cut.h), and for `bitflip` the drill flips bits in
// acknowledged blocks of the data file between rounds. After each round the drill reopens the
// store and checks every acknowledged block: none may be lost, none returned with wrong bytes, and
// every block it damaged must be reported corrupt.
//
// SIGINT/SIGTERM (StopSignals) stop the drill after the round it is in: the round's writer is killed
// at once (SIGKILL, as every round ends), its acknowledged blocks are checked as in any round, and
// the drill prints what it found so far and exits 128 + the signal number. The stores and logs stay
// in --dir; the next drill on it removes them.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/cli/cli_util.h"
#include "src/cli/cmd_store.h"
#include "src/cli/owned_dirs.h"
#include "src/cli/safe_files.h"
#include "src/cli/stop_signals.h"
#include "src/common/json_text.h"
#include "src/common/start_thread.h"
#include "tiers/nvme/format.h"
#include "tiers/nvme/nvme_tier.h"

extern char** environ;

namespace terrace::cli::store_cmd {
namespace {

namespace fs = std::filesystem;

constexpr const char* kDrillMarker = ".terrace-drill";
constexpr int kChildTimeoutSeconds = 300;  // one round's child, start to exit
constexpr const char* kAllKinds[] = {"eio", "enospc", "short", "bitflip", "powercut"};

struct DrillArgs {
  std::string dir;
  std::uint64_t kills = 4;
  std::string faults = "eio,enospc,short,bitflip,powercut";
  std::uint64_t seed = 1;
  std::uint64_t block_size = 16 * kKiB;
  bool block_size_given = false;  // --block-size on the command line: every kind uses it (short refuses < kShortMinBlock)
  std::uint64_t capacity = 256 * kMiB;
  std::uint64_t max_acks = 48;
  bool json = false;
};

// Short transfers are only injected into requests longer than one 4 KiB unit: the short kind's
// blocks are at least this (without --block-size it uses this; below it an explicit one is refused).
constexpr std::uint64_t kShortMinBlock = 64 * kKiB;

// The block size `kind` runs with: --block-size, or for short without it at least kShortMinBlock.
std::uint64_t DrillBlockSize(const DrillArgs& a, const std::string& kind) {
  return kind == "short" && !a.block_size_given ? std::max(a.block_size, kShortMinBlock) : a.block_size;
}

// The fewest blocks a drill store must hold (--capacity over --block-size).
constexpr std::uint64_t kMinDrillBlocks = 8;

struct KindResult {
  std::string kind;
  std::uint64_t block_size = 0;  // what this kind's blocks were (DrillBlockSize)
  std::uint64_t rounds = 0, kills = 0, faults = 0, acknowledged = 0, lost = 0, corrupt_detected = 0,
                corrupt_returned = 0, damage_missed = 0, rebuilt = 0, open_failures = 0;
  bool tested_nothing = false;  // no round acknowledged a put: nothing was checked, so nothing passed
  std::vector<std::string> problems;  // the first few, for the report
  bool failed() const { return lost || corrupt_returned || damage_missed || open_failures || tested_nothing; }
};

// A terrace.data.creating a killed store creation left: a regular file whose superblock is a
// Terrace one or still blank (all zeros, or shorter than the superblock).
bool IsCreatingDataFile(const fs::path& p) {
  if (!IsKind(p, S_IFREG)) return false;
  if (IsStoreDataFile(p)) return true;
  auto unit = ReadSuperblockUnit(p, /*follow_symlinks=*/false);
  return unit.ok() && std::all_of(unit->begin(), unit->end(), [](std::byte b) { return b == std::byte{0}; });
}

// What a drill round leaves in --dir/<kind>: one store's files (terrace.data, a Terrace data file;
// terrace.data.creating, see IsCreatingDataFile; index/) and the indexes moved aside by a rebuild
// (index.damaged-*) or a reformat (index.reformatted-*), each index folder holding only index
// files (ForeignIndexEntry, the CLI's one test of an index folder). Returns the first entry
// that is anything else, `p` itself when it is not a real directory (a symlink, a file) or cannot
// be listed; nullopt when `p` is absent or holds only the drill's files.
std::optional<fs::path> ForeignInDrillStore(const fs::path& p) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(p, ec);
  if (!fs::exists(st)) return std::nullopt;
  if (!fs::is_directory(st)) return p;
  for (fs::directory_iterator it(p, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path& e = it->path();
    const std::string n = e.filename().string();
    if (n == "terrace.data") {
      if (!IsStoreDataFile(e)) return e;
    } else if (n == "terrace.data.creating") {
      if (!IsCreatingDataFile(e)) return e;
    } else if (n == "index" || n.starts_with("index.damaged-") || n.starts_with("index.reformatted-")) {
      if (auto foreign = ForeignIndexEntry(e)) return foreign;
    } else {
      return e;
    }
  }
  if (ec) return p;
  return std::nullopt;
}

// Validates --dir: new, empty, or an earlier drill's (whose own entries are removed: each fault
// kind's store folder and log, and only when every one of them holds nothing else, see
// ForeignInDrillStore; one foreign entry anywhere and nothing at all is removed). Returns a usage
// message naming the foreign entry, empty when the directory is ready.
std::string PrepareDrillDir(const std::string& dir) {
  std::error_code ec;
  fs::file_status st = fs::symlink_status(dir, ec);
  if (!fs::exists(st)) {
    fs::create_directories(dir, ec);
    if (ec) return fmt::format("cannot create --dir '{}': {}", dir, ec.message());
  } else if (fs::is_symlink(st)) {
    return fmt::format("--dir '{}' is a symbolic link; give the directory itself (the drill removes its own stores "
                       "under --dir and follows no link there)",
                       dir);
  } else if (!fs::is_directory(st)) {
    return fmt::format("--dir '{}' is {}, not a directory; give a new or empty directory for the drill's stores", dir,
                       DescribePathKind(dir));
  } else if (!fs::is_empty(dir, ec)) {
    if (!IsKind(fs::path(dir) / kDrillMarker, S_IFREG)) {
      return fmt::format("--dir '{}' is not empty and was not made by 'terrace store drill' (no {} marker); give a "
                         "new or empty directory",
                         dir, kDrillMarker);
    }
    for (const char* k : kAllKinds) {
      const fs::path log = fs::path(dir) / (std::string(k) + ".log");
      std::optional<fs::path> foreign = ForeignInDrillStore(fs::path(dir) / k);
      if (!foreign && fs::exists(fs::symlink_status(log, ec)) && !IsKind(log, S_IFREG)) foreign = log;
      if (foreign) {
        return fmt::format("--dir '{}' holds '{}', which is {} an earlier drill did not make; nothing was removed: "
                           "move it out of '{}' (or delete it), or give a new or empty directory",
                           dir, foreign->lexically_relative(dir).string(), DescribePathKind(*foreign),
                           foreign->parent_path().string());
      }
    }
    for (const char* k : kAllKinds) {  // only what an earlier drill created
      fs::remove_all(fs::path(dir) / k, ec);
      fs::remove(fs::path(dir) / (std::string(k) + ".log"), ec);
    }
  }
  if (Status s = WriteMarker(dir, kDrillMarker, "terrace store drill"); !s.ok())
    return fmt::format("cannot write the drill marker in --dir '{}': {}", dir, s.message());
  return {};
}

struct Child {
  pid_t pid = -1;
  FILE* out = nullptr;
};

Result<Child> SpawnFill(const std::vector<std::string>& args, const std::string& log_path) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return Status::IoError(fmt::format("pipe: {}", std::strerror(errno)));
  int log = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return Status::IoError(fmt::format("cannot open the drill log '{}': {}", log_path, std::strerror(errno)));
  }
  std::vector<std::string> argv_s = {"/proc/self/exe"};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : argv_s) argv.push_back(s.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&fa, log, STDERR_FILENO);
  posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  pid_t pid = -1;
  int rc = posix_spawn(&pid, "/proc/self/exe", &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(fds[1]);
  ::close(log);
  if (rc != 0) {
    ::close(fds[0]);
    return Status::IoError(fmt::format("cannot start 'terrace store fill': {}", std::strerror(rc)));
  }
  return Child{pid, ::fdopen(fds[0], "r")};
}

// Flips one bit in the middle of block `key`'s bytes in the data file, found by content (so this
// works whatever the extent layout). False when the bytes are not found.
bool FlipBitInBlock(const std::string& data_path, std::uint64_t seed, const BlockKey& key, std::uint64_t size,
                    std::string* error) {
  std::vector<std::byte> want(size);
  FillPattern(seed, key, want);
  const std::size_t probe = static_cast<std::size_t>(std::min<std::uint64_t>(size, 256));
  int fd = ::open(data_path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    *error = fmt::format("cannot open '{}': {}", data_path, std::strerror(errno));
    return false;
  }
  struct stat st {};
  ::fstat(fd, &st);
  constexpr std::size_t kChunk = 8 * kMiB;
  std::vector<std::byte> buf(kChunk + probe);
  bool done = false;
  for (off_t pos = 0; !done && pos < st.st_size; pos += static_cast<off_t>(kChunk)) {
    ssize_t got = ::pread(fd, buf.data(), buf.size(), pos);
    if (got <= 0) break;
    auto end = buf.begin() + got;
    auto it = std::search(buf.begin(), end, want.begin(), want.begin() + static_cast<std::ptrdiff_t>(probe));
    if (it == end || static_cast<std::size_t>(end - it) < probe) continue;
    const off_t at = pos + static_cast<off_t>(it - buf.begin()) + static_cast<off_t>(size / 2);
    std::byte b{};
    if (::pread(fd, &b, 1, at) == 1) {
      b ^= std::byte{0x10};
      done = ::pwrite(fd, &b, 1, at) == 1 && ::fsync(fd) == 0;
    }
  }
  ::close(fd);
  if (!done) *error = fmt::format("block {} was not found in '{}'", key.ToString(), data_path);
  return done;
}

// One kind's rounds.
KindResult RunKind(const DrillArgs& a, const std::string& kind, std::mt19937_64& rng) {
  KindResult res;
  res.kind = kind;
  const std::string store_dir = (fs::path(a.dir) / kind).string();
  const std::string log_path = (fs::path(a.dir) / (kind + ".log")).string();
  std::vector<BlockKey> acked;
  std::unordered_set<BlockKey> acked_set, damaged, damage_reported, lost_keys;
  std::uint64_t next_first = 0;
  auto problem = [&](std::string p) {
    if (res.problems.size() < 5) res.problems.push_back(std::move(p));
  };
  const std::uint64_t block_size = DrillBlockSize(a, kind);
  res.block_size = block_size;
  const std::uint64_t capacity_blocks = a.capacity / (block_size + 8 * kKiB);
  for (std::uint64_t round = 0; round < a.kills; ++round) {
    if (StopSignalReceived() != 0) break;  // after the round that was under way (checked below)
    const bool powercut = kind == "powercut";
    const std::uint64_t kill_after = powercut ? UINT64_MAX : 1 + rng() % a.max_acks;
    const std::uint64_t count =
        std::min<std::uint64_t>(powercut ? a.max_acks * 2 : a.max_acks * 4,
                                capacity_blocks > next_first + 1 ? capacity_blocks - next_first - 1 : 1);
    std::vector<std::string> args = {"store",   "fill",
                                     "--dir",   store_dir,
                                     "--count", std::to_string(count),
                                     "--block-size", std::to_string(block_size),
                                     "--seed",  std::to_string(a.seed),
                                     "--first", std::to_string(next_first),
                                     "--threads", "2",
                                     "--capacity", std::to_string(a.capacity)};
    if (kind == "eio" || kind == "enospc" || kind == "short") {
      args.insert(args.end(), {"--drill-fault", kind, "--drill-fault-seed", std::to_string(rng()),
                               "--drill-fault-rate", kind == "short" ? "0.3" : "0.04"});
    } else if (powercut) {
      args.insert(args.end(), {"--drill-fault", "powercut", "--drill-fault-seed", std::to_string(rng()),
                               "--drill-cut-after", std::to_string(rng() % (count * 5 + 40))});
    }
    next_first += count;
    ++res.rounds;
    auto child = SpawnFill(args, log_path);
    if (!child.ok()) {
      problem(child.status().ToString());
      ++res.open_failures;
      break;
    }
    // A child that stops making progress is killed and reported (a hang is a finding, not a wait).
    // A stop signal (StopSignals) kills it at once: the round ends as a round does, in a kill.
    std::mutex wd_mu;
    std::condition_variable wd_cv;
    bool wd_done = false, hung = false, stop_killed = false;
    auto started = StartThread("the drill's watchdog thread", [&, pid = child->pid] {
      std::unique_lock<std::mutex> l(wd_mu);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kChildTimeoutSeconds);
      while (!wd_done) {
        if (StopSignalReceived() != 0 && !stop_killed) {
          stop_killed = true;
          ::kill(pid, SIGKILL);
        }
        if (std::chrono::steady_clock::now() >= deadline) {
          hung = true;
          ::kill(pid, SIGKILL);
          break;
        }
        wd_cv.wait_for(l, std::chrono::milliseconds(100));
      }
    });
    if (!started.ok()) {  // no round runs unwatched: end the child and the drill
      ::kill(child->pid, SIGKILL);
      std::fclose(child->out);
      ::waitpid(child->pid, nullptr, 0);
      problem(fmt::format("round {}: {}", round + 1, started.status().message()));
      ++res.open_failures;
      break;
    }
    std::thread watchdog = std::move(started).value();
    std::uint64_t acks = 0, faults = 0;
    bool killed = false;
    char* line = nullptr;
    std::size_t cap = 0;
    for (ssize_t n; (n = ::getline(&line, &cap, child->out)) > 0;) {
      std::string_view l(line, static_cast<std::size_t>(n));
      while (!l.empty() && (l.back() == '\n' || l.back() == '\r')) l.remove_suffix(1);
      if (l.rfind("durable ", 0) == 0) {
        auto key = BlockKey::Parse(l.substr(8));
        if (key.ok() && acked_set.insert(*key).second) acked.push_back(*key);
        if (++acks == kill_after && !killed) {
          ::kill(child->pid, SIGKILL);
          killed = true;  // keep reading: lines already in the pipe were acknowledged
        }
      } else if (l.rfind("injected ", 0) == 0) {
        faults = std::strtoull(std::string(l.substr(9)).c_str(), nullptr, 10);
      }
    }
    std::free(line);
    std::fclose(child->out);
    // The child is waited for without being reaped until the watchdog is done, so that its kill never
    // reaches another process that was given the pid meanwhile.
    siginfo_t exited {};
    ::waitid(P_PID, static_cast<id_t>(child->pid), &exited, WEXITED | WNOWAIT);
    {
      std::lock_guard<std::mutex> l(wd_mu);
      wd_done = true;
    }
    wd_cv.notify_all();
    watchdog.join();
    int status = 0;
    ::waitpid(child->pid, &status, 0);
    const bool by_stop = stop_killed && !killed && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
    killed = killed || by_stop;
    if (hung) {
      ++res.open_failures;
      problem(fmt::format("round {}: 'store fill' made no progress for {} s and was killed (see {})", round + 1,
                          kChildTimeoutSeconds, log_path));
    }
    res.kills += killed ? 1 : 0;
    res.faults += faults;
    std::string how = by_stop              ? fmt::format("killed by the stop ({}) after {} acknowledged puts",
                                                           StopSignalName(StopSignalReceived()), acks)
                      : killed               ? fmt::format("killed after {} acknowledged puts", acks)
                      : WIFEXITED(status)    ? fmt::format("exited {} after {} acknowledged puts", WEXITSTATUS(status), acks)
                                             : fmt::format("ended by signal {} after {} acknowledged puts",
                                                           WIFSIGNALED(status) ? WTERMSIG(status) : 0, acks);

    std::string flipped;
    if (kind == "bitflip") {
      std::vector<BlockKey> candidates;
      for (const BlockKey& k : acked) {
        if (!damaged.contains(k)) candidates.push_back(k);
      }
      for (int f = 0; f < 2 && !candidates.empty(); ++f) {
        std::size_t pick = rng() % candidates.size();
        BlockKey k = candidates[pick];
        candidates.erase(candidates.begin() + static_cast<std::ptrdiff_t>(pick));
        std::string err;
        if (FlipBitInBlock(DataFilePath(store_dir), a.seed, k, block_size, &err)) {
          damaged.insert(k);
          ++res.faults;
          ++faults;  // this round's, as the progress line counts them
        } else {
          problem(fmt::format("round {}: bit flip failed: {}", round + 1, err));
        }
      }
      flipped = fmt::format("; {} blocks damaged so far", damaged.size());
    }
    // Check every acknowledged block.
    StorePaths paths{store_dir, "", 0};
    auto opts = ExistingStoreOptions(paths, IndexDirUse::kExisting);
    std::unique_ptr<NvmeTier> tier;
    Status open_status = opts.status();
    std::string rebuilt;
    if (opts.ok()) {
      opts->read_only = true;  // the check changes nothing: damaged blocks stay damaged for the next round
      auto t = NvmeTier::Open(*opts);
      if (!t.ok() && t.status().message().find("store recover") != std::string::npos) {
        // A refusal that points at recovery is allowed; recovery must then bring everything back.
        NvmeTierOptions ro = *opts;
        ro.read_only = false;
        auto rep = NvmeTier::RebuildIndex(ro);
        if (rep.ok()) {
          ++res.rebuilt;
          rebuilt = fmt::format("; the store refused to open ({}), index rebuilt: {} blocks", t.status().message(),
                                rep->blocks_indexed);
          t = NvmeTier::Open(*opts);
        } else {
          problem(fmt::format("round {}: store recover failed: {}", round + 1, rep.status().ToString()));
        }
      }
      if (t.ok()) tier = std::move(*t);
      open_status = t.status();
    }
    if (!tier) {
      if (acked.empty() && open_status.IsNotFound()) {
        fmt::print(stderr, "drill {} round {}/{}: {}; no store yet\n", kind, round + 1, a.kills, how);
        if (!killed && !hung) problem(fmt::format("round {}: 'store fill' {} and made no store (see {})", round + 1, how, log_path));
        continue;
      }
      ++res.open_failures;
      res.lost += acked.size();
      problem(fmt::format("round {}: the store does not open: {}", round + 1, open_status.ToString()));
      fmt::print(stderr, "drill {} round {}/{}: {}; the store does not open: {}\n", kind, round + 1, a.kills, how,
                 open_status.ToString());
      break;
    }
    BlockCheck c = CheckBlocks(*tier, a.seed, acked, nullptr, nullptr);
    // Lost: an acknowledged block the drill did not damage that is gone or does not read back ok.
    std::uint64_t lost_now = 0;
    for (const std::vector<BlockKey>* keys : {&c.missing_keys, &c.expected_bad_keys}) {
      for (const BlockKey& k : *keys) {
        if (damaged.contains(k)) continue;
        ++lost_now;
        if (lost_keys.insert(k).second) problem(fmt::format("round {}: acknowledged block {} lost", round + 1, k.ToString()));
      }
    }
    // A block the drill damaged must be reported corrupt (or be gone after an earlier report).
    std::unordered_set<BlockKey> corrupt(c.corrupt_keys.begin(), c.corrupt_keys.end());
    std::uint64_t detected_now = 0;
    for (const BlockKey& k : damaged) {
      if (corrupt.contains(k)) {
        if (damage_reported.insert(k).second) ++detected_now;
        continue;
      }
      if (damage_reported.contains(k)) continue;  // reported (and dropped) earlier
      ++res.damage_missed;
      problem(fmt::format("round {}: damaged block {} was not reported corrupt", round + 1, k.ToString()));
    }
    for (const BlockKey& k : c.corrupt_keys) {
      if (!damaged.contains(k)) ++detected_now;  // corrupt without the drill's doing (a torn write)
    }
    res.lost = lost_keys.size();
    res.corrupt_detected += detected_now;
    res.corrupt_returned += c.wrong_content;
    if (c.wrong_content) problem(fmt::format("round {}: {} blocks returned with wrong bytes", round + 1, c.wrong_content));
    res.acknowledged = acked.size();
    tier.reset();

    fmt::print(stderr, "drill {} round {}/{}: {}, {} faults{}; check: {} indexed, {} ok, {} lost, {} corrupt{}\n", kind,
               round + 1, a.kills, how, faults, rebuilt, c.indexed, c.ok, lost_now, c.corrupt, flipped);
  }
  if (res.rounds > 0 && acked.empty() && StopSignalReceived() == 0) {
    res.tested_nothing = true;
    res.problems.push_back(fmt::format("no round acknowledged a put, so nothing was checked (the child's log: {})",
                                       log_path));
  }
  return res;
}

int RunDrill(const DrillArgs& a) {
  std::vector<std::string> kinds;
  {
    std::stringstream ss(a.faults);
    for (std::string k; std::getline(ss, k, ',');) {
      if (k.empty()) continue;
      if (std::find(std::begin(kAllKinds), std::end(kAllKinds), k) == std::end(kAllKinds)) {
        return FailUsage(fmt::format("--faults: unknown fault '{}'; choose from eio,enospc,short,bitflip,powercut", k));
      }
      if (std::find(kinds.begin(), kinds.end(), k) == kinds.end()) kinds.push_back(k);
    }
  }
  if (kinds.empty()) return FailUsage("--faults names no fault; choose from eio,enospc,short,bitflip,powercut");
  if (a.block_size < 64 || a.block_size > 16 * kMiB) return FailUsage("--block-size must be 64 B..16 MiB for the drill");
  if (a.block_size_given && a.block_size < kShortMinBlock &&
      std::find(kinds.begin(), kinds.end(), "short") != kinds.end()) {
    return FailUsage(fmt::format(
        "--block-size {} is below the 64 KiB the short fault needs (a short transfer is injected only into a request "
        "longer than one 4 KiB unit); give --block-size 64KiB or more, drop short from --faults, or leave "
        "--block-size out (short then uses 64 KiB, the other faults {})",
        FormatBytes(static_cast<double>(a.block_size)), FormatBytes(static_cast<double>(DrillArgs{}.block_size))));
  }
  if (a.capacity < 16 * kMiB || a.capacity % nvme::kUnit != 0) {
    return FailUsage("--capacity must be at least 16MiB and a multiple of 4KiB");
  }
  // Each round writes new blocks into the same store: it needs room for a few of them.
  for (const std::string& k : kinds) {
    const std::uint64_t block = DrillBlockSize(a, k), extent = nvme::RoundUp(block, nvme::kUnit) + nvme::kUnit;
    if ((a.capacity - nvme::kDataStart) / extent < kMinDrillBlocks) {
      return FailUsage(fmt::format(
          "--capacity {} holds fewer than {} blocks of {} (each takes its size rounded up to 4 KiB plus a 4 KiB "
          "descriptor){}; raise --capacity or lower --block-size",
          FormatBytes(static_cast<double>(a.capacity)), kMinDrillBlocks, FormatBytes(static_cast<double>(block)),
          block == a.block_size ? "" : fmt::format(" for the {} fault", k)));
    }
  }
  if (std::string err = PrepareDrillDir(a.dir); !err.empty()) return FailUsage(err);

  StopSignals stop_signals;  // Ctrl-C: stop after the current round, report it, exit 128 + the signal
  std::mt19937_64 rng(a.seed);
  std::vector<KindResult> results;
  for (const std::string& k : kinds) {
    if (StopSignalReceived() != 0) break;
    results.push_back(RunKind(a, k, rng));
  }
  const bool stopped = StopSignalReceived() != 0;

  bool failed = false;
  for (const auto& r : results) failed |= r.failed();
  if (a.json) {
    nlohmann::json rows = nlohmann::json::array();
    for (const auto& r : results) {
      rows.push_back({{"fault", r.kind},
                      {"block_size", r.block_size},
                      {"rounds", r.rounds},
                      {"kills", r.kills},
                      {"faults_injected", r.faults},
                      {"acknowledged", r.acknowledged},
                      {"lost", r.lost},
                      {"corrupt_detected", r.corrupt_detected},
                      {"corrupt_returned", r.corrupt_returned},
                      {"damage_missed", r.damage_missed},
                      {"open_failures", r.open_failures},
                      {"tested_nothing", r.tested_nothing},
                      {"index_rebuilds", r.rebuilt},
                      {"problems", r.problems}});
    }
    nlohmann::json j = {{"dir", a.dir},           {"seed", a.seed}, {"block_size", a.block_size},
                        {"kills_per_fault", a.kills}, {"ok", !failed}, {"faults", rows}};
    // The signal that stopped the drill before all its rounds ran (null: it ran them all).
    j["stopped_by"] = stopped ? nlohmann::json(std::string(StopSignalName(StopSignalReceived()))) : nlohmann::json(nullptr);
    fmt::print("{}\n", JsonText(j, 2));
  } else {
    Table t({"fault", "block", "rounds", "kills", "faults injected", "acknowledged", "lost", "corrupt-detected",
             "corrupt-returned"});
    for (const auto& r : results) {
      t.Add({r.kind, FormatBytes(static_cast<double>(r.block_size)), std::to_string(r.rounds), std::to_string(r.kills), std::to_string(r.faults),
             std::to_string(r.acknowledged), std::to_string(r.lost), std::to_string(r.corrupt_detected),
             std::to_string(r.corrupt_returned)});
    }
    fmt::print("{}", t.Render());
    for (const auto& r : results) {
      for (const auto& p : r.problems) fmt::print("{}: {}\n", r.kind, p);
    }
    if (failed) {
      fmt::print("store drill: FAILED: acknowledged data was lost or corrupt data was returned (child logs: "
                 "{}/*.log)\n",
                 a.dir);
    } else if (stopped) {
      fmt::print("store drill: stopped before all its rounds ran; so far no acknowledged block lost, no corrupt block "
                 "returned (child logs: {}/*.log)\n",
                 a.dir);
    } else {
      fmt::print("store drill: passed: no acknowledged block lost, no corrupt block returned (child logs: {}/*.log)\n",
                 a.dir);
    }
  }
  if (stopped) {
    std::uint64_t rounds = 0;
    for (const auto& r : results) rounds += r.rounds;
    return ExitStopped("store drill",
                       fmt::format(" after {} round(s) of {} fault kind(s) ({} planned: {} per kind); each round's "
                                   "acknowledged blocks were checked{}; the stores and logs in {} are kept (the next "
                                   "drill on this --dir removes them)",
                                   rounds, results.size(), a.kills * kinds.size(), a.kills,
                                   failed ? ", and some were lost or returned corrupt (above)" : "", a.dir));
  }
  return failed ? 1 : 0;
}

}  // namespace

void RegisterStoreDrill(CLI::App* store, Runner* run) {
  auto a = std::make_shared<DrillArgs>();
  auto* cmd = store->add_subcommand(
      "drill", "Recovery drill: fill stores under --dir, kill the writers and inject faults, then check that no "
               "acknowledged block was lost and no corrupt block returned");
  cmd->add_option("--dir", a->dir, "A new or empty directory for the drill's stores (or an earlier drill's)")->required()->transform(NormalizedPath());
  AddIntOption<std::uint64_t>(cmd, "--kills", &a->kills, 1, 10000, "Rounds per fault kind, each ending in a kill or a fault");
  cmd->add_option("--faults", a->faults, "Comma-separated faults: eio,enospc,short,bitflip,powercut (default: all)");
  AddIntOption<std::uint64_t>(cmd, "--seed", &a->seed, 0, UINT64_MAX, "Seed of the kill points, faults and block contents");
  AddSizeOption(cmd, "--block-size", &a->block_size,
                "Block size of the test blocks, every fault kind (without it short uses 64 KiB, the others the default; "
                "given, at least 64 KiB when --faults has short)",
                64, 16 * kMiB)
      ->each([a](const std::string&) { a->block_size_given = true; });
  AddSizeOption(cmd, "--capacity", &a->capacity, "Capacity of each drill store", 16 * kMiB, 1024 * kGiB);
  AddIntOption<std::uint64_t>(cmd, "--max-acks", &a->max_acks, 1, 100000,
                "A round kills its writer after 1..N acknowledged puts");
  cmd->add_flag("--json", a->json, "Print the result as one JSON object");
  cmd->callback([run, a] { *run = [a] { return RunDrill(*a); }; });
}

}  // namespace terrace::cli::store_cmd
