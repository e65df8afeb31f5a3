// The placement rules (src/store/placement_rules.h) as truth tables: hand-written rows for a
// three-slot store, then every mask of up to kMaxTierSlots slots against a per-slot oracle written
// independently of the header's bit arithmetic.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "src/store/placement_rules.h"

namespace terrace::store_internal {
namespace {

// "x.x": slots 0 and 2 hold a copy (character i is slot i).
SlotMask M(const std::string& s) {
  SlotMask m = 0;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == 'x') m = static_cast<SlotMask>(m | (1u << i));
  }
  return m;
}

std::string Show(SlotMask m, int slots) {
  std::string s;
  for (int i = 0; i < slots; ++i) s += (m >> i) & 1u ? 'x' : '.';
  return s;
}

constexpr auto kEx = Placement::kExclusive;
constexpr auto kIn = Placement::kInclusive;
constexpr auto kWb = WritePolicy::kWriteBack;
constexpr auto kWt = WritePolicy::kWriteThrough;

}  // namespace

TEST_CASE("Mask helpers") {
  CHECK(Bit(0) == 1);
  CHECK(Bit(7) == 128);
  CHECK(Fastest(0) == -1);
  CHECK(Fastest(M("..x")) == 2);
  CHECK(Fastest(M(".xx")) == 1);
  CHECK(Below(0) == M(".xxxxxxx"));
  CHECK(Below(2) == M("...xxxxx"));
  CHECK(Below(7) == 0);
}

TEST_CASE("EvictRule, by hand: three slots (hbm, host, nvme)") {
  struct Row {
    const char* copies;
    int slot;
    EvictAction action;
    int to;
  };
  const int lowest = 2;
  const std::vector<Row> rows = {
      // From hbm: written back into host unless host or nvme holds a copy.
      {"x..", 0, EvictAction::kWriteBack, 1},
      {"xx.", 0, EvictAction::kDrop, -1},
      {"x.x", 0, EvictAction::kDrop, -1},
      {"xxx", 0, EvictAction::kDrop, -1},
      // From host: a copy above does not count, only one below (nvme).
      {".x.", 1, EvictAction::kWriteBack, 2},
      {"xx.", 1, EvictAction::kWriteBack, 2},
      {".xx", 1, EvictAction::kDrop, -1},
      {"xxx", 1, EvictAction::kDrop, -1},
      // From nvme: always the last copy at or below it, whatever is above.
      {"..x", 2, EvictAction::kLastCopy, -1},
      {"x.x", 2, EvictAction::kLastCopy, -1},
      {".xx", 2, EvictAction::kLastCopy, -1},
      {"xxx", 2, EvictAction::kLastCopy, -1},
  };
  for (const Row& r : rows) {
    INFO("copies " << r.copies << ", evicting slot " << r.slot);
    const EvictDecision d = EvictRule(M(r.copies), r.slot, lowest);
    CHECK(d.action == r.action);
    CHECK(d.write_back_to == r.to);
  }
  // A single-slot store: its only slot is the lowest.
  CHECK(EvictRule(M("x"), 0, 0).action == EvictAction::kLastCopy);
}

TEST_CASE("WriteThroughSlot, by hand") {
  CHECK(WriteThroughSlot(0, 2, kWt) == 2);
  CHECK(WriteThroughSlot(1, 2, kWt) == 2);
  CHECK(WriteThroughSlot(2, 2, kWt) == -1);  // the put lands in the lowest slot already
  CHECK(WriteThroughSlot(0, 0, kWt) == -1);
  for (int t = 0; t <= 2; ++t) CHECK(WriteThroughSlot(t, 2, kWb) == -1);
}

