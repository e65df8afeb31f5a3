// LayerwiseRestore::Job, the engine behind PrefixCache::BeginRestore / Restore and
// LayerwiseRestore (docs/prefix-cache.md, "Restore"). One engine for both: a restore job issues
// every read of its boundary at once: the KV chunks in windows of about an eighth of the restore
// (the last two a quarter and a half of that, CutWindows), each window one GetBatch, on
// kRestoreKvReaders reader threads (so one window's GetBatch is in flight while the other's
// finishes and the tier's queue does not drain between windows: the KV pool needs a ring per
// reader), and the boundary's KDA snapshots (one GetBatch on the state pool) on a snapshot thread
// that also decodes them. The decoder thread checks and decodes the KV windows in order while the
// next ones are in flight. A layer becomes ready when all of its blocks are decoded. Read by layer
// (RestoreReadOrder::kLayers), the windows are cut per MLA layer (a phase) over that layer's
// sub-ranges of every chunk and read with Store::GetRanges; a layer is ready when its phase is.
//
// Where the time goes (docs/benchmarks.md, "Layerwise restore"): the reads are issued before any
// large buffer is touched. Raw blocks land in a few window buffers that the readers and decoder
// recycle (no per-block allocation, no zero-filling), taken from the cache's pool of restore
// buffers, so a process's later restores read into memory it already faulted in. Each MLA
// layer's latents are decoded straight into the vector that becomes the state's latent cache:
// the state's own vector when it already has room for the prompt (a state reused after Reset),
// else one reserved for the whole prompt up front (address space only); grown chunk by chunk by
// the decoder and moved into the state when the layer is retrieved, not copied. Fresh pages (the
// later window buffers, then the latents from the last window back) are faulted in by a faulter
// thread while the reads are in flight; an embedder that prepared the memory before the first
// request (PrefixCache::Reserve, SequenceState::Reserve) has none to fault. Every block is a
// multiple of 4 KiB (block format 2) and lands at a 4 KiB-aligned offset, so the NVMe tier reads
// it without a staging copy.
//
// Its parts: restore_reads.cpp (planning the windows; the reader, snapshot and faulter threads),
// restore_decode.cpp (the decoder thread: checks and decodes what was read, re-reads a failed
// range whole), layerwise_restore.cpp (the job's life, the LayerwiseRestore API, the fallback
// to an earlier boundary, PrefixCache::Reserve). Private to src/kv.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "src/common/mutex.h"
#include "src/kv/block_format.h"
#include "src/kv/prefix_cache_impl.h"

namespace terrace::kv {

// Threads issuing KV window reads.
constexpr std::size_t kReaders = static_cast<std::size_t>(kRestoreKvReaders);
// Bytes of KV chunk blocks one GetBatch reads: about an eighth of the restore, so decoding starts
// early and the last window's decode (the part no read overlaps) is short, within
// [kMinWindowBytes, kMaxWindowBytes]; with kReaders windows in flight the tier still sees a queue
// of 2 x 8 blocks at 16k tokens of k3-small.
constexpr std::uint64_t kMinWindowBytes = 256ull << 10, kMaxWindowBytes = 2ull << 20;
constexpr std::uint64_t kWindowsPerRestore = 8;

// A raw block's slot in a read buffer: its size aligned, then the store's read gap
// (Store::read_gap_bytes), so blocks adjacent on disk land one slot apart and the tier reads a
// window of them in a few large requests instead of one per block.
inline std::uint64_t Slot(std::uint64_t n, std::uint64_t gap) { return RoundUp(n, kRawAlign) + gap; }

// The bytes of KV chunk blocks a window is cut at, for a restore of `total` bytes of blocks.
inline std::uint64_t WindowTarget(std::uint64_t total) {
  return std::clamp(total / kWindowsPerRestore, kMinWindowBytes, kMaxWindowBytes);
}

// Windows over chunks whose reads take `slots` bytes of buffer each (in chunk order), cut from
// the back at `target` (WindowTarget of the whole restore): the last window holds about a quarter
// of it, the one before it half, the others the target, and the first what is left. So the decode
// after the last read (the part no read overlaps) is a quarter window, and the first decode starts
// early. No window holds more than the target plus one slot (PrefixCache::Reserve sizes by that).
std::vector<std::pair<std::int64_t, std::int64_t>> CutWindows(std::span<const std::uint64_t> slots,
                                                               std::uint64_t target);

// Faults in [p, p + bytes) (whole pages of it) for writing: MADV_POPULATE_WRITE, or one write per
// page where the kernel lacks it (the bytes are uninitialised room: what is written is of no use).
void PopulateWrite(std::byte* p, std::size_t bytes);

// Thread-safety: fields TERRACE_GUARDED_BY(mu) are under mu; the buffers of a window are written by the
// reader that claimed it before it marks it read and by the decoder after, the snapshots' by the
// decoder; the caller's thread reads them only once the layer is marked ready (mu orders each
// hand-over).
struct LayerwiseRestore::Job {
  PrefixCache::Impl* m = nullptr;
  GetOptions reads;  // every GetBatch of this restore (promotion: PrefixCache::SetRestorePromotion)
  std::vector<ContentId> chunk_ids;
  model::SequenceState* state = nullptr;
  PrefixCache::Impl::Found f;
  std::int64_t kmax = 0, C = 0, W = 0;
  std::int64_t prompt_tokens = 0;  // the request's tokens: the latent vectors are reserved for all of them
  std::chrono::steady_clock::time_point t0;

