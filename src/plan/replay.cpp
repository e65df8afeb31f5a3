#include "src/plan/replay.h"

#include <algorithm>
#include <bit>
#include <memory>
#include <unordered_map>

#include <fmt/format.h>

#include "src/store/eviction_policy.h"
#include "terrace/block.h"

namespace terrace::plan {
namespace {

using store_internal::EvictionPolicy;

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

// Bit t set: a copy of the block is in tier t (as the store's Entry::mask).
using CopyMask = std::uint32_t;
constexpr CopyMask Bit(std::size_t t) { return CopyMask{1} << t; }
// The fastest tier holding a copy (the one a read comes from).
int FastestCopy(CopyMask m) { return std::countr_zero(m); }

struct Node {
  std::vector<TierState> tiers;
  std::unordered_map<std::uint64_t, CopyMask> where;  // hash id -> tiers holding a copy
  std::vector<double> link_free_s;                    // per tier: when its link is next idle
  std::uint64_t requests = 0;
};

class Simulator {
 public:
  Simulator(const ReplayOptions& o, ReplayResult* r) : o_(o), r_(r) {}

  Node MakeNode() const {
    Node n;
    for (const TierSpec& t : o_.tiers) {
      TierState s;
      s.capacity_blocks = t.capacity_bytes / o_.block_bytes;
      s.policy = store_internal::MakeEvictionPolicy(o_.policy);
      n.tiers.push_back(std::move(s));
    }
    n.link_free_s.assign(o_.tiers.size(), 0.0);
    return n;
  }

  // Leading run of `ids` resident on `n`.
  static std::size_t ResidentPrefix(const Node& n, const std::vector<std::uint64_t>& ids) {
    std::size_t run = 0;
    while (run < ids.size() && n.where.contains(ids[run])) ++run;
    return run;
  }

  // The first tier at or after `k` that has any capacity (n.tiers.size() if none).
  std::size_t Present(const Node& n, std::size_t k) const {
    while (k < n.tiers.size() && n.tiers[k].capacity_blocks == 0) ++k;
    return k;
  }

  // Puts a copy of `id` into tier k (or the first present tier after it), evicting its policy's
  // victims first, as the store's PlaceWith / EvictLocked do: a victim whose only copy at or below
  // the tier is this one is written back (demoted) into the next present tier; one with a copy below
  // is dropped; the last tier drops its victims. Returns the tier the copy went to, or -1.
  int Place(Node& n, std::size_t k, std::uint64_t id) {
    k = Present(n, k);
    if (k >= n.tiers.size()) return -1;
    if (auto it = n.where.find(id); it != n.where.end() && (it->second & Bit(k))) {
      n.tiers[k].policy->OnAccess(KeyOf(id));
      return static_cast<int>(k);
    }
    TierState& t = n.tiers[k];
    while (t.resident >= t.capacity_blocks) {
      auto victim = t.policy->PickVictim([](const BlockKey&) { return true; });
      if (!victim) break;
      const std::uint64_t vid = victim->id.lo;
      t.policy->OnErase(*victim, /*evicted=*/true);
      --t.resident;
      ++r_->tiers[k].evictions;
      auto vit = n.where.find(vid);
      const CopyMask below = vit->second & ~(Bit(k + 1) - 1);
      vit->second &= ~Bit(k);
      if (below == 0) {
        const std::size_t next = Present(n, k + 1);
        if (next < n.tiers.size()) {
          r_->tiers[next].bytes_written += o_.block_bytes;
          Place(n, next, vid);
        }
      }
      vit = n.where.find(vid);
      if (vit != n.where.end() && vit->second == 0) n.where.erase(vit);
    }
    t.policy->OnInsert(KeyOf(id), o_.block_bytes);
    ++t.resident;
    n.where[id] |= Bit(k);
    return static_cast<int>(k);
  }

  void DropCopy(Node& n, std::uint64_t id, std::size_t k) {
    n.tiers[k].policy->OnErase(KeyOf(id), /*evicted=*/false);
    --n.tiers[k].resident;
    auto it = n.where.find(id);
    it->second &= ~Bit(k);
    if (it->second == 0) n.where.erase(it);
  }

  // A read of `id`, whose fastest copy is in tier k: tier 0 counts an access; a lower tier's copy is
  // promoted into tier 0 (moved under kExclusive, copied under kInclusive).
  void Touch(Node& n, std::uint64_t id, int k) {
    const auto kk = static_cast<std::size_t>(k);
    if (kk == Present(n, 0)) {
      n.tiers[kk].policy->OnAccess(KeyOf(id));
      return;
    }
    if (o_.placement == terrace::Placement::kExclusive) {
      DropCopy(n, id, kk);
    } else {
      n.tiers[kk].policy->OnAccess(KeyOf(id));
    }
    Place(n, 0, id);
  }

