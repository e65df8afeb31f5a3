// Restores: PrefixCache::BeginRestore / Restore and LayerwiseRestore (docs/prefix-cache.md,
// "Restore"). One engine for both: a restore job issues every read of its boundary at once: the
// KV chunks in windows of about an eighth of the restore (the last two a quarter and a half of
// that, CutWindows), each window one GetBatch, on
// kRestoreKvReaders reader threads (so one window's GetBatch is in flight while the other's
// finishes and the tier's queue does not drain between windows: the KV pool needs a ring per
// reader), and the boundary's KDA snapshots (one GetBatch on the state pool) on a snapshot thread
// that also decodes them. The decoder thread checks and decodes the KV windows in order while the
// next ones are in flight. A layer becomes ready when all of its blocks are decoded.
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
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "src/kv/block_format.h"
#include "src/kv/prefix_cache_impl.h"
#include "terrace/keys.h"

namespace terrace::kv {
namespace {

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
std::uint64_t Slot(std::uint64_t n, std::uint64_t gap) { return RoundUp(n, kRawAlign) + gap; }

// The bytes of KV chunk blocks a window is cut at, for a restore of `total` bytes of blocks.
std::uint64_t WindowTarget(std::uint64_t total) {
  return std::clamp(total / kWindowsPerRestore, kMinWindowBytes, kMaxWindowBytes);
}

// Windows over chunks whose reads take `slots` bytes of buffer each (in chunk order), cut from
// the back at `target` (WindowTarget of the whole restore): the last window holds about a quarter
// of it, the one before it half, the others the target, and the first what is left. So the decode
// after the last read (the part no read overlaps) is a quarter window, and the first decode starts
// early. No window holds more than the target plus one slot (PrefixCache::Reserve sizes by that).
std::vector<std::pair<std::int64_t, std::int64_t>> CutWindows(std::span<const std::uint64_t> slots,
                                                               std::uint64_t target) {
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  std::size_t end = slots.size();
  for (int n = 0; end > 0; ++n) {
    const std::uint64_t want = n == 0 ? target / 4 : n == 1 ? target / 2 : target;
    std::size_t b = end;
    std::uint64_t in = 0;
    while (b > 0 && in < want) in += slots[--b];
    out.emplace_back(static_cast<std::int64_t>(b), static_cast<std::int64_t>(end));
    end = b;
  }
  std::reverse(out.begin(), out.end());
  return out;
}

// Faults in [p, p + bytes) (whole pages of it) for writing: MADV_POPULATE_WRITE, or one write per
// page where the kernel lacks it (the bytes are uninitialised room: what is written is of no use).
void PopulateWrite(std::byte* p, std::size_t bytes) {
  if (p == nullptr || bytes == 0) return;
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto from = RoundUp(reinterpret_cast<std::uintptr_t>(p), page);
  const auto to = (reinterpret_cast<std::uintptr_t>(p) + bytes) / page * page;
  if (to <= from) return;
  if (::madvise(reinterpret_cast<void*>(from), to - from, MADV_POPULATE_WRITE) == 0) return;
  for (std::uintptr_t a = from; a < to; a += page) *reinterpret_cast<volatile std::byte*>(a) = std::byte{0};
}

}  // namespace

// Thread-safety: fields marked (mu) are under mu; the buffers of a window are written by the
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

  std::mutex mu;
  std::condition_variable cv;
  std::vector<char> ready;           // (mu) per model layer: its blocks at kmax are decoded (or failed)
  std::vector<Status> layer_status;  // (mu) per model layer
  std::vector<char> window_read;     // (mu) per KV window: its read returned (or it was skipped)
  std::size_t next_window = 0;       // (mu) the next KV window a reader claims
  std::size_t readers_left = 0;      // (mu) reader threads still running
  std::vector<std::size_t> free_buffers;  // (mu) indices into window_buffers not holding a window
  bool reads_done = false;           // (mu) every reader thread is done
  bool snapshots_done = true;        // (mu) the snapshot thread is done (or there is none)
  bool stop = false;                 // (mu) stop issuing reads (a block failed, or shutdown)
  std::chrono::steady_clock::time_point decoded_at;  // (mu) when the last block was decoded

  // KV chunks [0, kmax): raw blocks (in window buffers), and per MLA layer the decoded latents
  // [kmax * C, W], grown by the decoder chunk by chunk within a capacity reserved up front.
  // The buffers below marked (pool) come from m->restore_buffers at Start and go back in ~Job.
  std::unique_ptr<RestoreBuffers> pooled;                    // the set they were taken from
  std::array<RawBuffer, kWindowBuffers> window_buffers;      // (pool)
  std::vector<std::size_t> window_buffer;  // (mu) per window: the buffer its blocks were read into
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
  std::vector<std::vector<format::LayerRange>> chunk_ranges;  // decoder only: per chunk, its header's (kLayers)
  RawBuffer reread;                                           // decoder only: a whole block read again (kLayers)
  std::vector<Window> windows;
  std::uint64_t max_window_bytes = 0;                          // the largest window, in slots
  std::vector<std::vector<float>> latents;
  std::vector<char> latents_moved;  // caller thread only: latents[j] now is the state's cache
  std::int64_t good_chunks = 0;  // (mu) leading chunks decoded cleanly in every MLA layer (all kmax without MLA layers)
  std::int64_t limit = 0;        // (mu) chunks still of use: the first chunk that failed (kmax: none)
  Status chunk_error;            // (mu) why chunk `limit` failed (OK: none failed)
  std::string chunk_what;
  int range_rereads = 0;         // (mu)
  // Snapshots at kmax: per KDA layer (index j of layout.kda_layers()).
  RawBuffer snap_buffer;  // (pool)
  std::vector<Store::GetItem> snap_items;
  std::vector<Status> snap_status;
  std::vector<std::vector<float>> recurrent, conv;  // (pool)