  Mutex mu;
  CondVar cv;
  std::vector<char> ready TERRACE_GUARDED_BY(mu);           // per model layer: its blocks at kmax are decoded (or failed)
  std::vector<Status> layer_status TERRACE_GUARDED_BY(mu);  // per model layer
  std::vector<char> window_read TERRACE_GUARDED_BY(mu);     // per KV window: its read returned (or it was skipped)
  std::size_t next_window TERRACE_GUARDED_BY(mu) = 0;       // the next KV window a reader claims
  std::size_t readers_left TERRACE_GUARDED_BY(mu) = 0;      // reader threads still running
  std::vector<std::size_t> free_buffers TERRACE_GUARDED_BY(mu);  // indices into window_buffers not holding a window
  bool reads_done TERRACE_GUARDED_BY(mu) = false;           // every reader thread is done
  bool snapshots_done TERRACE_GUARDED_BY(mu) = true;        // the snapshot thread is done (or there is none)
  bool stop TERRACE_GUARDED_BY(mu) = false;                 // stop issuing reads (a block failed, or shutdown)
  std::chrono::steady_clock::time_point decoded_at TERRACE_GUARDED_BY(mu);  // when the last block was decoded

  // KV chunks [0, kmax): raw blocks (in window buffers), and per MLA layer the decoded latents
  // [kmax * C, W], grown by the decoder chunk by chunk within a capacity reserved up front.
  // The buffers below marked (pool) come from m->restore_buffers at Start and go back in ~Job.
  std::unique_ptr<RestoreBuffers> pooled;                    // the set they were taken from
  std::array<RawBuffer, kWindowBuffers> window_buffers;      // (pool)
  std::vector<std::size_t> window_buffer TERRACE_GUARDED_BY(mu);  // per window: the buffer its blocks were read into
  // A KV window: chunks [b, e) as whole blocks (phase -1, RestoreReadOrder::kChunks) or as MLA
  // layer `phase`'s sub-ranges (index j of layout.mla_layers(); phase 0's also hold the header).
  struct Window {
    int phase = -1;
    std::int64_t b = 0, e = 0;
  };
  bool by_layer = false;  // kLayers: windows phase 0, 1, ... in turn (fixed before Start)
  std::vector<Store::GetItem> kv_items;  // whole blocks, per chunk (kChunks)
  std::vector<Status> kv_status;
  std::vector<Store::GetRangeItem> range_items;  // sub-ranges, [phase * kmax + chunk] (kLayers)
  std::vector<Status> range_status;
  // A chunk's parsed header (kLayers): its layers' sub-ranges and the size of the block it was
  // read from (every later phase's read must find the same size).
  struct ChunkHeader {
    std::vector<format::LayerRange> ranges;
    std::uint64_t block_size = 0;  // 0: not read yet
  };
  std::vector<ChunkHeader> headers;  // decoder only: per chunk
  RawBuffer reread;                                           // decoder only: a whole block read again (kLayers)
  std::vector<Window> windows;
  std::uint64_t max_window_bytes = 0;                          // the largest window, in slots
  std::vector<std::vector<float>> latents;
  std::vector<char> latents_moved;  // caller thread only: latents[j] now is the state's cache
  std::int64_t good_chunks TERRACE_GUARDED_BY(mu) = 0;  // leading chunks decoded cleanly in every MLA layer (all kmax without MLA layers)
  std::int64_t limit TERRACE_GUARDED_BY(mu) = 0;        // chunks still of use: the first chunk that failed (kmax: none)
  Status chunk_error TERRACE_GUARDED_BY(mu);            // why chunk `limit` failed (OK: none failed)
  std::string chunk_what TERRACE_GUARDED_BY(mu);        // which block that was
  int range_rereads TERRACE_GUARDED_BY(mu) = 0;
  // Snapshots at kmax: per KDA layer (index j of layout.kda_layers()).
  RawBuffer snap_buffer;  // (pool)
  std::vector<Store::GetItem> snap_items;
  std::vector<Status> snap_status;
  std::vector<std::vector<float>> recurrent, conv;  // (pool)

