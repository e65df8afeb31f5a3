// terrace verify kv: what each KV codec costs in quality (docs/prefix-cache.md, "terrace verify kv").
//
// One f32 forward pass over a long context (synthetic token ids, --context tokens) writes the
// context's chunks and KDA snapshots into one in-memory pool per codec; then, per codec, a restore
// of the whole context followed by --eval-tokens more tokens is compared with the exact f32 path on
// those tokens: the mean and max KL divergence KL(exact || codec) of the next-token distributions,
// top-1 agreement, the compression ratio of the blocks (the f32 codec's stored KV chunk blocks /
// this codec's: f32 is exactly 1), and the
// attention focus drift: per MLA layer, head and compared token, the share of the exact path's
// top-8 attention positions that are also the codec's top-8 (ForwardOptions::on_mla_attention).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/cli/cli_util.h"
#include "src/cli/command.h"
#include "src/cli/prefill_progress.h"
#include "src/cli/safe_files.h"
#include "src/common/json_text.h"
#include "src/model/mla.h"
#include "src/model/model.h"
#include "src/model/safetensors.h"
#include "src/model/session.h"
#include "terrace/codec.h"
#include "terrace/keys.h"
#include "terrace/prefix_cache.h"

namespace terrace::cli {
namespace {

// The synthetic context's ids: splitmix64 from this state, mod the vocabulary (docs/prefix-cache.md).
constexpr std::uint64_t kVerifyTokenSeed = 17;

struct VerifyKvArgs {
  std::string model;
  std::string codecs = "bf16,f16,fp8,fp8-block,int8,int4-g32,int4-g64";
  std::string state_codec = "f32";
  int context = 4096;
  int eval = 64;
  int chunk_tokens = 256;
  bool json = false;
};

constexpr int kFocusTop = 8;

// The top-8 attention positions of every (MLA layer, head, compared token), recorded by an
// on_mla_attention probe from the rows of tokens at positions >= first. Slots are indexed
// ((pos - first) * layers + layer) * heads + head; an empty slot was never seen.
class FocusRecorder {
 public:
  FocusRecorder(std::int64_t first, std::int64_t count, int layers, std::int64_t heads)
      : first_(first), count_(count), layers_(layers), heads_(heads),
        top_(static_cast<std::size_t>(count * layers * heads)) {}

  std::function<void(int, std::int64_t, std::span<const float>, std::int64_t, std::int64_t)> Probe() {
    return [this](int layer, std::int64_t head, std::span<const float> probs, std::int64_t tokens, std::int64_t positions) {
      for (std::int64_t i = 0; i < tokens; ++i) {
        const std::int64_t pos = positions - tokens + i;
        if (pos < first_ || pos >= first_ + count_) continue;
        const auto row = probs.subspan(static_cast<std::size_t>(i * positions), static_cast<std::size_t>(pos + 1));
        top_[Slot(pos, layer, head)] = model::TopPositions(row, kFocusTop);
      }
    };
  }

  // Mean and min over slots seen by both of |top-8 here ∩ top-8 there| / 8; compared: their number.
  struct Overlap {
    double mean = 0, min = 0;
    std::int64_t compared = 0;
  };
  Overlap Compare(const FocusRecorder& other) const {
    Overlap o{0, 1, 0};
    double sum = 0;
    for (std::size_t s = 0; s < top_.size() && s < other.top_.size(); ++s) {
      const auto& a = top_[s];
      const auto& b = other.top_[s];
      if (a.empty() || b.empty()) continue;
      std::size_t common = 0;
      for (auto p : a) common += std::find(b.begin(), b.end(), p) != b.end();
      const double v = static_cast<double>(common) / static_cast<double>(std::max(a.size(), b.size()));
      sum += v;
      o.min = std::min(o.min, v);
      ++o.compared;
    }
    if (o.compared == 0) return Overlap{};
    o.mean = sum / static_cast<double>(o.compared);
    return o;
  }

