// The hybrid prefix cache (docs/prefix-cache.md): MLA latent chunks and KDA state snapshots of a
// K3-style model stored in Terrace stores and restored at joint boundaries.
//
// Two pools: KV chunk blocks go to `kv_store`, KDA snapshots to `state_store` (a separate Store
// with its own capacities and files), so the much larger KV write stream can never take the space
// snapshots need. The two may be the same Store (then they share its quota).
//
// The joint-boundary rule (docs/model.md): a restore fills a SequenceState only up to a boundary b
// (a multiple of chunk_tokens) at which every KDA layer's snapshot and every MLA layer's latents for
// [0, b) exist, decode and pass their checksums. No call hands out latents past that boundary: the
// only way to read blocks is Restore, which yields a whole state at b. A missing, corrupt or
// evicted block moves b back to the previous joint boundary (or 0), never forward, and each such
// fallback is counted in PrefixCacheStats and reported in RestoreReport.
//
// Thread-safety: every method may be called concurrently from several threads (different
// requests). Write-back runs on the cache's writer thread; the stores must outlive the cache.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "terrace/block.h"
#include "terrace/kv_layout.h"
#include "terrace/log.h"
#include "terrace/model.h"
#include "terrace/status.h"
#include "terrace/store.h"

namespace terrace::kv {

// One request's prompt, its tenant and the content ids of its full chunks (keys.h, ChunkIds).
// PrefixCache::Prepare builds one; a caller may then cut it: drop trailing chunk_ids (only that
// prefix is looked up, restored and written) or lower restorable_chunks (less is restored).
// Any other edit (tokens, tenant, or chunk_ids other than cutting them) makes a request that does
// not hold together. Lookup, BeginRestore / Restore and PrefillWithCache return InvalidArgument
// for one: more chunk_ids than full chunks of `tokens`; restorable_chunks < 0 or above
// (tokens.size() - 1) / chunk_tokens; or chunk_ids that are not the chain of `tokens` under
// `tenant` in that cache's namespace (keys::ChunkIds; e.g. tokens or tenant changed after Prepare,
// or a request prepared by another cache), which would otherwise restore or overwrite another
// prompt's or tenant's blocks. That check re-hashes the ids it uses (XXH3-128 over
// tokens.size() * 4 bytes for a whole request: about as long as Prepare took; PrefillWithCache
// once). WriteBack and StoreLayer refuse chunk_ids [0, chunks) that are not that chain: the first
// write from a state in full, then, as a pass writes its chunks in order, only each new chunk's
// link (a request changed after its chunks were written is caught in the chunks still to come).
struct PrefixRequest {
  std::vector<std::int32_t> tokens;
  std::string tenant;
  std::vector<ContentId> chunk_ids;  // one per full chunk of `tokens` (or fewer: a cut request)
  // Chunks a restore may cover: at most the full chunks strictly before the last token, so the
  // last prompt token is always computed (its logits start generation): Prepare sets
  // (tokens.size() - 1) / chunk_tokens. A restore covers min(restorable_chunks, chunk_ids.size()).
  std::int64_t restorable_chunks = 0;
};

struct PrefixLookup {
  std::int64_t boundary_tokens = 0;  // the largest joint boundary whose blocks all exist (not read)
  std::int64_t kv_chunks_present = 0;  // leading restorable chunks whose KV block exists
  std::int64_t restorable_chunks = 0;  // what a restore covers: min(restorable_chunks, chunk_ids.size())
};

struct RestoreReport {
  std::int64_t boundary_tokens = 0;        // the joint boundary the state was restored to
  std::int64_t lookup_boundary_tokens = 0; // what the lookup promised before reading
  // A boundary above lookup_boundary_tokens whose KDA snapshots exist for some layers but not all
  // (partly written or partly evicted): the lookup passed over it, one fallback (its reason names
  // the missing layer). 0 if there was none.
  std::int64_t partial_boundary_tokens = 0;
  int fallbacks = 0;                       // times the boundary moved back while reading
  std::vector<std::string> fallback_reasons;  // one line per fallback (block, what was wrong)
  std::array<std::uint64_t, kNumTiers> bytes_read{};  // by the tier each block was read from
  // Bytes of the blocks restored: the KV chunk blocks of [0, boundary_tokens) (a chunk read as
  // sub-ranges counts as its whole block) and the snapshots at boundary_tokens. What was read of a
  // boundary given up (its snapshots, chunks past the final boundary, a failed chunk's ranges, a
  // failed fallback candidate's snapshots) counts only in bytes_read.
  std::uint64_t kv_bytes = 0, state_bytes = 0;
  // Lookup + reads + checks + decode (+ import for a whole restore), in seconds: from the start of
  // the restore to the moment its last block was decoded, whether or not a forward pass ran
  // meanwhile. restore bandwidth = (kv_bytes + state_bytes) / seconds.
  double seconds = 0;
  // Layerwise restores: seconds the forward pass waited in RetrieveLayer for blocks still in
  // flight (0 = the reads hid completely behind the compute of the earlier layers). Whole
  // restores: 0 (the forward pass waits for all of `seconds`).
  double wait_seconds = 0;
  bool layerwise = false;        // restored layer by layer under a forward pass
  // KV chunks were read as per-layer sub-ranges (RestoreReadOrder::kLayers); false when the
  // restore read no KV chunk (nothing to restore, or a model without MLA layers).
  bool read_by_layer = false;
  // Blocks the restore asked the pools for, each once however it was read (whole, or as per-layer
  // sub-ranges; the whole re-read of a sub-range that failed is not another), and of those the ones
  // a tier served, by that tier: a whole block by the tier the lookup found it in, a block read as
  // sub-ranges by the tier its first sub-range (the one with its header) came from, or, when that
  // read failed and the whole re-read served the block, by the lookup's tier.
  std::uint64_t blocks_requested = 0;
  std::array<std::uint64_t, kNumTiers> blocks_read{};
  // Per-layer sub-ranges a tier served (Store::GetRanges items; about blocks x MLA layers when
  // read_by_layer, else none), by that tier. Each is a Get in the pools' StoreStats hits.
  std::array<std::uint64_t, kNumTiers> range_reads{};
  int range_rereads = 0;         // sub-ranges that failed their check or read: whole block re-read
  bool layerwise_voided = false; // a layer failed after others were handed out: the pass was
                                 // discarded and the state restored whole at the earlier boundary
};

struct PrefixCacheStats {
  std::uint64_t lookups = 0;
  std::uint64_t restores = 0;          // Restore calls that restored b > 0
  std::uint64_t restored_tokens = 0;
  std::uint64_t fallbacks = 0;         // all fallbacks, = missing + corrupt
  std::uint64_t fallbacks_missing = 0; // a block looked up as present was gone (evicted) at read
  std::uint64_t fallbacks_corrupt = 0; // a block failed its checksum, header check or decode
  // Blocks written: Puts that completed OK of a key the pool did not hold when the writer checked
  // (Store::Contains). A block the pool already held is not written and counts in *_already_stored
  // instead. (A Put of the same key by another request or cache between the check and this Put
  // can still make one of these a store no-op or a replacement.)
  std::uint64_t chunk_writes = 0, state_writes = 0;
  std::uint64_t chunk_already_stored = 0, state_already_stored = 0;  // not written: the pool held the key
  std::uint64_t write_failures = 0;    // write-back Puts or encodes that failed (the first is logged)
  std::uint64_t bytes_written = 0;
  std::array<std::uint64_t, kNumTiers> bytes_read{};
  std::uint64_t layerwise_restores = 0;  // restores (b > 0) that ran under a forward pass
  std::uint64_t layerwise_voided = 0;    // of those, passes discarded because a layer failed
  double restore_wait_seconds = 0;       // sum of RestoreReport::wait_seconds
  std::uint64_t range_rereads = 0;       // sum of RestoreReport::range_rereads
  // Now, not a count since Create: KV chunks of which StoreLayer holds some MLA layers' rows for a
  // pass, waiting for the chunk's other MLA layers (one per chunk and pass). 0 once every pass that
  // used StoreLayer ended (PrefixCache::EndStoreLayers; PrefillWithCache ends its own).
  std::uint64_t chunks_pending = 0;
};

class PrefixCache;

// How a layerwise restore (PrefixCache::BeginRestore) reads the KV chunk blocks.
// kChunks: whole blocks in chunk order; every MLA layer is ready once the last block is in. Fewer,
//   larger reads (adjacent blocks merged into one request).
// kLayers: each MLA layer's sub-ranges of every chunk (Store::GetRanges), the layers in model
//   order, the first read of each chunk also bringing its header: MLA layer l is ready as soon as
//   its own sub-ranges are in, so the forward pass computes it while the next MLA layer's are in
//   flight. Each sub-range is checked against its header's XXH3-64; one that fails (or whose read
//   fails) is read again as a whole block through Store::Get, which verifies it. Used only where
//   the sub-ranges sit at offsets the layout fixes (two or more MLA layers, a kv codec without a
//   lossless stage) and the restore does not promote (SetRestorePromotion; a promotion moves whole
//   blocks); otherwise kChunks. RestoreReport::read_by_layer says which order a restore used.
// PrefixCache::Restore (nothing runs beside it) always reads whole blocks.
enum class RestoreReadOrder : std::uint8_t { kChunks = 0, kLayers = 1 };

// A restore whose reads run in the background (all KV chunks and the boundary's snapshots at
// once, decoded as they arrive) while the caller computes: RetrieveLayer(l) from the forward
// pass's on_layer_begin hook hands out layer l as soon as its blocks are in, while later layers'
// blocks are still in flight. One restore, one boundary: boundary_tokens() is fixed at
// PrefixCache::BeginRestore (the lookup's boundary).
//
// No half restore: the layers handed out are only valid together. If a layer's blocks turn out
// missing, corrupt or undecodable, RetrieveLayer returns Cancelled and the restore is void: every
// layer already handed out must be discarded with whatever was computed from them (Reset the
// state; every later RetrieveLayer fails too). Finish() then restores the state whole at the
// previous joint boundary (reusing the blocks already read) and reports the fallback. A state is
// only a restore once Finish() returned OK.
//
// Thread-safety: one thread calls the methods (the forward pass's); the reads run on the
// restore's own threads. The cache, the state and the request must outlive the object.
class LayerwiseRestore {
 public:
  ~LayerwiseRestore();  // stops issuing reads and waits for those in flight
  LayerwiseRestore(const LayerwiseRestore&) = delete;
  LayerwiseRestore& operator=(const LayerwiseRestore&) = delete;