  // Every byte read, by tier (RestoreReport::bytes_read). RestoreReport::kv_bytes / state_bytes
  // (the blocks restored) are not counted as the reads return: Finish takes them from the blocks
  // within the boundary it settles on.
  std::array<std::uint64_t, kNumTiers> bytes_read TERRACE_GUARDED_BY(mu){};
  // RestoreReport's blocks_requested, blocks_read and range_reads, counted as the reads return.
  std::uint64_t blocks_requested TERRACE_GUARDED_BY(mu) = 0;
  std::array<std::uint64_t, kNumTiers> blocks_read TERRACE_GUARDED_BY(mu){};
  std::array<std::uint64_t, kNumTiers> range_reads TERRACE_GUARDED_BY(mu){};
  bool ranges_issued TERRACE_GUARDED_BY(mu) = false;  // a window of sub-ranges was read (RestoreReport::read_by_layer)

  std::vector<char> retrieved;  // caller thread only
  bool voided = false;          // caller thread only
  bool finished = false;
  double wait_seconds = 0;
  std::array<std::thread, kReaders> readers;
  std::thread decoder;
  std::thread snapshotter;
  // The first-touch page faults of memory this restore allocated (a fresh process's restore: 28 MB
  // of fresh f32 latents at 16k tokens of k3-small, and its window buffers) are taken by a faulter
  // thread while the reads are in flight (the latents from the last window back) and by the decoder
  // from the first window on, until they meet. A warm restore (reused set and state) starts none.
  std::thread faulter;
  // Fresh memory only (a reused set's buffers and a reused state's latents are already faulted in):
  std::vector<float*> latent_base;     // per MLA layer: latents[j].data() if fresh, else null; fixed before the threads start
  bool fresh_latents = false;
  std::array<char, kWindowBuffers> fresh_buffer{};  // window buffer b was allocated by this restore
  // The window buffers the readers claim after their first ones, in claim order (fixed before the
  // threads start; free_buffers holds 0..n-1 and the readers take from its back).
  std::vector<std::byte*> later_buffers;
  std::atomic<std::size_t> decoding{0};  // the window the decoder is at (the faulter stops there)

  const KvLayout& L() const { return m->layout; }

  // Plans the reads and starts the threads. Unavailable when a thread cannot be started: those
  // started before it are stopped and joined, and the state is Reset (the job then holds no
  // running thread; destroying it gives its buffers back).
  Status Start();

  // The KV windows of this restore and what each reads (kv_items or range_items), and
  // max_window_bytes.
  void PlanKvWindows();

