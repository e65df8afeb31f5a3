#include "src/cli/model_run_kv.h"

#include <algorithm>
#include <filesystem>
#include <optional>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "src/cli/cli_util.h"
#include "src/cli/cmd_store.h"
#include "src/cli/owned_dirs.h"
#include "tiers/hbm/emulated_hbm_tier.h"
#include "tiers/host/host_tier.h"
#include "terrace/codec.h"
#include "terrace/keys.h"

namespace terrace::cli {

namespace {

// OpenPool's host chunk.
constexpr std::uint64_t kPoolHostChunkBytes = 64ull << 20;

}  // namespace

std::uint64_t MaxPoolHostBytes() { return HostTier::MaxCapacityBytes(kPoolHostChunkBytes); }
std::uint64_t MaxPoolHbmBytes() { return HostTier::MaxCapacityBytes(EmulatedHbmTier::kChunkBytes); }

void AddKvFlags(CLI::App* cmd, KvRunArgs* a, bool with_store) {
  CLI::Option* store = nullptr;
  if (with_store) {
    store = cmd->add_option("--store", a->store,
                            "Prefix cache directory: restore the prompt's longest cached prefix from it and store what "
                            "was computed (KV pool in DIR/kv, KDA state pool in DIR/state)")->transform(NormalizedPath());
  }
  // The first option this function adds after --store; all of them up to the end need --store.
  const std::size_t first = cmd->get_options().size();
  cmd->add_option("--tenant", a->tenant, "Tenant of this request (blocks of other tenants are never used); default: none");
  cmd->add_option("--kv-codec", a->kv_codec, "Codec of the MLA latent blocks (f32, bf16, f16, fp8, fp8-block, int8, "
                                              "int4-g32, int4-g64, optionally +zstd or +lz4)")
      ->default_str("bf16");
  cmd->add_option("--state-codec", a->state_codec, "Codec of the KDA state snapshots (same names)")->default_str("f32");
  AddIntOption(cmd, "--chunk-tokens", &a->chunk_tokens, 1, 65536, "Tokens per cached chunk");
  AddIntOption(cmd, "--snapshot-every", &a->snapshot_every, 0, 1 << 20,
               "KDA snapshot every N chunks (0: only at the request's last full chunk)");
  AddSizeOption(cmd, "--store-nvme-size", &a->kv_nvme_bytes,
                "NVMe capacity of the KV pool when it is created (e.g. 1GiB); an existing pool of another size is "
                "refused",
                1 << 20)
      ->each([a](const std::string&) { a->kv_nvme_given = true; });
  AddSizeOption(cmd, "--state-nvme-size", &a->state_nvme_bytes,
                "NVMe capacity of the KDA state pool when it is created; an existing pool of another size is refused",
                1 << 20)
      ->each([a](const std::string&) { a->state_nvme_given = true; });
  AddSizeOption(cmd, "--store-host-size", &a->host_bytes, "Host tier of the KV pool", 1 << 20, MaxPoolHostBytes());
  AddSizeOption(cmd, "--state-host-size", &a->state_host_bytes, "Host tier of the KDA state pool", 1 << 20,
                MaxPoolHostBytes());
  AddSizeOption(cmd, "--store-hbm-size", &a->hbm_bytes, "HBM tier of the KV pool (emulated without a GPU)", 1 << 20,
                MaxPoolHbmBytes());
  cmd->add_option("--read-order", a->read_order,
                  "How a restore under the forward pass reads the KV chunks: layers (each MLA layer's part of every "
                  "chunk in turn, so a layer is computed while the next one's are read; whole chunks where that cannot "
                  "apply: a codec with a lossless stage, a model with one MLA layer) | chunks (whole chunks)")
      ->check(CLI::IsMember({"layers", "chunks"}))
      ->capture_default_str();
  if (store != nullptr) {
    const std::vector<CLI::Option*> added = cmd->get_options();
    for (std::size_t i = first; i < added.size(); ++i) added[i]->needs(store);
  }
}

namespace {

// The NVMe size the pool in `dir` already has: its terrace.data's, else that of the
// terrace.data.creating a stopped run left (*interrupted set; opening with it completes the
// creation). nullopt for a new pool, or when the file does not decode (Store::Open says why).
std::optional<std::uint64_t> PoolOwnCapacity(const std::filesystem::path& dir, bool* interrupted) {
  *interrupted = !StoreDataExists(dir);
  auto own = *interrupted ? InterruptedCreationCapacity(dir) : ExistingStoreCapacity(dir);
  if (!own.ok()) return std::nullopt;
  return *own;
}

// The words of messages about the pool whose NVMe size `nvme_flag` sets, for the command of `a`.
store_cmd::StoreWords PoolWords(const KvRunArgs& a, std::string_view nvme_flag) {
  const std::string new_dir = fmt::format("give a new {} directory", a.dir_flag);
  store_cmd::StoreWords w = store_cmd::CommandDirWords(
      a.dir_flag, "the pool",
      fmt::format("(or, to start over with an empty pool and lose every block in it, {})",
                  a.start_over.empty() ? new_dir : a.start_over));
  w.capacity_flag = std::string(nvme_flag);
  return w;
}

// Defined below OpenPool (where CheckKvRunArgs's checks are).
Status CheckPoolSize(const std::filesystem::path& dir, bool given, std::uint64_t bytes, std::string_view flag);

// The NVMe size OpenPool asks the tier for. A size given on the command line (`given`): the tier
// refuses a pool of another size under its lock, so a pool another process created since
// CheckKvRunArgs is refused too. Otherwise an existing pool's own (0: as its superblock records),
// an interrupted creation's, or `nvme` for a new pool.
std::uint64_t AskedCapacity(const std::filesystem::path& dir, bool given, std::uint64_t nvme) {
  if (given) return nvme;
  bool interrupted = false;
  const std::optional<std::uint64_t> own = PoolOwnCapacity(dir, &interrupted);
  return !interrupted ? 0 : own.value_or(nvme);
}

// Store::Open(o). When the tier refuses the size asked (o.nvme.capacity_bytes) because another
// process created the pool in `dir` with another size after AskedCapacity looked: CheckPoolSize's
// refusal naming `flag` when the size was given, else the pool opened at its own size.
Result<std::unique_ptr<Store>> OpenPoolStore(StoreOptions o, const std::filesystem::path& dir, bool given,
                                             std::string_view flag) {
  auto s = Store::Open(o);
  if (s.ok() || !s.status().IsInvalidArgument() || o.nvme.capacity_bytes == 0) return s;
  if (given) {
    TERRACE_RETURN_IF_ERROR(CheckPoolSize(dir, true, o.nvme.capacity_bytes, flag));
    return s;
  }
  bool interrupted = false;
  const std::optional<std::uint64_t> own = PoolOwnCapacity(dir, &interrupted);
  if (interrupted || !own || *own == o.nvme.capacity_bytes) return s;
  o.nvme.capacity_bytes = 0;
  return Store::Open(o);
}

Result<std::unique_ptr<Store>> OpenPool(const KvRunArgs& a, const std::filesystem::path& dir, std::uint64_t nvme,
                                        bool nvme_given, std::uint64_t host, std::uint64_t hbm,
                                        std::string_view nvme_flag, unsigned io_threads) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IoError(fmt::format("{}: cannot create {}: {}", a.dir_flag, dir.string(), ec.message()));
  StoreOptions o;
  o.hbm.mode = hbm > 0 ? HbmMode::kAuto : HbmMode::kOff;
  o.hbm.capacity_bytes = hbm;
  o.host.capacity_bytes = host;
  o.host.pin = false;
  o.host.chunk_bytes = std::min(host, kPoolHostChunkBytes);
  o.nvme.path = dir;
  RemoveOrphanedIndexCreation(dir, dir / "index", "model run");  // else the tier refuses it as incomplete
  o.nvme.capacity_bytes = AskedCapacity(dir, nvme_given, nvme);
  // One io_uring ring per thread that reads the pool at once: a tier call holds its ring until
  // its I/O completes, so the restore's concurrent KV window reads need a ring each to overlap.
  o.nvme.io_threads = io_threads;
  o.put_tier = TierId::kHost;
  // Every block also goes to NVMe, so the next process finds it.
  o.write_policy = WritePolicy::kWriteThrough;
  // No promotion on Get: a process restores a prefix once (`model run`, each `bench kv` row), so a
  // copy moved up into the host tier would never be read, and placing it there cost the NVMe
  // restore about 40 % of its time (docs/benchmarks.md, "Layerwise restore").
  o.promote_on_get = false;
  auto s = OpenPoolStore(o, dir, nvme_given, nvme_flag);
  if (!s.ok()) {
    if (std::optional<Status> busy = store_cmd::DirInUse(a.dir_flag, "pool", dir, o.nvme.lock_wait, s.status()))
      return *busy;
    if (KvSizeFlagRefused(a, s.status())) return s.status();
    const Status e = s.status().WithContext(
        fmt::format("{}: opening the pool in {} (its NVMe size is {} when created)", a.dir_flag, dir.string(), nvme_flag));
    return Reworded(e, store_cmd::InCliWords(e.message(), PoolWords(a, nvme_flag)));
  }
  return s;
}

// An existing pool keeps the size it was created with, and an interrupted creation the size it was
// started with: a size given on the command line that differs from it is refused (InvalidArgument
// naming the flag and the pool's size), never ignored.
Status CheckPoolSize(const std::filesystem::path& dir, bool given, std::uint64_t bytes, std::string_view flag) {
  if (!given) return Status::Ok();
  bool interrupted = false;
  const std::optional<std::uint64_t> own = PoolOwnCapacity(dir, &interrupted);
  if (!own || *own == bytes) return Status::Ok();  // a new pool, or an unreadable one: Store::Open says why
  if (interrupted) return store_cmd::PoolCreationSizeMismatch(dir, flag, bytes, *own);
  return Status::InvalidArgument(fmt::format(
      "{} {} ({} bytes) does not match the pool in {}, which was created with {} ({} bytes); omit {} to use the "
      "pool's own size, or use a new directory",
      flag, FormatBytes(static_cast<double>(bytes)), bytes, dir.string(), FormatBytes(static_cast<double>(*own)),
      *own, flag));
}

// The cache layout the flags ask for: InvalidArgument naming --kv-codec / --state-codec, or the
// layout's refusal.
Result<kv::KvLayout> Layout(const KvRunArgs& a, const model::ModelConfig& config) {
  auto kv_codec = codec::CodecSpec::Parse(a.kv_codec);
  if (!kv_codec.ok()) return Status::InvalidArgument("--kv-codec: " + kv_codec.status().message());
  auto state_codec = codec::CodecSpec::Parse(a.state_codec);
  if (!state_codec.ok()) return Status::InvalidArgument("--state-codec: " + state_codec.status().message());
  kv::KvLayoutOptions lo;
  lo.chunk_tokens = a.chunk_tokens;
  lo.snapshot_every = a.snapshot_every;
  lo.kv_codec = *kv_codec;
  lo.state_codec = *state_codec;
  auto layout = kv::KvLayout::FromConfig(config, lo);
  if (!layout.ok()) return Status::InvalidArgument(layout.status().message());
  return layout;
}

}  // namespace