  // The joint boundary (tokens) this restore fills if every block reads back good; 0 = nothing to
  // restore (RetrieveLayer is then a no-op and Finish resets the state).
  std::int64_t boundary_tokens() const;
  // Waits for layer `layer`'s blocks (the time counts in wait_seconds) and replaces that layer of
  // the state with [0, boundary_tokens()). Cancelled (the restore is void, see above) when a block
  // of this boundary, of any layer, failed; InvalidArgument for a bad layer index or a layer
  // already retrieved (once per layer; the restore is left as it was).
  Status RetrieveLayer(int layer);
  // Waits for every read. When every layer's blocks were good: imports the layers not retrieved
  // yet and checks the joint boundary (the layers retrieved may already have advanced by the same
  // tokens under a forward pass). Otherwise: resets the state, falls back to the largest earlier
  // boundary whose blocks read back good, imports every layer there. Call once.
  Result<RestoreReport> Finish();
  // True once a layer failed (the restore is void; Finish falls back).
  bool voided() const;

  struct Job;

 private:
  friend class PrefixCache;
  explicit LayerwiseRestore(std::unique_ptr<Job> job);
  std::unique_ptr<Job> job_;
};

// Threads a restore reads KV chunk windows on, each holding one GetBatch on the KV pool at a time.
// An NVMe tier holds one io_uring ring per call until its I/O completes, so the KV pool's
// NvmeTierOptions::io_threads should be at least this for the windows' reads to overlap (with
// fewer rings they run one after the other and the tier's queue drains between windows).
inline constexpr int kRestoreKvReaders = 2;

// What PrefixCache::Reserve prepared (bytes of restore buffers, 4 KiB pages faulted in).
struct RestoreReservation {
  std::uint64_t bytes_held = 0;      // the reserved sets' buffers in all (what they keep now)
  std::uint64_t bytes_prepared = 0;  // of those, allocated and faulted in by this call (0: already there)
  int sets = 0;                      // buffer sets held ready for restores
};

class PrefixCache {
 public:
  // `model_id`: keys::ModelId of the model the blocks belong to; `layout`: KvLayout::FromConfig of
  // that model's config. Precondition of every restore: the state or session restored into is of
  // that same model. The cache cannot check it (a state holds shapes, not weights): a session of
  // another model with the same shapes gets the first model's latents and snapshots, and computes
  // wrong logits without an error. Create one cache per model (ModelId differs for other weights). InvalidArgument for a null store or a layout with no layers (a
  // default-constructed KvLayout); Unavailable when the cache's writer thread cannot be started (thread or memory limit).
  static Result<std::unique_ptr<PrefixCache>> Create(const KvLayout& layout, const ContentId& model_id,
                                                     Store* kv_store, Store* state_store,
                                                     std::shared_ptr<Logger> logger = nullptr);
  ~PrefixCache();  // waits for the pending write-back
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  const KvLayout& layout() const;
  std::uint32_t kv_namespace() const;
  std::uint32_t state_namespace() const;