TEST_CASE("DroppedByMove, by hand: three slots") {
  struct Row {
    const char* copies;  // before the move (the target's copy may already be among them)
    int to;
    Placement placement;
    WritePolicy policy;
    bool keep_faster;
    const char* dropped;
  };
  const std::vector<Row> rows = {
      // A promotion (Get from below): exclusive moves the block.
      {"..x", 0, kEx, kWb, true, "..x"},
      {".x.", 0, kEx, kWb, true, ".x."},
      {".xx", 0, kEx, kWb, true, ".xx"},
      // ... but write-through keeps the durable copy in the lowest slot.
      {"..x", 0, kEx, kWt, true, "..."},
      {".xx", 0, kEx, kWt, true, ".x."},
      // Inclusive keeps every copy.
      {".xx", 0, kIn, kWb, true, "..."},
      {".xx", 0, kIn, kWt, true, "..."},
      {"..x", 1, kIn, kWb, true, "..."},
      // A promotion into the middle slot leaves a copy above it (a failed faster copy) alone.
      {"x.x", 1, kEx, kWb, true, "..x"},
      {"x.x", 1, kEx, kWt, true, "..."},
      // An exact move (the block must be in `to`: device reads) drops copies above `to` too.
      {"x.x", 1, kEx, kWb, false, "x.x"},
      {"x.x", 1, kEx, kWt, false, "x.."},
      {"x..", 2, kEx, kWb, false, "x.."},
      {"x..", 2, kEx, kWt, false, "x.."},
      {"x.x", 1, kIn, kWb, false, "..."},
      // The target's own copy is never dropped.
      {"xxx", 1, kEx, kWb, true, "..x"},
      {"xxx", 1, kEx, kWb, false, "x.x"},
  };
  for (const Row& r : rows) {
    INFO("copies " << r.copies << " -> slot " << r.to << (r.placement == kEx ? " exclusive" : " inclusive")
                   << (r.policy == kWt ? " write-through" : " write-back") << (r.keep_faster ? " up" : " exact"));
    CHECK(Show(DroppedByMove(M(r.copies), r.to, 2, r.placement, r.policy, r.keep_faster), 3) == r.dropped);
  }
}

TEST_CASE("Every mask of 1 to kMaxTierSlots slots against a per-slot oracle") {
  for (int slots = 1; slots <= kMaxTierSlots; ++slots) {
    const int lowest = slots - 1;
    for (unsigned m = 1; m < (1u << slots); ++m) {
      const auto copies = static_cast<SlotMask>(m);
      auto has = [&](int i) { return ((m >> i) & 1u) != 0; };
      for (int t = 0; t < slots; ++t) {
        // Eviction: look for a copy in any slot after t, one slot at a time.
        if (has(t)) {
          bool copy_below = false;
          for (int i = t + 1; i < slots; ++i) copy_below = copy_below || has(i);
          const EvictDecision d = EvictRule(copies, t, lowest);
          INFO(slots << " slots, copies " << Show(copies, slots) << ", evicting " << t);
          if (copy_below) {
            CHECK(d == EvictDecision{EvictAction::kDrop, -1});
          } else if (t == lowest) {
            CHECK(d == EvictDecision{EvictAction::kLastCopy, -1});
          } else {
            CHECK(d == EvictDecision{EvictAction::kWriteBack, t + 1});
          }
        }
        // A move into t: each other copy is dropped unless a keep reason applies.
        for (Placement pl : {kEx, kIn}) {
          for (WritePolicy wp : {kWb, kWt}) {
            for (bool keep_faster : {true, false}) {
              SlotMask want = 0;
              for (int i = 0; i < slots; ++i) {
                if (!has(i) || i == t || pl == kIn) continue;
                if (keep_faster && i < t) continue;
                if (wp == kWt && i == lowest) continue;
                want = static_cast<SlotMask>(want | (1u << i));
              }
              INFO(slots << " slots, copies " << Show(copies, slots) << " -> " << t);
              CHECK(DroppedByMove(copies, t, lowest, pl, wp, keep_faster) == want);
            }
          }
        }
      }
    }
  }
}

}  // namespace terrace::store_internal
