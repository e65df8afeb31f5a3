#include "src/plan/replay.h"

#include <algorithm>
#include <memory>
#include <numeric>
#include <unordered_map>

#include <fmt/format.h>

#include "src/store/eviction_policy.h"
#include "src/store/placement_rules.h"
#include "terrace/block.h"

namespace terrace::plan {
namespace {

using store_internal::Bit;
using store_internal::DroppedByMove;
using store_internal::EvictAction;
using store_internal::EvictDecision;
using store_internal::EvictionPolicy;
using store_internal::EvictRule;
using store_internal::Fastest;
using store_internal::SlotMask;
using store_internal::WriteThroughSlot;

BlockKey KeyOf(std::uint64_t hash_id) {
  BlockKey k;
  k.kind = BlockKind::kKv;
  k.id = ContentId{0, hash_id};
  return k;
}

struct TierState {
  std::uint64_t capacity_blocks = 0;
  std::uint64_t resident = 0;
  std::unique_ptr<EvictionPolicy> policy;
};

// A node's simulated tiers are the store's tier slots: the tiers with room for a block, fastest
// first, slot 0 = the first of them (an absent tier, capacity 0, has no slot, as a store has no slot
// for a tier it does not configure). Copies are tracked as the store's Entry::mask is, and every
// placement decision is the store's own (src/store/placement_rules.h).
struct Node {
  std::vector<TierState> slots;                       // per slot
  std::unordered_map<std::uint64_t, SlotMask> where;  // hash id -> slots holding a copy
  // Per tier (ReplayOptions::tiers): when its link is next idle, in seconds after the trace's first
  // timestamp.
  std::vector<double> link_free_s;
  std::vector<std::uint64_t> bytes_written;           // per tier: what this node wrote into it
  std::uint64_t requests = 0;
  std::uint64_t recomputed_tokens = 0;
};

class Simulator {
 public:
  Simulator(const ReplayOptions& o, ReplayResult* r) : o_(o), r_(r) {
    for (std::size_t t = 0; t < o_.tiers.size(); ++t) {
      if (o_.tiers[t].capacity_bytes / o_.stored_block_bytes() > 0) slot_tier_.push_back(t);
    }
  }

  // The number of slots (tiers with room for a block); at least 1 (Replay checks).
  std::size_t slot_count() const { return slot_tier_.size(); }
  int lowest() const { return static_cast<int>(slot_tier_.size()) - 1; }
  // The ReplayOptions::tiers index of slot `s` (what the per-tier results are indexed by).
  std::size_t TierOf(int s) const { return slot_tier_[static_cast<std::size_t>(s)]; }

  Node MakeNode() const {
    Node n;
    for (std::size_t t : slot_tier_) {
      TierState s;
      s.capacity_blocks = o_.tiers[t].capacity_bytes / o_.stored_block_bytes();
      s.policy = store_internal::MakeEvictionPolicy(o_.policy);
      n.slots.push_back(std::move(s));
    }
    n.link_free_s.assign(o_.tiers.size(), 0.0);
    n.bytes_written.assign(o_.tiers.size(), 0);
    return n;
  }

  // The prefix of `ids` restorable from `n` (trace.h's RestorablePrefix over its resident blocks).
  std::size_t RestorablePrefix(const Node& n, const std::vector<std::uint64_t>& ids) const {
    return plan::RestorablePrefix(ids, o_.restore_every_blocks,
                                  [&](std::uint64_t id) { return n.where.contains(id); });
  }

  // Puts a copy of `id` into slot k, evicting its policy's victims first, as the store's PlaceWith
  // / EvictLocked do, deciding each victim's fate with the store's EvictRule: written back
  // (demoted) into the next slot, or dropped; a last copy in the lowest slot, which the store
  // would refuse to drop, is dropped (the replay is a cache: the block is recomputed).
  void Place(Node& n, int k, std::uint64_t id) {
    if (auto it = n.where.find(id); it != n.where.end() && (it->second & Bit(k))) {
      n.slots[static_cast<std::size_t>(k)].policy->OnAccess(KeyOf(id));
      return;
    }
    TierState& t = n.slots[static_cast<std::size_t>(k)];
    while (t.resident >= t.capacity_blocks) {
      auto victim = t.policy->PickVictim([](const BlockKey&) { return true; });
      if (!victim) break;
      const std::uint64_t vid = victim->id.lo;
      t.policy->OnErase(*victim, /*evicted=*/true);
      --t.resident;
      ++r_->tiers[TierOf(k)].evictions;
      auto vit = n.where.find(vid);
      const EvictDecision rule = EvictRule(vit->second, k, lowest());
      vit->second = static_cast<SlotMask>(vit->second & ~Bit(k));
      if (rule.action == EvictAction::kWriteBack) {
        Written(n, TierOf(rule.write_back_to));
        Place(n, rule.write_back_to, vid);
      }
      vit = n.where.find(vid);
      if (vit != n.where.end() && vit->second == 0) n.where.erase(vit);
    }
    t.policy->OnInsert(KeyOf(id), o_.stored_block_bytes());
    ++t.resident;
    n.where[id] |= Bit(k);
  }

