// Internal: PrefixCache's state, shared by its source files (prefix_cache.cpp: lookup, write-out;
// restore_job.h and its layerwise_restore.cpp, restore_reads.cpp, restore_decode.cpp: restores;
// cached_prefill.cpp: PrefillWithCache).
//
// Thread-safety: `stats` under stats_mu; the write queue, `puts_in_flight` and `pending_chunks`
// under q_mu. Lock order: q_mu before stats_mu (never the reverse). `restore_buffers` locks
// itself. The rest is immutable after Create.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "src/common/clock.h"
#include "src/common/mutex.h"
#include "src/common/start_thread.h"
#include "src/kv/restore_buffers.h"
#include "terrace/prefix_cache.h"

namespace terrace::kv {

struct PrefixCache::Impl {
  KvLayout layout;
  ContentId model_id;
  Store* kv = nullptr;
  Store* st = nullptr;
  std::shared_ptr<Logger> logger;
  std::uint32_t ns_kv = 0, ns_state = 0;
  ContentId kv_root;  // the KV namespace's root: every chunk id chains from it
  // The stores' read_gap_bytes: the room a restore leaves past each raw block in its buffers
  // (restore_job.h, Slot), so adjacent blocks are read as one request.
  std::uint64_t kv_gap = 0, st_gap = 0;
  // SetRestorePromotion's choice (unset: each store's promote_on_get), read when a restore begins.
  std::atomic<std::optional<bool>> restore_promote{};
  // SetRestoreReadOrder's choice, read when a layerwise restore begins.
  std::atomic<RestoreReadOrder> restore_order{RestoreReadOrder::kLayers};

  mutable Mutex stats_mu;
  mutable PrefixCacheStats stats TERRACE_GUARDED_BY(stats_mu);

  // Restores' raw-block and snapshot buffers, reused from one restore to the next (thread-safe).
  RestoreBufferPool restore_buffers;

  // Write-out: jobs (encode + PutAsync) run on `writer`; the Puts complete on the store's pool.
  Mutex q_mu;
  CondVar q_cv, idle_cv;
  std::deque<std::function<void()>> queue TERRACE_GUARDED_BY(q_mu);
  int active TERRACE_GUARDED_BY(q_mu) = 0;
  int puts_in_flight TERRACE_GUARDED_BY(q_mu) = 0;
  bool stop TERRACE_GUARDED_BY(q_mu) = false;
  std::thread writer;
  // StoreLayer's MLA rows of chunks whose block is not complete yet: (chunk id, the pass's state)
  // -> its rows per MLA layer (empty until that layer was stored). Each pass assembles its own
  // block: two passes computing the same chunk at once (a shared prefix) never discard each
  // other's rows (their rows can also differ in the last bits, when they restored from different
  // boundaries with a lossy codec). EndStoreLayers drops a pass's entries when it ends.
  struct PendingKey {
    std::uint64_t hi = 0, lo = 0;
    const model::SequenceState* pass = nullptr;
    auto operator<=>(const PendingKey&) const = default;
  };
  std::map<PendingKey, std::vector<std::vector<float>>> pending_chunks TERRACE_GUARDED_BY(q_mu);

  // What a lookup found, kept for the reads.
  struct Found {
    std::int64_t kv_present = 0;
    std::vector<LookupResult> kv;     // per restorable chunk (only if MLA layers)
    std::vector<LookupResult> state;  // [boundary k-1][kda layer] flattened (k = 1..kv_present)
    std::vector<std::int64_t> candidates;  // boundaries (chunks) with every block present, descending
    // The largest boundary above candidates.front() where some KDA layers' snapshots exist and
    // others do not (a snapshot partly evicted or partly written); 0 if none.
    std::int64_t partial = 0;
    int partial_missing_layer = -1;
  };

  void WriterLoop();
  void Enqueue(std::function<void()> job);
  // Encodes (unless the store already holds `key`) and hands the bytes to store->PutAsync; the
  // completion is counted in stats. Runs on the writer thread.
  void WriteBlock(Store* store, const BlockKey& key, const std::function<Status(std::vector<std::byte>*)>& encode,
                  bool is_state);
  void EnqueueChunk(const ContentId& id, std::shared_ptr<std::vector<std::vector<float>>> rows);
  void EnqueueSnapshot(const ContentId& id, int layer, std::int64_t boundary, std::vector<float> recurrent,
                       std::vector<float> conv);
  // The lookup of the first `chunks` chunks of `r` (RestorableChunks: chunks <= r.chunk_ids.size()).
  Found LookupFound(const PrefixRequest& r, std::int64_t chunks) const;