  std::array<std::uint64_t, kNumTiers> bytes_read{};  // (mu)
  std::uint64_t kv_bytes = 0, state_bytes = 0;         // (mu)

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

  void Start() {
    const auto& mla = L().mla_layers();
    const auto& kda = L().kda_layers();
    ready.assign(static_cast<std::size_t>(L().num_layers()), 0);
    layer_status.assign(static_cast<std::size_t>(L().num_layers()), Status::Ok());
    retrieved.assign(static_cast<std::size_t>(L().num_layers()), 0);
    if (kmax == 0) {  // nothing to read: no buffers taken, the state's memory untouched
      std::fill(ready.begin(), ready.end(), 1);
      reads_done = true;
      decoded_at = std::chrono::steady_clock::now();
      return;
    }
    pooled = m->restore_buffers.Take();
    window_buffers = std::move(pooled->windows);
    snap_buffer = std::move(pooled->snapshots);
    recurrent = std::move(pooled->recurrent);
    conv = std::move(pooled->conv);
    limit = kmax;
    if (!mla.empty()) {
      PlanKvWindows();
      window_buffer.assign(windows.size(), 0);
      // Address space only (no page is touched here); a buffer that cannot be had now is
      // allocated by its reader, which fails the restore if it cannot.
      for (std::size_t b = 0; b < std::min(kWindowBuffers, windows.size()); ++b) {
        free_buffers.push_back(b);
        const std::byte* before = window_buffers[b].data();
        (void)window_buffers[b].Ensure(static_cast<std::size_t>(max_window_bytes), kRawAlign);
        fresh_buffer[b] = window_buffers[b].data() != before;
      }
      // Room for the whole prompt: the state's own vector when it has that room (memory the
      // caller owns and has touched before, e.g. a state reused after Reset), else address space
      // reserved here; the decoder grows each vector chunk by chunk.
      const auto n = static_cast<std::size_t>(std::max(kmax * C, prompt_tokens)) * static_cast<std::size_t>(W);
      latents.resize(mla.size());
      latent_base.assign(mla.size(), nullptr);
      for (std::size_t j = 0; j < mla.size(); ++j) {
        std::vector<float>& own = state->layer(mla[j]).latents;
        if (own.capacity() >= n) {
          latents[j] = std::move(own);
          own = std::vector<float>();
          latents[j].clear();
        } else {
          latents[j].reserve(n);
          latent_base[j] = latents[j].data();  // fresh address space: the faulter's
          fresh_latents = true;
        }
      }
      latents_moved.assign(mla.size(), 0);
    }
    good_chunks = mla.empty() ? kmax : 0;
    if (!kda.empty()) {
      snap_items.resize(kda.size());
      snap_status.resize(kda.size());
      recurrent.resize(kda.size());
      conv.resize(kda.size());
      for (std::size_t j = 0; j < kda.size(); ++j)
        snap_items[j].key = keys::StateKey(m->ns_state, kda[j], chunk_ids[static_cast<std::size_t>(kmax - 1)]);
    }
    window_read.assign(windows.size(), 0);
    readers_left = kReaders;
    snapshots_done = snap_items.empty();
    for (std::size_t k = free_buffers.size(); k-- > 0;)
      if (k + kReaders < free_buffers.size() && fresh_buffer[free_buffers[k]])
        later_buffers.push_back(window_buffers[free_buffers[k]].data());
    // The snapshots' read first: the forward pass's first (KDA) layers wait for nothing else, and
    // the tier's queue then holds them ahead of the KV windows.
    if (!snap_items.empty()) snapshotter = std::thread([this] { SnapshotLoop(); });
    for (auto& r : readers) r = std::thread([this] { ReadLoop(); });
    decoder = std::thread([this] { DecodeLoop(); });
    if ((fresh_latents && windows.size() > 1) || !later_buffers.empty()) faulter = std::thread([this] { FaultLoop(); });
  }

  // The KV windows of this restore and what each reads (kv_items or range_items), and
  // max_window_bytes.
  void PlanKvWindows() {
    const auto K = static_cast<std::size_t>(kmax);
    const std::size_t phases = by_layer ? L().mla_layers().size() : 1;
    std::vector<std::uint64_t> slots(K * phases);  // [phase * K + chunk]
    if (!by_layer) {
      kv_items.resize(K);
      kv_status.resize(K);
      for (std::size_t i = 0; i < K; ++i) {
        kv_items[i].key = keys::KvChunkKey(m->ns_kv, chunk_ids[i]);
        slots[i] = Slot(f.kv[i].desc.size, m->kv_gap);
      }
    } else {
      // Layer p's sub-range where the layout puts it (block_format.h: the header, then each layer
      // at the next 4 KiB boundary; exact for a codec without a lossless stage); phase 0 also
      // reads the header. The decoder checks each against its header and re-reads on a mismatch.
      const std::uint64_t header = L().chunk_header_bytes(), range = RoundUp(L().mla_layer_range_bytes(), kRawAlign);
      range_items.resize(K * phases);
      range_status.resize(K * phases);
      chunk_ranges.resize(K);
      for (std::size_t p = 0; p < phases; ++p)
        for (std::size_t i = 0; i < K; ++i) {
          const std::uint64_t size = f.kv[i].desc.size, at = p == 0 ? 0 : header + p * range;
          Store::GetRangeItem& it = range_items[p * K + i];
          it.key = keys::KvChunkKey(m->ns_kv, chunk_ids[i]);
          it.offset = std::min(at, size);
          it.length = std::min(p == 0 ? header + range : range, size - it.offset);
          slots[p * K + i] = RoundUp(it.length, kRawAlign);
        }
    }
    std::uint64_t total = 0;
    for (std::uint64_t b : slots) total += b;
    const std::uint64_t target = WindowTarget(total);
    for (std::size_t p = 0; p < phases; ++p) {
      const auto phase_slots = std::span(slots).subspan(p * K, K);
      for (const auto& [b, e] : CutWindows(phase_slots, target)) {
        windows.push_back({by_layer ? static_cast<int>(p) : -1, b, e});
        std::uint64_t bytes = 0;
        for (std::int64_t i = b; i < e; ++i) bytes += phase_slots[static_cast<std::size_t>(i)];
        max_window_bytes = std::max(max_window_bytes, bytes);
      }
    }
  }

