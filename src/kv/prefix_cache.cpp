#include "terrace/prefix_cache.h"

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "src/kv/block_format.h"
#include "terrace/keys.h"

namespace terrace::kv {
namespace {

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Codec StoreCodecTag(const codec::CodecSpec& c) {
  if (c.lossless != codec::Lossless::kNone) return Codec::kRaw;
  switch (c.kind) {
    case codec::CodecKind::kF32: return Codec::kF32;
    case codec::CodecKind::kBf16: return Codec::kBf16;
    case codec::CodecKind::kF16: return Codec::kF16;
    case codec::CodecKind::kFp8E4M3: return Codec::kFp8E4M3;
    default: return Codec::kRaw;
  }
}

}  // namespace

struct PrefixCache::Impl {
  KvLayout layout;
  ContentId model_id;
  Store* kv = nullptr;
  Store* st = nullptr;
  std::shared_ptr<Logger> logger;
  std::uint32_t ns_kv = 0, ns_state = 0;

  mutable std::mutex stats_mu;
  mutable PrefixCacheStats stats;

  std::mutex q_mu;
  std::condition_variable q_cv, idle_cv;
  std::deque<std::function<void()>> queue;
  int active = 0;
  bool stop = false;
  std::thread writer;

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

  void WriterLoop() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock lock(q_mu);
        q_cv.wait(lock, [&] { return stop || !queue.empty(); });
        if (queue.empty()) return;
        job = std::move(queue.front());
        queue.pop_front();
        ++active;
      }
      job();
      {
        std::lock_guard lock(q_mu);
        --active;
        if (queue.empty() && active == 0) idle_cv.notify_all();
      }
    }
  }

  void Enqueue(std::function<void()> job) {
    {
      std::lock_guard lock(q_mu);
      queue.push_back(std::move(job));
    }
    q_cv.notify_one();
  }

  void WriteBlock(Store* store, const BlockKey& key, const std::function<Status(std::vector<std::byte>*)>& encode,
                  bool is_state) {
    if (store->Contains(key)) {
      std::lock_guard lock(stats_mu);
      ++(is_state ? stats.state_writes : stats.chunk_writes);
      return;
    }
    std::vector<std::byte> bytes;
    Status s = encode(&bytes);
    if (s.ok()) s = store->Put(key, bytes, PutOptions{StoreCodecTag(is_state ? layout.state_codec() : layout.kv_codec()), {}});
    std::lock_guard lock(stats_mu);
    if (!s.ok()) {
      ++stats.write_failures;
      logger->Log(LogLevel::kWarning, "prefix-cache",
                  fmt::format("write-back of {} failed (the block is not cached): {}", key.ToString(), s.ToString()));
      return;
    }
    ++(is_state ? stats.state_writes : stats.chunk_writes);
    stats.bytes_written += bytes.size();
  }

  Found LookupFound(const PrefixRequest& r) const {
    Found f;
    const std::int64_t K = r.restorable_chunks;
    {
      std::lock_guard lock(stats_mu);
      ++stats.lookups;
    }
    if (K <= 0) return f;
    const auto& kda = layout.kda_layers();
    if (!layout.mla_layers().empty()) {
      std::vector<BlockKey> keys;
      keys.reserve(static_cast<std::size_t>(K));
      for (std::int64_t i = 0; i < K; ++i) keys.push_back(keys::KvChunkKey(ns_kv, r.chunk_ids[static_cast<std::size_t>(i)]));
      f.kv = kv->Lookup(keys);
      while (f.kv_present < K && f.kv[static_cast<std::size_t>(f.kv_present)].found) ++f.kv_present;
    } else {
      f.kv_present = K;
    }
    if (!kda.empty() && f.kv_present > 0) {
      std::vector<BlockKey> keys;
      keys.reserve(static_cast<std::size_t>(f.kv_present) * kda.size());
      for (std::int64_t k = 1; k <= f.kv_present; ++k)
        for (int l : kda) keys.push_back(keys::StateKey(ns_state, l, r.chunk_ids[static_cast<std::size_t>(k - 1)]));
      f.state = st->Lookup(keys);
    }
    for (std::int64_t k = f.kv_present; k >= 1; --k) {
      std::size_t present = 0;
      int missing_layer = -1;
      for (std::size_t j = 0; j < kda.size(); ++j) {
        if (f.state[static_cast<std::size_t>(k - 1) * kda.size() + j].found) ++present;
        else if (missing_layer < 0) missing_layer = kda[j];
      }
      if (present == kda.size()) {
        f.candidates.push_back(k);
      } else if (present > 0 && f.candidates.empty() && f.partial == 0) {
        f.partial = k;
        f.partial_missing_layer = missing_layer;
      }
    }
    return f;
  }
};