 private:
  std::size_t Slot(std::int64_t pos, int layer, std::int64_t head) const {
    return static_cast<std::size_t>(((pos - first_) * layers_ + layer) * heads_ + head);
  }
  std::int64_t first_, count_;
  int layers_;
  std::int64_t heads_;
  std::vector<std::vector<std::int64_t>> top_;
};

// log-softmax of one row.
std::vector<double> LogSoftmax(const float* x, std::int64_t n) {
  double mx = -INFINITY;
  for (std::int64_t i = 0; i < n; ++i) mx = std::max(mx, static_cast<double>(x[i]));
  double sum = 0;
  for (std::int64_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(x[i]) - mx);
  const double lse = mx + std::log(sum);
  std::vector<double> out(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) out[static_cast<std::size_t>(i)] = static_cast<double>(x[i]) - lse;
  return out;
}

int RunVerifyKv(const VerifyKvArgs& a) {
  if (Status s = CheckModelDirInput(a.model, "--model"); !s.ok()) return FailUsage(s.message());
  if (a.context % a.chunk_tokens != 0)
    return FailUsage(fmt::format("--context {} must be a multiple of --chunk-tokens {} (the whole context is restored)",
                                 a.context, a.chunk_tokens));
  std::vector<codec::CodecSpec> specs;
  for (const auto& name : SplitCommas(a.codecs)) {
    auto s = codec::CodecSpec::Parse(name);
    if (!s.ok()) return FailUsage("--codecs: " + s.status().message());
    specs.push_back(*s);
  }
  auto state_codec = codec::CodecSpec::Parse(a.state_codec);
  if (!state_codec.ok()) return FailUsage("--state-codec: " + state_codec.status().message());
  auto mdir = model::ModelDir::Open(a.model);
  if (!mdir.ok()) return Fail(mdir.status().ToString());
  const model::ModelConfig& config = (*mdir)->config();
  auto m = model::Model::Load(config, **mdir);
  if (!m.ok()) return Fail(m.status().ToString());
  const ContentId model_id = keys::ModelId(config, **mdir);

  const int n = a.context + a.eval;
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(n));
  // Pseudo-random ids with no period: (i * prime + c) mod vocab repeated every vocab tokens, so on
  // a small vocabulary the "long" context was one block of ids copied over and over (and attention
  // spread evenly over the copies made the top-8 positions a near-tie).
  std::uint64_t token_state = kVerifyTokenSeed;
  for (int i = 0; i < n; ++i)
    tokens[static_cast<std::size_t>(i)] =
        static_cast<std::int32_t>(SplitMix(token_state) % static_cast<std::uint64_t>(config.vocab_size));

  struct PerCodec {
    codec::CodecSpec spec;
    std::unique_ptr<Store> store;
    std::unique_ptr<kv::PrefixCache> cache;
    kv::PrefixRequest request;
  };
  // The compression ratio's numerator: the context's KV chunk blocks as the f32 codec stores them
  // (headers and 4 KiB alignment included, as the codecs' own kv_bytes), so f32 is exactly 1.
  std::uint64_t f32_kv_bytes = 0;
  {
    kv::KvLayoutOptions lo;
    lo.chunk_tokens = a.chunk_tokens;
    lo.snapshot_every = 0;
    lo.kv_codec = codec::CodecSpec{};  // f32
    lo.state_codec = *state_codec;
    auto layout = kv::KvLayout::FromConfig(config, lo);
    if (!layout.ok()) return FailUsage(layout.status().message());
    f32_kv_bytes = layout->mla_chunk_block_bytes() * static_cast<std::uint64_t>(a.context / a.chunk_tokens);
  }
  std::vector<PerCodec> pools;
  for (const auto& spec : specs) {
    PerCodec p;
    p.spec = spec;
    kv::KvLayoutOptions lo;
    lo.chunk_tokens = a.chunk_tokens;
    lo.snapshot_every = 0;
    lo.kv_codec = spec;
    lo.state_codec = *state_codec;
    auto layout = kv::KvLayout::FromConfig(config, lo);
    if (!layout.ok()) return FailUsage(layout.status().message());
    StoreOptions so;
    so.hbm.mode = HbmMode::kOff;
    so.host.pin = false;
    so.host.capacity_bytes = layout->mla_chunk_block_bytes() * static_cast<std::uint64_t>(n / a.chunk_tokens + 1) +
                             layout->state_block_bytes() * layout->kda_layers().size() * 2 + (8ull << 20);
    so.host.chunk_bytes = std::min<std::uint64_t>(so.host.capacity_bytes, 64ull << 20);
    auto st = Store::Open(so);
    if (!st.ok()) return Fail(st.status().ToString());
    p.store = std::move(st).value();
    auto c = kv::PrefixCache::Create(*layout, model_id, p.store.get(), p.store.get());
    if (!c.ok()) return Fail(c.status().ToString());
    p.cache = std::move(c).value();
    // The context only: its last full chunk (the end of the context) gets the snapshot.
    p.request = p.cache->Prepare(std::span(tokens).first(static_cast<std::size_t>(a.context)), "");
    pools.push_back(std::move(p));
  }