  bool Stopped() {
    std::lock_guard lock(mu);
    return stop;
  }

  // Points items' outputs at consecutive slots of `buf` (sized for them; `gap`: the read gap of
  // the store they are read from), each out covering its whole slot.
  static void Place(std::span<Store::GetItem> items, std::span<const LookupResult> found, RawBuffer& buf,
                    std::uint64_t gap) {
    std::uint64_t need = 0;
    for (const auto& r : found) need += Slot(r.desc.size, gap);
    EnsureRaw(buf, need);
    std::uint64_t at = 0;
    for (std::size_t i = 0; i < items.size(); ++i) {
      const std::uint64_t slot = Slot(found[i].desc.size, gap);
      items[i].out = std::span<std::byte>(buf.data() + at, slot);
      at += slot;
    }
  }

  // One reader thread: claims the next KV window together with a free buffer (in window order,
  // so the window the decoder needs next always has a buffer: later windows can never hold them
  // all), reads it with one GetBatch and marks it read.
  void ReadLoop() {
    for (;;) {
      std::size_t w = 0, buffer = 0;
      bool skip = false;  // every chunk of the window is past a failed one: nothing to read
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return stop || next_window >= windows.size() || !free_buffers.empty(); });
        if (stop || next_window >= windows.size()) break;
        w = next_window++;
        buffer = free_buffers.back();
        free_buffers.pop_back();
        window_buffer[w] = buffer;
        skip = windows[w].b >= limit;
      }
      if (!skip) ReadWindow(windows[w], window_buffers[buffer]);
      {
        std::lock_guard lock(mu);
        window_read[w] = 1;
      }
      cv.notify_all();
    }
    {
      std::lock_guard lock(mu);
      if (--readers_left == 0) reads_done = true;
    }
    cv.notify_all();
  }

  // Reads window `win`'s blocks or sub-ranges into `buf`, one after the other at 4 KiB-aligned
  // slots (a direct read from NVMe each), with one GetBatch / GetRanges.
  void ReadWindow(const Window& win, RawBuffer& buf) {
    EnsureRaw(buf, max_window_bytes);
    const auto b = static_cast<std::size_t>(win.b), n = static_cast<std::size_t>(win.e - win.b);
    if (win.phase < 0) {
      auto items = std::span(kv_items).subspan(b, n);
      Place(items, std::span(f.kv).subspan(b, n), buf, m->kv_gap);
      const auto st = m->kv->GetBatch(items, reads);
      std::copy(st.begin(), st.end(), kv_status.begin() + win.b);
      return;
    }
    const std::size_t first = static_cast<std::size_t>(win.phase) * static_cast<std::size_t>(kmax) + b;
    auto items = std::span(range_items).subspan(first, n);
    std::uint64_t at = 0;
    for (auto& it : items) {
      const std::uint64_t slot = RoundUp(it.length, kRawAlign);
      it.out = std::span<std::byte>(buf.data() + at, slot);
      at += slot;
    }
    const auto st = m->kv->GetRanges(items);
    std::copy(st.begin(), st.end(), range_status.begin() + static_cast<std::ptrdiff_t>(first));
  }

  // The boundary's snapshots, on the snapshot thread (their GetBatch runs beside the readers'
  // first KV windows).
  void ReadSnapshots() {
    const auto& kda = L().kda_layers();
    Place(snap_items, std::span(f.state).subspan(static_cast<std::size_t>(kmax - 1) * kda.size(), kda.size()),
          snap_buffer, m->st_gap);
    snap_status = m->st->GetBatch(snap_items, reads);
  }

  void DecodeSnapshots() {
    const auto& kda = L().kda_layers();
    for (std::size_t j = 0; j < kda.size(); ++j) {
      Status s = snap_status[j];
      const auto tier = f.state[static_cast<std::size_t>(kmax - 1) * kda.size() + j].tier;
      if (s.ok()) {
        recurrent[j].resize(static_cast<std::size_t>(L().kda_heads()) * L().kda_head_dim() * L().kda_head_dim());
        conv[j].resize(static_cast<std::size_t>(L().kda_conv_rows()) * L().kda_conv_cols());
        s = format::DecodeState(L(), kda[j], kmax * C, chunk_ids[static_cast<std::size_t>(kmax - 1)],
                                std::span<const std::byte>(snap_items[j].out.data(), snap_items[j].desc.size), recurrent[j],
                                conv[j]);
      }
      std::lock_guard lock(mu);
      if (snap_status[j].ok()) {
        bytes_read[static_cast<std::size_t>(tier)] += snap_items[j].desc.size;
        state_bytes += snap_items[j].desc.size;
      }
      if (!s.ok()) snap_status[j] = s;
      layer_status[static_cast<std::size_t>(kda[j])] = s;
      ready[static_cast<std::size_t>(kda[j])] = 1;
    }
    cv.notify_all();
  }

  // Decodes window w and gives its buffer back to the readers. The last window of an MLA
  // layer's phase (kLayers) makes that layer ready.
  void DecodeWindow(int w) {
    DecodeWindowBlocks(w);
    const Window& win = windows[static_cast<std::size_t>(w)];
    {
      std::lock_guard lock(mu);
      free_buffers.push_back(window_buffer[static_cast<std::size_t>(w)]);
      if (win.phase >= 0 && (static_cast<std::size_t>(w) + 1 == windows.size() || windows[static_cast<std::size_t>(w) + 1].phase != win.phase)) {
        const auto l = static_cast<std::size_t>(L().mla_layers()[static_cast<std::size_t>(win.phase)]);
        layer_status[l] = limit == kmax ? Status::Ok() : chunk_error;
        ready[l] = 1;
      }
    }
    cv.notify_all();
  }

  // Faults in the latents' pages of the windows the decoder has not reached, last window first
  // (MADV_POPULATE_WRITE: the kernel maps zeroed pages and leaves pages already there alone, so
  // it never races with the decoder's writes; where the kernel lacks it, the decoder faults).
  // Before that, the window buffers the readers claim after their first windows (a fresh set's
  // pages are otherwise faulted in by the kernel inside the readers' direct reads).
  void FaultLoop() {
    const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
    auto populate = [&](const void* begin, const void* end) {
      const auto from = RoundUp(reinterpret_cast<std::uintptr_t>(begin), page);
      const auto to = reinterpret_cast<std::uintptr_t>(end) / page * page;
      return to <= from || ::madvise(reinterpret_cast<void*>(from), to - from, MADV_POPULATE_WRITE) == 0;
    };
    for (std::byte* buf : later_buffers) {
      if (Stopped()) return;
      if (!populate(buf, buf + max_window_bytes)) return;
    }
    for (std::size_t w = windows.size(); w-- > 0;) {
      if (w <= decoding.load(std::memory_order_relaxed) || Stopped()) return;
      const Window& win = windows[w];
      for (std::size_t j = 0; j < latent_base.size(); ++j) {
        float* base = latent_base[j];
        if (base == nullptr || (win.phase >= 0 && static_cast<std::size_t>(win.phase) != j)) continue;
        if (!populate(base + win.b * C * W, base + win.e * C * W)) return;
      }
    }
  }

  // Decodes window w's chunks before `limit`. A chunk that fails lowers `limit` to it (the
  // boundary cannot pass it; later phases still decode the chunks before it).
  void DecodeWindowBlocks(int w) {
    decoding.store(static_cast<std::size_t>(w), std::memory_order_relaxed);
    const Window& win = windows[static_cast<std::size_t>(w)];
    const auto& mla = L().mla_layers();
    const bool last_phase = win.phase < 0 || static_cast<std::size_t>(win.phase) + 1 == mla.size();
    for (std::int64_t i = win.b; i < win.e; ++i) {
      {
        std::lock_guard lock(mu);
        if (i >= limit) return;
      }
      const auto u = static_cast<std::size_t>(i);
      const Status s = win.phase < 0 ? DecodeChunk(u) : DecodeChunkLayer(static_cast<std::size_t>(win.phase), u);
      std::lock_guard lock(mu);
      if (s.ok()) {
        if (last_phase) good_chunks = i + 1;
        continue;
      }
      limit = i;
      good_chunks = std::min(good_chunks, i);
      chunk_error = s;
      chunk_what = fmt::format("KV chunk {} ({})", i, keys::KvChunkKey(m->ns_kv, chunk_ids[u]).ToString());
      for (std::size_t j = 0; j < latents.size(); ++j)  // the good chunks only
        if (win.phase < 0 || static_cast<std::size_t>(win.phase) == j) latents[j].resize(u * static_cast<std::size_t>(C * W));
      return;
    }
  }

  // Grows MLA layer j's latents by chunk u's rows right before decoding them: within the reserved
  // capacity, so the vector never moves (the caller reads it only once the layer is ready), and
  // the rows resize() zero-fills are still in cache when the decode overwrites them (growing a
  // whole window first wrote 3.5 MB of zeros to memory and then the decode wrote the same lines
  // again: 7.2 -> 5.7 ms for 16k tokens of k3-small).
  std::span<float> Rows(std::size_t j, std::size_t u) {
    const auto rows = static_cast<std::size_t>(C * W);
    latents[j].resize((u + 1) * rows);
    return std::span(latents[j]).subspan(u * rows, rows);
  }

  // Chunk u's whole block (kChunks): every MLA layer.
  Status DecodeChunk(std::size_t u) {
    const auto& mla = L().mla_layers();
    Status s = kv_status[u];
    if (s.ok()) {
      const std::span<const std::byte> block(kv_items[u].out.data(), kv_items[u].desc.size);
      auto ranges = format::ParseKvChunkHeader(L(), chunk_ids[u], block);
      s = ranges.status();
      // The block is whole, as the KV pool's GetBatch verified it: no second hash per layer.
      for (std::size_t j = 0; s.ok() && j < mla.size(); ++j)
        s = format::DecodeKvLayer(L(), block, (*ranges)[j], Rows(j, u), format::LayerCheck::kBlockVerifiedByStore);
      std::lock_guard lock(mu);
      bytes_read[static_cast<std::size_t>(f.kv[u].tier)] += kv_items[u].desc.size;
      kv_bytes += kv_items[u].desc.size;
    }
    return s;
  }

  // MLA layer j's sub-range of chunk u (kLayers; j == 0 also parses the header), checked against
  // the header's XXH3-64. Anything wrong with it (its read, the header, where the header puts the
  // layer, the checksum) and the whole block is read again instead.
  Status DecodeChunkLayer(std::size_t j, std::size_t u) {
    const Store::GetRangeItem& it = range_items[j * static_cast<std::size_t>(kmax) + u];
    Status s = range_status[j * static_cast<std::size_t>(kmax) + u];
    if (s.ok()) {
      const std::span<const std::byte> got(it.out.data(), it.length);
      {
        std::lock_guard lock(mu);
        bytes_read[static_cast<std::size_t>(it.tier)] += it.length;
        kv_bytes += it.length;
      }
      if (j == 0) {
        auto ranges = format::ParseKvChunkHeader(L(), chunk_ids[u], got, it.desc.size);
        s = ranges.status();
        if (s.ok()) chunk_ranges[u] = std::move(*ranges);
      } else if (it.desc.size != range_items[u].desc.size) {
        s = Status::Corruption("the block changed size between its header's read and this layer's");
      }
      if (s.ok()) {
        format::LayerRange r = chunk_ranges[u][j];
        if (r.offset < it.offset || r.offset - it.offset > it.length || r.size > it.length - (r.offset - it.offset)) {
          s = Status::Corruption(fmt::format("layer {}'s sub-range [{}, +{}) is not where the layout puts it", r.model_layer,
                                             r.offset, r.size));
        } else {
          r.offset -= it.offset;  // into `got`
          s = format::DecodeKvLayer(L(), got, r, Rows(j, u), format::LayerCheck::kVerify);
        }
      }
    }
    if (s.ok()) return s;
    {
      std::lock_guard lock(mu);
      ++range_rereads;
    }
    m->logger->Log(LogLevel::kWarning, "prefix-cache",
                   fmt::format("KV chunk {} ({}) MLA layer {}: {}; reading the whole block again", u, it.key.ToString(),
                               L().mla_layers()[j], s.ToString()));
    return RereadLayer(j, u);
  }

  // Chunk u's whole block through Store::Get (which verifies it, drops a damaged copy and tries
  // the next), then MLA layer j from it; its header replaces the one read before.
  Status RereadLayer(std::size_t j, std::size_t u) {
    const BlockKey key = keys::KvChunkKey(m->ns_kv, chunk_ids[u]);
    const std::uint64_t room = Slot(std::max(f.kv[u].desc.size, L().mla_chunk_block_bytes()), 0);
    if (!reread.Ensure(static_cast<std::size_t>(room), kRawAlign))
      return Status::OutOfCapacity(fmt::format("no memory to read KV chunk block {} again", key.ToString()));
    auto got = m->kv->Get(key, std::span<std::byte>(reread.data(), reread.capacity()), reads);
    if (!got.ok()) return got.status();
    const std::span<const std::byte> block(reread.data(), got->size);
    {
      std::lock_guard lock(mu);
      bytes_read[static_cast<std::size_t>(f.kv[u].tier)] += got->size;
      kv_bytes += got->size;
    }
    auto ranges = format::ParseKvChunkHeader(L(), chunk_ids[u], block);
    TERRACE_RETURN_IF_ERROR(ranges.status());
    chunk_ranges[u] = std::move(*ranges);
    return format::DecodeKvLayer(L(), block, chunk_ranges[u][j], Rows(j, u), format::LayerCheck::kBlockVerifiedByStore);
  }

  // The snapshot thread: reads and decodes the boundary's snapshots beside the KV windows (its
  // GetBatch goes to the state pool, so it never waits for the KV pool's rings, and the decoder
  // never waits for it before the first KV window).
  void SnapshotLoop() {
    if (!Stopped()) {
      ReadSnapshots();
      DecodeSnapshots();
    }
    {
      std::lock_guard lock(mu);
      snapshots_done = true;
    }
    cv.notify_all();
  }

  void DecodeLoop() {
    std::size_t windows_done = 0;
    for (std::size_t w = 0; w < windows.size(); ++w) {
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return window_read[w] != 0 || reads_done; });
        if (!window_read[w]) break;  // stopped before this window was read
      }
      DecodeWindow(static_cast<int>(w));
      ++windows_done;
    }
    {
      std::lock_guard lock(mu);
      const Status mla_status =
          limit == kmax && windows_done == windows.size()
              ? Status::Ok()
              : (chunk_error.ok() ? Status::Cancelled("the restore was stopped before its KV chunks were read") : chunk_error);
      for (int l : L().mla_layers()) {
        if (ready[static_cast<std::size_t>(l)]) continue;
        layer_status[static_cast<std::size_t>(l)] = mla_status;
        ready[static_cast<std::size_t>(l)] = 1;
      }
    }
    cv.notify_all();
    {
      // The restore is decoded when the snapshots are too (they may land after the KV chunks).
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return snapshots_done; });
      for (int l : L().kda_layers()) {  // snapshots never read (stopped early)
        if (!ready[static_cast<std::size_t>(l)]) {
          layer_status[static_cast<std::size_t>(l)] = Status::Cancelled("the restore was stopped before its snapshots were read");
          ready[static_cast<std::size_t>(l)] = 1;
        }
      }
      decoded_at = std::chrono::steady_clock::now();
    }
    cv.notify_all();
  }

  void Join() {
    for (auto& r : readers)
      if (r.joinable()) r.join();
    if (decoder.joinable()) decoder.join();
    if (snapshotter.joinable()) snapshotter.join();
    if (faulter.joinable()) faulter.join();
  }

  ~Job() {
    {
      std::lock_guard lock(mu);
      stop = true;
    }
    cv.notify_all();
    Join();
    if (pooled) {
      pooled->windows = std::move(window_buffers);
      pooled->snapshots = std::move(snap_buffer);
      pooled->recurrent = std::move(recurrent);
      pooled->conv = std::move(conv);
      m->restore_buffers.Give(std::move(pooled));
    }
  }

  // Gives the latent vectors no layer took back to the state, emptied (a restore to boundary 0
  // leaves the caller's memory with the caller). Only for layers whose state cache is empty.
  void ReturnUnusedLatents() {
    const auto& mla = L().mla_layers();
    for (std::size_t j = 0; j < latents_moved.size(); ++j) {
      std::vector<float>& own = state->layer(mla[j]).latents;
      if (latents_moved[j] || !own.empty() || own.capacity() >= latents[j].capacity()) continue;
      latents[j].clear();
      own = std::move(latents[j]);
      latents[j] = std::vector<float>();
    }
  }

  // Takes back the latents handed to the state (before the state is reset for a fallback): its
  // first kmax * C rows are still what was decoded (the forward pass only appends rows).
  void ReclaimLatents() {
    const auto& mla = L().mla_layers();
    for (std::size_t j = 0; j < latents_moved.size(); ++j) {  // empty when nothing was read
      if (!latents_moved[j]) continue;
      std::vector<float>& v = state->layer(mla[j]).latents;
      v.resize(static_cast<std::size_t>(kmax * C * W));
      latents[j] = std::move(v);
      v.clear();
      state->layer(mla[j]).tokens = 0;
      latents_moved[j] = 0;
    }
  }

  // Imports layer l at `chunks` (<= kmax) from the decoded buffers (index j of its kind).
  Status Import(int l, std::int64_t chunks) {
    const auto& mla = L().mla_layers();
    const auto& kda = L().kda_layers();
    const std::int64_t bt = chunks * C;
    if (auto it = std::find(mla.begin(), mla.end(), l); it != mla.end()) {
      const auto j = static_cast<std::size_t>(it - mla.begin());
      const auto n = static_cast<std::size_t>(bt * W);
      if (latents_moved[j] || latents[j].size() < n)
        return Status::Internal(fmt::format("prefix cache: MLA layer {} has no decoded latents for {} tokens", l, bt));
      if (!state->layer(l).is_mla)
        return Status::InvalidArgument(fmt::format("layer {}: the state is not shaped for this cache's model", l));
      // Hand the decoded vector over, cut to the boundary (its first rows are chunks [0, chunks)):
      // its capacity holds the prompt, so the suffix's rows are appended in place.
      model::LayerState& s = state->layer(l);
      s.latents = std::move(latents[j]);
      s.latents.resize(n);
      s.tokens = bt;
      latents_moved[j] = 1;
      return Status::Ok();
    }
    const auto j = static_cast<std::size_t>(std::find(kda.begin(), kda.end(), l) - kda.begin());
    model::LayerState& s = state->layer(l);
    if (s.recurrent.size() != recurrent[j].size() || s.conv.size() != conv[j].size())
      return Status::InvalidArgument(fmt::format("KDA layer {}: the state is not shaped for this cache's model", l));
    std::copy(recurrent[j].begin(), recurrent[j].end(), s.recurrent.begin());
    std::copy(conv[j].begin(), conv[j].end(), s.conv.begin());
    s.tokens = bt;
    return Status::Ok();
  }
};

