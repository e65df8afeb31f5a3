// terrace verify kv: what each KV codec costs in quality (docs/prefix-cache.md, "terrace verify kv").
//
// One f32 forward pass over a long context (synthetic token ids, --context tokens) writes the
// context's chunks and KDA snapshots into one in-memory pool per codec; then, per codec, a restore
// of the whole context followed by --eval-tokens more tokens is compared with the exact f32 path on
// those tokens: the mean and max KL divergence KL(exact || codec) of the next-token distributions,
// top-1 agreement, and the compression ratio of the blocks (f32 bytes / encoded bytes).
#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/cli/cli_util.h"
#include "src/cli/command.h"
#include "src/cli/safe_files.h"
#include "src/model/model.h"
#include "src/model/safetensors.h"
#include "src/model/session.h"
#include "terrace/codec.h"
#include "terrace/keys.h"
#include "terrace/prefix_cache.h"

namespace terrace::cli {
namespace {

struct VerifyKvArgs {
  std::string model;
  std::string codecs = "bf16,f16,fp8,fp8-block,int8,int4-g32,int4-g64";
  std::string state_codec = "f32";
  int context = 4096;
  int eval = 64;
  int chunk_tokens = 256;
  bool json = false;
};

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (pos <= s.size()) {
    const std::size_t end = std::min(s.find(',', pos), s.size());
    out.push_back(s.substr(pos, end - pos));
    pos = end + 1;
  }
  return out;
}

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
  for (const auto& name : Split(a.codecs)) {
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
  for (int i = 0; i < n; ++i)
    tokens[static_cast<std::size_t>(i)] = static_cast<std::int32_t>((static_cast<std::uint64_t>(i) * 2654435761u + 17) %
                                                                    static_cast<std::uint64_t>(config.vocab_size));

  struct PerCodec {
    codec::CodecSpec spec;
    std::unique_ptr<Store> store;
    std::unique_ptr<kv::PrefixCache> cache;
    kv::PrefixRequest request;
  };
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
             std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());

  nlohmann::json rows = nlohmann::json::array();
  for (auto& p : pools) {
    p.cache->Flush();
    if (p.cache->Stats().write_failures > 0)
      return Fail(fmt::format("codec {}: {} block writes failed", p.spec.Name(), p.cache->Stats().write_failures));
    model::Session s(**m);
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
    const auto& L = p.cache->layout();
    const double f32_kv = static_cast<double>(a.context) * L.mla_width() * static_cast<double>(L.mla_layers().size()) * 4.0;
    nlohmann::json row;
    row["codec"] = p.spec.Name();
    row["kv_bytes"] = r->restore.kv_bytes;
    row["compression_ratio"] = r->restore.kv_bytes > 0 ? f32_kv / static_cast<double>(r->restore.kv_bytes) : 0.0;
    row["kl_mean"] = kl_sum / a.eval;
    row["kl_max"] = kl_max;
    row["top1_agreement"] = static_cast<double>(agree) / a.eval;
    rows.push_back(row);
  }
  nlohmann::json j;
  j["model"] = a.model;
  j["context_tokens"] = a.context;
  j["eval_tokens"] = a.eval;
  j["chunk_tokens"] = a.chunk_tokens;
  j["state_codec"] = a.state_codec;
  j["attention_focus_drift"] = nullptr;  // not measured yet (docs/prefix-cache.md)
  j["rows"] = rows;
  if (a.json) {
    fmt::print("{}\n", j.dump());
    return 0;
  }
  fmt::print("context {} tokens restored, then {} tokens compared with the exact f32 path (state codec {})\n",
             a.context, a.eval, a.state_codec);
  fmt::print("{:<12} {:>12} {:>12} {:>12} {:>10}\n", "codec", "compression", "KL mean", "KL max", "top-1");
  for (const auto& r : rows)
    fmt::print("{:<12} {:>11.2f}x {:>12.3e} {:>12.3e} {:>9.1f}%\n", r["codec"].get<std::string>(),
               r["compression_ratio"].get<double>(), r["kl_mean"].get<double>(), r["kl_max"].get<double>(),
               100.0 * r["top1_agreement"].get<double>());
  return 0;
}

}  // namespace

void RegisterVerify(CLI::App& app, Runner* run) {
  auto* verify = app.add_subcommand("verify", "Quality checks");
  verify->require_subcommand(1);
  auto a = std::make_shared<VerifyKvArgs>();
  auto* cmd = verify->add_subcommand("kv", "KV codecs: compression ratio, logits KL divergence and top-1 agreement "
                                           "after restoring a long context, against the exact f32 path");
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
