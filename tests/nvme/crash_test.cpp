// Crash recovery: a child process (this binary, re-executed) puts blocks and reports each
// acknowledged one on a pipe; the parent SIGKILLs it at a random moment, reopens the store and
// checks that every acknowledged block is present and intact and that nothing corrupt comes back.
#include <catch2/catch.hpp>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>

#include "nvme_test_util.h"

extern char** environ;

using namespace terrace;
using namespace terrace::testing;

namespace {

constexpr const char* kChildEnv = "TERRACE_NVME_CRASH_CHILD";  // "<dir>|<sync 0/1>|<round>|<seed>"
constexpr int kAckFd = 3;
constexpr int kKeys = 24;
constexpr std::uint64_t kCapacity = 64 * kMiB;

std::uint64_t VersionId(int round, std::uint64_t v, int key) {
  return (static_cast<std::uint64_t>(round) * 1000000 + v) * 64 + static_cast<std::uint64_t>(key);
}
std::size_t SizeOf(int key) { return NvmeTestSize(static_cast<std::uint64_t>(key)); }

NvmeTierOptions CrashOptions(const std::string& dir, bool sync) {
  auto o = SmallNvmeOptions(dir, kCapacity, sync ? Durability::kSync : Durability::kAsync);
  o.group_commit_interval = std::chrono::microseconds(3000);
  return o;
}

void Say(const std::string& line) {
  std::string l = line + "\n";
  if (::write(kAckFd, l.data(), l.size()) < 0) std::_Exit(4);
}

[[noreturn]] void RunChild(const std::string& spec) {
  std::stringstream ss(spec);
  std::string dir, sync_s, round_s, seed_s;
  std::getline(ss, dir, '|');
  std::getline(ss, sync_s, '|');
  std::getline(ss, round_s, '|');
  std::getline(ss, seed_s, '|');
  bool sync = sync_s == "1";
  int round = std::stoi(round_s);
  std::uint64_t seed = std::stoull(seed_s);
  auto t = NvmeTier::Open(CrashOptions(dir, sync));
  if (!t.ok()) {
    Say("error " + t.status().ToString());
    std::_Exit(2);
  }
  std::vector<std::string> pending;
  for (std::uint64_t n = 0;; ++n) {
    int key = static_cast<int>(n % kKeys);
    std::uint64_t v = n / kKeys;
    auto data = TestBytes(VersionId(round, v, key), SizeOf(key), seed);
    Status s = (*t)->Put(TestKey(key), DescribeBlock(data), data);
    if (!s.ok()) {
      Say("error " + s.ToString());
      std::_Exit(3);
    }
    std::string line = "durable " + std::to_string(key) + " " + std::to_string(round) + " " + std::to_string(v);
    if (sync) {
      Say(line);
    } else {
      pending.push_back(line);
      if (n % 5 == 4) {
        Status f = (*t)->Flush();
        if (!f.ok()) {
          Say("error " + f.ToString());
          std::_Exit(3);
        }
        for (const auto& p : pending) Say(p);
        pending.clear();
      }
    }
  }
}

struct Version {
  int round = -1;
  std::uint64_t v = 0;
};

}  // namespace

TEST_CASE("nvme crash child", "[.nvme_crash_child]") {
  const char* spec = std::getenv(kChildEnv);
  if (!spec) return;  // only meaningful when spawned by the crash test
  RunChild(spec);
}

TEST_CASE("nvme crash recovery: SIGKILL at random moments never loses an acknowledged block", "[nvme][crash]") {
  const bool sync = GENERATE(true, false);
  const std::uint64_t seed = sync ? 1234 : 5678;
  TempDir dir("nvme-crash");
  std::mt19937_64 rng(seed);
  std::map<int, Version> acked;              // key -> last acknowledged version
  std::map<int, std::uint64_t> max_acked_v;  // round -> highest acknowledged v (any key)
  constexpr int kRounds = 4;
  for (int round = 0; round < kRounds; ++round) {
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    std::string env = std::string(kChildEnv) + "=" + dir.path().string() + "|" + (sync ? "1" : "0") + "|" +
                      std::to_string(round) + "|" + std::to_string(seed);
    std::vector<char*> envp;
    for (char** e = environ; *e; ++e) envp.push_back(*e);
    envp.push_back(env.data());
    envp.push_back(nullptr);
    std::string self = "/proc/self/exe", name = "nvme crash child";
    char* argv[] = {self.data(), name.data(), nullptr};
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addclose(&fa, fds[0]);  // before the dup2: fds[0] may be kAckFd itself
    posix_spawn_file_actions_adddup2(&fa, fds[1], kAckFd);
    pid_t pid = -1;
    int rc = posix_spawn(&pid, "/proc/self/exe", &fa, nullptr, argv, envp.data());
    posix_spawn_file_actions_destroy(&fa);
    ::close(fds[1]);
    REQUIRE(rc == 0);

    const int kill_after = 3 + static_cast<int>(rng() % 40);  // acknowledgements before the kill
    const auto extra = std::chrono::microseconds(rng() % 20000);
    FILE* in = ::fdopen(fds[0], "r");
    char line[512];
    int acks = 0;
    bool killed = false;
    std::string error;
    while (std::fgets(line, sizeof line, in)) {
      int key = 0, r = 0;
      unsigned long long v = 0;
      if (std::sscanf(line, "durable %d %d %llu", &key, &r, &v) == 3) {
        acked[key] = Version{r, v};
        max_acked_v[r] = std::max<std::uint64_t>(max_acked_v[r], v);
        if (++acks == kill_after && !killed) {
          std::this_thread::sleep_for(extra);
          ::kill(pid, SIGKILL);
          killed = true;  // keep reading: lines already in the pipe were acknowledged
        }
      } else {
        error = line;
      }
    }
    std::fclose(in);
    int status = 0;
    ::waitpid(pid, &status, 0);
    INFO("round " << round << " child error: " << error);
    REQUIRE(error.empty());
    REQUIRE(killed);
    REQUIRE(WIFSIGNALED(status));

    auto t = NvmeTier::Open(CrashOptions(dir.path().string(), sync));
    INFO(t.status().ToString());
    REQUIRE(t.ok());
    NvmeTier& tier = **t;
    CHECK(tier.recovery_report().dropped() == 0);
    std::vector<std::byte> buf(2 * kMiB);
    for (int key = 0; key < kKeys; ++key) {
      BlockDesc d;
      Status s = tier.Get(TestKey(key), buf, &d);
      INFO("round " << round << " key " << key << ": " << s.ToString());
      auto it = acked.find(key);
      if (s.IsNotFound()) {
        REQUIRE(it == acked.end());  // only never-acknowledged keys may be missing
        continue;
      }
      REQUIRE(s.ok());  // never corrupt, never an I/O error
      // Acceptable contents: the last acknowledged version, or a newer unacknowledged one.
      bool match = false;
      int from_round = it == acked.end() ? 0 : it->second.round;
      for (int r = from_round; r <= round && !match; ++r) {
        std::uint64_t v0 = (it != acked.end() && r == it->second.round) ? it->second.v : 0;
        for (std::uint64_t v = v0; v <= max_acked_v[r] + 2 && !match; ++v) {
          auto want = TestBytes(VersionId(r, v, key), SizeOf(key), seed);
          match = d.size == want.size() && std::equal(want.begin(), want.end(), buf.begin());
        }
      }
      REQUIRE(match);
    }
    CHECK(tier.Stats().corruptions == 0);
  }
}