LayerwiseRestore::LayerwiseRestore(std::unique_ptr<Job> job) : job_(std::move(job)) {}
LayerwiseRestore::~LayerwiseRestore() = default;

std::int64_t LayerwiseRestore::boundary_tokens() const { return job_->kmax * job_->C; }
bool LayerwiseRestore::voided() const { return job_->voided; }

Status LayerwiseRestore::RetrieveLayer(int layer) {
  Job& j = *job_;
  if (layer < 0 || layer >= j.L().num_layers())
    return Status::InvalidArgument(
        fmt::format("LayerwiseRestore::RetrieveLayer: layer {} is outside [0, {})", layer, j.L().num_layers()));
  if (j.finished) return Status::InvalidArgument("LayerwiseRestore::RetrieveLayer: the restore is already finished");
  if (j.kmax == 0) return Status::Ok();
  const auto u = static_cast<std::size_t>(layer);
  if (j.voided)
    return Status::Cancelled(fmt::format("the layerwise restore to token {} is void (an earlier layer failed); discard "
                                       "this pass and Finish() the restore", j.kmax * j.C));
  Status s;
  {
    const auto w0 = std::chrono::steady_clock::now();
    std::unique_lock lock(j.mu);
    j.cv.wait(lock, [&] { return j.ready[u] != 0; });
    j.wait_seconds += SecondsSince(w0);
    s = j.layer_status[u];
  }
  if (s.ok()) s = j.Import(layer, j.kmax);
  if (!s.ok()) {
    j.voided = true;  // the reads go on: Finish's fallback uses the chunks before the boundary
    j.ReclaimLatents();
    return Status::Cancelled(fmt::format("the layerwise restore to token {} is void: layer {}: {}; discard this pass and "
                                       "Finish() the restore (it falls back to an earlier boundary)",
                                       j.kmax * j.C, layer, s.ToString()));
  }
  j.retrieved[u] = 1;
  return Status::Ok();
}