  // Ok when r.chunk_ids[0, count) are the chain of r.tokens under r.tenant from kv_root
  // (keys::ChunkIds), recomputed here: count chained XXH3-128s over count * chunk_tokens tokens.
  // InvalidArgument, starting with `where` and naming the first id that differs, otherwise (or
  // when r holds fewer than `count` ids or full chunks). `from` > 0 takes ids [0, from) as given
  // and checks only the links from chunk `from` on (chained from r.chunk_ids[from - 1]).
  Status CheckChunkIds(const PrefixRequest& r, std::size_t count, std::string_view where, std::size_t from = 0) const;
  // Every check of a request before a lookup, restore or prefill reads or computes anything:
  // RestorableChunks (its result is returned) and CheckChunkIds of all of r.chunk_ids.
  Result<std::int64_t> CheckRequest(const PrefixRequest& r, std::string_view where) const;
  // Before WriteBack or StoreLayer writes chunk `chunks` of the pass that computed `pass`: as
  // CheckChunkIds(r, chunks), but a pass writes its chunks in order, so while the pass's earlier
  // ids are the ones already checked only the new chunk's link is hashed (O(chunk_tokens) a write,
  // not O(prompt)); a request changed after its chunks were checked is caught only in the chunks
  // still to come. Thread-safe.
  Status CheckWrite(const PrefixRequest& r, std::size_t chunks, const model::SequenceState* pass, std::string_view where);
  // The ids CheckWrite has checked, per pass; dropped by EndStoreLayers, all dropped past
  // kMaxCheckedPasses passes. verified_mu is taken alone (never with another lock held).
  static constexpr std::size_t kMaxCheckedPasses = 256;
  struct Checked {
    std::string tenant;          // the chain's tenant
    std::vector<ContentId> ids;  // chunk_ids [0, ids.size()) checked under it
  };
  Mutex verified_mu;
  std::unordered_map<const model::SequenceState*, Checked> verified TERRACE_GUARDED_BY(verified_mu);
  // WriteBack and StoreLayer after the request was checked (PrefillWithCache checks it once).
  Status WriteBackChecked(const PrefixRequest& request, std::int64_t chunks, const model::SequenceState& state,
                          bool snapshot);
  Status StoreLayerChecked(const PrefixRequest& request, std::int64_t chunks, int layer,
                           const model::SequenceState& state, bool snapshot);
};

// PrefillWithCache's way past the public entry points' per-call request checks, for a request
// it checked once (Impl::CheckRequest) and holds unchanged (a const reference, for the call).
struct PrefixCacheAccess {
  static PrefixCache::Impl& impl(PrefixCache& c) { return *c.impl_; }
  // BeginRestore in the cache's read order, without the request check.
  static Result<std::unique_ptr<LayerwiseRestore>> BeginRestoreChecked(PrefixCache& c, const PrefixRequest& request,
                                                                       model::SequenceState* state) {
    return c.BeginRestore(request, state, c.impl_->restore_order.load(std::memory_order_relaxed));
  }
  // Restore (whole blocks), without the request check.
  static Result<RestoreReport> RestoreChecked(PrefixCache& c, const PrefixRequest& request,
                                              model::SequenceState* state);
};

// The chunks a restore of `r` covers, its restorable_chunks cut to the ids it carries (the
// PrefixRequest contract). InvalidArgument, starting with `where`, for a request that does not
// hold together: restorable_chunks < 0 or past (tokens.size() - 1) / chunk_tokens, or more
// chunk_ids than full chunks of tokens.
Result<std::int64_t> RestorableChunks(const PrefixRequest& r, int chunk_tokens, std::string_view where);

// Ok when `state` is shaped for `layout`'s model: its layer count, which layers are MLA, the MLA
// latent width, and every KDA layer's recurrent and conv sizes; InvalidArgument, starting with
// `where` and naming the first difference, otherwise. Every call that reads or writes a state's
// rows at the layout's offsets checks it first (a state of another model would be read or
// written out of bounds).
Status CheckStateShape(const KvLayout& layout, const model::SequenceState& state, std::string_view where);

}  // namespace terrace::kv