  // A block (its KV and snapshots) written into tier `t` of node `n`.
  void Written(Node& n, std::size_t t) {
    r_->tiers[t].bytes_written += o_.stored_block_bytes();
    n.bytes_written[t] += o_.stored_block_bytes();
  }

  void DropCopy(Node& n, std::uint64_t id, int k) {
    n.slots[static_cast<std::size_t>(k)].policy->OnErase(KeyOf(id), /*evicted=*/false);
    --n.slots[static_cast<std::size_t>(k)].resident;
    auto it = n.where.find(id);
    it->second = static_cast<SlotMask>(it->second & ~Bit(k));
    if (it->second == 0) n.where.erase(it);
  }

  // A read of `id`, whose fastest copy is in slot k: slot 0 counts an access; a lower slot's copy
  // is promoted into slot 0, and the copies the store's DroppedByMove names are dropped (exclusive
  // placement: the others, except the lowest slot's under write-through) before the copy is placed.
  void Touch(Node& n, std::uint64_t id, int k) {
    if (k == 0) {
      n.slots[0].policy->OnAccess(KeyOf(id));
      return;
    }
    const SlotMask copies = n.where.at(id);
    const SlotMask drop = DroppedByMove(copies, 0, lowest(), o_.placement, o_.write_policy, /*keep_faster=*/true);
    for (int s = 0; s < static_cast<int>(slot_count()); ++s) {
      if (drop & Bit(s)) DropCopy(n, id, s);
    }
    if (!(drop & Bit(k))) n.slots[static_cast<std::size_t>(k)].policy->OnAccess(KeyOf(id));
    Place(n, 0, id);
  }

  // A newly computed block: into slot 0, and into the slot the store's WriteThroughSlot names.
  void Insert(Node& n, std::uint64_t id) {
    Place(n, 0, id);
    const int through = WriteThroughSlot(0, lowest(), o_.write_policy);
    if (through >= 0) {
      Written(n, TierOf(through));
      Place(n, through, id);
    }
  }