Result<RestoreReport> LayerwiseRestore::Finish() {
  Job& j = *job_;
  if (j.finished) return Status::InvalidArgument("LayerwiseRestore::Finish: called twice");
  j.finished = true;
  PrefixCache::Impl& m = *j.m;
  const KvLayout& L = m.layout;
  const auto& kda = L.kda_layers();
  const std::int64_t C = j.C;
  j.Join();
  RestoreReport rep;
  rep.lookup_boundary_tokens = j.kmax * C;
  rep.wait_seconds = j.wait_seconds;
  std::uint64_t missing = 0, corrupt = 0;
  auto note = [&](const Status& s, std::string what) {
    (s.code() == Code::kNotFound ? missing : corrupt)++;
    ++rep.fallbacks;
    rep.fallback_reasons.push_back(fmt::format("{}: {}", what, s.ToString()));
  };
  if (j.f.partial > 0)
    note(Status::NotFound("missing (evicted or never written)"),
         fmt::format("KDA snapshot of layer {} at token {}", j.f.partial_missing_layer, j.f.partial * C));

  bool all_good = j.kmax > 0 && j.good_chunks == j.kmax;
  for (std::size_t i = 0; all_good && i < kda.size(); ++i) all_good = j.snap_status[i].ok();
  bool any_retrieved = false;
  for (char r : j.retrieved) any_retrieved = any_retrieved || r != 0;
  rep.layerwise = any_retrieved || j.voided;
  rep.read_by_layer = j.by_layer;
  rep.range_rereads = j.range_rereads;
  std::int64_t b = 0;
  if (all_good && !j.voided) {
    b = j.kmax;
    for (int l = 0; l < L.num_layers(); ++l)
      if (!j.retrieved[static_cast<std::size_t>(l)]) TERRACE_RETURN_IF_ERROR(j.Import(l, b));
    if (Status s = model::ValidateJointBoundary(*j.state); !s.ok())
      return Status::Internal("prefix cache restored a state that is not at a joint boundary: " + s.message());
  } else {
    rep.layerwise_voided = j.voided;
    j.ReclaimLatents();
    j.state->Reset();
    if (j.kmax > 0) {
      // The boundary kmax failed: say why (the chunk first: it also rules out every boundary past it).
      if (!j.chunk_error.ok()) note(j.chunk_error, j.chunk_what);
      else
        for (std::size_t i = 0; i < kda.size(); ++i)
          if (!j.snap_status[i].ok())
            note(j.snap_status[i], fmt::format("KDA snapshot of layer {} at token {} ({})", kda[i], j.kmax * C,
                                               j.snap_items[i].key.ToString()));
    }
    // Earlier candidates: their snapshots, one batch per boundary, until one reads back good.
    for (std::int64_t k : j.f.candidates) {
      if (k >= j.kmax || k > j.good_chunks) continue;
      bool ok = true;
      if (!kda.empty()) {
        std::vector<Store::GetItem> items(kda.size());
        for (std::size_t i = 0; i < kda.size(); ++i)
          items[i].key = keys::StateKey(m.ns_state, kda[i], j.chunk_ids[static_cast<std::size_t>(k - 1)]);
        // The reads are done (Join): the snapshot buffer is free for this boundary's blocks.
        LayerwiseRestore::Job::Place(items, std::span(j.f.state).subspan(static_cast<std::size_t>(k - 1) * kda.size(), kda.size()),
                                     j.snap_buffer, m.st_gap);
        const auto statuses = m.st->GetBatch(items, j.reads);
        for (std::size_t i = 0; i < kda.size() && ok; ++i) {
          Status s = statuses[i];
          if (s.ok()) {
            j.bytes_read[static_cast<std::size_t>(j.f.state[static_cast<std::size_t>(k - 1) * kda.size() + i].tier)] +=
                items[i].desc.size;
            j.state_bytes += items[i].desc.size;
            j.recurrent[i].resize(static_cast<std::size_t>(L.kda_heads()) * L.kda_head_dim() * L.kda_head_dim());
            j.conv[i].resize(static_cast<std::size_t>(L.kda_conv_rows()) * L.kda_conv_cols());
            s = format::DecodeState(L, kda[i], k * C, j.chunk_ids[static_cast<std::size_t>(k - 1)],
                                    std::span<const std::byte>(items[i].out.data(), items[i].desc.size), j.recurrent[i],
                                    j.conv[i]);
          }
          if (!s.ok()) {
            note(s, fmt::format("KDA snapshot of layer {} at token {} ({})", kda[i], k * C, items[i].key.ToString()));
            ok = false;
          }
        }
      }
      if (ok) {
        b = k;
        break;
      }
    }
    if (b > 0) {
      for (int l = 0; l < L.num_layers(); ++l) TERRACE_RETURN_IF_ERROR(j.Import(l, b));
      if (Status s = model::ValidateJointBoundary(*j.state); !s.ok())
        return Status::Internal("prefix cache restored a state that is not at a joint boundary: " + s.message());
    }
  }
  if (b == 0) j.ReturnUnusedLatents();
  rep.boundary_tokens = b * C;
  rep.bytes_read = j.bytes_read;
  rep.kv_bytes = j.kv_bytes;
  rep.state_bytes = j.state_bytes;
  // Until the last block was decoded; a whole restore's imports come after that, and count.
  rep.seconds = rep.layerwise && !rep.layerwise_voided
                    ? std::chrono::duration<double>(j.decoded_at - j.t0).count()
                    : SecondsSince(j.t0);
  {
    std::lock_guard lock(m.stats_mu);
    if (b > 0) ++m.stats.restores;
    if (b > 0 && rep.layerwise && !rep.layerwise_voided) ++m.stats.layerwise_restores;
    if (rep.layerwise_voided) ++m.stats.layerwise_voided;
    m.stats.restore_wait_seconds += rep.wait_seconds;
    m.stats.range_rereads += static_cast<std::uint64_t>(rep.range_rereads);
    m.stats.restored_tokens += static_cast<std::uint64_t>(b * C);
    m.stats.fallbacks += missing + corrupt;
    m.stats.fallbacks_missing += missing;
    m.stats.fallbacks_corrupt += corrupt;
    for (std::size_t t = 0; t < kNumTiers; ++t) m.stats.bytes_read[t] += rep.bytes_read[t];
  }
  for (const auto& r : rep.fallback_reasons)
    m.logger->Log(LogLevel::kWarning, "prefix-cache", "restore fell back to an earlier joint boundary: " + r);
  return rep;
}