  PrefixRequest Prepare(std::span<const std::int32_t> tokens, std::string_view tenant) const;
  // Without moving data: one batched Store::Lookup per pool (two in all, not one per chunk).
  // InvalidArgument for a request that does not hold together (PrefixRequest).
  Result<PrefixLookup> Lookup(const PrefixRequest& request) const;
  Result<PrefixLookup> Lookup(std::span<const std::int32_t> tokens, std::string_view tenant) const {
    return Lookup(Prepare(tokens, tenant));
  }
  // Fills `state` (shaped for the model by SequenceState::ForConfig; its contents are replaced) to
  // the largest joint boundary whose blocks read back good, reading the KV chunks with one GetBatch
  // and each candidate boundary's snapshots with one GetBatch. Boundary 0 (a Reset state) when
  // nothing is usable. Errors only for a state of the wrong shape or a request that does not hold
  // together (InvalidArgument) and as BeginRestore's below (Unavailable).
  Result<RestoreReport> Restore(const PrefixRequest& request, model::SequenceState* state);
  // Starts a layerwise restore of `request` into `state` (see LayerwiseRestore): looks up, then
  // issues every read of the boundary at once and returns. Restore() is BeginRestore + Finish.
  // InvalidArgument for a state of the wrong shape or a request that does not hold together
  // (PrefixRequest; the state untouched either way); Unavailable when the
  // restore's threads cannot be started (thread or memory limit: the state is then Reset).
  Result<std::unique_ptr<LayerwiseRestore>> BeginRestore(const PrefixRequest& request, model::SequenceState* state);

