// The analytic capacity planner (docs/plan.md, "Analytic plan"): memory per token and per sequence,
// weights, expert cache, concurrency, bandwidth and stalls for one model on one node. Every KV and
// KDA size comes from kv::KvLayout and every weight size from the model's tensor list
// (model::ExpectedTensors): no layer size is computed here. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "src/model/names.h"
#include "src/plan/hardware.h"
#include "terrace/kv_layout.h"
#include "terrace/model_config.h"
#include "terrace/model_weights.h"
#include "terrace/status.h"

namespace terrace::plan {

// One point of the prompt-length distribution: `share` of the requests have `tokens` prompt tokens.
struct ContextShare {
  std::uint64_t tokens = 0;
  double share = 0;
};

struct Workload {
  double rate_rps = 1.0;                 // requests per second per node
  // Prompt tokens per request: a distribution whose shares sum to 1 (one entry: a fixed length).
  // Every per-request byte and bandwidth figure is linear in the prompt length, so the plan uses
  // its mean; the longest entry bounds the sequences that fit per tier from below.
  std::vector<ContextShare> context = DefaultContext();
  double prefix_reuse = 0.5;             // share of each prompt found in the prefix cache, [0, 1]
  int concurrency = 32;                  // sequences decoding at once per node
  std::uint64_t decode_tokens = 512;     // output tokens per request