  Status Run(const Trace& trace) {
    std::vector<Node> nodes;
    for (int i = 0; i < o_.nodes; ++i) nodes.push_back(MakeNode());
    std::vector<std::uint64_t> per_tier_bytes(o_.tiers.size());
    std::vector<std::size_t> hit_tier;  // per hit block: the tier (ReplayOptions::tiers index) it was read from
    std::uint64_t since_requests = 0, since_blocks = 0;  // replayed since the last checkpoint
    // Time runs from the earliest timestamp, subtracted in integers before the conversion to seconds:
    // an absolute timestamp (ms since 1970, ~1.7e12, or larger) as a double would round away the
    // microseconds a restore takes, and the figures would depend on a constant offset.
    std::uint64_t t_first = UINT64_MAX, t_last = 0;
    for (const TraceRequest& req : trace.requests) {
      t_first = std::min(t_first, req.timestamp_ms);
      t_last = std::max(t_last, req.timestamp_ms);
    }
    r_->duration_ms = trace.requests.empty() ? 0 : t_last - t_first;
    for (std::size_t ri = 0; ri < trace.requests.size(); ++ri) {
      if (o_.checkpoint && (ri == 0 || since_requests >= kReplayCheckpointRequests ||
                            since_blocks >= kReplayCheckpointBlocks)) {
        TERRACE_RETURN_IF_ERROR(o_.checkpoint(ri));
        since_requests = since_blocks = 0;
      }
      const TraceRequest& req = trace.requests[ri];
      ++since_requests;
      since_blocks += req.hash_ids.size();
      const double now = static_cast<double>(req.timestamp_ms - t_first) / 1000.0;
      // Route.
      std::size_t node_index = ri % nodes.size();
      if (o_.routing == Routing::kPrefixAffinity && nodes.size() > 1) {
        std::size_t best = 0, best_run = 0;
        for (std::size_t i = 0; i < nodes.size(); ++i) {
          const std::size_t run = RestorablePrefix(nodes[i], req.hash_ids);
          if (i == 0 || run > best_run || (run == best_run && nodes[i].requests < nodes[best].requests)) {
            best = i;
            best_run = run;
          }
        }
        node_index = best;
      }
      Node& n = nodes[node_index];
      ++n.requests;
      ++r_->requests;
      r_->blocks += req.hash_ids.size();
      r_->prompt_tokens += req.input_length;

      const std::size_t run = RestorablePrefix(n, req.hash_ids);
      hit_tier.resize(run);
      std::fill(per_tier_bytes.begin(), per_tier_bytes.end(), 0);
      for (std::size_t i = 0; i < run; ++i) {
        const std::size_t k = TierOf(Fastest(n.where.at(req.hash_ids[i])));
        hit_tier[i] = k;
        ++r_->tiers[k].hit_blocks;
        if (k > 0) per_tier_bytes[k] += o_.block_bytes;
      }
      r_->hit_blocks += run;
      n.recomputed_tokens += req.input_length - std::min<std::uint64_t>(run * o_.block_tokens, req.input_length);
      if (run > 0) {
        ++r_->restores;
        const std::size_t last = hit_tier[run - 1];
        if (last > 0) per_tier_bytes[last] += o_.restore_extra_bytes;
        // Every lower tier's link transfers its share after waiting for the earlier restores on it;
        // the restore ends when the last one does. Durations are measured from `now` (wait + transfer),
        // not as differences of absolute times, so a restore that waits for nothing has no wait at all
        // (no rounding residue).
        double restore = 0, transfer_only = 0;
        for (std::size_t k = 1; k < o_.tiers.size(); ++k) {
          if (per_tier_bytes[k] == 0) continue;
          r_->tiers[k].bytes_read += per_tier_bytes[k];
          const double dur = static_cast<double>(per_tier_bytes[k]) / o_.tiers[k].read_bandwidth;
          const double wait = std::max(0.0, n.link_free_s[k] - now);
          n.link_free_s[k] = now + wait + dur;
          restore = std::max(restore, wait + dur);
          transfer_only = std::max(transfer_only, dur);
        }
        const std::uint64_t hit_tokens = std::min<std::uint64_t>(run * o_.block_tokens, req.input_length);
        r_->hit_tokens += hit_tokens;
        r_->restore_s += restore;
        r_->queue_wait_s += std::max(0.0, restore - transfer_only);
        const double recompute = static_cast<double>(hit_tokens) / o_.prefill_tokens_per_s;
        if (restore > recompute) {
          ++r_->restores_slower_than_recompute;
        } else {
          r_->ttft_saved_s += recompute - restore;
        }
      }
      for (std::size_t i = 0; i < req.hash_ids.size(); ++i) {
        const std::uint64_t id = req.hash_ids[i];
        auto it = n.where.find(id);
        if (it == n.where.end()) {
          Insert(n, id);
        } else {
          Touch(n, id, Fastest(it->second));
        }
      }
    }
    for (const Node& n : nodes) {
      r_->requests_per_node.push_back(n.requests);
      r_->max_node_recomputed_tokens = std::max(r_->max_node_recomputed_tokens, n.recomputed_tokens);
      for (std::size_t t = 0; t < o_.tiers.size(); ++t) {
        r_->tiers[t].max_node_bytes_written = std::max(r_->tiers[t].max_node_bytes_written, n.bytes_written[t]);
      }
    }
    return Status::Ok();
  }

