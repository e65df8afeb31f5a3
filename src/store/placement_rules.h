// Placement rules: the store's decisions about which tier slots hold a block's copies
// (StoreOptions::placement and write_policy, terrace/options.h), as pure functions over a copy
// mask. The store (placement.cpp, read_path.cpp, write_path.cpp, device_path.cpp, evict_copy.cpp)
// and the planner's trace replay (src/plan/replay.cpp) both decide with these, so the replay
// follows the store's rules by construction. Header-only, no state, no locks, no I/O, no
// dependence on StoreImpl or on any tier: the caller applies a decision and adds what only it
// knows (pins and handles, I/O errors, the order of the writes).
//
// Slots are positions in an ordered tier list, 0 = fastest, `lowest` = the last slot (the list's
// size - 1, at most kMaxTierSlots - 1). A SlotMask has bit i set when slot i holds a copy.
#pragma once

#include <bit>
#include <cstdint>

#include "terrace/options.h"
#include "terrace/tier.h"

namespace terrace::store_internal {

using SlotMask = std::uint8_t;
static_assert(kMaxTierSlots <= 8 * sizeof(SlotMask));
constexpr SlotMask Bit(int slot) { return static_cast<SlotMask>(1u << static_cast<unsigned>(slot)); }
// Index of the fastest slot in `mask`, or -1 when the mask is empty.
constexpr int Fastest(SlotMask mask) { return mask == 0 ? -1 : std::countr_zero(static_cast<unsigned>(mask)); }
// Index of the slowest slot in `mask`, or -1 when the mask is empty.
constexpr int Slowest(SlotMask mask) { return std::bit_width(static_cast<unsigned>(mask)) - 1; }
// Slots strictly after `slot`.
constexpr SlotMask Below(int slot) { return static_cast<SlotMask>(~((2u << static_cast<unsigned>(slot)) - 1u)); }

// What evicting slot `slot`'s copy takes.
enum class EvictAction : std::uint8_t {
  kDrop,       // a slot below holds a copy: erase this one, nothing is written
  kWriteBack,  // no slot below holds one: write it into EvictDecision::write_back_to first (a demotion)
  kLastCopy,   // no slot below holds one and `slot` is the lowest: nowhere to write it back (the
               // store refuses, it never drops the last copy; the replay, a cache, drops it)
};
struct EvictDecision {
  EvictAction action = EvictAction::kDrop;
  int write_back_to = -1;  // kWriteBack: the next slot (slot + 1); else -1
  friend constexpr bool operator==(const EvictDecision&, const EvictDecision&) = default;
};
// `copies`: the slots holding the block now (including `slot`).
constexpr EvictDecision EvictRule(SlotMask copies, int slot, int lowest) {
  if (copies & Below(slot)) return {EvictAction::kDrop, -1};
  if (slot >= lowest) return {EvictAction::kLastCopy, -1};
  return {EvictAction::kWriteBack, slot + 1};
}

// Write-through: the slot a put into `target` also writes before it is acknowledged (the lowest),
// or -1 (write-back, or `target` is the lowest already).
constexpr int WriteThroughSlot(int target, int lowest, WritePolicy policy) {
  return policy == WritePolicy::kWriteThrough && target != lowest ? lowest : -1;
}

// The copies placement removes once a block has been copied into slot `to` (`copies`: the slots
// that held it before). kInclusive: none. kExclusive: every other copy, except the lowest slot's
// under write-through (the durable copy stays) and, when `keep_faster` (a promotion: the move was
// up to `to`), the copies above `to`. The store keeps copies pinned by a handle besides.
constexpr SlotMask DroppedByMove(SlotMask copies, int to, int lowest, Placement placement, WritePolicy policy,
                                 bool keep_faster) {
  if (placement != Placement::kExclusive) return 0;
  SlotMask keep = Bit(to);
  if (policy == WritePolicy::kWriteThrough) keep |= Bit(lowest);
  if (keep_faster) keep |= static_cast<SlotMask>(Bit(to) - 1u);
  return static_cast<SlotMask>(copies & ~keep);
}

}  // namespace terrace::store_internal
