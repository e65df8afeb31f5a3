// A restore's life and its API (restore_job.h): LayerwiseRestore::RetrieveLayer / Finish (the
// fallback to an earlier joint boundary), PrefixCache::BeginRestore / Restore and
// PrefixCache::Reserve.
#include <algorithm>
#include <new>

#include <fmt/format.h>

#include "src/kv/restore_job.h"
#include "terrace/keys.h"

namespace terrace::kv {

void LayerwiseRestore::Job::Join() {
  for (auto& r : readers)
    if (r.joinable()) r.join();
  if (decoder.joinable()) decoder.join();
  if (snapshotter.joinable()) snapshotter.join();
  if (faulter.joinable()) faulter.join();
}

LayerwiseRestore::Job::~Job() {
  {
    MutexLock lock(&mu);
    stop = true;
  }
  cv.SignalAll();
  Join();
  if (pooled) {
    pooled->windows = std::move(window_buffers);
    pooled->snapshots = std::move(snap_buffer);
    pooled->recurrent = std::move(recurrent);
    pooled->conv = std::move(conv);
    m->restore_buffers.Give(std::move(pooled));
  }
}

void LayerwiseRestore::Job::ReturnUnusedLatents() {
  const auto& mla = L().mla_layers();
  for (std::size_t j = 0; j < latents_moved.size(); ++j) {
    std::vector<float>& own = state->layer(mla[j]).latents;
    if (latents_moved[j] || !own.empty() || own.capacity() >= latents[j].capacity()) continue;
    latents[j].clear();
    own = std::move(latents[j]);
    latents[j] = std::vector<float>();
  }
}

void LayerwiseRestore::Job::ReclaimLatents() {
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

Status LayerwiseRestore::Job::Import(int l, std::int64_t chunks) {
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
  // A second call would import again from latents the first already handed to the session (and
  // void the restore, moving its boundary back): refused, the restore unchanged.
  if (j.retrieved[u] != 0)
    return Status::InvalidArgument(
        fmt::format("LayerwiseRestore::RetrieveLayer: layer {} was already retrieved; call it once per layer", layer));
  if (j.voided)
    return Status::Cancelled(fmt::format("the layerwise restore to token {} is void (an earlier layer failed); discard "
                                       "this pass and Finish() the restore", j.kmax * j.C));
  Status s;
  {
    const auto w0 = std::chrono::steady_clock::now();
    MutexLock lock(&j.mu);
    while (j.ready[u] == 0) j.cv.Wait(&j.mu);
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
  // What the job's threads left under mu (they are joined: read once; the fallback below adds to
  // the byte counts).
  std::int64_t good_chunks = 0;
  Status chunk_error;
  std::string chunk_what;
  RestoreReport rep;
  std::chrono::steady_clock::time_point decoded_at;
  {
    MutexLock lock(&j.mu);
    good_chunks = j.good_chunks;
    chunk_error = j.chunk_error;
    chunk_what = j.chunk_what;
    rep.range_rereads = j.range_rereads;
    rep.bytes_read = j.bytes_read;
    rep.blocks_requested = j.blocks_requested;
    rep.blocks_read = j.blocks_read;
    rep.range_reads = j.range_reads;
    rep.read_by_layer = j.ranges_issued;
    decoded_at = j.decoded_at;
  }
  rep.lookup_boundary_tokens = j.kmax * C;
  rep.partial_boundary_tokens = j.f.partial * C;
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

  bool all_good = j.kmax > 0 && good_chunks == j.kmax;
  for (std::size_t i = 0; all_good && i < kda.size(); ++i) all_good = j.snap_status[i].ok();
  bool any_retrieved = false;
  for (char r : j.retrieved) any_retrieved = any_retrieved || r != 0;
  rep.layerwise = any_retrieved || j.voided;
  std::int64_t b = 0;
  // The snapshots the state was restored from (their sizes: RestoreReport::state_bytes).
  std::uint64_t restored_state_bytes = 0;
  if (all_good && !j.voided) {
    b = j.kmax;
    for (const auto& it : j.snap_items) restored_state_bytes += it.desc.size;
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
      if (!chunk_error.ok()) note(chunk_error, chunk_what);
      else
        for (std::size_t i = 0; i < kda.size(); ++i)
          if (!j.snap_status[i].ok())
            note(j.snap_status[i], fmt::format("KDA snapshot of layer {} at token {} ({})", kda[i], j.kmax * C,
                                               j.snap_items[i].key.ToString()));
    }
    // Earlier candidates: their snapshots, one batch per boundary, until one reads back good.
    for (std::int64_t k : j.f.candidates) {
      if (k >= j.kmax || k > good_chunks) continue;
      bool ok = true;
      std::uint64_t candidate_bytes = 0;  // its snapshots' (RestoreReport::state_bytes if it is the one)
      if (!kda.empty()) {
        std::vector<Store::GetItem> items(kda.size());
        for (std::size_t i = 0; i < kda.size(); ++i)
          items[i].key = keys::StateKey(m.ns_state, kda[i], j.chunk_ids[static_cast<std::size_t>(k - 1)]);
        // The reads are done (Join): the snapshot buffer is free for this boundary's blocks.
        LayerwiseRestore::Job::Place(items, std::span(j.f.state).subspan(static_cast<std::size_t>(k - 1) * kda.size(), kda.size()),
                                     j.snap_buffer, m.st_gap);
        const auto statuses = m.st->GetBatch(items, j.reads);
        rep.blocks_requested += items.size();
        // Every snapshot read counts in bytes_read, also those after one that failed.
        for (std::size_t i = 0; i < kda.size(); ++i)
          if (statuses[i].ok()) {
            const auto tier = static_cast<std::size_t>(j.f.state[static_cast<std::size_t>(k - 1) * kda.size() + i].tier);
            ++rep.blocks_read[tier];
            rep.bytes_read[tier] += items[i].desc.size;
            candidate_bytes += items[i].desc.size;
          }
        for (std::size_t i = 0; i < kda.size() && ok; ++i) {
          Status s = statuses[i];
          if (s.ok()) {
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
        restored_state_bytes = candidate_bytes;  // every snapshot of it read and decoded
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
  // Bytes of the blocks restored: the KV chunks [0, b) and the snapshots at b, not every block read
  // (the snapshots of a boundary given up, chunks past b, a failed chunk's header or sub-ranges, a
  // fallback candidate's snapshots that did not decode: those are in bytes_read only). A chunk read
  // as sub-ranges is its whole block: the sub-ranges cover its header and every layer's bytes.
  if (b > 0 && !L.mla_layers().empty())
    for (std::size_t u = 0; u < static_cast<std::size_t>(b); ++u)
      rep.kv_bytes += j.by_layer ? j.headers[u].block_size : j.kv_items[u].desc.size;
  rep.state_bytes = restored_state_bytes;
  // Until the last block was decoded; a whole restore's imports come after that, and count.
  rep.seconds = rep.layerwise && !rep.layerwise_voided
                    ? std::chrono::duration<double>(decoded_at - j.t0).count()
                    : SecondsSince(j.t0);
  {
    MutexLock lock(&m.stats_mu);
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
  if (rep.range_rereads > 1)
    m.logger->Log(LogLevel::kWarning, "prefix-cache",
                  fmt::format("restore to token {}: {} KV sub-ranges failed their read or check and were read again "
                              "as whole blocks (the first is logged above)", rep.lookup_boundary_tokens,
                              rep.range_rereads));
  for (const auto& r : rep.fallback_reasons)
    m.logger->Log(LogLevel::kWarning, "prefix-cache", "restore fell back to an earlier joint boundary: " + r);
  return rep;
}

Result<std::unique_ptr<LayerwiseRestore>> PrefixCache::BeginRestore(const PrefixRequest& request,
                                                                    model::SequenceState* state) {
  TERRACE_RETURN_IF_ERROR(impl_->CheckRequest(request, "PrefixCache::BeginRestore").status());
  return BeginRestore(request, state, impl_->restore_order.load(std::memory_order_relaxed));
}

Result<std::unique_ptr<LayerwiseRestore>> PrefixCache::BeginRestore(const PrefixRequest& request,
                                                                    model::SequenceState* state, RestoreReadOrder order) {
  const auto t0 = std::chrono::steady_clock::now();
  Impl& m = *impl_;
  const KvLayout& L = m.layout;
  if (state == nullptr)
    return Status::InvalidArgument("PrefixCache::Restore: the state is null (create it with SequenceState::ForConfig)");
  TERRACE_RETURN_IF_ERROR(CheckStateShape(L, *state, "PrefixCache::Restore"));
  TERRACE_ASSIGN_OR_RETURN(const std::int64_t chunks, RestorableChunks(request, L.chunk_tokens(), "PrefixCache::Restore"));
  auto job = std::make_unique<LayerwiseRestore::Job>();
  job->m = &m;
  job->reads.promote = m.restore_promote.load(std::memory_order_relaxed);
  job->t0 = t0;
  job->chunk_ids = request.chunk_ids;
  job->state = state;
  job->C = L.chunk_tokens();
  job->W = L.mla_width();
  job->prompt_tokens = static_cast<std::int64_t>(request.tokens.size());
  job->f = m.LookupFound(request, chunks);
  job->kmax = job->f.candidates.empty() ? 0 : job->f.candidates.front();
  // Sub-ranges at the offsets the layout fixes (no lossless stage), worth it with two or more MLA
  // layers; a restore that promotes reads whole blocks (a promotion moves whole blocks up).
  job->by_layer = order == RestoreReadOrder::kLayers && L.mla_layers().size() >= 2 &&
                  L.kv_codec().lossless == codec::Lossless::kNone &&
                  !job->reads.promote.value_or(m.kv->options().promote_on_get);
  TERRACE_RETURN_IF_ERROR(job->Start());
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
  TERRACE_RETURN_IF_ERROR(impl_->CheckRequest(request, "PrefixCache::Restore").status());
  return PrefixCacheAccess::RestoreChecked(*this, request, state);
}

Result<RestoreReport> PrefixCacheAccess::RestoreChecked(PrefixCache& c, const PrefixRequest& request,
                                                        model::SequenceState* state) {
  TERRACE_ASSIGN_OR_RETURN(auto restore, c.BeginRestore(request, state, RestoreReadOrder::kChunks));
  return restore->Finish();
}

}  // namespace terrace::kv