  bool Stopped();

  // Points items' outputs at consecutive slots of `buf` (sized for them; `gap`: the read gap of
  // the store they are read from), each out covering its whole slot.
  static void Place(std::span<Store::GetItem> items, std::span<const LookupResult> found, RawBuffer& buf,
                    std::uint64_t gap);

  // One reader thread: claims the next KV window together with a free buffer (in window order,
  // so the window the decoder needs next always has a buffer: later windows can never hold them
  // all), reads it with one GetBatch and marks it read.
  void ReadLoop();

  // Reads window `win`'s blocks or sub-ranges into `buf`, one after the other at 4 KiB-aligned
  // slots (a direct read from NVMe each), with one GetBatch / GetRanges.
  void ReadWindow(const Window& win, RawBuffer& buf);

  // The boundary's snapshots, on the snapshot thread (their GetBatch runs beside the readers'
  // first KV windows).
  void ReadSnapshots();

  void DecodeSnapshots();

  // Decodes window w and gives its buffer back to the readers. The last window of an MLA
  // layer's phase (kLayers) makes that layer ready.
  void DecodeWindow(int w);

  // Faults in the latents' pages of the windows the decoder has not reached, last window first
  // (MADV_POPULATE_WRITE: the kernel maps zeroed pages and leaves pages already there alone, so
  // it never races with the decoder's writes; where the kernel lacks it, the decoder faults).
  // Before that, the window buffers the readers claim after their first windows (a fresh set's
  // pages are otherwise faulted in by the kernel inside the readers' direct reads).
  void FaultLoop();

  // Decodes window w's chunks before `limit`. A chunk that fails lowers `limit` to it (the
  // boundary cannot pass it; later phases still decode the chunks before it).
  void DecodeWindowBlocks(int w);

  // Grows MLA layer j's latents by chunk u's rows right before decoding them: within the reserved
  // capacity, so the vector never moves (the caller reads it only once the layer is ready), and
  // the rows resize() zero-fills are still in cache when the decode overwrites them (growing a
  // whole window first wrote 3.5 MB of zeros to memory and then the decode wrote the same lines
  // again: 7.2 -> 5.7 ms for 16k tokens of k3-small).
  std::span<float> Rows(std::size_t j, std::size_t u);

  // Chunk u's whole block (kChunks): every MLA layer.
  Status DecodeChunk(std::size_t u);

  // MLA layer j's sub-range of chunk u (kLayers; j == 0 also parses the header), checked against
  // the header's XXH3-64. Anything wrong with it (its read, the header, where the header puts the
  // layer, the checksum) and the whole block is read again instead.
  Status DecodeChunkLayer(std::size_t j, std::size_t u);

  // Chunk u's whole block through Store::Get (which verifies it, drops a damaged copy and tries
  // the next), then MLA layer j from it; its header replaces the one read before.
  Status RereadLayer(std::size_t j, std::size_t u);

  // Parses chunk u's header from `head` (the block's first bytes, or all of it) of a block of
  // `block_size` bytes into headers[u].
  Status TakeHeader(std::size_t u, std::span<const std::byte> head, std::uint64_t block_size);

  // The snapshot thread: reads and decodes the boundary's snapshots beside the KV windows (its
  // GetBatch goes to the state pool, so it never waits for the KV pool's rings, and the decoder
  // never waits for it before the first KV window).
  void SnapshotLoop();

  void DecodeLoop();

  void Join();

  ~Job();

  // Gives the latent vectors no layer took back to the state, emptied (a restore to boundary 0
  // leaves the caller's memory with the caller). Only for layers whose state cache is empty.
  void ReturnUnusedLatents();

  // Takes back the latents handed to the state (before the state is reset for a fallback): its
  // first kmax * C rows are still what was decoded (the forward pass only appends rows).
  void ReclaimLatents();

  // Imports layer l at `chunks` (<= kmax) from the decoded buffers (index j of its kind).
  Status Import(int l, std::int64_t chunks);
};

}  // namespace terrace::kv