 private:
  const ReplayOptions& o_;
  ReplayResult* r_;
  std::vector<std::size_t> slot_tier_;  // per slot: its ReplayOptions::tiers index
};

}  // namespace

Result<TraceBlockCharge> ChargeTraceBlock(std::uint64_t block_tokens, std::uint64_t chunk_tokens,
                                          std::uint64_t chunk_block_bytes, int snapshot_every,
                                          std::uint64_t snapshot_bytes) {
  if (block_tokens == 0 || chunk_tokens == 0 || chunk_block_bytes == 0) {
    return Status::InvalidArgument("a trace block needs positive --trace-block-tokens, --chunk-tokens and chunk bytes");
  }
  if (snapshot_every < 1) {
    return Status::InvalidArgument(
        fmt::format("the replay charges KDA snapshots at chunk boundaries: snapshot_every must be at least 1 (got {})",
                    snapshot_every));
  }
  if (block_tokens % chunk_tokens != 0 && chunk_tokens % block_tokens != 0) {
    return Status::InvalidArgument(fmt::format(
        "--trace-block-tokens {} and --chunk-tokens {}: neither divides the other, so a trace block would hold parts "
        "of two stored chunks; give a --chunk-tokens that divides {} or is a multiple of it",
        block_tokens, chunk_tokens, block_tokens));
  }
  // Exact fractions: num / den chunks per block (one of them 1).
  const std::uint64_t num = block_tokens >= chunk_tokens ? block_tokens / chunk_tokens : 1;
  const std::uint64_t den = block_tokens >= chunk_tokens ? 1 : chunk_tokens / block_tokens;
  const auto every = static_cast<std::uint64_t>(snapshot_every);
  auto rounded = [](std::uint64_t n, std::uint64_t d) { return (n + d / 2) / d; };
  TraceBlockCharge c;
  c.chunks_per_block = static_cast<double>(num) / static_cast<double>(den);
  c.snapshots_per_block = c.chunks_per_block / static_cast<double>(every);
  c.kv_bytes = rounded(num * chunk_block_bytes, den);
  c.snapshot_bytes = rounded(num * snapshot_bytes, den * every);
  const std::uint64_t boundary_tokens = every * chunk_tokens;
  c.restore_every_blocks = boundary_tokens / std::gcd(block_tokens, boundary_tokens);
  return c;
}

std::string_view ReplayPolicyName(ReplayPolicy p) { return p == ReplayPolicy::kLru ? "lru" : "s3fifo"; }
std::string_view RoutingName(Routing r) { return r == Routing::kRoundRobin ? "round-robin" : "prefix-affinity"; }

std::uint64_t ReplayResult::bytes_moved() const {
  std::uint64_t b = 0;
  for (const auto& t : tiers) b += t.bytes_read + t.bytes_written;
  return b;
}

Result<ReplayResult> Replay(const Trace& trace, const ReplayOptions& o) {
  if (o.tiers.empty()) return Status::InvalidArgument("no tiers to replay into (give --kv-hbm, --kv-host or --kv-nvme)");
  if (o.block_tokens == 0) return Status::InvalidArgument("--trace-block-tokens must be positive");
  if (o.restore_every_blocks == 0) return Status::InvalidArgument("restore_every_blocks must be positive");
  if (o.block_bytes == 0) return Status::InvalidArgument("the model's KV block size is 0 bytes (a model without MLA layers?)");
  if (o.snapshot_bytes_per_block > UINT64_MAX / 2 || o.block_bytes > UINT64_MAX / 2) {
    return Status::InvalidArgument("a block's KV or snapshot bytes are over 2^63");
  }
  if (std::all_of(o.tiers.begin(), o.tiers.end(),
                  [&](const TierSpec& t) { return t.capacity_bytes < o.stored_block_bytes(); })) {
    return Status::InvalidArgument(fmt::format(
        "no tier holds even one {}-byte block ({} of KV and {} of KDA snapshots): raise --kv-hbm, --kv-host or "
        "--kv-nvme",
        o.stored_block_bytes(), o.block_bytes, o.snapshot_bytes_per_block));
  }
  if (o.nodes < 1) return Status::InvalidArgument("--nodes must be at least 1");
  if (o.tiers.size() > static_cast<std::size_t>(kMaxTierSlots)) {
    return Status::InvalidArgument(fmt::format("at most {} tiers can be replayed (as a store composes)", kMaxTierSlots));
  }
  if (!(o.prefill_tokens_per_s > 0)) return Status::InvalidArgument("the prefill speed must be positive (--hardware)");
  for (std::size_t k = 1; k < o.tiers.size(); ++k) {
    if (!(o.tiers[k].read_bandwidth > 0)) {
      return Status::InvalidArgument(fmt::format("tier '{}' needs a positive read bandwidth (--hardware)", o.tiers[k].name));
    }
  }
  ReplayResult r;
  for (const TierSpec& t : o.tiers) {
    TierReplayStats s;
    s.name = t.name;
    s.capacity_blocks = t.capacity_bytes / o.stored_block_bytes();
    r.tiers.push_back(s);
  }
  Simulator sim(o, &r);
  TERRACE_RETURN_IF_ERROR(sim.Run(trace));
  return r;
}

}  // namespace terrace::plan
