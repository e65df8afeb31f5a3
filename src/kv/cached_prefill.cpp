// PrefillWithCache (docs/prefix-cache.md, "Compute and write-back"): restore, compute the rest in
// chunk-aligned pieces, write out what was computed. Layerwise by default: the restore's reads
// run under the first piece's forward pass (on_layer_begin -> LayerwiseRestore::RetrieveLayer)
// and the write-out goes layer by layer (on_layer_end -> PrefixCache::StoreLayer).
#include <algorithm>
#include <chrono>

#include <fmt/format.h>

#include "src/kv/prefix_cache_impl.h"

namespace terrace::kv {
namespace {

// Puts a session's own hooks back when the prefill returns, whatever the path.
class HookGuard {
 public:
  explicit HookGuard(model::Session* s) : session_(s), saved_(s->hooks()) {}
  ~HookGuard() { session_->set_hooks(saved_); }
  const model::ForwardOptions& saved() const { return saved_; }
  HookGuard(const HookGuard&) = delete;
  HookGuard& operator=(const HookGuard&) = delete;

 private:
  model::Session* session_;
  model::ForwardOptions saved_;
};

// Ends the prefill's StoreLayer pass when it returns, whatever the path (success, a failed
// piece, a failed write-out): rows of a chunk whose MLA layers were not all stored are dropped,
// not left in the cache for the next pass of the same state to mix with.
class StoreLayerGuard {
 public:
  StoreLayerGuard(PrefixCache& cache, const model::SequenceState& state) : cache_(cache), state_(state) {}
  ~StoreLayerGuard() { cache_.EndStoreLayers(state_); }
  StoreLayerGuard(const StoreLayerGuard&) = delete;
  StoreLayerGuard& operator=(const StoreLayerGuard&) = delete;

 private:
  PrefixCache& cache_;
  const model::SequenceState& state_;
};

}  // namespace

Result<CachedPrefill> PrefillWithCache(model::Session* session, PrefixCache& cache, const PrefixRequest& request,
                                       const PrefillOptions& options) {
  if (session == nullptr) return Status::InvalidArgument("PrefillWithCache: the session is null");
  if (session->state().num_tokens() != 0)
    return Status::InvalidArgument("PrefillWithCache: the session must be fresh (no tokens yet)");
  if (request.tokens.empty()) return Status::InvalidArgument("PrefillWithCache: the prompt is empty");
  const std::int64_t C = cache.layout().chunk_tokens();
  // Checked once here (its chunk_ids against its tokens and tenant included); the request is a const
  // reference held for the call, so the restore and write-out below skip their per-call checks.
  PrefixCache::Impl& impl = PrefixCacheAccess::impl(cache);
  TERRACE_RETURN_IF_ERROR(impl.CheckRequest(request, "PrefillWithCache").status());
  const auto n = static_cast<std::int64_t>(request.tokens.size());
  const auto last_chunks = static_cast<std::int64_t>(request.chunk_ids.size());
  HookGuard guard(session);
  StoreLayerGuard pass_guard(cache, session->state());

  CachedPrefill out;
  std::unique_ptr<LayerwiseRestore> layerwise;
  if (options.restore && options.layerwise) {
    TERRACE_ASSIGN_OR_RETURN(layerwise, PrefixCacheAccess::BeginRestoreChecked(cache, request, &session->state()));
    if (layerwise->boundary_tokens() == 0) {
      TERRACE_ASSIGN_OR_RETURN(out.restore, layerwise->Finish());
      layerwise.reset();
    }
  } else if (options.restore) {
    TERRACE_ASSIGN_OR_RETURN(out.restore, PrefixCacheAccess::RestoreChecked(cache, request, &session->state()));
  }
  std::int64_t b = layerwise ? layerwise->boundary_tokens() : out.restore.boundary_tokens;

  // The piece being computed: its end decides what the write-out stores.
  std::int64_t piece_end = 0;
  Status write_error;
  model::ForwardOptions mine;
  mine.on_layer_begin = [&](int layer, std::int64_t) -> Status {
    return layerwise ? layerwise->RetrieveLayer(layer) : Status::Ok();
  };
  mine.on_layer_end = [&](int layer, std::span<const float>, std::int64_t) {
    if (!options.write_back || !options.layerwise || piece_end % C != 0 || piece_end / C > last_chunks) return;
    const std::int64_t chunks = piece_end / C;
    Status s = impl.StoreLayerChecked(request, chunks, layer, session->state(), cache.layout().SnapshotDue(chunks, last_chunks));
    if (!s.ok() && write_error.ok()) write_error = s;
  };
  session->set_hooks(model::ChainHooks(guard.saved(), std::move(mine)));

  const auto t0 = std::chrono::steady_clock::now();
  std::vector<float> logits;
  std::int64_t vocab = 0;
  for (std::int64_t pos = b; pos < n;) {
    const std::int64_t end = std::min(n, (pos / C + 1) * C);
    piece_end = end;
    auto piece = session->Prefill(
        std::span(request.tokens).subspan(static_cast<std::size_t>(pos), static_cast<std::size_t>(end - pos)));
    if (layerwise) {
      // The restore's layers were all handed out (or one failed): settle the boundary now.
      const bool voided = layerwise->voided();
      if (!piece.ok() && !voided) return piece.status();
      if (voided) session->state().Reset();  // Finish restores it whole at the earlier boundary
      TERRACE_ASSIGN_OR_RETURN(out.restore, layerwise->Finish());
      layerwise.reset();
      if (voided) {
        // The discarded pass's rows of its chunk: the recompute from the earlier boundary stores
        // that chunk again, from its own rows only.
        cache.EndStoreLayers(session->state());
        b = out.restore.boundary_tokens;
        pos = b;
        continue;  // recompute from the earlier boundary, same pieces
      }
    }
    if (!piece.ok()) return piece.status();
    TERRACE_RETURN_IF_ERROR(write_error);
    vocab = piece->dim(1);
    logits.insert(logits.end(), piece->data.begin(), piece->data.end());
    if (options.write_back && !options.layerwise && end % C == 0 && end / C <= last_chunks) {
      const std::int64_t chunks = end / C;
      TERRACE_RETURN_IF_ERROR(
          impl.WriteBackChecked(request, chunks, session->state(), cache.layout().SnapshotDue(chunks, last_chunks)));
    }
    pos = end;
  }
  out.compute_seconds = SecondsSince(t0);
  out.restored_tokens = b;
  out.computed_tokens = n - b;
  out.logits.shape = {out.computed_tokens, vocab};
  out.logits.data = std::move(logits);
  return out;
}

}  // namespace terrace::kv