Status CheckKvPoolSizes(const KvRunArgs& a) {
  constexpr std::uint64_t kUnit = 4096;  // the NVMe tier's allocation unit (tiers/nvme/format.h)
  for (const auto& [bytes, flag] : {std::pair{a.kv_nvme_bytes, std::string_view(a.kv_nvme_flag)},
                                    std::pair{a.state_nvme_bytes, std::string_view(a.state_nvme_flag)}}) {
    if (bytes % kUnit == 0) continue;
    const std::uint64_t below = bytes / kUnit * kUnit, above = below + kUnit;
    return Status::InvalidArgument(fmt::format(
        "{} {} is not a multiple of 4 KiB (the NVMe tier's allocation unit); give {} or {} bytes, or a size such as "
        "{}MiB",
        flag, bytes, below, above, std::max<std::uint64_t>(1, (bytes + (1 << 19)) >> 20)));
  }
  return Status::Ok();
}

kv::RestoreReadOrder ReadOrder(const KvRunArgs& a) {
  return a.read_order == "chunks" ? kv::RestoreReadOrder::kChunks : kv::RestoreReadOrder::kLayers;
}

bool KvSizeFlagRefused(const KvRunArgs& a, const Status& s) {
  return s.IsInvalidArgument() &&
         (s.message().starts_with(a.kv_nvme_flag + " ") || s.message().starts_with(a.state_nvme_flag + " "));
}