Result<std::unique_ptr<LayerwiseRestore>> PrefixCache::BeginRestore(const PrefixRequest& request,
                                                                    model::SequenceState* state) {
  return BeginRestore(request, state, impl_->restore_order.load(std::memory_order_relaxed));
}

Result<std::unique_ptr<LayerwiseRestore>> PrefixCache::BeginRestore(const PrefixRequest& request,
                                                                    model::SequenceState* state, RestoreReadOrder order) {
  const auto t0 = std::chrono::steady_clock::now();
  Impl& m = *impl_;
  const KvLayout& L = m.layout;
  if (state == nullptr || state->num_layers() != L.num_layers() ||
      (!L.mla_layers().empty() && state->mla_width() != L.mla_width()))
    return Status::InvalidArgument("PrefixCache::Restore: the state is not shaped for this cache's model "
                                   "(create it with SequenceState::ForConfig of the same config)");
  auto job = std::make_unique<LayerwiseRestore::Job>();
  job->m = &m;
  job->reads.promote = m.restore_promote.load(std::memory_order_relaxed);
  job->t0 = t0;
  job->chunk_ids = request.chunk_ids;
  job->state = state;
  job->C = L.chunk_tokens();
  job->W = L.mla_width();
  job->prompt_tokens = static_cast<std::int64_t>(request.tokens.size());
  job->f = m.LookupFound(request);
  job->kmax = job->f.candidates.empty() ? 0 : job->f.candidates.front();
  // Sub-ranges at the offsets the layout fixes (no lossless stage), worth it with two or more MLA
  // layers; a restore that promotes reads whole blocks (a promotion moves whole blocks up).
  job->by_layer = order == RestoreReadOrder::kLayers && L.mla_layers().size() >= 2 &&
                  L.kv_codec().lossless == codec::Lossless::kNone &&
                  !job->reads.promote.value_or(m.kv->options().promote_on_get);
  job->Start();
  return std::unique_ptr<LayerwiseRestore>(new LayerwiseRestore(std::move(job)));
}

