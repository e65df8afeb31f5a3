// Helpers for the NVMe durability tests: a fixed scenario of puts, overwrites and erases, child
// processes that run it (and die without closing), directory hashes, damage to files.
#pragma once

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "nvme_test_util.h"

extern char** environ;

namespace terrace::testing {

// The scenario: keys [0, kScenarioKeys) put with seed 1; keys [0, kScenarioKeys/2) overwritten
// with seed 2; keys [kScenarioKeys-4, kScenarioKeys) erased. Sync mode: every step acknowledged
// durable before the next.
inline constexpr int kScenarioKeys = 40;

inline Status RunScenario(NvmeTier& t) {
  for (int i = 0; i < kScenarioKeys; ++i) TERRACE_RETURN_IF_ERROR(PutTestBlock(t, i, 1));
  for (int i = 0; i < kScenarioKeys / 2; ++i) TERRACE_RETURN_IF_ERROR(PutTestBlock(t, i, 2));
  for (int i = kScenarioKeys - 4; i < kScenarioKeys; ++i) TERRACE_RETURN_IF_ERROR(t.Erase(TestKey(i)));
  return Status::Ok();
}

inline int ScenarioBlocks() { return kScenarioKeys - 4; }

// OK when the tier holds exactly the scenario's final state.
inline Status CheckScenario(NvmeTier& t) {
  for (int i = 0; i < kScenarioKeys; ++i) {
    if (i >= kScenarioKeys - 4) {
      if (!t.Lookup(TestKey(i)).status().IsNotFound()) {
        return Status::Internal("erased block " + TestKey(i).ToString() + " is back");
      }
      continue;
    }
    Status s = CheckTestBlock(t, i, i < kScenarioKeys / 2 ? 2 : 1);
    if (!s.ok()) return s.WithContext("scenario block " + std::to_string(i));
  }
  if (t.block_count() != static_cast<std::uint64_t>(ScenarioBlocks())) {
    return Status::Internal("tier holds " + std::to_string(t.block_count()) + " blocks, expected " +
                            std::to_string(ScenarioBlocks()));
  }
  return Status::Ok();
}

inline NvmeTierOptions DurabilityOptions(const std::filesystem::path& dir) {
  return SmallNvmeOptions(dir, 32 * kMiB, Durability::kSync);
}

// Spawns this test binary running the Catch test `test_name` with env `var=value`. Returns the pid.
inline pid_t SpawnSelf(const std::string& test_name, const std::string& var, const std::string& value) {
  std::string env = var + "=" + value;
  std::vector<char*> envp;
  for (char** e = environ; *e; ++e) envp.push_back(*e);
  envp.push_back(env.data());
  envp.push_back(nullptr);
  std::string self = "/proc/self/exe", name = test_name;
  char* argv[] = {self.data(), name.data(), nullptr};
  pid_t pid = -1;
  if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, envp.data()) != 0) return -1;
  return pid;
}

// Every regular file under `dir` (relative name -> content checksum).
inline std::map<std::string, std::uint64_t> HashTree(const std::filesystem::path& dir) {
  std::map<std::string, std::uint64_t> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream f(e.path(), std::ios::binary);
    std::string bytes(static_cast<std::size_t>(e.file_size()), '\0');
    f.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    REQUIRE(f.gcount() == static_cast<std::streamsize>(bytes.size()));
    out[std::filesystem::relative(e.path(), dir).string()] = Checksum(std::as_bytes(std::span(bytes.data(), bytes.size())));
  }
  return out;
}

inline void FlipBit(const std::filesystem::path& file, std::uint64_t offset, int bit) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ (1 << bit));
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

// Files in the index directory whose names end with `suffix` (".log": the WAL; ".sst": tables).
inline std::vector<std::filesystem::path> IndexFiles(const std::filesystem::path& index, const std::string& suffix) {
  std::vector<std::filesystem::path> out;
  for (const auto& e : std::filesystem::directory_iterator(index)) {
    const std::string n = e.path().filename().string();
    if (n.size() >= suffix.size() && n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0) {
      out.push_back(e.path());
    }
  }
  return out;
}

}  // namespace terrace::testing
