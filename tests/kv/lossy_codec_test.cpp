// Lossy KV and state codecs through the prefix cache (docs/prefix-cache.md, "Lossy codecs"). A
// restore hands the model exactly codec::Decode(codec::Encode(x)) of the latents and snapshots it
// stored, so:
// - the restored state equals the exact state at the boundary with every chunk's latents (per MLA
//   layer, [C, width] as the KV chunk block encodes them) and every KDA layer's recurrent and conv
//   state round-tripped through the codec API, bitwise;
// - restore + suffix (+ decode) is bitwise a recompute whose state at the boundary was round-tripped
//   so (the exact oracle: the model has no hook for it, the test edits the state between pieces);
// - against the exact (f32) recompute, the logits stay within a per-codec tolerance, measured on
//   k3-toy and written in docs/prefix-cache.md; the test fails above it;
// - a lossless stage (+zstd, +lz4) changes no bit: the same restored states as without it (every
//   scenario) and the same logits (one scenario end to end; the model is deterministic).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <string>
#include <memory>
#include <span>
#include <vector>

#include <fmt/format.h>

#include "kv_test_util.h"

namespace terrace::kv {
namespace {

using namespace testing;

// Tolerances of max |logit - exact| / max |exact| against the exact (f32) recompute of the same
// prompt, over the computed positions before the first one whose MoE routing differs from the
// exact run's: the error the codec's rounding itself causes. A pair's tolerance is the sum of its
// two codecs' (f32: 0). Each is twice the largest error measured over the matrix below, rounded up
// to 1, 2 or 5 x 10^k (docs/prefix-cache.md, "Lossy codecs", has the measured figures).
double KvTolerance(const std::string& base) {
  static const std::map<std::string, double> t = {
      {"f32", 0},    {"bf16", 2e-3}, {"f16", 2e-4},      {"fp8", 1e-2},
      {"int8", 2e-3}, {"fp8-block", 2e-2}, {"int4-g32", 5e-2}, {"int4-g64", 5e-2},
  };
  return t.at(base);
}
double StateTolerance(const std::string& base) {
  static const std::map<std::string, double> t = {{"f32", 0}, {"bf16", 5e-3}, {"fp8", 5e-2}};
  return t.at(base);
}
// Over every computed position, whatever the codec: top-k routing is discontinuous, and a flip
// changes that token's FFN output wholesale (by up to 0.54 of the largest logit in the matrix
// below); which borderline decisions flip can differ with the machine's arithmetic, so this bound
// is one generous figure (it still catches a garbage decode).
constexpr double kAnyPositionTolerance = 1.0;

// max |x - ref| / max |ref| over the first `values` values of both.
double RelErr(const std::vector<float>& x, const std::vector<float>& ref, std::size_t values) {
  REQUIRE(x.size() == ref.size());
  REQUIRE(values <= ref.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < values; ++i) {
    num = std::max(num, static_cast<double>(std::abs(x[i] - ref[i])));
    den = std::max(den, static_cast<double>(std::abs(ref[i])));
  }
  return den > 0 ? num / den : num;
}

// Decode(Encode(x)) through the codec API.
std::vector<float> RoundTrip(const codec::CodecSpec& spec, std::span<const float> x, std::int64_t rows,
                             std::int64_t cols) {
  std::vector<std::byte> enc;
  REQUIRE(codec::Encode(spec, x, rows, cols, &enc).ok());
  std::vector<float> out(x.size());
  REQUIRE(codec::Decode(enc, rows, cols, out).ok());
  return out;
}

// `s` (at a chunk boundary) as a restore of it through layout L's codecs must decode it: each
// chunk of each MLA layer's latents round-tripped as one [C, width] matrix, each KDA layer's
// recurrent state as [H d_k, d_v] and its conv state as [kernel-1, 3 H d_k].
model::SequenceState RoundTripState(const KvLayout& L, model::SequenceState s) {
  const std::int64_t C = L.chunk_tokens(), W = L.mla_width();
  for (int l : L.mla_layers()) {
    auto& lat = s.layer(l).latents;
    REQUIRE(lat.size() % static_cast<std::size_t>(C * W) == 0);
    for (std::size_t at = 0; at < lat.size(); at += static_cast<std::size_t>(C * W)) {
      const auto chunk = RoundTrip(L.kv_codec(), std::span(lat).subspan(at, static_cast<std::size_t>(C * W)), C, W);
      std::copy(chunk.begin(), chunk.end(), lat.begin() + static_cast<std::ptrdiff_t>(at));
    }
  }
  for (int l : L.kda_layers()) {
    auto& ls = s.layer(l);
    ls.recurrent = RoundTrip(L.state_codec(), ls.recurrent, static_cast<std::int64_t>(L.kda_heads()) * L.kda_head_dim(),
                             L.kda_head_dim());
    ls.conv = RoundTrip(L.state_codec(), ls.conv, L.kda_conv_rows(), L.kda_conv_cols());
  }
  return s;
}

struct Out {
  std::vector<float> logits;               // rows [b, n)
  std::vector<std::vector<int>> routing;   // per position of [b, n): every MoE layer's expert ids (sorted), in layer order
  std::vector<std::vector<float>> decode;  // greedy steps after the prompt
};

constexpr int kDecode = 1;

// Computes tokens [b, n) on top of `state` (which covers [0, b)) in the pieces PrefillWithCache
// uses ([b, b+C), ..., [last boundary, n)), then kDecode greedy steps.
Out Continue(const model::Model& m, model::SequenceState state, const std::vector<std::int32_t>& tokens,
             std::int64_t b, std::int64_t C) {
  model::Session s(m);
  s.state() = std::move(state);
  REQUIRE(s.state().num_tokens() == b);
  Out out;
  const auto n = static_cast<std::int64_t>(tokens.size());
  out.routing.resize(static_cast<std::size_t>(n - b));
  std::size_t first = 0;  // the routing rows of the running call start here
  model::ForwardOptions hooks;
  hooks.on_routing = [&](int, const model::Routing& r) {
    const auto k = static_cast<std::size_t>(r.top_k);
    for (std::size_t t = 0; t < r.ids.size() / k && first + t < out.routing.size(); ++t) {
      auto& row = out.routing[first + t];
      const auto from = static_cast<std::ptrdiff_t>(row.size());
      row.insert(row.end(), r.ids.begin() + static_cast<std::ptrdiff_t>(t * k),
                 r.ids.begin() + static_cast<std::ptrdiff_t>((t + 1) * k));
      std::sort(row.begin() + from, row.end());  // the set of experts, not their order
    }
  };
  s.set_hooks(hooks);
  for (std::int64_t pos = b; pos < n;) {
    const std::int64_t end = std::min(n, (pos / C + 1) * C);
    first = static_cast<std::size_t>(pos - b);
    auto piece = s.Prefill(std::span(tokens).subspan(static_cast<std::size_t>(pos), static_cast<std::size_t>(end - pos)));
    REQUIRE(piece.ok());
    out.logits.insert(out.logits.end(), piece->data.begin(), piece->data.end());
    pos = end;
  }
  first = out.routing.size();
  for (int i = 0; i < kDecode; ++i) {
    auto l = s.Decode(model::Argmax(s.last_logits()));
    REQUIRE(l.ok());
    out.decode.push_back(*l);
  }
  return out;
}

// The positions before the first one at which some MoE layer chose another set of experts in `a`
// than in `ref` (top-k routing is discontinuous: a flip changes that token's FFN output wholesale).
std::size_t SameRoutingPositions(const Out& a, const Out& ref) {
  std::size_t t = 0;
  while (t < a.routing.size() && t < ref.routing.size() && a.routing[t] == ref.routing[t]) ++t;
  return t;
}

// Prompt 1 (4 chunks + 3 tokens) and the exact states after each of its chunks, computed once per
// chunk size in the pieces PrefillWithCache uses: the writes of every codec and every oracle
// start from these.
struct Exact {
  int C = 0;
  std::vector<std::int32_t> p1;
  std::vector<model::SequenceState> at;  // at[k]: after chunks [0, k), k = 0..4
  std::map<std::pair<int, std::int64_t>, Out> runs;  // (shared, b) -> the exact run of prompt 2 from b (cached)
};

constexpr int kChunks = 4;

Exact MakeExact(const ToyModel& m, int C) {
  Exact e;
  e.C = C;
  e.p1 = Tokens(kChunks * C + 3);
  model::Session s(*m.model);
  e.at.push_back(s.state());
  for (int k = 1; k <= kChunks; ++k) {
    REQUIRE(s.Prefill(std::span(e.p1).subspan(static_cast<std::size_t>((k - 1) * C), static_cast<std::size_t>(C))).ok());
    e.at.push_back(s.state());
  }
  return e;
}

struct Combo {
  std::string kv, state;  // base codec names (no lossless stage)
};

// One cache (store) per combo, chunk size and interval; prompt 1 written to it, through the
// layerwise write-out of PrefillWithCache (`by_prefill`) or through WriteBack of the exact states
// (what PrefillWithCache does with layerwise = false; no forward pass, so the matrix stays fast).
struct Written {
  std::unique_ptr<Store> store;
  std::unique_ptr<PrefixCache> cache;
};

Written Write(const ToyModel& m, const Exact& e, const KvLayout& layout, bool by_prefill) {
  Written w;
  w.store = HostStore(64 * kMiB);
  auto c = PrefixCache::Create(layout, m.id, w.store.get(), w.store.get());
  REQUIRE(c.ok());
  w.cache = std::move(c).value();
  if (by_prefill) {
    Prefill(*m.model, *w.cache, e.p1, "");
  } else {
    const auto req = w.cache->Prepare(e.p1, "");
    REQUIRE(req.chunk_ids.size() == static_cast<std::size_t>(kChunks));
    for (int k = 1; k <= kChunks; ++k)
      REQUIRE(w.cache->WriteBack(req, k, e.at[static_cast<std::size_t>(k)], layout.SnapshotDue(k, kChunks)).ok());
  }
  w.cache->Flush();
  REQUIRE(w.cache->Stats().write_failures == 0);
  return w;
}

std::string WithStage(const std::string& base, const char* stage) { return base == "f32" ? base : base + stage; }

TEST_CASE("lossy codecs: restore + suffix is bitwise the recompute from the round-tripped state, within the "
          "documented tolerance of the exact one; lossless stages change no bit",
          "[no-tsan]") {
  const auto& m = Toy();
  // Every lossy KV codec with exact state, every lossy state codec with exact KV, and two pairs.
  const std::vector<Combo> combos = {
      {"bf16", "f32"},     {"f16", "f32"},      {"fp8", "f32"},  {"fp8-block", "f32"}, {"int8", "f32"},
      {"int4-g32", "f32"}, {"int4-g64", "f32"}, {"f32", "bf16"}, {"f32", "fp8"},       {"bf16", "bf16"},
      {"int4-g32", "fp8"},
  };
  // TERRACE_KV_CODEC_ERRORS=1 prints the measured errors (docs/prefix-cache.md, "Lossy codecs").
  const bool print = std::getenv("TERRACE_KV_CODEC_ERRORS") != nullptr;
  // Sanitizer builds run one chunk size (every codec, interval and prefix still).
  const std::vector<int> chunk_sizes =
      terrace::testing::kSanitizedBuild ? std::vector<int>{16} : std::vector<int>{16, 32};
  for (int C : chunk_sizes) {
    Exact e = MakeExact(m, C);
    const int n1 = static_cast<int>(e.p1.size());
    for (const Combo& combo : combos) {
      const double tol = KvTolerance(combo.kv) + StateTolerance(combo.state);
      double worst_smooth = 0, worst_any = 0;
      std::size_t positions = 0, before_flip = 0;
      for (int every : {1, 2}) {
        CAPTURE(C, combo.kv, combo.state, every);
        const KvLayout layout = Layout(C, every, combo.kv.c_str(), combo.state.c_str());
        // Both write paths: the layerwise write-out for the pairs at interval 1, WriteBack otherwise
        // (it needs no forward pass).
        Written w = Write(m, e, layout, combo.kv != "f32" && combo.state != "f32" && every == 1);
        // The same prompt in caches whose codecs add a lossless stage.
        std::vector<std::pair<KvLayout, Written>> staged;
        for (const char* stage : {"+zstd", "+lz4"}) {
          const KvLayout sl = Layout(C, every, WithStage(combo.kv, stage).c_str(), WithStage(combo.state, stage).c_str());
          staged.emplace_back(sl, Write(m, e, sl, false));
        }
        // Shared prefixes: exactly one chunk and one chunk + 1 (interval 1; at interval 2 nothing is
        // restorable there, which prefix_cache_test covers), 3C + 5 (restores 2C at interval 2: a
        // boundary that is not a multiple of the interval) and the whole of prompt 1.
        const std::vector<int> shared_lengths =
            every == 1 ? std::vector<int>{C, C + 1, 3 * C + 5, n1} : std::vector<int>{3 * C + 5, n1};
        for (int shared : shared_lengths) {
          CAPTURE(shared);
          const int n2 = shared + 3;
          const auto p2 = Diverge(e.p1, shared, n2);
          const std::int64_t b = ExpectedBoundary(n1, shared, n2, C, every);
          REQUIRE(b > 0);
          const auto bk = static_cast<std::size_t>(b / C);
          // The exact recompute of prompt 2 from b (the same pieces as from 0, so the same bits).
          Out& exact = e.runs[{shared, b}];
          if (exact.logits.empty()) exact = Continue(*m.model, e.at[bk], p2, b, C);
          // The oracle: the exact state at b, round-tripped through this layout's codecs.
          const model::SequenceState rt = RoundTripState(layout, e.at[bk]);
          const Out oracle = Continue(*m.model, rt, p2, b, C);

          const Run warm = Prefill(*m.model, *w.cache, p2, "", {.restore = true, .write_back = false}, kDecode);
          REQUIRE(warm.prefill.restored_tokens == b);
          CHECK(warm.prefill.restore.fallbacks == 0);
          CHECK(Bitwise(warm.prefill.logits.data, oracle.logits));
          REQUIRE(warm.decode_logits.size() == oracle.decode.size());
          for (std::size_t i = 0; i < oracle.decode.size(); ++i) CHECK(Bitwise(warm.decode_logits[i], oracle.decode[i]));
          // Against the exact recompute (the oracle's routing is the restored run's: bitwise equal).
          const std::size_t same = SameRoutingPositions(oracle, exact);
          const std::size_t vocab = exact.logits.size() / exact.routing.size();
          const double smooth = RelErr(warm.prefill.logits.data, exact.logits, same * vocab);
          const double any = RelErr(warm.prefill.logits.data, exact.logits, exact.logits.size());
          CHECK(smooth <= tol);
          CHECK(any <= kAnyPositionTolerance);
          CHECK(any > 0);  // the codec was applied: lossy, not bitwise the exact run
          worst_smooth = std::max(worst_smooth, smooth);
          worst_any = std::max(worst_any, any);
          positions += exact.routing.size();
          before_flip += same;

          // The restored state itself (a whole restore) is decode(encode(x)) of what was stored.
          auto state = model::SequenceState::ForConfig(m.ckpt.config);
          auto rep = w.cache->Restore(w.cache->Prepare(p2, ""), &state);
          REQUIRE(rep.ok());
          CHECK(rep->boundary_tokens == b);
          CHECK(SameState(state, rt));

          // Lossless stages: the same restored state, and (once, at C = 16) the same logits, bit for bit.
          for (auto& [sl, sw] : staged) {
            CAPTURE(sl.kv_codec().Name(), sl.state_codec().Name());
            auto st2 = model::SequenceState::ForConfig(m.ckpt.config);
            auto rep2 = sw.cache->Restore(sw.cache->Prepare(p2, ""), &st2);
            REQUIRE(rep2.ok());
            CHECK(rep2->boundary_tokens == b);
            CHECK(SameState(st2, RoundTripState(sl, e.at[bk])));
            CHECK(SameState(st2, state));
            if (C != 16 || every != 1 || shared != 3 * C + 5) continue;
            const Run sr = Prefill(*m.model, *sw.cache, p2, "", {.restore = true, .write_back = false}, kDecode);
            CHECK(sr.prefill.restored_tokens == b);
            CHECK(Bitwise(sr.prefill.logits.data, warm.prefill.logits.data));
            CHECK(Bitwise(sr.decode_logits.back(), warm.decode_logits.back()));
          }
        }
      }
      CHECK(before_flip > 0);  // the tolerance was checked at this chunk size, not only the loose bound
      if (print)
        fmt::print("C={} kv={} state={}: max rel err {:.2e} before a routing flip ({} of {} positions), {:.2e} at any "
                   "position (tolerance {:.0e})\n",
                   C, combo.kv, combo.state, worst_smooth, before_flip, positions, worst_any, tol);
    }
  }
}

}  // namespace
}  // namespace terrace::kv
