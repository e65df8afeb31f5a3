// InflightTable: in-flight deduplication of reads from slow tiers. The first caller to fetch a
// key becomes the leader and does the read; callers arriving while it runs wait for its result
// (bytes and status) instead of reading again. Thread-safe.
#pragma once

#include <cstddef>
#include <memory>
#include <unordered_map>
#include <vector>

#include "src/common/mutex.h"
#include "terrace/block.h"
#include "terrace/status.h"

namespace terrace::store_internal {

struct Fetch {
  // Set by the leader before Finish(); read by followers only after Wait() returns.
  Status status;
  BlockDesc desc;
  std::vector<std::byte> bytes;  // the block when status is OK
  bool by_prefetch = false;      // immutable after creation
  std::size_t followers = 0;     // callers that joined; guarded by the InflightTable's mu_ (not
                                 // expressible as an annotation: another object's lock), final after Close()

  Mutex mu;
  CondVar cv;
  bool done TERRACE_GUARDED_BY(mu) = false;
};

class InflightTable {
 public:
  struct Ticket {
    std::shared_ptr<Fetch> fetch;
    bool leader = false;
  };

  Ticket JoinOrLead(const BlockKey& key, bool by_prefetch);
  // Leader only: removes the entry, then wakes the followers. The leader must have published
  // its effects (directory updates) before calling, so a caller arriving later sees them.
  void Finish(const BlockKey& key, const std::shared_ptr<Fetch>& fetch);
  // Finish in two steps, for a leader that publishes bytes only when someone waits for them:
  // Close removes the entry (no one can join after it) and returns how many joined; Wake then
  // releases them. Between the two the leader sets status, desc and (if followers) bytes.
  std::size_t Close(const BlockKey& key, const std::shared_ptr<Fetch>& fetch);
  static void Wake(Fetch& fetch);
  static void Wait(Fetch& fetch);

 private:
  Mutex mu_;
  std::unordered_map<BlockKey, std::shared_ptr<Fetch>> fetches_ TERRACE_GUARDED_BY(mu_);
};

}  // namespace terrace::store_internal