Result<std::unique_ptr<PrefixCache>> PrefixCache::Create(const KvLayout& layout, const ContentId& model_id,
                                                         Store* kv_store, Store* state_store,
                                                         std::shared_ptr<Logger> logger) {
  if (kv_store == nullptr || state_store == nullptr)
    return Status::InvalidArgument("PrefixCache::Create: the KV store and the state store must not be null");
  auto impl = std::make_unique<Impl>();
  impl->layout = layout;
  impl->model_id = model_id;
  impl->kv = kv_store;
  impl->st = state_store;
  impl->logger = LoggerOrDefault(std::move(logger));
  impl->ns_kv = keys::Namespace(model_id, layout.Id(), layout.kv_codec().Name(), keys::kKeySchemaVersion);
  impl->ns_state = keys::Namespace(model_id, layout.Id(), layout.state_codec().Name(), keys::kKeySchemaVersion);
  Impl* raw = impl.get();
  impl->writer = std::thread([raw] { raw->WriterLoop(); });
  return std::unique_ptr<PrefixCache>(new PrefixCache(std::move(impl)));
}

PrefixCache::PrefixCache(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

PrefixCache::~PrefixCache() {
  {
    std::lock_guard lock(impl_->q_mu);
    impl_->stop = true;
  }
  impl_->q_cv.notify_all();
  impl_->writer.join();  // drains the queue first
}

const KvLayout& PrefixCache::layout() const { return impl_->layout; }
std::uint32_t PrefixCache::kv_namespace() const { return impl_->ns_kv; }
std::uint32_t PrefixCache::state_namespace() const { return impl_->ns_state; }

PrefixRequest PrefixCache::Prepare(std::span<const std::int32_t> tokens, std::string_view tenant) const {
  PrefixRequest r;
  r.tokens.assign(tokens.begin(), tokens.end());
  r.tenant = std::string(tenant);
  // Chunk ids chain from the KV namespace's tenant root; state keys reuse them in their own namespace.
  r.chunk_ids = keys::ChunkIds(impl_->ns_kv, tenant, tokens, impl_->layout.chunk_tokens());
  r.restorable_chunks =
      tokens.empty() ? 0 : static_cast<std::int64_t>(tokens.size() - 1) / impl_->layout.chunk_tokens();
  return r;
}

PrefixLookup PrefixCache::Lookup(const PrefixRequest& request) const {
  const Impl::Found f = impl_->LookupFound(request);
  PrefixLookup out;
  out.restorable_chunks = request.restorable_chunks;
  out.kv_chunks_present = f.kv_present;
  out.boundary_tokens = f.candidates.empty() ? 0 : f.candidates.front() * impl_->layout.chunk_tokens();
  return out;
}

Result<RestoreReport> PrefixCache::Restore(const PrefixRequest& request, model::SequenceState* state) {
  const auto t0 = std::chrono::steady_clock::now();
  Impl& m = *impl_;
  const KvLayout& L = m.layout;
  if (state == nullptr || state->num_layers() != L.num_layers() ||
      (!L.mla_layers().empty() && state->mla_width() != L.mla_width()))
    return Status::InvalidArgument("PrefixCache::Restore: the state is not shaped for this cache's model "
                                   "(create it with SequenceState::ForConfig of the same config)");
  const std::int64_t C = L.chunk_tokens(), W = L.mla_width();
  const auto& mla = L.mla_layers();
  const auto& kda = L.kda_layers();
  RestoreReport rep;
  const Impl::Found f = m.LookupFound(request);
  rep.lookup_boundary_tokens = f.candidates.empty() ? 0 : f.candidates.front() * C;
  std::uint64_t missing = 0, corrupt = 0;
  auto note = [&](const Status& s, std::string what) {
    (s.code() == Code::kNotFound ? missing : corrupt)++;
    ++rep.fallbacks;
    rep.fallback_reasons.push_back(fmt::format("{}: {}", what, s.ToString()));
  };

  if (f.partial > 0)
    note(Status::NotFound("missing (evicted or never written)"),
         fmt::format("KDA snapshot of layer {} at token {}", f.partial_missing_layer, f.partial * C));

  std::int64_t b = 0;
  std::vector<std::vector<float>> latents(mla.size());
  std::vector<std::vector<float>> recurrent(kda.size()), conv(kda.size());
  if (!f.candidates.empty()) {
    const std::int64_t kmax = f.candidates.front();
    // KV chunks [0, kmax): one batch; decode up to the first bad one.
    std::int64_t good_chunks = kmax;
    Status chunk_error;
    std::string chunk_what;
    if (!mla.empty()) {
      std::vector<std::vector<std::byte>> bufs(static_cast<std::size_t>(kmax));
      std::vector<Store::GetItem> items(static_cast<std::size_t>(kmax));
      for (std::int64_t i = 0; i < kmax; ++i) {
        const auto u = static_cast<std::size_t>(i);
        bufs[u].resize(f.kv[u].desc.size);
        items[u].key = keys::KvChunkKey(m.ns_kv, request.chunk_ids[u]);
        items[u].out = bufs[u];
      }
      const auto statuses = m.kv->GetBatch(items);
      for (auto& v : latents) v.resize(static_cast<std::size_t>(kmax * C * W));
      for (std::int64_t i = 0; i < kmax; ++i) {
        const auto u = static_cast<std::size_t>(i);
        Status s = statuses[u];
        if (s.ok()) {
          rep.bytes_read[static_cast<std::size_t>(f.kv[u].tier)] += items[u].desc.size;
          rep.kv_bytes += items[u].desc.size;
          const std::span<const std::byte> block(bufs[u].data(), items[u].desc.size);
          auto ranges = format::ParseKvChunkHeader(L, request.chunk_ids[u], block);
          s = ranges.status();
          for (std::size_t j = 0; s.ok() && j < mla.size(); ++j)
            s = format::DecodeKvLayer(L, block, (*ranges)[j],
                                      std::span(latents[j]).subspan(static_cast<std::size_t>(i * C * W),
                                                                    static_cast<std::size_t>(C * W)));
        }
        if (!s.ok()) {
          good_chunks = i;
          chunk_error = s;
          chunk_what = fmt::format("KV chunk {} ({})", i, items[u].key.ToString());
          break;
        }
      }
    }
    bool chunk_noted = false;
    for (std::int64_t k : f.candidates) {
      if (k > good_chunks) {
        if (!chunk_noted) note(chunk_error, chunk_what);
        chunk_noted = true;
        continue;
      }
      // This boundary's snapshots: one batch.
      bool ok = true;
      if (!kda.empty()) {
        std::vector<std::vector<std::byte>> bufs(kda.size());
        std::vector<Store::GetItem> items(kda.size());
        for (std::size_t j = 0; j < kda.size(); ++j) {
          bufs[j].resize(f.state[static_cast<std::size_t>(k - 1) * kda.size() + j].desc.size);
          items[j].key = keys::StateKey(m.ns_state, kda[j], request.chunk_ids[static_cast<std::size_t>(k - 1)]);
          items[j].out = bufs[j];
        }
        const auto statuses = m.st->GetBatch(items);
        std::array<std::uint64_t, kNumTiers> bytes{};
        std::uint64_t state_bytes = 0;
        for (std::size_t j = 0; j < kda.size() && ok; ++j) {
          Status s = statuses[j];
          if (s.ok()) {
            bytes[static_cast<std::size_t>(f.state[static_cast<std::size_t>(k - 1) * kda.size() + j].tier)] += items[j].desc.size;
            state_bytes += items[j].desc.size;
            recurrent[j].resize(static_cast<std::size_t>(L.kda_heads()) * L.kda_head_dim() * L.kda_head_dim());
            conv[j].resize(static_cast<std::size_t>(L.kda_conv_rows()) * L.kda_conv_cols());
            s = format::DecodeState(L, kda[j], k * C, request.chunk_ids[static_cast<std::size_t>(k - 1)],
                                    std::span<const std::byte>(bufs[j].data(), items[j].desc.size), recurrent[j], conv[j]);
          }
          if (!s.ok()) {
            note(s, fmt::format("KDA snapshot of layer {} at token {} ({})", kda[j], k * C, items[j].key.ToString()));
            ok = false;
          }
        }
        for (std::size_t t = 0; t < kNumTiers; ++t) rep.bytes_read[t] += bytes[t];
        rep.state_bytes += state_bytes;
      }
      if (ok) {
        b = k;
        break;
      }
    }
  }

  // Import exactly [0, b) of every layer.
  state->Reset();
  const std::int64_t bt = b * C;
  if (b > 0) {
    for (std::size_t j = 0; j < mla.size(); ++j) {
      const auto bytes = std::as_bytes(std::span(latents[j]).first(static_cast<std::size_t>(bt * W)));
      TERRACE_RETURN_IF_ERROR(state->ImportLayer(mla[j], bytes, bt));
    }
    for (std::size_t j = 0; j < kda.size(); ++j) {
      std::vector<float> both(recurrent[j]);
      both.insert(both.end(), conv[j].begin(), conv[j].end());
      TERRACE_RETURN_IF_ERROR(state->ImportLayer(kda[j], std::as_bytes(std::span(both)), bt));
    }
    if (Status s = model::ValidateJointBoundary(*state); !s.ok())
      return Status::Internal("prefix cache restored a state that is not at a joint boundary: " + s.message());
  }
  rep.boundary_tokens = bt;
  rep.seconds = Since(t0);
  {
    std::lock_guard lock(m.stats_mu);
    if (b > 0) ++m.stats.restores;
    m.stats.restored_tokens += static_cast<std::uint64_t>(bt);
    m.stats.fallbacks += missing + corrupt;
    m.stats.fallbacks_missing += missing;
    m.stats.fallbacks_corrupt += corrupt;
    for (std::size_t t = 0; t < kNumTiers; ++t) m.stats.bytes_read[t] += rep.bytes_read[t];
  }
  for (const auto& r : rep.fallback_reasons)
    m.logger->Log(LogLevel::kWarning, "prefix-cache", "restore fell back to an earlier joint boundary: " + r);
  return rep;
}

Status PrefixCache::WriteBack(const PrefixRequest& request, std::int64_t chunks, const model::SequenceState& state,
                              bool snapshot) {
  Impl& m = *impl_;
  const KvLayout& L = m.layout;
  const std::int64_t C = L.chunk_tokens(), W = L.mla_width();
  if (chunks < 1 || chunks > static_cast<std::int64_t>(request.chunk_ids.size()) || state.num_layers() != L.num_layers())
    return Status::InvalidArgument(fmt::format("PrefixCache::WriteBack: chunk count {} is outside [1, {}] or the state has "
                                               "another model's shape", chunks, request.chunk_ids.size()));
  for (int l = 0; l < state.num_layers(); ++l)
    if (state.layer(l).tokens != chunks * C)
      return Status::InvalidArgument(fmt::format("PrefixCache::WriteBack: layer {} covers {} tokens, expected {} "
                                                 "(write back right after computing chunk {})", l, state.layer(l).tokens,
                                                 chunks * C, chunks - 1));
  const ContentId id = request.chunk_ids[static_cast<std::size_t>(chunks - 1)];
  if (!L.mla_layers().empty()) {
    auto rows = std::make_shared<std::vector<std::vector<float>>>();
    for (int l : L.mla_layers()) {
      const auto& lat = state.layer(l).latents;
      rows->emplace_back(lat.begin() + (chunks - 1) * C * W, lat.begin() + chunks * C * W);
    }
    const BlockKey key = keys::KvChunkKey(m.ns_kv, id);
    m.Enqueue([&m, rows, key, id] {
      m.WriteBlock(m.kv, key, [&](std::vector<std::byte>* out) { return format::EncodeKvChunk(m.layout, id, *rows, out); },
                   false);
    });
  }
  if (snapshot) {
    for (int l : L.kda_layers()) {
      auto rec = std::make_shared<std::vector<float>>(state.layer(l).recurrent);
      auto cv = std::make_shared<std::vector<float>>(state.layer(l).conv);
      const BlockKey key = keys::StateKey(m.ns_state, l, id);
      const std::int64_t boundary = chunks * C;
      m.Enqueue([&m, rec, cv, key, id, l, boundary] {
        m.WriteBlock(m.st, key,
                     [&](std::vector<std::byte>* out) { return format::EncodeState(m.layout, l, boundary, id, *rec, *cv, out); },
                     true);
      });
    }
  }
  return Status::Ok();
}

void PrefixCache::Flush() {
  std::unique_lock lock(impl_->q_mu);
  impl_->idle_cv.wait(lock, [&] { return impl_->queue.empty() && impl_->active == 0; });
}

PrefixCacheStats PrefixCache::Stats() const {
  std::lock_guard lock(impl_->stats_mu);
  return impl_->stats;
}

Result<CachedPrefill> PrefillWithCache(model::Session* session, PrefixCache& cache, const PrefixRequest& request,
                                       const PrefillOptions& options) {
  if (session == nullptr || session->state().num_tokens() != 0)
    return Status::InvalidArgument("PrefillWithCache: the session must be fresh (no tokens yet)");
  if (request.tokens.empty()) return Status::InvalidArgument("PrefillWithCache: the prompt is empty");
  CachedPrefill out;
  if (options.restore) {
    TERRACE_ASSIGN_OR_RETURN(out.restore, cache.Restore(request, &session->state()));
  }
  const std::int64_t C = cache.layout().chunk_tokens();
  const auto n = static_cast<std::int64_t>(request.tokens.size());
  const std::int64_t b = out.restore.boundary_tokens;
  out.restored_tokens = b;
  out.computed_tokens = n - b;
  const auto last_chunks = static_cast<std::int64_t>(request.chunk_ids.size());
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<float> logits;
  std::int64_t vocab = 0;
  for (std::int64_t pos = b; pos < n;) {
    const std::int64_t end = std::min(n, (pos / C + 1) * C);
    TERRACE_ASSIGN_OR_RETURN(
        model::Tensor piece,
        session->Prefill(std::span(request.tokens).subspan(static_cast<std::size_t>(pos), static_cast<std::size_t>(end - pos))));
    vocab = piece.dim(1);
    logits.insert(logits.end(), piece.data.begin(), piece.data.end());
    if (options.write_back && end % C == 0 && end / C <= last_chunks) {
      const std::int64_t chunks = end / C;
      TERRACE_RETURN_IF_ERROR(
          cache.WriteBack(request, chunks, session->state(), cache.layout().SnapshotDue(chunks, last_chunks)));
    }
    pos = end;
  }
  out.compute_seconds = Since(t0);
  out.logits.shape = {out.computed_tokens, vocab};
  out.logits.data = std::move(logits);
  return out;
}

}  // namespace terrace::kv