Status CheckKvLayoutArgs(const KvRunArgs& a, const model::ModelConfig& config) { return Layout(a, config).status(); }

Status CheckKvRunArgs(const KvRunArgs& a, const model::ModelConfig& config) {
  TERRACE_RETURN_IF_ERROR(CheckStoreDirArg(a.store, a.dir_flag));
  TERRACE_RETURN_IF_ERROR(CheckKvPoolSizes(a));
  TERRACE_RETURN_IF_ERROR(Layout(a, config).status());
  const std::filesystem::path dir(a.store);
  TERRACE_RETURN_IF_ERROR(CheckPoolSize(dir / "kv", a.kv_nvme_given, a.kv_nvme_bytes, a.kv_nvme_flag));
  return CheckPoolSize(dir / "state", a.state_nvme_given, a.state_nvme_bytes, a.state_nvme_flag);
}

// The prefix cache's log lines (a failed write-back: the store's and tier's reasons) in the words of
// the command that runs it. Thread-safe as the logger it forwards to.
class PoolLogger final : public Logger {
 public:
  explicit PoolLogger(store_cmd::StoreWords words) : words_(std::move(words)), out_(LoggerOrDefault(nullptr)) {}
  void Log(LogLevel level, std::string_view component, std::string_view message) override {
    out_->Log(level, component, store_cmd::InCliWords(message, words_));
  }