  // Prepares the cache's restore memory ahead of the first request, as a serving engine reserves
  // its KV memory at start-up: `restores` buffer sets (1 to RestoreBufferPool's 2 pooled sets;
  // one per restore that may run at once) sized for a restore of a prompt of up to
  // `prompt_tokens` tokens at this layout's block upper bounds (its KV window buffers, the
  // boundary's snapshot blocks and their decoded KDA state), allocated and faulted in
  // (MADV_POPULATE_WRITE, or a write per page where the kernel lacks it), then kept in the
  // cache's pool for the restores to take. The latent caches a restore decodes into belong to the
  // state: prepare those with model::SequenceState::Reserve (for the whole prompt, restored +
  // computed tokens). Ownership: the cache owns the sets until it is destroyed; a restore borrows
  // one and gives it back. Idempotent: a set already large enough is kept as it is (nothing
  // allocated or touched); a smaller one is replaced. A restore larger than reserved still works:
  // it grows the buffers it needs and pays their first-touch faults. Thread-safe, also with
  // restores running (a restore that finds the pool empty meanwhile uses fresh memory).
  // InvalidArgument for prompt_tokens < 0 or restores outside [1, 2]; OutOfCapacity when the
  // memory cannot be had (what was prepared before stays).
  Result<RestoreReservation> Reserve(std::int64_t prompt_tokens, int restores = 1);