Result<RestoreReservation> PrefixCache::Reserve(std::int64_t prompt_tokens, int restores) {
  Impl& m = *impl_;
  const KvLayout& L = m.layout;
  if (prompt_tokens < 0)
    return Status::InvalidArgument(fmt::format("PrefixCache::Reserve: negative prompt length {}", prompt_tokens));
  if (restores < 1 || restores > static_cast<int>(RestoreBufferPool::kMaxPooled))
    return Status::InvalidArgument(fmt::format("PrefixCache::Reserve: {} restores is outside [1, {}] (the pooled sets)",
                                               restores, RestoreBufferPool::kMaxPooled));
  // A restore of this prompt covers at most its full chunks before the last token (PrefixRequest).
  const std::int64_t chunks = prompt_tokens > 0 ? (prompt_tokens - 1) / L.chunk_tokens() : 0;
  RestoreReservation out;
  if (chunks == 0) return out;  // nothing a restore would read
  const auto K = static_cast<std::uint64_t>(chunks);
  const auto& kda = L.kda_layers();
  // Upper bounds of what Start sizes for this restore: windows are cut once they reach
  // WindowTarget(total), so none holds more than the target plus one block (nor more than all).
  std::uint64_t window_bytes = 0;
  std::size_t window_count = 0;
  if (!L.mla_layers().empty()) {
    const std::uint64_t block = Slot(L.mla_chunk_block_bytes(), m.kv_gap), total = K * block;
    window_bytes = std::min(total, WindowTarget(total) + block);
    window_count = static_cast<std::size_t>(std::min<std::uint64_t>(kWindowBuffers, K));
  }
  const std::uint64_t snap_bytes = kda.size() * Slot(L.state_block_bytes(), m.st_gap);
  const auto rec_n = static_cast<std::size_t>(L.kda_heads()) * L.kda_head_dim() * L.kda_head_dim();
  const auto conv_n = static_cast<std::size_t>(L.kda_conv_rows()) * L.kda_conv_cols();
  std::vector<std::unique_ptr<RestoreBuffers>> sets;
  for (int i = 0; i < restores; ++i) sets.push_back(m.restore_buffers.Take());
  Status error;
  for (auto& set : sets) {
    auto ensure = [&](RawBuffer& buf, std::uint64_t bytes) {
      if (!error.ok() || bytes == 0) return;
      const std::byte* before = buf.data();
      if (!buf.Ensure(static_cast<std::size_t>(bytes), kRawAlign)) {
        error = Status::OutOfCapacity(fmt::format("PrefixCache::Reserve: no memory for a {}-byte restore buffer", bytes));
        return;
      }
      if (buf.data() != before) {
        PopulateWrite(buf.data(), buf.capacity());
        out.bytes_prepared += buf.capacity();
      }
    };
    for (std::size_t b = 0; b < window_count; ++b) ensure(set->windows[b], window_bytes);
    ensure(set->snapshots, snap_bytes);
    if (error.ok()) {
      try {
        set->recurrent.resize(kda.size());
        set->conv.resize(kda.size());
        for (std::size_t j = 0; j < kda.size(); ++j)
          for (auto [v, n] : {std::pair{&set->recurrent[j], rec_n}, std::pair{&set->conv[j], conv_n}}) {
            if (v->size() >= n) continue;
            v->resize(n);  // value-initialised: written, so faulted in
            out.bytes_prepared += n * sizeof(float);
          }
      } catch (const std::bad_alloc&) {
        error = Status::OutOfCapacity("PrefixCache::Reserve: no memory for the decoded KDA snapshots");
      }
    }
    for (const auto& w : set->windows) out.bytes_held += w.data() ? w.capacity() : 0;
    out.bytes_held += set->snapshots.data() ? set->snapshots.capacity() : 0;
    for (const auto& v : set->recurrent) out.bytes_held += v.capacity() * sizeof(float);
    for (const auto& v : set->conv) out.bytes_held += v.capacity() * sizeof(float);
  }
  out.sets = static_cast<int>(sets.size());
  for (auto& set : sets) m.restore_buffers.Give(std::move(set));
  if (!error.ok()) return error;
  return out;
}

Result<RestoreReport> PrefixCache::Restore(const PrefixRequest& request, model::SequenceState* state) {
  TERRACE_ASSIGN_OR_RETURN(auto restore, BeginRestore(request, state, RestoreReadOrder::kChunks));
  return restore->Finish();
}

}  // namespace terrace::kv
