// terrace bench kv: one prefix length's row (bench_kv.h). Turn 1 computes and stores the prefix;
// then, per round, four turn-2 restores (cold unprepared, cold prepared, warm, warm alone), each
// with the tier's raw read of the same bytes right after it; the first round also times the
// recompute. The row's figures are the medians over the rounds.
#include <fcntl.h>
#include <linux/fiemap.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "src/cli/bench_kv.h"
#include "src/cli/cli_util.h"
#include "src/cli/owned_dirs.h"
#include "src/cli/prefill_progress.h"
#include "src/cli/stop_signals.h"
#include "src/common/aligned_buffer.h"
#include "src/common/clock.h"
#include "src/common/median.h"
#include "src/model/session.h"
#include "terrace/codec.h"
#include "terrace/keys.h"
#include "tiers/nvme/format.h"

namespace terrace::cli::bench_kv {
namespace {

// Whether the codec `name` (CodecSpec::Parse's; a lossless stage allowed) stores f32 exactly.
bool IsF32(const std::string& name) {
  const auto spec = codec::CodecSpec::Parse(name);
  return spec.ok() && spec->kind == codec::CodecKind::kF32;
}

// A raw read's rate, MB/s (0: nothing to read), the bytes one pass of it read, and how the files'
// written data was found (WrittenRanges::how; null when no file was read).
struct RawRead {
  double mb_per_s = 0;
  std::uint64_t bytes = 0;
  const char* extents_from = nullptr;
};

// A byte range of a file: [offset, offset + length).
struct ByteRange {
  std::uint64_t offset = 0, length = 0;
};

// Appends [begin, end) to `out` (offset order), merged into the last range where they touch.
void AppendRange(std::vector<ByteRange>* out, std::uint64_t begin, std::uint64_t end) {
  if (end <= begin) return;
  if (!out->empty() && out->back().offset + out->back().length == begin) out->back().length += end - begin;
  else out->push_back({begin, end - begin});
}

// The ranges of `fd`'s data from `from` on, in offset order, and how they were found.
struct WrittenData {
  std::vector<ByteRange> ranges;
  const char* how = "";  // "fiemap" or "seek_data"
};

// FIEMAP's extents of `fd` from `from` on, less holes and unwritten (fallocated) extents, which
// read as zeros without touching the disk; dirty pages are flushed first (FIEMAP_FLAG_SYNC). False
// with errno set when the ioctl fails (EOPNOTSUPP: a file system without it, e.g. tmpfs).
bool FiemapRanges(int fd, std::uint64_t from, std::vector<ByteRange>* out) {
  constexpr unsigned kExtents = 256;
  std::vector<std::uint64_t> storage((sizeof(fiemap) + kExtents * sizeof(fiemap_extent)) / sizeof(std::uint64_t) + 1);
  for (std::uint64_t start = from;;) {
    std::fill(storage.begin(), storage.end(), 0);
    auto* fm = reinterpret_cast<fiemap*>(storage.data());
    fm->fm_start = start;
    fm->fm_length = FIEMAP_MAX_OFFSET - start;
    fm->fm_flags = FIEMAP_FLAG_SYNC;
    fm->fm_extent_count = kExtents;
    if (::ioctl(fd, FS_IOC_FIEMAP, fm) != 0) return false;
    if (fm->fm_mapped_extents == 0) return true;
    for (unsigned i = 0; i < fm->fm_mapped_extents; ++i) {
      const fiemap_extent& e = fm->fm_extents[i];
      if ((e.fe_flags & FIEMAP_EXTENT_UNWRITTEN) == 0)
        AppendRange(out, std::max<std::uint64_t>(e.fe_logical, from), e.fe_logical + e.fe_length);
      start = e.fe_logical + e.fe_length;
      if (e.fe_flags & FIEMAP_EXTENT_LAST) return true;
    }
  }
}

// lseek(SEEK_DATA / SEEK_HOLE)'s data ranges of `fd` from `from` on. What counts as data is the
// file system's: tmpfs skips holes and fallocated pages not yet written; ext4 and xfs skip
// unwritten extents; a file system with only the kernel's generic SEEK_DATA reports the whole file
// as data, fallocated space included. False with errno set when lseek fails.
bool SeekDataRanges(int fd, std::uint64_t from, std::vector<ByteRange>* out) {
  for (off_t at = static_cast<off_t>(from);;) {
    const off_t data = ::lseek(fd, at, SEEK_DATA);
    if (data < 0) return errno == ENXIO;  // ENXIO: no data at or after `at`
    const off_t hole = ::lseek(fd, data, SEEK_HOLE);
    if (hole < 0) return false;
    AppendRange(out, static_cast<std::uint64_t>(data), static_cast<std::uint64_t>(hole));
    at = hole;
  }
}

// The ranges of `fd` (the file `file`) that hold written data, from `from` on: FIEMAP's, or, on a
// file system without FIEMAP (EOPNOTSUPP, ENOTTY), SeekDataRanges'. IoError naming the file when
// neither can map it.
Result<WrittenData> WrittenRanges(int fd, const std::filesystem::path& file, std::uint64_t from) {
  WrittenData out;
  out.how = "fiemap";
  if (FiemapRanges(fd, from, &out.ranges)) return out;
  if (errno != EOPNOTSUPP && errno != ENOTTY)
    return Status::IoError(fmt::format("cannot map the written extents of {} (FIEMAP): {}", file.string(),
                                       std::strerror(errno)));
  out.ranges.clear();
  out.how = "seek_data";
  if (SeekDataRanges(fd, from, &out.ranges)) return out;
  return Status::IoError(fmt::format("cannot map the written data of {} (FIEMAP is not supported there, and "
                                     "lseek SEEK_DATA failed: {}); the tier read rate needs a file system that "
                                     "reports either (ext4, xfs, btrfs, tmpfs)",
                                     file.string(), std::strerror(errno)));
}

// One pool's part of a raw read: its data file, the bytes to read (the restore's count from it,
// rounded up to 4 KiB) and where its written data after the superblock lies (WrittenRanges).
struct RawReadPart {
  std::filesystem::path file;
  std::uint64_t want = 0;
  WrittenData written;
};

// The parts of a raw read of `parts` (each pool's data file and the bytes the restore took from
// it), mapped once for every pass: a pool the restore did not read is left out.
Result<std::vector<RawReadPart>> MapRawRead(std::span<const std::pair<std::filesystem::path, std::uint64_t>> parts) {
  std::vector<RawReadPart> out;
  for (const auto& [file, bytes] : parts) {
    if (bytes == 0) continue;  // a pool the restore did not read
    const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return Status::IoError(fmt::format("cannot open {}: {}", file.string(), std::strerror(errno)));
    auto written = WrittenRanges(fd, file, nvme::kDataStart);
    ::close(fd);
    if (!written.ok()) return written.status();
    out.push_back({file, RoundUp(bytes, 4 * kKiB), std::move(written).value()});
  }
  return out;
}

// One timed pass of O_DIRECT sequential reads of at most 1 MiB over each part: the first `want`
// bytes of its written data, in offset order. Adds the bytes read to *done and returns the seconds.
Result<double> RawReadPass(std::span<const RawReadPart> parts, void* buf, std::uint64_t* done) {
  constexpr std::uint64_t kIo = 1 << 20;
  double seconds = 0;
  for (const RawReadPart& part : parts) {
    const int fd = ::open(part.file.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd < 0) {
      return Status::IoError(fmt::format("cannot open {} with O_DIRECT: {}", part.file.string(), std::strerror(errno)));
    }
    std::uint64_t got = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (const ByteRange& r : part.written.ranges) {
      for (std::uint64_t at = 0; at < r.length && got < part.want;) {
        const std::uint64_t n = std::min({kIo, r.length - at, part.want - got});
        const ssize_t read = ::pread(fd, buf, n, static_cast<off_t>(r.offset + at));
        if (read <= 0) break;
        at += static_cast<std::uint64_t>(read);
        got += static_cast<std::uint64_t>(read);
      }
      if (got >= part.want) break;
    }
    seconds += SecondsSince(t0);
    ::close(fd);
    if (got < part.want)
      return Status::IoError(fmt::format("{} holds {} of written data after its superblock, less than the {} the "
                                         "restore read from it", part.file.string(), FormatBytes(static_cast<double>(got)),
                                         FormatBytes(static_cast<double>(part.want))));
    *done += got;
  }
  return seconds;
}

// The NVMe tier's raw read for a restore that read `parts` (each pool's data file and the bytes
// the restore took from it): MB/s (1e6 bytes per second), the median of three passes of
// RawReadPass right after the restore, so the same files, the same byte counts of written data and
// the same (just written, just read) state of the disk's caches; and the bytes one pass read.
// Nothing to read: 0 MB/s, 0 bytes. Requests of up to 1 MiB are the tier's best case; the restore
// reads its 150-230 KiB blocks as batches. The files are mapped once, untimed (MapRawRead).
Result<RawRead> RawReadMbPerS(std::span<const std::pair<std::filesystem::path, std::uint64_t>> parts) {
  AlignedBuffer buffer(1 << 20);
  if (!buffer.data()) return Status::OutOfCapacity("no memory for a 1 MiB read buffer");
  TERRACE_ASSIGN_OR_RETURN(const std::vector<RawReadPart> mapped, MapRawRead(parts));
  RawRead out;
  if (mapped.empty()) return out;
  out.extents_from = mapped.back().written.how;  // how the last file's data was mapped
  std::vector<double> rates;
  for (int pass = 0; pass < 3; ++pass) {
    std::uint64_t done = 0;
    TERRACE_ASSIGN_OR_RETURN(const double s, RawReadPass(mapped, buffer.data(), &done));
    rates.push_back(static_cast<double>(done) / s / 1e6);
    out.bytes = done;
  }
  std::sort(rates.begin(), rates.end());
  out.mb_per_s = rates[1];
  return out;
}

// The host tier's stand-in for a raw read: one memcpy of max(bytes, 4 MiB) from main memory into
// faulted-in memory; nothing for 0 bytes. A sweep of 64 MiB (larger than the last-level cache of
// the machines this runs on) between filling the source and copying it pushes the source out of
// the caches: copied straight after it was written, a few MiB were read from the cache, several
// times faster than the tier's memory can deliver.
RawRead MemcpyMbPerS(std::uint64_t bytes) {
  if (bytes == 0) return {};
  std::vector<std::byte> a(std::max<std::uint64_t>(bytes, 4 << 20), std::byte{1}), b(a.size(), std::byte{0});
  std::vector<std::byte> sweep(64 << 20, std::byte{2});
  volatile std::byte sink = std::byte{0};
  for (std::size_t i = 0; i < sweep.size(); i += 64) sink = sink ^ sweep[i];
  const auto t0 = std::chrono::steady_clock::now();
  std::memcpy(b.data(), a.data(), a.size());
  const double s = SecondsSince(t0);
  return RawRead{static_cast<double>(a.size()) / s / 1e6, a.size()};
}

}  // namespace

Result<nlohmann::json> RunPrefixRow(const RowContext& ctx, int prefix_tokens, TierTally* all_read, TierTally* all_written) {
  const Args& a = ctx.a;
  const KvRunArgs& kv = ctx.kv;
  const std::filesystem::path& dir = ctx.dir;
  const model::ModelConfig& config = ctx.config;
  const int P = prefix_tokens;
  std::vector<std::int32_t> prompt(static_cast<std::size_t>(P + kSuffixTokens));
  for (std::size_t i = 0; i < prompt.size(); ++i)
    prompt[i] = static_cast<std::int32_t>((i * 7919 + 13 + (i >= static_cast<std::size_t>(P) ? 1 : 0)) %
                                          static_cast<std::size_t>(config.vocab_size));
  std::vector<std::int32_t> prefix(prompt.begin(), prompt.begin() + P);
  TierTally written;  // turn 1's write-back, per tier (both pools)
  // Long prefixes: turn 1 computes the whole prompt cold and is the row's recompute measurement.
  const bool recompute_in_turn1 = P > a.recompute_max_tokens;
  fmt::print(stderr, "terrace bench kv: prefix {} tokens: turn 1 (compute and store{})...\n", P,
             recompute_in_turn1 ? fmt::format(", timed as the recompute of all {} tokens", prompt.size()) : "");
  TERRACE_ASSIGN_OR_RETURN(KvRun run, OpenNewPools(kv, dir, config, ctx.mdir, ctx.pools_made));
  const int last_layer = config.num_hidden_layers - 1;
  double ttft_recompute = 0;
  std::optional<kv::CachedPrefill> r3;  // the cold run of the turn-2 prompt
  {
    const TierTally before = Tally(run);
    model::Session s1(ctx.m);
    PrefillProgress progress("terrace bench kv", "turn 1",
                             static_cast<std::int64_t>(recompute_in_turn1 ? prompt.size() : prefix.size()),
                             last_layer);
    s1.set_hooks(progress.Hooks());
    // Turn 1 stores the prefix's chunks only, with the prefix's last chunk as the last snapshot
    // (KvLayout::SnapshotDue), whether or not it computes the whole prompt: the whole prompt's
    // request cut to the prefix's chunk ids, so what turn 2 restores does not depend on
    // --recompute-max-tokens.
    kv::PrefixRequest turn1 = run.cache->Prepare(recompute_in_turn1 ? std::span<const std::int32_t>(prompt)
                                                                   : std::span<const std::int32_t>(prefix),
                                                 kv.tenant);
    turn1.chunk_ids.resize(static_cast<std::size_t>(P / run.cache->layout().chunk_tokens()));
    const auto t1 = std::chrono::steady_clock::now();
    auto r1 = kv::PrefillWithCache(&s1, *run.cache, turn1, {.restore = !recompute_in_turn1});
    if (!r1.ok()) return r1.status();
    if (recompute_in_turn1) {
      ttft_recompute = SecondsSince(t1);
      r3 = std::move(r1).value();
    }
    run.cache->Flush();
    written = Tally(run) - before;
  }
  const auto cache_written = run.cache->Stats();
  // A fresh cache on the pools, as a new process opens it (nvme: the pools closed and reopened,
  // so nothing is left in memory; host: the pools kept, the cache and its restore buffers new).
  auto fresh_cache = [&]() -> Status {
    if (a.tier != "nvme") {
      const kv::KvLayout layout = run.cache->layout();
      run.cache.reset();
      auto c = kv::PrefixCache::Create(layout, keys::ModelId(config, ctx.mdir), run.kv_store.get(), run.state_store.get());
      if (!c.ok()) return c.status();
      run.cache = std::move(c).value();
      run.cache->SetRestoreReadOrder(ReadOrder(kv));
      return Status::Ok();
    }
    run.cache.reset();
    TERRACE_RETURN_IF_ERROR(run.kv_store->Flush());
    TERRACE_RETURN_IF_ERROR(run.state_store->Flush());
    run = KvRun{};
    auto again = OpenKvRun(kv, config, ctx.mdir);
    if (!again.ok()) return again.status();
    run = std::move(again).value();
    return Status::Ok();
  };
  // Read requests the NVMe tiers of both pools have completed (0 for --tier host).
  auto nvme_reads = [&]() -> std::uint64_t {
    std::uint64_t n = 0;
    for (Store* s : {run.kv_store.get(), run.state_store.get()}) {
      const StoreStats st = s->Stats();
      if (st.present[static_cast<std::size_t>(TierId::kNvme)])
        n += st.tiers[static_cast<std::size_t>(TierId::kNvme)].read_requests;
    }
    return n;
  };
  // The tier's raw read of what a restore read, right after it.
  auto tier_read = [&](const kv::RestoreReport& r) -> Result<RawRead> {
    if (a.tier != "nvme") return MemcpyMbPerS(r.kv_bytes + r.state_bytes);
    const std::pair<std::filesystem::path, std::uint64_t> parts[] = {
        {dir / "kv" / "terrace.data", r.kv_bytes}, {dir / "state" / "terrace.data", r.state_bytes}};
    return RawReadMbPerS(parts);
  };
  // One round of turn 2: the unprepared, the prepared and the warm restore (each with its raw
  // read right after it); round 0 also runs the recompute (unless turn 1 was it).
  struct Round {
    std::optional<kv::CachedPrefill> ru, r2, rw;
    kv::RestoreReport alone;  // PrefixCache::Restore with no forward pass beside it
    std::uint64_t alone_requests = 0;  // NVMe read requests it issued (both pools)
    double ttft_unprepared = 0, tier_unprepared = 0, ttft_restore = 0, tier_mb = 0, ttft_warm = 0, tier_warm = 0;
    double tier_alone = 0;
    RawRead tier_raw;  // the prepared restore's raw read (its bytes: what one pass read)
    double prepare_s = 0;
    std::uint64_t prepare_bytes = 0;
    TierTally read;  // what the prepared restore read, per tier (both pools)
    long faults_unprepared = 0, faults_prepared = 0, faults_warm = 0;
  };
  // One restore into `session`, timed with its minor faults, then the tier's raw read of what it
  // read (its MB/s to *tier_mb, the whole RawRead to *tier_raw unless null).
  auto timed_restore = [&](model::Session* session, const auto& req, std::optional<kv::CachedPrefill>* result,
                           double* ttft_s, long* faults, double* tier_mb, RawRead* tier_raw = nullptr) -> Status {
    const long f0 = MinorFaults();
    const auto t0 = std::chrono::steady_clock::now();
    auto r = kv::PrefillWithCache(session, *run.cache, req, {.restore = true, .write_back = false});
    *ttft_s = SecondsSince(t0);
    *faults = MinorFaults() - f0;
    if (!r.ok()) return r.status();
    *result = std::move(r).value();
    TERRACE_ASSIGN_OR_RETURN(const RawRead raw, tier_read((*result)->restore));
    *tier_mb = raw.mb_per_s;
    if (tier_raw) *tier_raw = raw;
    return Status::Ok();
  };
  auto round = [&](int index, Round* out) -> Status {
    TERRACE_RETURN_IF_ERROR(StopCheck());
    TERRACE_RETURN_IF_ERROR(fresh_cache());
    // Cold, unprepared: a fresh cache's first restore into a fresh session, every buffer and
    // latent page touched for the first time inside the restore.
    {
      model::Session fresh(ctx.m);
      TERRACE_RETURN_IF_ERROR(timed_restore(&fresh, run.cache->Prepare(prompt, kv.tenant), &out->ru,
                                            &out->ttft_unprepared,
                                            &out->faults_unprepared, &out->tier_unprepared));
    }
    TERRACE_RETURN_IF_ERROR(fresh_cache());
    const auto req = run.cache->Prepare(prompt, kv.tenant);
    // Cold, prepared (the row's headline): a fresh cache and session whose restore memory was
    // prepared at open (PrefixCache::Reserve + SequenceState::Reserve for the prompt), outside
    // the request; the preparation is timed on its own (prepare_s).
    model::Session turn2(ctx.m);
    const auto tp = std::chrono::steady_clock::now();
    TERRACE_ASSIGN_OR_RETURN(auto reserved, run.cache->Reserve(static_cast<std::int64_t>(prompt.size())));
    TERRACE_RETURN_IF_ERROR(turn2.state().Reserve(static_cast<std::int64_t>(prompt.size())));
    out->prepare_s = SecondsSince(tp);
    out->prepare_bytes = reserved.bytes_prepared + static_cast<std::uint64_t>(turn2.state().reserved_tokens()) *
                                                       static_cast<std::uint64_t>(turn2.state().mla_width()) *
                                                       sizeof(float) * run.cache->layout().mla_layers().size();
    const TierTally before = Tally(run);
    TERRACE_RETURN_IF_ERROR(
        timed_restore(&turn2, req, &out->r2, &out->ttft_restore, &out->faults_prepared, &out->tier_mb,
                      &out->tier_raw));
    out->read = Tally(run) - before;
    out->read.AddRestore(out->r2->restore);
    if (index == 0 && !recompute_in_turn1) {
      fmt::print(stderr, "terrace bench kv: prefix {} tokens: recompute...\n", P);
      model::Session cold(ctx.m);
      PrefillProgress progress("terrace bench kv", "recompute", static_cast<std::int64_t>(prompt.size()), last_layer);
      cold.set_hooks(progress.Hooks());
      const auto t1 = std::chrono::steady_clock::now();
      auto cold_run = kv::PrefillWithCache(&cold, *run.cache, req, {.restore = false, .write_back = false});
      ttft_recompute = SecondsSince(t1);
      if (!cold_run.ok()) return cold_run.status();
      r3 = std::move(cold_run).value();
    }
    // Warm: the same restore into the same state after Reset (memory reused), same cache.
    turn2.state().Reset();
    TERRACE_RETURN_IF_ERROR(timed_restore(&turn2, req, &out->rw, &out->ttft_warm, &out->faults_warm, &out->tier_warm));
    // Alone: the same warm restore, whole (PrefixCache::Restore), with no forward pass sharing
    // the cores: what the restore engine reaches when the compute is elsewhere (an engine's
    // forward pass runs on the GPU, not beside the restore on a CPU core).
    turn2.state().Reset();
    const std::uint64_t requests_before = nvme_reads();
    TERRACE_ASSIGN_OR_RETURN(out->alone, run.cache->Restore(req, &turn2.state()));
    out->alone_requests = nvme_reads() - requests_before;
    if (out->alone.boundary_tokens != out->rw->restored_tokens)
      return Status::Internal(fmt::format("bench kv: the restore alone restored {} tokens, the warm one {}",
                                          out->alone.boundary_tokens, out->rw->restored_tokens));
    TERRACE_ASSIGN_OR_RETURN(const RawRead alone_raw, tier_read(out->alone));
    out->tier_alone = alone_raw.mb_per_s;
    return Status::Ok();
  };
  fmt::print(stderr, "terrace bench kv: prefix {} tokens: turn 2 restore unprepared, prepared, warm ({} round{})...\n",
             P, a.repeat, a.repeat == 1 ? "" : "s");
  std::vector<Round> rounds(static_cast<std::size_t>(a.repeat));
  Status round_error;
  for (int i = 0; i < a.repeat && round_error.ok(); ++i) round_error = round(i, &rounds[static_cast<std::size_t>(i)]);
  if (!round_error.ok()) return round_error;
  // Scalar figures: the median over the rounds (each round's own value is in the *_runs lists).
  auto median = [&](auto get) {
    std::vector<double> v;
    for (const Round& r : rounds) v.push_back(static_cast<double>(get(r)));
    return Median(std::move(v));
  };
  auto runs = [&](auto get) {
    nlohmann::json l = nlohmann::json::array();
    for (const Round& r : rounds) l.push_back(get(r));
    return l;
  };
  auto report_mb_per_s = [](const kv::RestoreReport& r) {
    return r.seconds > 0 ? static_cast<double>(r.kv_bytes + r.state_bytes) / r.seconds / 1e6 : 0.0;
  };
  auto report_ratio = [&](const kv::RestoreReport& r, double tier) { return tier > 0 ? report_mb_per_s(r) / tier : 0.0; };
  auto mb_per_s = [&](const kv::CachedPrefill& c) { return report_mb_per_s(c.restore); };
  auto ratio = [&](const kv::CachedPrefill& c, double tier) { return report_ratio(c.restore, tier); };
  auto alone_ratio = [&](const Round& r) { return report_ratio(r.alone, r.tier_alone); };
  const Round& first = rounds.front();
  const kv::CachedPrefill* r2 = &*first.r2;
  const kv::CachedPrefill* ru = &*first.ru;
  const kv::CachedPrefill* rw = &*first.rw;
  // TERRACE_TEST_BENCH_KV_SKEW (tests only): "warm" moves one logit of the first warm restore,
  // "recompute" one of the recompute's compared logits, so that the checks below fail.
  if (const char* skew = std::getenv("TERRACE_TEST_BENCH_KV_SKEW")) {
    const std::size_t at = static_cast<std::size_t>(r2->restored_tokens) * static_cast<std::size_t>(config.vocab_size);
    std::vector<float>* v = std::string_view(skew) == "warm"        ? &rounds.front().rw->logits.data
                            : std::string_view(skew) == "recompute" ? &r3->logits.data
                                                                    : nullptr;
    const std::size_t i = v == &r3->logits.data ? at : 0;
    if (v && i < v->size()) (*v)[i] = std::nextafter((*v)[i], INFINITY);
  }
  bool unprepared_equal = true, warm_equal = true, prepared_equal = true;
  int warm_fallbacks = 0, fallbacks = 0;
  for (const Round& r : rounds) {
    unprepared_equal = unprepared_equal && r.ru->logits.data == r2->logits.data;
    warm_equal = warm_equal && r.rw->logits.data == r2->logits.data;
    prepared_equal = prepared_equal && r.r2->logits.data == r2->logits.data;
    warm_fallbacks += r.rw->restore.fallbacks;
    fallbacks += r.r2->restore.fallbacks;
  }
  // The restored run's logits against the recompute's for the same positions.
  double num = 0, den = 0;
  const std::size_t off = static_cast<std::size_t>(r2->restored_tokens) * static_cast<std::size_t>(config.vocab_size);
  for (std::size_t i = 0; i < r2->logits.data.size() && off + i < r3->logits.data.size(); ++i) {
    num = std::max(num, static_cast<double>(std::abs(r2->logits.data[i] - r3->logits.data[off + i])));
    den = std::max(den, static_cast<double>(std::abs(r3->logits.data[off + i])));
  }
  nlohmann::json row;
  row["prefix_tokens"] = P;
  row["prompt_tokens"] = prompt.size();
  row["rounds"] = a.repeat;
  row["restored_tokens"] = r2->restored_tokens;
  row["ttft_restore_s"] = median([](const Round& r) { return r.ttft_restore; });
  row["ttft_recompute_s"] = ttft_recompute;
  row["recompute_in_turn1"] = recompute_in_turn1;  // true: timed while storing the prefix
  row["restore_s"] = median([](const Round& r) { return r.r2->restore.seconds; });
  row["restore_wait_s"] = median([](const Round& r) { return r.r2->restore.wait_seconds; });
  row["restore_mb_per_s"] = median([&](const Round& r) { return mb_per_s(*r.r2); });
  row["tier_read_mb_per_s"] = median([](const Round& r) { return r.tier_mb; });
  row["tier_read_bytes"] = first.tier_raw.bytes;  // one pass of the first round's raw read
  // How that raw read found the files' written data ("fiemap", "seek_data"); null: no file read.
  row["tier_read_extents_from"] =
      first.tier_raw.extents_from ? nlohmann::json(first.tier_raw.extents_from) : nlohmann::json(nullptr);
  row["restore_over_tier"] = median([&](const Round& r) { return ratio(*r.r2, r.tier_mb); });
  row["restore_s_runs"] = runs([](const Round& r) { return r.r2->restore.seconds; });
  row["restore_over_tier_runs"] = runs([&](const Round& r) { return ratio(*r.r2, r.tier_mb); });
  row["prepare_s"] = median([](const Round& r) { return r.prepare_s; });
  row["prepare_bytes"] = first.prepare_bytes;
  // Minor page faults of the whole process during each TTFT (restore + the suffix's forward pass).
  row["ttft_minor_faults"] = median([](const Round& r) { return r.faults_prepared; });
  row["cold_unprepared_ttft_minor_faults"] = median([](const Round& r) { return r.faults_unprepared; });
  row["warm_ttft_minor_faults"] = median([](const Round& r) { return r.faults_warm; });
  row["cold_unprepared_ttft_restore_s"] = median([](const Round& r) { return r.ttft_unprepared; });
  row["cold_unprepared_restored_tokens"] = ru->restored_tokens;
  row["cold_unprepared_restore_s"] = median([](const Round& r) { return r.ru->restore.seconds; });
  row["cold_unprepared_restore_wait_s"] = median([](const Round& r) { return r.ru->restore.wait_seconds; });
  row["cold_unprepared_restore_mb_per_s"] = median([&](const Round& r) { return mb_per_s(*r.ru); });
  row["cold_unprepared_tier_read_mb_per_s"] = median([](const Round& r) { return r.tier_unprepared; });
  row["cold_unprepared_restore_over_tier"] = median([&](const Round& r) { return ratio(*r.ru, r.tier_unprepared); });
  row["cold_unprepared_restore_over_tier_runs"] = runs([&](const Round& r) { return ratio(*r.ru, r.tier_unprepared); });
  row["cold_unprepared_logits_bitwise_equal"] = unprepared_equal;
  row["prepared_logits_bitwise_equal_across_rounds"] = prepared_equal;
  row["warm_ttft_restore_s"] = median([](const Round& r) { return r.ttft_warm; });
  row["warm_restored_tokens"] = rw->restored_tokens;
  row["warm_restore_s"] = median([](const Round& r) { return r.rw->restore.seconds; });
  row["warm_restore_wait_s"] = median([](const Round& r) { return r.rw->restore.wait_seconds; });
  row["warm_restore_mb_per_s"] = median([&](const Round& r) { return mb_per_s(*r.rw); });
  row["warm_tier_read_mb_per_s"] = median([](const Round& r) { return r.tier_warm; });
  row["warm_restore_over_tier"] = median([&](const Round& r) { return ratio(*r.rw, r.tier_warm); });
  row["warm_restore_s_runs"] = runs([](const Round& r) { return r.rw->restore.seconds; });
  row["warm_restore_over_tier_runs"] = runs([&](const Round& r) { return ratio(*r.rw, r.tier_warm); });
  row["alone_restore_s"] = median([](const Round& r) { return r.alone.seconds; });
  row["alone_restore_mb_per_s"] = median([&](const Round& r) { return report_mb_per_s(r.alone); });
  row["alone_tier_read_mb_per_s"] = median([](const Round& r) { return r.tier_alone; });
  row["alone_restore_over_tier"] = median(alone_ratio);
  row["alone_restore_s_runs"] = runs([](const Round& r) { return r.alone.seconds; });
  row["alone_restore_over_tier_runs"] = runs(alone_ratio);
  row["alone_read_requests"] = median([](const Round& r) { return r.alone_requests; });
  row["read_by_layer"] = r2->restore.read_by_layer;
  row["range_rereads"] = r2->restore.range_rereads;
  row["warm_fallbacks"] = warm_fallbacks;
  row["warm_logits_bitwise_equal"] = warm_equal;
  row["kv_bytes"] = r2->restore.kv_bytes;
  row["state_bytes"] = r2->restore.state_bytes;
  row["bytes_read"] = ByTier([&](std::size_t t) { return r2->restore.bytes_read[t]; });
  row["bytes_written"] = cache_written.bytes_written;
  row["kv_bytes_per_token"] = run.cache->layout().mla_bytes_per_token();
  row["state_bytes_per_sequence"] = run.cache->layout().kda_state_bytes_per_sequence();
  row["fallbacks"] = fallbacks;
  // Per restore, as bytes_read: the first round's prepared restore (every round restores the same
  // blocks), not a sum over the --repeat rounds.
  const TierTally& read = first.read;
  PutTierFigures(read, written, &row);
  *all_read += read;
  *all_written += written;
  row["logits_max_rel_err_vs_recompute"] = den > 0 ? num / den : 0.0;
  // The checks that must hold (docs/prefix-cache.md, "terrace bench kv"): every restore of the same
  // blocks gives the same logits, bitwise, whatever the codec; with f32 KV and state codecs (a
  // lossless stage changes nothing) the restored run's logits are the recompute's, bitwise.
  // Lossy codecs differ from the recompute by design. A failed check is named here and makes the
  // command exit 1 after its output.
  const bool lossless = IsF32(kv.kv_codec) && IsF32(kv.state_codec);
  row["lossless_codecs"] = lossless;
  nlohmann::json failed = nlohmann::json::array();
  if (!warm_equal) failed.push_back("warm_logits_bitwise_equal");
  if (!unprepared_equal) failed.push_back("cold_unprepared_logits_bitwise_equal");
  if (!prepared_equal) failed.push_back("prepared_logits_bitwise_equal_across_rounds");
  if (lossless && num != 0) failed.push_back("logits_max_rel_err_vs_recompute");
  row["failed_checks"] = std::move(failed);
  // Turn 1's block writes that failed (a pool's tiers full): the blocks after the first failure
  // are missing, so turn 2 restores fewer tokens than the prefix's full chunks
  // (restorable_tokens). The row is kept: it measures the restore of restored_tokens, and the
  // warning, the text's `!` and the report say so.
  const std::int64_t chunk = run.cache->layout().chunk_tokens();
  row["write_failures"] = cache_written.write_failures;
  row["restorable_tokens"] = static_cast<std::int64_t>(P) / chunk * chunk;
  if (cache_written.write_failures > 0 && r2->restored_tokens < static_cast<std::int64_t>(P) / chunk * chunk)
    fmt::print(stderr,
               "terrace bench kv: warning: prefix {} tokens: {} of turn 1's block writes failed (a pool's tiers are "
               "full), so turn 2 restored only {} of the prefix's {} tokens in full chunks: this row measures a "
               "{}-token restore, not {}; raise --store-nvme-size / --state-nvme-size (and --store-host-size / "
               "--state-host-size) so the prefix fits\n",
               P, cache_written.write_failures, r2->restored_tokens, static_cast<std::int64_t>(P) / chunk * chunk,
               r2->restored_tokens, P);
  run.cache.reset();
  run = KvRun{};
  if (!RemovePools(dir, *ctx.pools_made, false))
    return Status::IoError("--dir: cannot remove the pools of this prefix row (above)");
  *ctx.pools_made = false;
  return row;
}

}  // namespace terrace::cli::bench_kv
