// The prefix-cache part of `terrace model run` (--store DIR and its flags; docs/prefix-cache.md,
// "terrace model run --store"). Opens the two store pools under DIR, restores what they hold for
// the prompt, computes the rest and writes back what it computed.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "terrace/model.h"
#include "terrace/prefix_cache.h"
#include "terrace/store.h"

namespace terrace::cli {

struct KvRunArgs {
  std::string store;  // empty: no prefix cache
  std::string tenant;
  std::string kv_codec = "bf16";
  std::string state_codec = "f32";
  int chunk_tokens = 256;
  int snapshot_every = 1;
  std::uint64_t kv_nvme_bytes = 1ull << 30;
  std::uint64_t state_nvme_bytes = 256ull << 20;
  std::uint64_t host_bytes = 256ull << 20;
  std::uint64_t state_host_bytes = 64ull << 20;
  std::uint64_t hbm_bytes = 256ull << 20;
  std::string read_order = "layers";  // kv::RestoreReadOrder: layers | chunks
  // The NVMe sizes given on the command line (an existing pool of another size is then refused), and
  // the flags that set them, for messages (`terrace demo` calls the first --kv-nvme-size).
  bool kv_nvme_given = false, state_nvme_given = false;
  std::string kv_nvme_flag = "--store-nvme-size", state_nvme_flag = "--state-nvme-size";
  // The flag naming the directory that holds the pools (`bench kv` and `demo`: "--dir"), and what a
  // user of the command does to start a pool over with nothing in it (empty: "give a new <dir_flag>
  // directory"; `demo`: its --fresh), for messages.
  std::string dir_flag = "--store";
  std::string start_over;
};

// The largest --store-host-size / --state-host-size (host tiers of 64 MiB chunks) and
// --store-hbm-size (the emulated HBM tier: 256 MiB chunks) a pool accepts: the host tier refuses more
// than 1,000,000 chunks and numbers its 4 KiB pages with 32-bit ids (tiers/host/host_tier.cpp,
// page_allocator.h), which for these chunks is the tighter rule (16 TiB less one chunk).
std::uint64_t MaxPoolHostBytes();
std::uint64_t MaxPoolHbmBytes();

// The prefix-cache flags. with_store: also --store DIR, which every other flag here then needs
// (given without it, they are a usage error, never ignored); without (bench kv, whose --dir names
// the pools): the rest only.
void AddKvFlags(CLI::App* cmd, KvRunArgs* args, bool with_store);

// --read-order as the cache's RestoreReadOrder.
kv::RestoreReadOrder ReadOrder(const KvRunArgs& args);

// The opened cache and its pools.
struct KvRun {
  std::unique_ptr<Store> kv_store, state_store;
  std::unique_ptr<kv::PrefixCache> cache;
};

// The two pools' NVMe sizes as the NVMe tier takes them: multiples of its 4 KiB allocation unit
// (the flags' own range checks keep them at 1 MiB or more). InvalidArgument naming the flag
// (args.kv_nvme_flag / args.state_nvme_flag) and the valid sizes either side. Creates nothing:
// commands call it before they create a directory, and OpenKvRun before it opens a pool.
Status CheckKvPoolSizes(const KvRunArgs& args);

// The codecs and the cache layout the flags ask for (--kv-codec, --state-codec, --chunk-tokens,
// --snapshot-every) against `config`: InvalidArgument naming the flag. Reads nothing on disk:
// `bench kv` calls it before it touches --dir.
Status CheckKvLayoutArgs(const KvRunArgs& args, const model::ModelConfig& config);

// Every check of the flags that OpenKvRun makes (CheckKvPoolSizes, the codecs, the layout, an
// existing pool's size against the NVMe size flags): InvalidArgument naming the flag, a usage error.
// Creates nothing.
Status CheckKvRunArgs(const KvRunArgs& args, const model::ModelConfig& config);

// CheckKvRunArgs (its InvalidArgument is a usage error), then opens the pools. A later error is a
// runtime failure, whatever its code (a pool's data file that is not a Terrace store is an
// InvalidArgument too), except KvSizeFlagRefused: a caller that ran CheckKvRunArgs first fails with
// exit 2 on that one and exit 1 on any other. A given NVMe size flag is checked again under the
// pool's lock, so a pool another process created since CheckKvRunArgs with another size is refused
// as CheckKvRunArgs refuses it; without the flag, such a pool is opened at its own size. The
// pool-opening messages are in the words of the command (args.dir_flag, the NVMe size flags); a pool
// another process holds is Unavailable naming that process's pid where /proc/locks lists it.
Result<KvRun> OpenKvRun(const KvRunArgs& args, const model::ModelConfig& config, const model::WeightSource& weights);

// True for OpenKvRun's refusal of a pool whose size differs from a given NVMe size flag
// (InvalidArgument beginning with args.kv_nvme_flag or args.state_nvme_flag): a usage error.
bool KvSizeFlagRefused(const KvRunArgs& args, const Status& status);

// The JSON object / text lines the run reports about the cache (after the write-back finished),
// naming `layout`'s codecs and saying which are lossy.
nlohmann::json KvReportJson(const kv::CachedPrefill& prefill, const kv::PrefixCacheStats& stats,
                            const kv::KvLayout& layout);
std::string KvReportText(const kv::CachedPrefill& prefill, const kv::PrefixCacheStats& stats, const kv::KvLayout& layout);
// "wrote N chunk and M state blocks (BYTES), F write failure(s); K chunk and L state blocks were
// already stored": the write-back so far, blocks the pools already held counted apart from writes.
std::string WriteBackText(const kv::PrefixCacheStats& stats);
// "" without write failures; else one line (no newline) saying how many block writes failed and,
// as a full pool is the usual cause, that a pool's size is fixed when it is created: a new
// args.dir_flag directory with larger NVMe size flags.
std::string WriteFailureText(const KvRunArgs& args, const kv::PrefixCacheStats& stats);

}  // namespace terrace::cli
