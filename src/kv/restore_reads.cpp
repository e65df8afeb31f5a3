// The reading side of a restore (restore_job.h): the KV windows' plan, the reader threads (one
// GetBatch or GetRanges per window), the snapshot thread and the faulter thread.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>

#include "src/kv/restore_job.h"
#include "terrace/keys.h"

namespace terrace::kv {

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

void PopulateWrite(std::byte* p, std::size_t bytes) {
  if (p == nullptr || bytes == 0) return;
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto from = RoundUp(reinterpret_cast<std::uintptr_t>(p), page);
  const auto to = (reinterpret_cast<std::uintptr_t>(p) + bytes) / page * page;
  if (to <= from) return;
  if (::madvise(reinterpret_cast<void*>(from), to - from, MADV_POPULATE_WRITE) == 0) return;
  for (std::uintptr_t a = from; a < to; a += page) *reinterpret_cast<volatile std::byte*>(a) = std::byte{0};
}

Status LayerwiseRestore::Job::Start() {
  // No thread of the job runs before the end of Start: mu is held for the lock rule's checker and
  // released before they start.
  MutexLock lock(&mu);
  const auto& mla = L().mla_layers();
  const auto& kda = L().kda_layers();
  ready.assign(static_cast<std::size_t>(L().num_layers()), 0);
  layer_status.assign(static_cast<std::size_t>(L().num_layers()), Status::Ok());
  retrieved.assign(static_cast<std::size_t>(L().num_layers()), 0);
  if (kmax == 0) {  // nothing to read: no buffers taken, the state's memory untouched
    std::fill(ready.begin(), ready.end(), 1);
    reads_done = true;
    decoded_at = std::chrono::steady_clock::now();
    return Status::Ok();
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
  lock.Unlock();
  // The snapshots' read first: the forward pass's first (KDA) layers wait for nothing else, and
  // the tier's queue then holds them ahead of the KV windows. Each thread starts only after those
  // it waits for (the decoder waits for the readers and the snapshotter), so the threads started
  // before a refused one finish once stopped.
  auto start = [&](std::thread& t, const char* what, void (Job::*loop)()) {
    auto started = StartThread(what, [this, loop] { (this->*loop)(); });
    if (!started.ok()) return started.status();
    t = std::move(started).value();
    return Status::Ok();
  };
  Status s;
  if (!snap_items.empty()) s = start(snapshotter, "a prefix-cache restore's snapshot thread", &Job::SnapshotLoop);
  for (std::size_t i = 0; i < readers.size() && s.ok(); ++i)
    s = start(readers[i], "a prefix-cache restore's reader thread", &Job::ReadLoop);
  if (s.ok()) s = start(decoder, "a prefix-cache restore's decoder thread", &Job::DecodeLoop);
  if (s.ok() && ((fresh_latents && windows.size() > 1) || !later_buffers.empty()))
    s = start(faulter, "a prefix-cache restore's page-fault thread", &Job::FaultLoop);
  if (!s.ok()) {
    lock.Lock();
    stop = true;
    lock.Unlock();
    cv.SignalAll();
    Join();
    // The state as Finish leaves it after a restore that found nothing: Reset, with the latent
    // vectors Start took from it given back.
    state->Reset();
    ReturnUnusedLatents();
  }
  return s;
}

void LayerwiseRestore::Job::PlanKvWindows() {
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
    headers.assign(K, {});
    for (std::size_t p = 0; p < phases; ++p)
      for (std::size_t i = 0; i < K; ++i) {
        const std::uint64_t size = f.kv[i].desc.size, at = p == 0 ? 0 : header + p * range;
        Store::GetRangeItem& it = range_items[p * K + i];
        it.key = keys::KvChunkKey(m->ns_kv, chunk_ids[i]);
        it.offset = std::min(at, size);
        it.length = std::min(p == 0 ? header + range : range, size - it.offset);
        slots[p * K + i] = Slot(it.length, 0);
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

bool LayerwiseRestore::Job::Stopped() {
  MutexLock lock(&mu);
  return stop;
}

void LayerwiseRestore::Job::Place(std::span<Store::GetItem> items, std::span<const LookupResult> found,
                                  RawBuffer& buf, std::uint64_t gap) {
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

void LayerwiseRestore::Job::ReadLoop() {
  for (;;) {
    std::size_t w = 0, buffer = 0;
    bool skip = false;  // every chunk of the window is past a failed one: nothing to read
    {
      MutexLock lock(&mu);
      while (!stop && next_window < windows.size() && free_buffers.empty()) cv.Wait(&mu);
      if (stop || next_window >= windows.size()) break;
      w = next_window++;
      buffer = free_buffers.back();
      free_buffers.pop_back();
      window_buffer[w] = buffer;
      skip = windows[w].b >= limit;
    }
    if (!skip) ReadWindow(windows[w], window_buffers[buffer]);
    {
      MutexLock lock(&mu);
      window_read[w] = 1;
    }
    cv.SignalAll();
  }
  {
    MutexLock lock(&mu);
    if (--readers_left == 0) reads_done = true;
  }
  cv.SignalAll();
}

void LayerwiseRestore::Job::ReadWindow(const Window& win, RawBuffer& buf) {
  EnsureRaw(buf, max_window_bytes);
  const auto b = static_cast<std::size_t>(win.b), n = static_cast<std::size_t>(win.e - win.b);
  if (win.phase < 0) {
    auto items = std::span(kv_items).subspan(b, n);
    Place(items, std::span(f.kv).subspan(b, n), buf, m->kv_gap);
    const auto st = m->kv->GetBatch(items, reads);
    std::copy(st.begin(), st.end(), kv_status.begin() + win.b);
    MutexLock lock(&mu);
    blocks_requested += n;
    for (std::size_t i = 0; i < n; ++i)
      if (st[i].ok()) ++blocks_read[static_cast<std::size_t>(f.kv[b + i].tier)];
    return;
  }
  const std::size_t first = static_cast<std::size_t>(win.phase) * static_cast<std::size_t>(kmax) + b;
  auto items = std::span(range_items).subspan(first, n);
  std::uint64_t at = 0;
  for (auto& it : items) {
    const std::uint64_t slot = Slot(it.length, 0);  // ranges of one phase are not adjacent on disk: no gap
    it.out = std::span<std::byte>(buf.data() + at, slot);
    at += slot;
  }
  const auto st = m->kv->GetRanges(items);
  std::copy(st.begin(), st.end(), range_status.begin() + static_cast<std::ptrdiff_t>(first));
  MutexLock lock(&mu);
  ranges_issued = true;
  if (win.phase == 0) blocks_requested += n;  // a chunk's first sub-range stands for its block
  for (std::size_t i = 0; i < n; ++i) {
    if (!st[i].ok()) continue;
    const auto t = static_cast<std::size_t>(items[i].tier);
    ++range_reads[t];
    if (win.phase == 0) ++blocks_read[t];
  }
}

void LayerwiseRestore::Job::ReadSnapshots() {
  const auto& kda = L().kda_layers();
  Place(snap_items, std::span(f.state).subspan(static_cast<std::size_t>(kmax - 1) * kda.size(), kda.size()),
        snap_buffer, m->st_gap);
  snap_status = m->st->GetBatch(snap_items, reads);
  MutexLock lock(&mu);
  blocks_requested += snap_items.size();
  for (std::size_t j = 0; j < snap_items.size(); ++j)
    if (snap_status[j].ok())
      ++blocks_read[static_cast<std::size_t>(f.state[static_cast<std::size_t>(kmax - 1) * kda.size() + j].tier)];
}

void LayerwiseRestore::Job::FaultLoop() {
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

void LayerwiseRestore::Job::SnapshotLoop() {
  if (!Stopped()) {
    ReadSnapshots();
    DecodeSnapshots();
  }
  {
    MutexLock lock(&mu);
    snapshots_done = true;
  }
  cv.SignalAll();
}

}  // namespace terrace::kv
