// Trace replay: runs a request trace (trace.h) through simulated tiers, each a capacity and a link
// bandwidth, with the store's own eviction policies (src/store/eviction_policy.h: LRU, S3-FIFO) and
// the store's own placement rules (src/store/placement_rules.h: EvictRule, DroppedByMove,
// WriteThroughSlot). Model (docs/plan.md, "Trace replay"): every node has its own tiers, fastest
// first; the first tier with room for a block is where compute reads the KV (HBM). A request's
// prefix hit is the leading run of its hash ids resident anywhere on its node. A block occupies its
// KV and the KDA snapshots stored at its restore boundaries (a hybrid model's state, often far
// larger than the KV: ReplayOptions::snapshot_bytes_per_block), which are resident, demoted and
// evicted with it; hit blocks whose
// fastest copy is in a lower tier are read over that tier's link and promoted into the first tier
// (Placement::kExclusive drops the other copies, except the lowest tier's under
// WritePolicy::kWriteThrough; kInclusive keeps them), the rest of the prompt is recomputed and
// written to the first tier (and, under kWriteThrough, to the lowest tier). A full tier evicts its
// policy's victim: written back into the next tier when it has no copy below (a write, counted but
// not timed), else dropped; the last tier drops it. Links are FIFO servers of the restores (reads
// into tier 0): a restore waits for earlier restores over the same link. Writes (demotions,
// write-through copies, new KV) are counted (TierReplayStats::bytes_written, max_node_bytes_written)
// but not timed: they take no link time and never delay a restore; the CLI compares their average
// rate over the trace with the hardware's write bandwidth instead. Recompute is not queued either
// (a request's prefill never waits for another's). Time is the trace's timestamps relative to its
// first, so a constant offset changes nothing. Decode-time KV (output tokens) is not simulated.
// Pure function of its inputs; thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "src/plan/trace.h"
#include "terrace/options.h"
#include "terrace/status.h"

namespace terrace::plan {

// The store's own eviction policy choice (StoreOptions::eviction): the replay builds each simulated
// tier's policy with the factory the store uses (store_internal::MakeEvictionPolicy).
using ReplayPolicy = terrace::EvictionPolicy;
std::string_view ReplayPolicyName(ReplayPolicy p);  // "lru", "s3fifo"
enum class Routing : std::uint8_t {
  kRoundRobin,      // request i goes to node i mod N
  kPrefixAffinity,  // the node holding the longest resident prefix; ties to the node with fewest requests
};
std::string_view RoutingName(Routing r);  // "round-robin", "prefix-affinity"

struct TierSpec {
  std::string name;                 // "hbm", "host", "nvme"
  std::uint64_t capacity_bytes = 0; // 0: the tier is absent (blocks pass through to the next)
  double read_bandwidth = 0;        // bytes/s into tier 0 (ignored for tier 0)
};

// A replay calls its checkpoint before its first request, then whenever kReplayCheckpointRequests
// requests or kReplayCheckpointBlocks blocks have been replayed since the last call (a trace of
// few, long requests checks as often as one of many short ones).
inline constexpr std::uint64_t kReplayCheckpointRequests = 4096;
inline constexpr std::uint64_t kReplayCheckpointBlocks = 1u << 16;

struct ReplayOptions {
  std::uint64_t block_tokens = 512;  // tokens per hash id
  std::uint64_t block_bytes = 0;     // bytes of one block's KV (> 0); read for every hit block
  // Bytes of the KDA snapshots stored with each block (TraceBlockCharge::snapshot_bytes; 0 for a
  // model without KDA layers). They take tier capacity with the block's
  // KV (a tier holds capacity / stored_block_bytes() blocks) and move with it: a demotion or a
  // write-through copy writes both. Only the snapshot at the prefix's end is read on a restore
  // (restore_extra_bytes).
  std::uint64_t snapshot_bytes_per_block = 0;
  // Bytes loaded with every restore besides the KV blocks (the KDA snapshot at the prefix's end),
  // read from the tier that holds the last hit block.
  std::uint64_t restore_extra_bytes = 0;
  // A prefix hit counts in whole multiples of this many blocks (TraceBlockCharge::
  // restore_every_blocks): the leading run of resident blocks is cut back to the last block that
  // ends at a restore boundary, as the store restores only from one; the rest is recomputed.
  std::uint64_t restore_every_blocks = 1;
  std::vector<TierSpec> tiers;       // fastest first, at least one
  ReplayPolicy policy = ReplayPolicy::kLru;
  // The store's placement rules (StoreOptions::placement / write_policy, terrace/options.h;
  // applied through src/store/placement_rules.h): kExclusive moves a block up on a hit,
  // kInclusive keeps its copy below (so evicting the upper copy writes nothing); kWriteThrough
  // also writes every new block into the lowest tier, which keeps that copy under both.
  terrace::Placement placement = terrace::Placement::kExclusive;
  terrace::WritePolicy write_policy = terrace::WritePolicy::kWriteBack;
  int nodes = 1;
  Routing routing = Routing::kPrefixAffinity;
  double prefill_tokens_per_s = 0;   // recompute speed of one node (> 0)
  // Unset, or called before the first request and then as kReplayCheckpointRequests says, with the
  // number of requests replayed so far: an error stops the replay and Replay returns it (a CLI's
  // progress lines and Ctrl-C).
  std::function<Status(std::uint64_t requests_done)> checkpoint;

