// The decoding side of a restore (restore_job.h): the decoder thread checks and decodes each KV
// window in order (whole chunks, or one MLA layer's sub-ranges, re-reading a failed one whole) and
// the snapshots, and marks each layer ready.
#include <algorithm>

#include <fmt/format.h>

#include "src/kv/restore_job.h"
#include "terrace/keys.h"

namespace terrace::kv {

void LayerwiseRestore::Job::DecodeSnapshots() {
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
    MutexLock lock(&mu);
    if (snap_status[j].ok()) bytes_read[static_cast<std::size_t>(tier)] += snap_items[j].desc.size;
    if (!s.ok()) snap_status[j] = s;
    layer_status[static_cast<std::size_t>(kda[j])] = s;
    ready[static_cast<std::size_t>(kda[j])] = 1;
  }
  cv.SignalAll();
}

void LayerwiseRestore::Job::DecodeWindow(int w) {
  DecodeWindowBlocks(w);
  const auto u = static_cast<std::size_t>(w);
  const Window& win = windows[u];
  const bool ends_phase = win.phase >= 0 && (u + 1 == windows.size() || windows[u + 1].phase != win.phase);
  {
    MutexLock lock(&mu);
    free_buffers.push_back(window_buffer[u]);
    if (ends_phase) {
      const auto l = static_cast<std::size_t>(L().mla_layers()[static_cast<std::size_t>(win.phase)]);
      layer_status[l] = limit == kmax ? Status::Ok() : chunk_error;
      ready[l] = 1;
    }
  }
  cv.SignalAll();
}

void LayerwiseRestore::Job::DecodeWindowBlocks(int w) {
  decoding.store(static_cast<std::size_t>(w), std::memory_order_relaxed);
  const Window& win = windows[static_cast<std::size_t>(w)];
  const auto& mla = L().mla_layers();
  const bool last_phase = win.phase < 0 || static_cast<std::size_t>(win.phase) + 1 == mla.size();
  for (std::int64_t i = win.b; i < win.e; ++i) {
    {
      MutexLock lock(&mu);
      if (i >= limit) return;
    }
    const auto u = static_cast<std::size_t>(i);
    const Status s = win.phase < 0 ? DecodeChunk(u) : DecodeChunkLayer(static_cast<std::size_t>(win.phase), u);
    MutexLock lock(&mu);
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

std::span<float> LayerwiseRestore::Job::Rows(std::size_t j, std::size_t u) {
  const auto rows = static_cast<std::size_t>(C * W);
  latents[j].resize((u + 1) * rows);
  return std::span(latents[j]).subspan(u * rows, rows);
}

Status LayerwiseRestore::Job::DecodeChunk(std::size_t u) {
  const auto& mla = L().mla_layers();
  Status s = kv_status[u];
  if (s.ok()) {
    const std::span<const std::byte> block(kv_items[u].out.data(), kv_items[u].desc.size);
    auto ranges = format::ParseKvChunkHeader(L(), chunk_ids[u], block);
    s = ranges.status();
    // The block is whole, as the KV pool's GetBatch verified it: no second hash per layer.
    for (std::size_t j = 0; s.ok() && j < mla.size(); ++j)
      s = format::DecodeKvLayer(L(), block, (*ranges)[j], Rows(j, u), format::LayerCheck::kBlockVerifiedByStore);
    MutexLock lock(&mu);
    bytes_read[static_cast<std::size_t>(f.kv[u].tier)] += kv_items[u].desc.size;
  }
  return s;
}

Status LayerwiseRestore::Job::DecodeChunkLayer(std::size_t j, std::size_t u) {
  const Store::GetRangeItem& it = range_items[j * static_cast<std::size_t>(kmax) + u];
  Status s = range_status[j * static_cast<std::size_t>(kmax) + u];
  if (s.ok()) {
    const std::span<const std::byte> got(it.out.data(), it.length);
    {
      MutexLock lock(&mu);
      bytes_read[static_cast<std::size_t>(it.tier)] += it.length;
    }
    if (j == 0) {
      s = TakeHeader(u, got, it.desc.size);
    } else if (it.desc.size != headers[u].block_size) {
      s = Status::Corruption("the block changed size between its header's read and this layer's");
    }
    if (s.ok()) {
      format::LayerRange r = headers[u].ranges[j];
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
  bool first = false;
  {
    MutexLock lock(&mu);
    first = range_rereads++ == 0;
  }
  // The first per restore (Finish logs how many there were in all, when more than one).
  if (first)
    m->logger->Log(LogLevel::kWarning, "prefix-cache",
                   fmt::format("KV chunk {} ({}) MLA layer {}: {}; reading the whole block again", u,
                               it.key.ToString(), L().mla_layers()[j], s.ToString()));
  return RereadLayer(j, u);
}

Status LayerwiseRestore::Job::RereadLayer(std::size_t j, std::size_t u) {
  const BlockKey key = keys::KvChunkKey(m->ns_kv, chunk_ids[u]);
  const std::uint64_t room = Slot(std::max(f.kv[u].desc.size, L().mla_chunk_block_bytes()), 0);
  if (!reread.Ensure(static_cast<std::size_t>(room), kRawAlign))
    return Status::OutOfCapacity(fmt::format("no memory to read KV chunk block {} again", key.ToString()));
  auto got = m->kv->Get(key, std::span<std::byte>(reread.data(), reread.capacity()), reads);
  if (!got.ok()) return got.status();
  const std::span<const std::byte> block(reread.data(), got->size);
  {
    MutexLock lock(&mu);
    bytes_read[static_cast<std::size_t>(f.kv[u].tier)] += got->size;
    // The block's first sub-range read failed, so its block was not counted as served yet.
    if (j == 0 && !range_status[u].ok()) ++blocks_read[static_cast<std::size_t>(f.kv[u].tier)];
  }
  TERRACE_RETURN_IF_ERROR(TakeHeader(u, block, got->size));
  return format::DecodeKvLayer(L(), block, headers[u].ranges[j], Rows(j, u), format::LayerCheck::kBlockVerifiedByStore);
}

Status LayerwiseRestore::Job::TakeHeader(std::size_t u, std::span<const std::byte> head, std::uint64_t block_size) {
  auto ranges = format::ParseKvChunkHeader(L(), chunk_ids[u], head, block_size);
  TERRACE_RETURN_IF_ERROR(ranges.status());
  headers[u] = {std::move(*ranges), block_size};
  return Status::Ok();
}

void LayerwiseRestore::Job::DecodeLoop() {
  std::size_t windows_done = 0;
  for (std::size_t w = 0; w < windows.size(); ++w) {
    {
      MutexLock lock(&mu);
      while (window_read[w] == 0 && !reads_done) cv.Wait(&mu);
      if (!window_read[w]) break;  // stopped before this window was read
    }
    DecodeWindow(static_cast<int>(w));
    ++windows_done;
  }
  {
    MutexLock lock(&mu);
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
  cv.SignalAll();
  {
    // The restore is decoded when the snapshots are too (they may land after the KV chunks).
    MutexLock lock(&mu);
    while (!snapshots_done) cv.Wait(&mu);
    for (int l : L().kda_layers()) {  // snapshots never read (stopped early)
      if (!ready[static_cast<std::size_t>(l)]) {
        layer_status[static_cast<std::size_t>(l)] = Status::Cancelled("the restore was stopped before its snapshots were read");
        ready[static_cast<std::size_t>(l)] = 1;
      }
    }
    decoded_at = std::chrono::steady_clock::now();
  }
  cv.SignalAll();
}

}  // namespace terrace::kv