  // A newly computed block: into tier 0; under kWriteThrough also into the lowest tier.
  void Insert(Node& n, std::uint64_t id) {
    const int placed = Place(n, 0, id);
    if (o_.write_policy != terrace::WritePolicy::kWriteThrough) return;
    std::size_t lowest = n.tiers.size();
    for (std::size_t k = n.tiers.size(); k-- > 0;) {
      if (n.tiers[k].capacity_blocks > 0) {
        lowest = k;
        break;
      }
    }
    if (lowest < n.tiers.size() && static_cast<int>(lowest) != placed) {
      r_->tiers[lowest].bytes_written += o_.block_bytes;
      Place(n, lowest, id);
    }
  }

  void Run(const Trace& trace) {
    std::vector<Node> nodes;
    for (int i = 0; i < o_.nodes; ++i) nodes.push_back(MakeNode());
    std::vector<std::uint64_t> per_tier_bytes(o_.tiers.size());
    std::vector<int> hit_tier;
    for (std::size_t ri = 0; ri < trace.requests.size(); ++ri) {
      const TraceRequest& req = trace.requests[ri];
      const double now = static_cast<double>(req.timestamp_ms) / 1000.0;
      // Route.
      std::size_t node_index = ri % nodes.size();
      if (o_.routing == Routing::kPrefixAffinity && nodes.size() > 1) {
        std::size_t best = 0, best_run = 0;
        for (std::size_t i = 0; i < nodes.size(); ++i) {
          const std::size_t run = ResidentPrefix(nodes[i], req.hash_ids);
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

      const std::size_t run = ResidentPrefix(n, req.hash_ids);
      hit_tier.resize(run);
      std::fill(per_tier_bytes.begin(), per_tier_bytes.end(), 0);
      for (std::size_t i = 0; i < run; ++i) {
        const int k = FastestCopy(n.where.at(req.hash_ids[i]));
        hit_tier[i] = k;
        ++r_->tiers[static_cast<std::size_t>(k)].hit_blocks;
        if (k > 0) per_tier_bytes[static_cast<std::size_t>(k)] += o_.block_bytes;
      }
      r_->hit_blocks += run;
      if (run > 0) {
        ++r_->restores;
        const std::size_t last = static_cast<std::size_t>(hit_tier[run - 1]);
        if (last > 0) per_tier_bytes[last] += o_.restore_extra_bytes;
        // Every lower tier's link transfers its share; the restore ends when the last one does.
        double done = now, transfer_only = 0;
        for (std::size_t k = 1; k < o_.tiers.size(); ++k) {
          if (per_tier_bytes[k] == 0) continue;
          r_->tiers[k].bytes_read += per_tier_bytes[k];
          const double dur = static_cast<double>(per_tier_bytes[k]) / o_.tiers[k].read_bandwidth;
          const double start = std::max(now, n.link_free_s[k]);
          n.link_free_s[k] = start + dur;
          done = std::max(done, start + dur);
          transfer_only = std::max(transfer_only, dur);
        }
        const std::uint64_t hit_tokens = std::min<std::uint64_t>(run * o_.block_tokens, req.input_length);
        r_->hit_tokens += hit_tokens;
        const double restore = done - now;
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
          Touch(n, id, FastestCopy(it->second));
        }
      }
    }
    for (const Node& n : nodes) r_->requests_per_node.push_back(n.requests);
  }

 private:
  const ReplayOptions& o_;
  ReplayResult* r_;
};

}  // namespace

std::string_view ReplayPolicyName(ReplayPolicy p) { return p == ReplayPolicy::kLru ? "lru" : "s3fifo"; }
std::string_view RoutingName(Routing r) { return r == Routing::kRoundRobin ? "round-robin" : "prefix-affinity"; }

std::uint64_t ReplayResult::bytes_moved() const {
  std::uint64_t b = 0;
  for (const auto& t : tiers) b += t.bytes_read + t.bytes_written;
  return b;
}

Result<ReplayResult> Replay(const Trace& trace, const ReplayOptions& o) {
  if (o.tiers.empty()) return Status::InvalidArgument("no tiers to replay into (give --kv-hbm, --kv-host or --kv-nvme)");
  if (std::all_of(o.tiers.begin(), o.tiers.end(), [&](const TierSpec& t) { return t.capacity_bytes < o.block_bytes; })) {
    return Status::InvalidArgument(fmt::format(
        "no tier holds even one {}-byte block: raise --kv-hbm, --kv-host or --kv-nvme", o.block_bytes));
  }
  if (o.block_tokens == 0) return Status::InvalidArgument("--trace-block-tokens must be positive");
  if (o.block_bytes == 0) return Status::InvalidArgument("the model's KV block size is 0 bytes (a model without MLA layers?)");
  if (o.nodes < 1) return Status::InvalidArgument("--nodes must be at least 1");
  if (o.tiers.size() > 32) return Status::InvalidArgument("at most 32 tiers can be replayed");
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
    s.capacity_blocks = t.capacity_bytes / o.block_bytes;
    r.tiers.push_back(s);
  }
  Simulator sim(o, &r);
  sim.Run(trace);
  return r;
}

}  // namespace terrace::plan