 private:
  const store_cmd::StoreWords words_;
  const std::shared_ptr<Logger> out_;
};

Result<KvRun> OpenKvRun(const KvRunArgs& a, const model::ModelConfig& config, const model::WeightSource& weights) {
  TERRACE_RETURN_IF_ERROR(CheckKvRunArgs(a, config));
  TERRACE_ASSIGN_OR_RETURN(kv::KvLayout layout, Layout(a, config));
  KvRun run;
  const std::filesystem::path dir(a.store);
  TERRACE_ASSIGN_OR_RETURN(run.kv_store,
                           OpenPool(a, dir / "kv", a.kv_nvme_bytes, a.kv_nvme_given, a.host_bytes, a.hbm_bytes,
                                    a.kv_nvme_flag, static_cast<unsigned>(kv::kRestoreKvReaders)));
  TERRACE_ASSIGN_OR_RETURN(run.state_store, OpenPool(a, dir / "state", a.state_nvme_bytes, a.state_nvme_given,
                                                     a.state_host_bytes, 0, a.state_nvme_flag, 1));
  auto cache = kv::PrefixCache::Create(
      layout, keys::ModelId(config, weights), run.kv_store.get(), run.state_store.get(),
      std::make_shared<PoolLogger>(PoolWords(a, fmt::format("{} / {}", a.kv_nvme_flag, a.state_nvme_flag))));
  if (!cache.ok()) return Status::Internal(cache.status().message());
  run.cache = std::move(cache).value();
  run.cache->SetRestoreReadOrder(ReadOrder(a));
  return run;
}