  // The exact path: one f32 pass over context + eval, writing the context into every pool.
  fmt::print(stderr, "terrace verify kv: exact pass over {} tokens...\n", n);
  const auto t0 = std::chrono::steady_clock::now();
  model::Session exact(**m);
  const std::int64_t heads = (*m)->mla_dims().heads;
  FocusRecorder exact_focus(a.context, a.eval, config.num_hidden_layers, heads);
  PrefillProgress progress("terrace verify kv", "exact pass", n, config.num_hidden_layers - 1);
  {
    model::ForwardOptions hooks = progress.Hooks();
    hooks.on_mla_attention = exact_focus.Probe();
    exact.set_hooks(hooks);
  }
  std::vector<float> exact_eval;
  const std::int64_t V = config.vocab_size, C = a.chunk_tokens;
  for (std::int64_t pos = 0; pos < n;) {
    const std::int64_t end = std::min<std::int64_t>(n, (pos / C + 1) * C);
    auto l = exact.Prefill(std::span(tokens).subspan(static_cast<std::size_t>(pos), static_cast<std::size_t>(end - pos)));
    if (!l.ok()) return Fail(l.status().ToString());
    for (std::int64_t t = pos; t < end; ++t)
      if (t >= a.context)
        exact_eval.insert(exact_eval.end(), l->data.begin() + (t - pos) * V, l->data.begin() + (t - pos + 1) * V);
    if (end % C == 0 && end <= a.context) {
      for (auto& p : pools) {
        if (Status s = p.cache->WriteBack(p.request, end / C, exact.state(), end == a.context); !s.ok())
          return Fail(s.ToString());
      }
    }
    pos = end;
  }
  fmt::print(stderr, "terrace verify kv: exact pass {:.1f} s; restoring per codec...\n",
             SecondsSince(t0));
  std::fflush(stderr);