  static std::vector<ContextShare> DefaultContext();  // 32768 tokens, share 1
  double MeanContext() const;            // sum of tokens x share
  std::uint64_t MaxContext() const;
};

// Parses "32768", "32k" (k = 1024 tokens, M = 1024k) or a distribution "4k:0.5,32k:0.3,128k:0.2"
// (tokens:weight pairs; weights are normalised to shares). InvalidArgument naming `flag` for
// anything else, a zero length, a length over 16M tokens, or non-positive weights.
Result<std::vector<ContextShare>> ParseContextDistribution(std::string_view text, std::string_view flag);
// Parses a token count with an optional k / M suffix (1024 / 1048576), naming `flag` on error.
Result<std::uint64_t> ParseTokens(std::string_view text, std::string_view flag);

struct PlanOptions {
  kv::KvLayoutOptions layout;
  Workload workload;
  double expert_hit_target = 0.9;        // the expert-cache hit rate to size for, (0, 1]
  double expert_zipf = 1.0;              // routing skew: expert i of a layer chosen with p ~ 1/(i+1)^s
  // HBM for the routed-expert cache; unset: half of what is left of HBM after the resident weights,
  // at most all routed experts. A budget over the HBM left is refused; one over all routed experts
  // (that fits) is capped at them (ExpertPlan::budget_capped).
  std::optional<std::uint64_t> expert_cache_bytes;
  // How the checkpoint stores its routed experts, which sizes them when `tensors` is empty: kMxfp4
  // (compressed-tensors MXFP4, K3) or kF32 (plain matrices, sized as BF16 as ExpectedTensors lists
  // them; Kimi Linear's published checkpoint). `expert_format_from` says where the caller took the
  // weights' format from (shown with the plan).
  model::ExpertFormat expert_format = model::ExpertFormat::kMxfp4;
  std::string expert_format_from;
  // The model's tensors as a checkpoint stores them (StoredTensors), which size the weights; empty:
  // ExpectedTensors(config, expert_format), in the dtypes Terrace writes.
  std::vector<model::TensorSpec> tensors;
  int gqa_kv_heads = 8;                  // KV heads of the GQA comparison model
};

struct CurvePoint {
  std::uint64_t tokens = 0;
  std::uint64_t mla_bytes = 0;   // MLA latents of one sequence
  std::uint64_t kda_bytes = 0;   // KDA state of one sequence (fixed)
  std::uint64_t total_bytes = 0; // mla + kda
  std::uint64_t mha_bytes = 0;   // the MHA comparison model's KV
  std::uint64_t gqa_bytes = 0;   // the GQA comparison model's KV
};

struct MemoryPlan {
  int mla_layers = 0, kda_layers = 0, layers = 0;
  std::uint64_t mla_bytes_per_token = 0;
  std::uint64_t kda_recurrent_bytes_per_layer = 0;
  std::uint64_t kda_conv_bytes_per_layer = 0;
  std::uint64_t kda_state_bytes_per_sequence = 0;
  std::uint64_t mla_chunk_block_bytes = 0;  // one stored KV chunk (chunk_tokens tokens, with header)
  // What the store keeps per token: mla_chunk_block_bytes / chunk_tokens (the codec's scales, the
  // chunk header and 4 KiB alignment included; mla_bytes_per_token is the codec's nominal size).
  double mla_stored_bytes_per_token = 0;
  std::uint64_t state_block_bytes = 0;      // one stored KDA layer snapshot
  int attnres_sources = 0;                  // bank vectors + the running partial sum (0 without AttnRes)
  std::uint64_t attnres_bank_bytes_per_token = 0;  // transient, during one forward pass (f32)
  // Comparison: every layer full attention with K (qk head dim) and V (v head dim) per KV head, at
  // the KV codec's nominal size.
  std::uint64_t mha_bytes_per_token = 0;
  std::uint64_t gqa_bytes_per_token = 0;
  int mha_kv_heads = 0, gqa_kv_heads = 0;
  std::uint64_t sequence_tokens = 0;        // mean context + decode of the workload (rounded)
  std::uint64_t sequence_bytes = 0;         // MLA latents + KDA state of a mean sequence
  std::uint64_t longest_sequence_tokens = 0;  // longest context + decode
  std::uint64_t longest_sequence_bytes = 0;
  struct ContextRow {
    std::uint64_t tokens = 0;               // context + decode
    double share = 0;
    std::uint64_t bytes = 0;                // MLA latents + KDA state of one such sequence
  };
  std::vector<ContextRow> per_context;      // one row per entry of the workload's distribution
  std::vector<CurvePoint> curve;            // 1k .. 1M tokens, powers of two
};

struct WeightPlan {
  std::vector<std::pair<std::string, std::uint64_t>> bytes_by_component;  // model::ComponentName order
  std::uint64_t total_bytes = 0;
  std::uint64_t routed_expert_bytes = 0;   // all routed experts
  std::uint64_t resident_bytes = 0;        // everything but routed experts (always in HBM)
  std::uint64_t expert_bytes = 0;          // one routed expert (w1, w2, w3 with scales)
  // The routed experts' format: "mxfp4", else their dtypes ("f32", "bf16", "f16"; several joined by
  // "+", most bytes first; "none" without routed experts). resident_format: the other tensors'
  // dtypes, the same way.
  std::string expert_format;
  std::string resident_format;
  // The input-embedding table when it is only a lookup (untied lm_head): no FLOPs, and a decode step
  // reads one row of it per sequence. 0 with tie_word_embeddings (the table is then the lm_head, a
  // matmul, and counts as such).
  std::uint64_t lookup_embedding_bytes = 0;
  std::uint64_t embedding_row_bytes = 0;   // one token's row of embed_tokens
  int moe_layers = 0, experts_per_layer = 0, experts_per_token = 0;
  // Parameters one token multiplies: the resident ones but a lookup-only embedding table, plus the
  // top-k routed experts of every MoE layer.
  double active_params_per_token = 0;
  bool resident_fits_hbm = true;           // resident_bytes <= the node's HBM (else every rate is hypothetical)
};

struct ExpertPlan {
  double hit_target = 0;
  int experts_per_layer_for_target = 0;
  std::uint64_t bytes_for_target = 0;      // HBM cache holding that many experts of every MoE layer
  std::uint64_t budget_bytes = 0;          // the expert-cache budget evaluated below (HBM charged for it)
  std::uint64_t budget_requested_bytes = 0;  // --expert-cache as given (0 when not given)
  bool budget_given = false;               // --expert-cache was given (0 included: no expert cache)
  bool budget_capped = false;              // the given budget was over all routed experts: capped at them
  int cached_per_layer = 0;
  double hit_rate = 0;                     // routed-expert hit rate of that budget (batch 1); exactly 1 when all are cached
  double stall_s_per_token_batch1 = 0;     // miss bytes / host link bandwidth, one sequence
  double stall_s_per_token_batched = 0;    // the same per token at the workload's concurrency
  double miss_bytes_per_token_batch1 = 0;
  double miss_bytes_per_token_batched = 0;
};

struct TierPlan {
  std::string name;
  std::uint64_t capacity_bytes = 0;
  std::uint64_t kv_bytes = 0;              // left for KV/state after what the plan places there
  std::uint64_t sequences = 0;             // workload sequences that fit in kv_bytes (mean length)
  std::uint64_t sequences_longest = 0;     // the same if every sequence had the longest context
  std::uint64_t other_bytes = 0;           // what else the plan puts there (`holds`)
  std::string holds;
};

struct BandwidthLine {
  std::string link;                        // "hbm", "pcie-h2d", "pcie-d2h", "nvme-read", "nvme-write"
  double required = 0;                     // bytes/s
  double available = 0;                    // bytes/s
  std::string what;
  double utilisation() const { return available > 0 ? required / available : 0; }
};

struct LifecyclePlan {
  double weight_load_s = 0;                // all weights NVMe -> host, then resident ones host -> HBM
  std::uint64_t kv_state_bytes_per_request = 0;
  double router_flops_per_token = 0;       // 2 x the router gate's parameters (tensor list) x MoE layers
  double routing_flops_share = 0;          // router FLOPs / (2 x active params) per token
  std::uint64_t offload_bytes_per_request = 0;  // prefix restore + write-back + expert misses
  // Per request, as stored (KvLayout's block sizes, headers and alignment included): the prefix
  // restore reads --prefix-reuse x the mean prompt of KV chunks and one KDA snapshot (all KDA
  // layers); the write-back writes the rest of the prompt's KV and a KDA snapshot at every chunk
  // boundary of it that KvLayout::SnapshotDue makes due (each multiple of snapshot_every and the
  // prompt's last full chunk, once; snapshot_every 0: that one only), per prompt length of the
  // distribution. Generated tokens are not written (the prefix cache stores the prompt only).
  double restore_bytes_per_request = 0;
  double writeback_bytes_per_request = 0;
  double snapshots_per_request = 0;        // KDA snapshots the write-back writes (0 without KDA layers)
  double snapshot_bytes = 0;               // one snapshot: KDA layers x state_block_bytes
  double prefill_tokens_per_s = 0;         // recompute speed of the node
  double decode_step_bytes = 0;            // HBM bytes one decode step reads and writes (see MakePlan)
  double decode_step_s = 0;                // HBM-bound decode step at the workload's concurrency
  double decode_tokens_per_s = 0;
  // The same step plus the expert-cache misses of the step loaded over the host link (no overlap).
  double decode_step_with_stalls_s = 0;
  double decode_tokens_per_s_with_stalls = 0;
  double decode_tokens_needed_per_s = 0;   // rate x decode tokens
  double prefill_tokens_needed_per_s = 0;  // rate x the prompt tokens not restored from the prefix cache
  double prefill_utilisation = 0;          // prefill_tokens_needed_per_s / prefill_tokens_per_s
};

struct Plan {
  std::string model_name;
  Hardware hardware;
  std::string kv_codec, state_codec, layout_id;
  PlanOptions options;
  MemoryPlan memory;
  WeightPlan weights;
  ExpertPlan experts;
  std::vector<TierPlan> tiers;
  std::vector<BandwidthLine> bandwidth;
  LifecyclePlan lifecycle;
  // Where the workload does not fit the node (resident weights over the HBM, concurrency over the
  // HBM's sequences, a link or the GPUs over 100%): one sentence each, in CLI flag words.
  std::vector<std::string> warnings;
};

// InvalidArgument naming the CLI flag for out-of-range workload or option values, and
// CheckExpertDims' error.
Result<Plan> MakePlan(const model::ModelConfig& config, std::string model_name, const Hardware& hardware,
                      const PlanOptions& options);

// The tensors ExpectedTensors(config, DetectExpertFormat(source, config)) lists, each with the dtype
// and shape `source` stores it in (plain floats may be F32, BF16 or F16): the checkpoint's true sizes.
// NotFound naming a listed tensor `source` lacks (a ModelDir opened with check_tensors has them all).
Result<std::vector<model::TensorSpec>> StoredTensors(const model::WeightSource& source,
                                                     const model::ModelConfig& config);
// The format the checkpoint a preset stands for stores its routed experts in: kF32 (BF16) for
// kimi-linear-48b, whose published checkpoint has plain BF16 experts (docs/model-format.md section
// 3); kMxfp4 for kimi-k3 (its published checkpoint) and Terrace's own presets (`model init` writes
// MXFP4). InvalidArgument for an unknown preset.
Result<model::ExpertFormat> PresetExpertFormat(std::string_view preset);

// InvalidArgument, as `model init` words it, when `format` is kMxfp4 and a dimension the routed
// experts' rows run along (moe_intermediate_size, and routed_expert_hidden_size or hidden_size) is
// not a multiple of the MXFP4 block (32); `why` says where the format was taken from. Ok for a model
// without routed experts or with plain-float experts.
Status CheckExpertDims(const model::ModelConfig& config, model::ExpertFormat format, std::string_view why);

// Top-k routing without repeats over a layer's `experts`, Zipf(s) weights w_i ~ 1/(i+1)^s, hottest
// first: expert i is among a token's `top_k` picks with probability p_i = min(1, c x w_i), c such that
// the p_i sum to top_k (all 1 when top_k >= experts).
std::vector<double> ExpertInclusion(int experts, double zipf_s, int top_k);
// The hit rate of caching the hottest `cached` experts: their share of the picks, sum of p_i over
// them / top_k (exactly 1 when cached >= experts); and the smallest `cached` whose hit rate reaches
// `target`.
double ZipfMass(int experts, double zipf_s, int top_k, int cached);
int ExpertsForHitRate(int experts, double zipf_s, int top_k, double target);

}  // namespace terrace::plan