namespace {

// Seconds the restore added to the forward pass.
double RestoreCost(const kv::CachedPrefill& p) {
  return p.restore.layerwise && !p.restore.layerwise_voided ? p.restore.wait_seconds : p.restore.seconds;
}

// Why the run's saving is not estimated, or "" when SavedEstimate gives a figure.
std::string_view SavedUnestimatedReason(const kv::CachedPrefill& p) {
  if (p.restored_tokens == 0) return "nothing was restored";
  if (p.restore.layerwise_voided) return "the compute time includes a discarded pass";
  // A rate measured on fewer tokens than it is applied to multiplies the suffix's per-pass
  // overhead up (a 1-token suffix after 576 restored tokens claimed 6x the cost of a full
  // recompute), so the suffix must be at least as long as the restored prefix.
  if (p.computed_tokens < p.restored_tokens) return "the computed suffix is shorter than the restored prefix";
  return "";
}

// Seconds the restore saved: the restored tokens at the suffix's own compute rate (its forward
// passes less the restore's waits inside them), minus what the restore cost the pass; negative
// when the restore cost more than computing would have. nullopt where SavedUnestimatedReason says why.
std::optional<double> SavedEstimate(const kv::CachedPrefill& p) {
  if (!SavedUnestimatedReason(p).empty()) return std::nullopt;
  const double waits_inside = p.restore.layerwise ? p.restore.wait_seconds : 0.0;
  const double per_token = std::max(0.0, p.compute_seconds - waits_inside) / static_cast<double>(p.computed_tokens);
  return per_token * static_cast<double>(p.restored_tokens) - RestoreCost(p);
}

// Whether `spec` decodes to exactly what was encoded (f32, with or without a lossless stage).
bool IsLossless(const codec::CodecSpec& spec) { return spec.kind == codec::CodecKind::kF32; }

std::string SavedText(const kv::CachedPrefill& p) {
  const std::optional<double> saved = SavedEstimate(p);
  if (!saved) return fmt::format("saved: not estimated ({})", SavedUnestimatedReason(p));
  if (*saved >= 0) return fmt::format("saved ~{:.4f} s (estimate)", *saved);
  return fmt::format("the restore cost ~{:.4f} s more than computing the restored tokens (estimate)", -*saved);
}

}  // namespace

nlohmann::json KvReportJson(const kv::CachedPrefill& p, const kv::PrefixCacheStats& st, const kv::KvLayout& layout) {
  nlohmann::json j;
  j["kv_codec"] = layout.kv_codec().Name();
  j["state_codec"] = layout.state_codec().Name();
  j["codecs_lossless"] = IsLossless(layout.kv_codec()) && IsLossless(layout.state_codec());
  j["restored_tokens"] = p.restored_tokens;
  j["computed_tokens"] = p.computed_tokens;
  j["joint_boundary"] = p.restore.boundary_tokens;
  j["lookup_boundary"] = p.restore.lookup_boundary_tokens;
  j["partial_boundary"] = p.restore.partial_boundary_tokens;
  j["fallbacks"] = p.restore.fallbacks;
  j["fallback_reasons"] = p.restore.fallback_reasons;
  for (int t = 0; t < kNumTiers; ++t) j["bytes_read"][kTierNames[t]] = p.restore.bytes_read[static_cast<std::size_t>(t)];
  j["kv_bytes_restored"] = p.restore.kv_bytes;
  j["state_bytes_restored"] = p.restore.state_bytes;
  j["restore_s"] = p.restore.seconds;
  j["restore_wait_s"] = p.restore.wait_seconds;
  j["restore_layerwise"] = p.restore.layerwise;
  j["restore_layerwise_voided"] = p.restore.layerwise_voided;
  j["restore_read_by_layer"] = p.restore.read_by_layer;
  j["range_rereads"] = p.restore.range_rereads;
  j["compute_s"] = p.compute_seconds;
  if (const std::optional<double> saved = SavedEstimate(p)) {
    j["saved_s_estimate"] = *saved;
  } else {
    j["saved_s_estimate"] = nullptr;
    j["saved_s_unestimated"] = std::string(SavedUnestimatedReason(p));
  }
  j["chunk_blocks_written"] = st.chunk_writes;
  j["state_blocks_written"] = st.state_writes;
  j["chunk_blocks_already_stored"] = st.chunk_already_stored;
  j["state_blocks_already_stored"] = st.state_already_stored;
  j["write_failures"] = st.write_failures;
  j["bytes_written"] = st.bytes_written;
  return j;
}