  nlohmann::json rows = nlohmann::json::array();
  for (auto& p : pools) {
    p.cache->Flush();
    if (p.cache->Stats().write_failures > 0)
      return Fail(fmt::format("codec {}: {} block writes failed", p.spec.Name(), p.cache->Stats().write_failures));
    model::Session s(**m);
    FocusRecorder focus(a.context, a.eval, config.num_hidden_layers, heads);
    {
      model::ForwardOptions hooks;
      hooks.on_mla_attention = focus.Probe();
      s.set_hooks(hooks);
    }
    auto req = p.cache->Prepare(tokens, "");
    auto r = kv::PrefillWithCache(&s, *p.cache, req, {.restore = true, .write_back = false});
    if (!r.ok()) return Fail(r.status().ToString());
    if (r->restored_tokens != a.context)
      return Fail(fmt::format("codec {}: restored {} of {} context tokens", p.spec.Name(), r->restored_tokens, a.context));
    double kl_sum = 0, kl_max = 0;
    int agree = 0;
    for (int e = 0; e < a.eval; ++e) {
      const float* ref = exact_eval.data() + static_cast<std::size_t>(e) * static_cast<std::size_t>(V);
      const float* got = r->logits.data.data() + static_cast<std::size_t>(e) * static_cast<std::size_t>(V);
      const auto lp = LogSoftmax(ref, V), lq = LogSoftmax(got, V);
      double kl = 0;
      for (std::int64_t i = 0; i < V; ++i) kl += std::exp(lp[static_cast<std::size_t>(i)]) * (lp[static_cast<std::size_t>(i)] - lq[static_cast<std::size_t>(i)]);
      kl_sum += kl;
      kl_max = std::max(kl_max, kl);
      agree += model::Argmax(std::span(ref, static_cast<std::size_t>(V))) == model::Argmax(std::span(got, static_cast<std::size_t>(V)));
    }
    nlohmann::json row;
    row["codec"] = p.spec.Name();
    row["kv_bytes"] = r->restore.kv_bytes;
    row["f32_kv_bytes"] = f32_kv_bytes;
    row["compression_ratio"] =
        r->restore.kv_bytes > 0 ? static_cast<double>(f32_kv_bytes) / static_cast<double>(r->restore.kv_bytes) : 0.0;
    row["kl_mean"] = kl_sum / a.eval;
    row["kl_max"] = kl_max;
    row["top1_agreement"] = static_cast<double>(agree) / a.eval;
    const auto overlap = focus.Compare(exact_focus);
    if (overlap.compared == 0) return Fail(fmt::format("codec {}: no MLA attention rows were compared", p.spec.Name()));
    row["top8_overlap_mean"] = overlap.mean;
    row["top8_overlap_min"] = overlap.min;
    row["top8_compared"] = overlap.compared;
    rows.push_back(row);
    fmt::print(stderr, "terrace verify kv: codec {} done ({}/{}), {:.1f} s\n", p.spec.Name(), rows.size(), pools.size(),
               SecondsSince(t0));
  }
  nlohmann::json j;
  j["model"] = a.model;
  j["context_tokens"] = a.context;
  j["eval_tokens"] = a.eval;
  j["chunk_tokens"] = a.chunk_tokens;
  j["state_codec"] = a.state_codec;
  j["attention_top_k"] = kFocusTop;
  j["rows"] = rows;
  if (a.json) {
    fmt::print("{}\n", JsonText(j));
    return 0;
  }
  fmt::print("context {} tokens restored, then {} tokens compared with the exact f32 path (state codec {});\n"
             "top-8 overlap: share of the exact path's top-8 attention positions kept, per MLA layer, head and token\n",
             a.context, a.eval, a.state_codec);
  fmt::print("{:<12} {:>12} {:>12} {:>12} {:>10} {:>14} {:>13}\n", "codec", "compression", "KL mean", "KL max", "top-1",
             "top-8 overlap", "top-8 min");
  for (const auto& r : rows)
    fmt::print("{:<12} {:>11.2f}x {:>12.3e} {:>12.3e} {:>9.1f}% {:>13.2f}% {:>12.1f}%\n", r["codec"].get<std::string>(),
               r["compression_ratio"].get<double>(), r["kl_mean"].get<double>(), r["kl_max"].get<double>(),
               100.0 * r["top1_agreement"].get<double>(), 100.0 * r["top8_overlap_mean"].get<double>(),
               100.0 * r["top8_overlap_min"].get<double>());
  return 0;
}

}  // namespace

void RegisterVerify(CLI::App& app, Runner* run) {
  auto* verify = app.add_subcommand("verify", "Quality measurements (they report figures; they do not pass or fail "
                                               "them)");
  verify->require_subcommand(1);
  auto a = std::make_shared<VerifyKvArgs>();
  auto* cmd = verify->add_subcommand("kv", "KV codecs: compression ratio (f32's stored blocks / the codec's), logits "
                                           "KL divergence, top-1 agreement and top-8 attention overlap after "
                                           "restoring a long context, against the exact f32 path. It measures and "
                                           "does not judge: no threshold, exit 0 whatever the figures");
  cmd->add_option("--model", a->model, "Model directory")->required();
  cmd->add_option("--codecs", a->codecs, "KV codecs to compare, comma separated")->capture_default_str();
  cmd->add_option("--state-codec", a->state_codec, "Codec of the KDA snapshots")->capture_default_str();
  AddIntOption(cmd, "--context", &a->context, 1, 1 << 20, "Context tokens restored (a multiple of --chunk-tokens)");
  AddIntOption(cmd, "--eval-tokens", &a->eval, 1, 1 << 16, "Tokens after the context that are compared");
  AddIntOption(cmd, "--chunk-tokens", &a->chunk_tokens, 1, 65536, "Tokens per cached chunk");
  cmd->add_flag("--json", a->json, "Print one JSON object with a 'rows' list");
  cmd->callback([run, a] { *run = [a] { return RunVerifyKv(*a); }; });
}

}  // namespace terrace::cli