  // Write-back of the state right after chunk `chunks - 1` of `request` was computed
  // (state.num_tokens() == chunks * chunk_tokens): that chunk's MLA latents, and every KDA layer's
  // snapshot when `snapshot`. Copies what it needs and returns at once; encoding and the Puts run on
  // the writer thread. A failure is counted (write_failures; the cache logs its first), and leaves no block behind
  // that a lookup could hit. InvalidArgument, before anything is read, when the state is not
  // shaped for this cache's model (layers, which are MLA, latent width, KDA sizes: as BeginRestore
  // checks) or does not match `chunks`, or when chunk_ids [0, chunks) are not the chain of the
  // request's tokens under its tenant (PrefixRequest). The cache cannot check that the state was
  // computed from request.tokens: that is the caller's contract.
  Status WriteBack(const PrefixRequest& request, std::int64_t chunks, const model::SequenceState& state,
                   bool snapshot);
  // Per-layer write-out during prefill: layer `layer` of the state right after it computed chunk
  // `chunks - 1` (state.layer(layer).tokens == chunks * chunk_tokens; other layers may be behind).
  // A KDA layer's snapshot is queued at once (when `snapshot`); an MLA layer's rows of the chunk are
  // kept until every MLA layer of that chunk was stored, then the whole KV chunk block is queued
  // (a chunk block is never written with a layer missing). A pass is identified by its `state`:
  // each pass assembles its own rows of a chunk, so passes computing the same chunk at once (a
  // shared prefix) never mix or discard each other's rows; the first complete block is written,
  // the others find it stored (chunk_already_stored). Copies what it needs and returns at once:
  // encoding runs on the writer thread, the Puts on the store's async path (PutAsync), so a
  // forward pass calling it from on_layer_end never waits for a write. Failures and refusals as
  // WriteBack's.
  // A pass that stops between MLA layers of a chunk must call EndStoreLayers.
  Status StoreLayer(const PrefixRequest& request, std::int64_t chunks, int layer, const model::SequenceState& state,
                    bool snapshot);
  // Ends the StoreLayer pass of `state` (it ended, failed or was abandoned): drops the MLA rows
  // StoreLayer holds for chunks of that pass not all of whose MLA layers were stored (those chunks
  // are not written by it). Call it before the state starts another pass; PrefillWithCache does,
  // whatever way it returns. Thread-safe; a no-op for a state with nothing held.
  void EndStoreLayers(const model::SequenceState& state);
  // Whether a restore's reads copy blocks found below a store's put tier up to it (a promotion:
  // the next restore of the prefix reads them from there) or read them straight into the restore's
  // buffers (Store's GetOptions::promote). Unset, the default: each store's
  // StoreOptions::promote_on_get. Applies to restores begun after the call; thread-safe.
  void SetRestorePromotion(std::optional<bool> promote);
  // BeginRestore's read order (default kLayers). Applies to restores begun after the call; thread-safe.
  void SetRestoreReadOrder(RestoreReadOrder order);
  // Waits until every WriteBack / StoreLayer so far has been written or has failed.
  void Flush();

  PrefixCacheStats Stats() const;

  struct Impl;

 private:
  friend struct PrefixCacheAccess;  // src/kv internals: PrefillWithCache checks a request once
  explicit PrefixCache(std::unique_ptr<Impl> impl);
  Result<std::unique_ptr<LayerwiseRestore>> BeginRestore(const PrefixRequest& request, model::SequenceState* state,
                                                         RestoreReadOrder order);
  std::unique_ptr<Impl> impl_;
};

// The result of a prefill through the cache.
struct CachedPrefill {
  model::Tensor logits;            // [computed_tokens, vocab]: positions [restored_tokens, n)
  std::int64_t restored_tokens = 0;
  std::int64_t computed_tokens = 0;
  RestoreReport restore;
  double compute_seconds = 0;      // the forward passes over [restored_tokens, n)
};

// Restores the longest joint boundary b of `prompt` into session->state() (which must hold no
// tokens; b < n, see PrefixRequest), computes [b, n) and writes the new chunks and the due snapshots back asynchronously.
// It writes only chunks that have an id in request.chunk_ids, and the last of those is the last
// chunk of KvLayout::SnapshotDue: with `restore` off, a request whose chunk_ids are cut to its
// first k ids computes the whole prompt but stores only the k-chunk prefix, as a request for that
// prefix alone would.
// The prompt is always computed in pieces that end at chunk boundaries ([b, b+C), [b+C, b+2C), ...,
// [last boundary, n)), the same pieces whatever was restored, so a restored run's logits are
// bitwise those of a cold run through this function with the same chunk size.
// Layerwise (default): the restore's reads run under the forward pass of the first piece, layer l
// taken from a LayerwiseRestore in the on_layer_begin hook; the write-out goes layer by layer
// from on_layer_end (StoreLayer). Hooks already set on the session run too (the session's own
// on_layer_begin / on_layer_end first, then the cache's), and are put back on return. When a layer of the restore
// turns out bad, the pass is discarded, the state restored whole at the earlier boundary and the
// prompt computed from there: the logits are the same either way.
struct PrefillOptions {
  bool restore = true;     // false: compute from token 0 (a cold run with the same segmentation)
  bool write_back = true;  // false: write nothing
  bool layerwise = true;   // false: Restore() whole before computing, WriteBack() after each piece
};
Result<CachedPrefill> PrefillWithCache(model::Session* session, PrefixCache& cache, const PrefixRequest& request,
                                       const PrefillOptions& options = {});

}  // namespace terrace::kv