std::string KvReportText(const kv::CachedPrefill& p, const kv::PrefixCacheStats& st, const kv::KvLayout& layout) {
  std::vector<std::string> lossy;
  for (const auto& [what, spec] : {std::pair{"KV", &layout.kv_codec()}, std::pair{"state", &layout.state_codec()}})
    if (!IsLossless(*spec)) lossy.push_back(fmt::format("{} {}", what, spec->Name()));
  std::string out = fmt::format(
      "prefix cache: codecs KV {}, state {}{}\n", layout.kv_codec().Name(), layout.state_codec().Name(),
      lossy.empty() ? std::string(" (lossless)")
                    : fmt::format(" ({} lossy: restored tokens carry its rounding, so the logits can differ from a "
                                  "run that computed them)",
                                  fmt::join(lossy, " and ")));
  out += fmt::format(
      "prefix cache: restored {} tokens (joint boundary {}), computed {}; read {} hbm, {} host, {} nvme in {:.4f} s "
      "({}{}, the forward pass waited {:.4f} s); {}\n",
      p.restored_tokens, p.restore.boundary_tokens, p.computed_tokens, FormatBytes(static_cast<double>(p.restore.bytes_read[0])),
      FormatBytes(static_cast<double>(p.restore.bytes_read[1])), FormatBytes(static_cast<double>(p.restore.bytes_read[2])),
      p.restore.seconds, p.restore.layerwise ? "layerwise" : "whole", p.restore.read_by_layer ? ", read by layer" : "",
      p.restore.layerwise ? p.restore.wait_seconds : p.restore.seconds, SavedText(p));
  if (p.restore.range_rereads > 0)
    out += fmt::format("prefix cache: {} per-layer read(s) failed their check and were read again as whole blocks\n",
                       p.restore.range_rereads);
  if (p.restore.layerwise_voided)
    out += "prefix cache: a layer of the layerwise restore failed; the pass was discarded and the prompt computed from "
           "the earlier boundary\n";
  if (p.restore.fallbacks > 0) {
    const kv::RestoreReport& rep = p.restore;
    if (rep.partial_boundary_tokens == 0)
      out += fmt::format("prefix cache: {} fallback(s) from the looked-up boundary {} to {}:\n", rep.fallbacks,
                         rep.lookup_boundary_tokens, rep.boundary_tokens);
    else if (rep.lookup_boundary_tokens == rep.boundary_tokens)
      out += fmt::format("prefix cache: {} fallback(s) from boundary {} (partly written) to {}:\n", rep.fallbacks,
                         rep.partial_boundary_tokens, rep.boundary_tokens);
    else
      out += fmt::format("prefix cache: {} fallback(s) from boundary {} (partly written) past the looked-up boundary {} "
                         "to {}:\n", rep.fallbacks, rep.partial_boundary_tokens, rep.lookup_boundary_tokens, rep.boundary_tokens);
    for (const auto& r : p.restore.fallback_reasons) out += "  " + r + "\n";
  }
  out += "prefix cache: " + WriteBackText(st) + "\n";
  return out;
}

std::string WriteFailureText(const KvRunArgs& a, const kv::PrefixCacheStats& st) {
  if (st.write_failures == 0) return "";
  return fmt::format("prefix cache: {} block write(s) failed and were not cached (the first failure was logged "
                     "above); if the pools are full: a pool's size is fixed when it is created, so give a new {} "
                     "directory with a larger {} / {}",
                     st.write_failures, a.dir_flag, a.kv_nvme_flag, a.state_nvme_flag);
}

std::string WriteBackText(const kv::PrefixCacheStats& st) {
  return fmt::format("wrote {} chunk and {} state blocks ({}), {} write failure(s); {} chunk and {} state blocks were "
                     "already stored",
                     st.chunk_writes, st.state_writes, FormatBytes(static_cast<double>(st.bytes_written)),
                     st.write_failures, st.chunk_already_stored, st.state_already_stored);
}

}  // namespace terrace::cli
