#include "terrace/prefix_cache.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "src/kv/block_format.h"
#include "src/kv/prefix_cache_impl.h"
#include "terrace/hash.h"
#include "terrace/keys.h"

namespace terrace::kv {
namespace {

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

void PrefixCache::Impl::WriterLoop() {
  for (;;) {
    std::function<void()> job;
    {
      MutexLock lock(&q_mu);
      while (!stop && queue.empty()) q_cv.Wait(&q_mu);
      if (queue.empty()) return;
      job = std::move(queue.front());
      queue.pop_front();
      ++active;
    }
    job();
    {
      MutexLock lock(&q_mu);
      --active;
      if (queue.empty() && active == 0 && puts_in_flight == 0) idle_cv.SignalAll();
    }
  }
}

void PrefixCache::Impl::Enqueue(std::function<void()> job) {
  {
    MutexLock lock(&q_mu);
    queue.push_back(std::move(job));
  }
  q_cv.Signal();
}

void PrefixCache::Impl::WriteBlock(Store* store, const BlockKey& key,
                                   const std::function<Status(std::vector<std::byte>*)>& encode, bool is_state) {
  if (store->Contains(key)) {
    MutexLock lock(&stats_mu);
    ++(is_state ? stats.state_already_stored : stats.chunk_already_stored);
    return;
  }
  auto bytes = std::make_shared<std::vector<std::byte>>();
  Status s = encode(bytes.get());
  auto finish = [this, key, is_state](const Status& status, std::uint64_t size) {
    MutexLock lock(&stats_mu);
    if (!status.ok()) {
      // The first failure is logged; the rest, often the same one for every block of a full pool,
      // are only counted (stats.write_failures), so a full pool cannot flood the log.
      if (++stats.write_failures == 1) {
        logger->Log(LogLevel::kWarning, "prefix-cache",
                    fmt::format("write-back of {} failed (the block is not cached): {}; later write-back failures of "
                                "this cache are counted in its stats, not logged",
                                key.ToString(), status.ToString()));
      }
      return;
    }
    ++(is_state ? stats.state_writes : stats.chunk_writes);
    stats.bytes_written += size;
  };
  if (!s.ok()) {
    finish(s, 0);
    return;
  }
  {
    MutexLock lock(&q_mu);
    ++puts_in_flight;
  }
  // `bytes` lives in the callback until the Put completed (PutAsync's contract).
  store->PutAsync(key, *bytes, PutOptions{StoreCodecTag(is_state ? layout.state_codec() : layout.kv_codec()), {}})
      .then([this, bytes, finish](Status status) {
        finish(status, bytes->size());
        MutexLock lock(&q_mu);
        --puts_in_flight;
        if (queue.empty() && active == 0 && puts_in_flight == 0) idle_cv.SignalAll();
      });
}

void PrefixCache::Impl::EnqueueChunk(const ContentId& id, std::shared_ptr<std::vector<std::vector<float>>> rows) {
  const BlockKey key = keys::KvChunkKey(ns_kv, id);
  Enqueue([this, rows = std::move(rows), key, id] {
    WriteBlock(kv, key, [&](std::vector<std::byte>* out) { return format::EncodeKvChunk(layout, id, *rows, out); }, false);
  });
}

void PrefixCache::Impl::EnqueueSnapshot(const ContentId& id, int l, std::int64_t boundary, std::vector<float> recurrent,
                                        std::vector<float> conv) {
  auto rec = std::make_shared<std::vector<float>>(std::move(recurrent));
  auto cv = std::make_shared<std::vector<float>>(std::move(conv));
  const BlockKey key = keys::StateKey(ns_state, l, id);
  Enqueue([this, rec, cv, key, id, l, boundary] {
    WriteBlock(st, key,
               [&](std::vector<std::byte>* out) { return format::EncodeState(layout, l, boundary, id, *rec, *cv, out); },
               true);
  });
}

Status CheckStateShape(const KvLayout& L, const model::SequenceState& state, std::string_view where) {
  auto refuse = [&](const std::string& what) {
    return Status::InvalidArgument(fmt::format("{}: the state is not shaped for this cache's model ({}); create it "
                                               "with SequenceState::ForConfig of the same config",
                                               where, what));
  };
  if (state.num_layers() != L.num_layers())
    return refuse(fmt::format("{} layers, the cache's model has {}", state.num_layers(), L.num_layers()));
  if (!L.mla_layers().empty() && state.mla_width() != L.mla_width())
    return refuse(fmt::format("MLA width {}, the cache's model has {}", state.mla_width(), L.mla_width()));
  for (int l : L.mla_layers()) {
    if (!state.layer(l).is_mla) return refuse(fmt::format("layer {} is not MLA, the cache's model's is", l));
  }
  const auto recurrent = static_cast<std::size_t>(L.kda_heads()) * static_cast<std::size_t>(L.kda_head_dim()) *
                         static_cast<std::size_t>(L.kda_head_dim());
  const auto conv = static_cast<std::size_t>(L.kda_conv_rows()) * static_cast<std::size_t>(L.kda_conv_cols());
  for (int l : L.kda_layers()) {
    const model::LayerState& s = state.layer(l);
    if (s.is_mla) return refuse(fmt::format("layer {} is MLA, the cache's model's is KDA", l));
    if (s.recurrent.size() != recurrent || s.conv.size() != conv)
      return refuse(fmt::format("KDA layer {} holds {} recurrent and {} conv values, the cache's model {} and {}", l,
                                s.recurrent.size(), s.conv.size(), recurrent, conv));
  }
  return Status::Ok();
}

namespace {

// True when `s` covers exactly `tokens` tokens and, for an MLA layer, holds their `width`-value
// latent rows (WriteBack and StoreLayer copy them at those offsets).
bool CoversTokens(const model::LayerState& s, std::int64_t tokens, std::int64_t width) {
  return s.tokens == tokens && (!s.is_mla || s.latents.size() >= static_cast<std::size_t>(tokens * width));
}

}  // namespace

Result<std::int64_t> RestorableChunks(const PrefixRequest& r, int chunk_tokens, std::string_view where) {
  const auto n = static_cast<std::int64_t>(r.tokens.size());
  const std::int64_t full = n / chunk_tokens, most = n > 0 ? (n - 1) / chunk_tokens : 0;
  const auto ids = static_cast<std::int64_t>(r.chunk_ids.size());
  if (ids > full)
    return Status::InvalidArgument(fmt::format("{}: the request has {} chunk_ids but its {} tokens hold only {} full "
                                               "{}-token chunks (build requests with PrefixCache::Prepare)",
                                               where, ids, n, full, chunk_tokens));
  if (r.restorable_chunks < 0 || r.restorable_chunks > most)
    return Status::InvalidArgument(fmt::format("{}: restorable_chunks {} is outside [0, {}] for {} tokens in {}-token "
                                               "chunks (the last token is always computed: at most (tokens - 1) / "
                                               "chunk_tokens chunks are restored)",
                                               where, r.restorable_chunks, most, n, chunk_tokens));
  return std::min(r.restorable_chunks, ids);
}

Status PrefixCache::Impl::CheckChunkIds(const PrefixRequest& r, std::size_t count, std::string_view where,
                                        std::size_t from) const {
  const auto C = static_cast<std::size_t>(layout.chunk_tokens());
  if (count > r.chunk_ids.size() || count > r.tokens.size() / C)
    return Status::InvalidArgument(fmt::format("{}: the request has {} chunk_ids and {} full {}-token chunks, {} are "
                                               "needed (build requests with PrefixCache::Prepare)",
                                               where, r.chunk_ids.size(), r.tokens.size() / C, C, count));
  if (count == 0 || from >= count) return Status::Ok();
  const std::span<const std::int32_t> tokens(r.tokens);
  ContentId id = from == 0 ? keys::TenantRoot(kv_root, r.tenant) : r.chunk_ids[from - 1];
  for (std::size_t i = from; i < count; ++i) {
    id = ChainContentId(id, tokens.subspan(i * C, C));
    if (id != r.chunk_ids[i])
      return Status::InvalidArgument(fmt::format(
          "{}: the request does not hold together: chunk_ids[{}] is not the content id of its tokens [0, {}) under "
          "its tenant \"{}\" in this cache's namespace (tokens, tenant or chunk_ids were changed after "
          "PrefixCache::Prepare, or the request was prepared by another cache); build it with this cache's "
          "Prepare(tokens, tenant), and change afterwards only chunk_ids by cutting them or restorable_chunks",
          where, i, (i + 1) * C, r.tenant.size() <= 64 ? r.tenant : r.tenant.substr(0, 64) + "..."));
  }
  return Status::Ok();
}

Status PrefixCache::Impl::CheckWrite(const PrefixRequest& r, std::size_t chunks, const model::SequenceState* pass,
                                     std::string_view where) {
  const auto C = static_cast<std::size_t>(layout.chunk_tokens());
  if (chunks == 0 || chunks > r.chunk_ids.size() || chunks > r.tokens.size() / C) return CheckChunkIds(r, chunks, where);
  const auto ids = r.chunk_ids.begin();
  bool link_only = false;
  {
    MutexLock lock(&verified_mu);
    if (const auto it = verified.find(pass); it != verified.end() && it->second.tenant == r.tenant) {
      const std::vector<ContentId>& v = it->second.ids;
      if (v.size() >= chunks && std::equal(ids, ids + static_cast<std::ptrdiff_t>(chunks), v.begin()))
        return Status::Ok();  // another layer of a chunk already checked
      link_only = v.size() == chunks - 1 && std::equal(ids, ids + static_cast<std::ptrdiff_t>(chunks - 1), v.begin());
    }
  }
  // Only the new chunk's link when the earlier ids are the checked ones; a failure is then named
  // by the check in full (the first id that differs).
  const bool link_holds = link_only && CheckChunkIds(r, chunks, where, chunks - 1).ok();
  if (!link_holds) TERRACE_RETURN_IF_ERROR(CheckChunkIds(r, chunks, where));
  MutexLock lock(&verified_mu);
  if (verified.size() >= kMaxCheckedPasses && !verified.contains(pass)) verified.clear();
  Checked& c = verified[pass];
  if (link_holds) {
    if (c.tenant == r.tenant && c.ids.size() == chunks - 1) c.ids.push_back(r.chunk_ids[chunks - 1]);
    else verified.erase(pass);  // the pass's record changed meanwhile (another thread): check in full next time
  } else {
    c.tenant = r.tenant;
    c.ids.assign(ids, ids + static_cast<std::ptrdiff_t>(chunks));
  }
  return Status::Ok();
}

Result<std::int64_t> PrefixCache::Impl::CheckRequest(const PrefixRequest& r, std::string_view where) const {
  TERRACE_ASSIGN_OR_RETURN(const std::int64_t chunks, RestorableChunks(r, layout.chunk_tokens(), where));
  TERRACE_RETURN_IF_ERROR(CheckChunkIds(r, r.chunk_ids.size(), where));
  return chunks;
}

PrefixCache::Impl::Found PrefixCache::Impl::LookupFound(const PrefixRequest& r, std::int64_t chunks) const {
  Found f;
  const std::int64_t K = chunks;
  {
    MutexLock lock(&stats_mu);
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

Result<std::unique_ptr<PrefixCache>> PrefixCache::Create(const KvLayout& layout, const ContentId& model_id,
                                                         Store* kv_store, Store* state_store,
                                                         std::shared_ptr<Logger> logger) {
  if (kv_store == nullptr || state_store == nullptr)
    return Status::InvalidArgument("PrefixCache::Create: the KV store and the state store must not be null");
  if (layout.num_layers() < 1)
    return Status::InvalidArgument("PrefixCache::Create: the layout has no layers (a default-constructed KvLayout); "
                                   "build it with KvLayout::FromConfig of the model's config");
  auto impl = std::make_unique<Impl>();
  impl->layout = layout;
  impl->model_id = model_id;
  impl->kv = kv_store;
  impl->st = state_store;
  impl->kv_gap = kv_store->read_gap_bytes();
  impl->st_gap = state_store->read_gap_bytes();
  impl->logger = LoggerOrDefault(std::move(logger));
  impl->ns_kv = keys::Namespace(model_id, layout.Id(), layout.kv_codec().Name(), keys::kKeySchemaVersion);
  impl->kv_root = keys::NamespaceRoot(model_id, layout.Id(), layout.kv_codec().Name(), keys::kKeySchemaVersion);
  impl->ns_state = keys::Namespace(model_id, layout.Id(), layout.state_codec().Name(), keys::kKeySchemaVersion);
  Impl* raw = impl.get();
  TERRACE_ASSIGN_OR_RETURN(impl->writer, StartThread("the prefix cache's writer thread", [raw] { raw->WriterLoop(); }));
  return std::unique_ptr<PrefixCache>(new PrefixCache(std::move(impl)));
}

PrefixCache::PrefixCache(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

PrefixCache::~PrefixCache() {
  Flush();  // the writer's queue and the Puts still in flight
  {
    MutexLock lock(&impl_->q_mu);
    impl_->stop = true;
  }
  impl_->q_cv.SignalAll();
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
  r.chunk_ids = keys::ChunkIds(impl_->kv_root, tenant, tokens, impl_->layout.chunk_tokens());
  r.restorable_chunks =
      tokens.empty() ? 0 : static_cast<std::int64_t>(tokens.size() - 1) / impl_->layout.chunk_tokens();
  return r;
}

Result<PrefixLookup> PrefixCache::Lookup(const PrefixRequest& request) const {
  TERRACE_ASSIGN_OR_RETURN(const std::int64_t chunks, impl_->CheckRequest(request, "PrefixCache::Lookup"));
  const Impl::Found f = impl_->LookupFound(request, chunks);
  PrefixLookup out;
  out.restorable_chunks = chunks;
  out.kv_chunks_present = f.kv_present;
  out.boundary_tokens = f.candidates.empty() ? 0 : f.candidates.front() * impl_->layout.chunk_tokens();
  return out;
}

Status PrefixCache::WriteBack(const PrefixRequest& request, std::int64_t chunks, const model::SequenceState& state,
                              bool snapshot) {
  if (chunks >= 1 && chunks <= static_cast<std::int64_t>(request.chunk_ids.size()))
    TERRACE_RETURN_IF_ERROR(impl_->CheckWrite(request, static_cast<std::size_t>(chunks), &state, "PrefixCache::WriteBack"));
  return impl_->WriteBackChecked(request, chunks, state, snapshot);
}

Status PrefixCache::Impl::WriteBackChecked(const PrefixRequest& request, std::int64_t chunks,
                                           const model::SequenceState& state, bool snapshot) {
  Impl& m = *this;
  const KvLayout& L = m.layout;
  const std::int64_t C = L.chunk_tokens(), W = L.mla_width();
  if (chunks < 1 || chunks > static_cast<std::int64_t>(request.chunk_ids.size()))
    return Status::InvalidArgument(fmt::format("PrefixCache::WriteBack: chunk count {} is outside [1, {}]", chunks,
                                               request.chunk_ids.size()));
  TERRACE_RETURN_IF_ERROR(CheckStateShape(L, state, "PrefixCache::WriteBack"));
  for (int l = 0; l < state.num_layers(); ++l)
    if (!CoversTokens(state.layer(l), chunks * C, W))
      return Status::InvalidArgument(fmt::format("PrefixCache::WriteBack: layer {} covers {} tokens ({} latent values), "
                                                 "expected {} tokens (write back right after computing chunk {})", l,
                                                 state.layer(l).tokens, state.layer(l).latents.size(), chunks * C,
                                                 chunks - 1));
  const ContentId id = request.chunk_ids[static_cast<std::size_t>(chunks - 1)];
  if (!L.mla_layers().empty()) {
    auto rows = std::make_shared<std::vector<std::vector<float>>>();
    for (int l : L.mla_layers()) {
      const auto& lat = state.layer(l).latents;
      rows->emplace_back(lat.begin() + (chunks - 1) * C * W, lat.begin() + chunks * C * W);
    }
    m.EnqueueChunk(id, std::move(rows));
  }
  if (snapshot)
    for (int l : L.kda_layers()) m.EnqueueSnapshot(id, l, chunks * C, state.layer(l).recurrent, state.layer(l).conv);
  return Status::Ok();
}

Status PrefixCache::StoreLayer(const PrefixRequest& request, std::int64_t chunks, int layer,
                               const model::SequenceState& state, bool snapshot) {
  if (chunks >= 1 && chunks <= static_cast<std::int64_t>(request.chunk_ids.size()))
    TERRACE_RETURN_IF_ERROR(impl_->CheckWrite(request, static_cast<std::size_t>(chunks), &state, "PrefixCache::StoreLayer"));
  return impl_->StoreLayerChecked(request, chunks, layer, state, snapshot);
}

Status PrefixCache::Impl::StoreLayerChecked(const PrefixRequest& request, std::int64_t chunks, int layer,
                                            const model::SequenceState& state, bool snapshot) {
  Impl& m = *this;
  const KvLayout& L = m.layout;
  const std::int64_t C = L.chunk_tokens(), W = L.mla_width();
  if (chunks < 1 || chunks > static_cast<std::int64_t>(request.chunk_ids.size()) || layer < 0 || layer >= L.num_layers())
    return Status::InvalidArgument(fmt::format("PrefixCache::StoreLayer: chunk count {} is outside [1, {}] or layer {} "
                                               "outside [0, {})",
                                               chunks, request.chunk_ids.size(), layer, L.num_layers()));
  TERRACE_RETURN_IF_ERROR(CheckStateShape(L, state, "PrefixCache::StoreLayer"));
  const model::LayerState& s = state.layer(layer);
  if (!CoversTokens(s, chunks * C, W))
    return Status::InvalidArgument(fmt::format("PrefixCache::StoreLayer: layer {} covers {} tokens ({} latent values), "
                                               "expected {} tokens (store a layer right after it computed chunk {})",
                                               layer, s.tokens, s.latents.size(), chunks * C, chunks - 1));
  const ContentId id = request.chunk_ids[static_cast<std::size_t>(chunks - 1)];
  if (!s.is_mla) {
    if (snapshot) m.EnqueueSnapshot(id, layer, chunks * C, s.recurrent, s.conv);
    return Status::Ok();
  }
  const auto& mla = L.mla_layers();
  const std::size_t j = static_cast<std::size_t>(std::find(mla.begin(), mla.end(), layer) - mla.begin());
  std::vector<float> rows(s.latents.begin() + (chunks - 1) * C * W, s.latents.begin() + chunks * C * W);
  std::shared_ptr<std::vector<std::vector<float>>> complete;
  {
    MutexLock lock(&m.q_mu);
    const Impl::PendingKey pk{id.hi, id.lo, &state};
    auto& slot = m.pending_chunks[pk];
    slot.resize(mla.size());
    slot[j] = std::move(rows);
    bool all = true;
    for (const auto& r : slot) all = all && !r.empty();
    if (all) {
      complete = std::make_shared<std::vector<std::vector<float>>>(std::move(slot));
      m.pending_chunks.erase(pk);
    }
  }
  if (complete) m.EnqueueChunk(id, std::move(complete));
  return Status::Ok();
}

void PrefixCache::EndStoreLayers(const model::SequenceState& state) {
  {
    MutexLock lock(&impl_->verified_mu);
    impl_->verified.erase(&state);
  }
  MutexLock lock(&impl_->q_mu);
  std::erase_if(impl_->pending_chunks, [&](const auto& e) { return e.first.pass == &state; });
}

void PrefixCache::SetRestorePromotion(std::optional<bool> promote) {
  impl_->restore_promote.store(promote, std::memory_order_relaxed);
}

void PrefixCache::SetRestoreReadOrder(RestoreReadOrder order) {
  impl_->restore_order.store(order, std::memory_order_relaxed);
}

void PrefixCache::Flush() {
  MutexLock lock(&impl_->q_mu);
  while (!impl_->queue.empty() || impl_->active != 0 || impl_->puts_in_flight != 0) impl_->idle_cv.Wait(&impl_->q_mu);
}

PrefixCacheStats PrefixCache::Stats() const {
  std::uint64_t pending = 0;
  {
    MutexLock lock(&impl_->q_mu);
    pending = impl_->pending_chunks.size();
  }
  MutexLock lock(&impl_->stats_mu);
  PrefixCacheStats out = impl_->stats;
  out.chunks_pending = pending;
  return out;
}

}  // namespace terrace::kv