  // What one block takes in a tier: its KV and its snapshots.
  std::uint64_t stored_block_bytes() const { return block_bytes + snapshot_bytes_per_block; }
};

// What the store holds for one trace block of `block_tokens` tokens (docs/plan.md, "Trace replay").
// The store cuts a prompt into KV chunks of `chunk_tokens` tokens from its first token, stores a
// chunk (`chunk_block_bytes`) once it is complete, and writes every KDA layer's snapshot
// (`snapshot_bytes` together) at every `snapshot_every`-th chunk boundary; a restore starts at such a
// boundary. Either size must divide the other, so a block is whole chunks or a whole share of one.
struct TraceBlockCharge {
  double chunks_per_block = 0;     // block_tokens / chunk_tokens (1/n where n blocks make a chunk)
  double snapshots_per_block = 0;  // chunks_per_block / snapshot_every
  std::uint64_t kv_bytes = 0;      // chunks_per_block x chunk_block_bytes, to the nearest byte
  std::uint64_t snapshot_bytes = 0;  // snapshots_per_block x snapshot_bytes, to the nearest byte
  // Blocks between consecutive restore boundaries that fall at a block's end (snapshot_every x
  // chunk_tokens / gcd(block_tokens, snapshot_every x chunk_tokens)): 1 unless a block is shorter
  // than a chunk, or than snapshot_every chunks.
  std::uint64_t restore_every_blocks = 1;
};

// InvalidArgument naming --trace-block-tokens and --chunk-tokens when neither divides the other (a
// block would hold parts of two chunks), and for zero tokens or chunk bytes or snapshot_every < 1
// (the replay charges the snapshots at chunk boundaries).
Result<TraceBlockCharge> ChargeTraceBlock(std::uint64_t block_tokens, std::uint64_t chunk_tokens,
                                          std::uint64_t chunk_block_bytes, int snapshot_every,
                                          std::uint64_t snapshot_bytes);

struct TierReplayStats {
  std::string name;
  std::uint64_t capacity_blocks = 0;  // per node: capacity / ReplayOptions::stored_block_bytes()
  std::uint64_t hit_blocks = 0;       // prefix blocks found in this tier
  std::uint64_t bytes_read = 0;       // restores out of this tier (0 for tier 0)
  std::uint64_t bytes_written = 0;    // demotions (and write-through copies) into this tier, snapshots included
  std::uint64_t evictions = 0;        // blocks this tier's policy gave up
  // bytes_written of the node that wrote the most into this tier (bytes_written itself for 1 node).
  // Tier 0's writes (new and promoted blocks) are not counted in bytes_written.
  std::uint64_t max_node_bytes_written = 0;
};

struct ReplayResult {
  std::uint64_t requests = 0;
  std::uint64_t blocks = 0;           // prompt blocks in the trace
  std::uint64_t hit_blocks = 0;       // prefix blocks found in any tier
  std::uint64_t hit_tokens = 0;       // prompt tokens not recomputed
  std::uint64_t prompt_tokens = 0;
  std::vector<TierReplayStats> tiers;
  double ttft_saved_s = 0;            // sum over requests of max(0, recompute time - restore time)
  double restore_s = 0;               // sum over requests of the restore time (transfer + waiting)
  double queue_wait_s = 0;            // the waiting part: transfers queued behind earlier ones
  std::uint64_t restores = 0;         // requests with a prefix hit
  std::uint64_t restores_slower_than_recompute = 0;
  std::vector<std::uint64_t> requests_per_node;
  // Prompt tokens recomputed (not hit) by the node that recomputed the most (prompt_tokens -
  // hit_tokens for 1 node).
  std::uint64_t max_node_recomputed_tokens = 0;
  // The trace's span: its last timestamp minus its first, in ms (0 for one request, or all at once).
  std::uint64_t duration_ms = 0;

  double hit_rate() const { return blocks == 0 ? 0.0 : static_cast<double>(hit_blocks) / static_cast<double>(blocks); }
  double tier_hit_rate(std::size_t t) const {
    return blocks == 0 ? 0.0 : static_cast<double>(tiers[t].hit_blocks) / static_cast<double>(blocks);
  }
  std::uint64_t bytes_moved() const;  // all reads and demotion writes
};

// InvalidArgument (naming the CLI flag that sets it) for no tiers or none with room for a block
// (stored_block_bytes()),
// more tiers than a store composes (kMaxTierSlots),
// zero block bytes or tokens or restore_every_blocks,
// nodes < 1, a non-positive prefill speed or bandwidth of a lower tier.
Result<ReplayResult> Replay(const Trace& trace, const ReplayOptions& options);

}  // namespace terrace::plan
