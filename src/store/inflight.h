// InflightTable: in-flight deduplication of reads from slow tiers. The first caller to fetch a
// key becomes the leader and does the read; callers arriving while it runs wait for its result
// (status, and the bytes when they asked for them) instead of reading again. The leader reads into
// its own destination (its caller's buffer, a reservation, a bounce buffer) and copies the block
// into Fetch::bytes only when a follower that wants the bytes joined. Thread-safe.
#pragma once

#include <cstddef>
#include <memory>
#include <thread>
#include <unordered_map>
#include <vector>

#include "src/common/mutex.h"
#include "terrace/block.h"
#include "terrace/status.h"

namespace terrace::store_internal {

struct Fetch {
  // Set by the leader before Wake(); read by followers only after Wait() returns.
  Status status;
  BlockDesc desc;
  std::vector<std::byte> bytes;  // the block when status is OK and readers > 0 (else empty)
  int src = -1;                  // the slot the leader read it from (-1: not read)
  bool by_prefetch = false;      // immutable after creation
  std::thread::id leader;        // the thread leading it; immutable after creation
  // Followers that want the bytes (not only the outcome); guarded by the InflightTable's mu_ (not
  // expressible as an annotation: another object's lock), final after Close().
  std::size_t readers = 0;

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

  // wants_bytes: a follower needs Fetch::bytes (a Get), not only the outcome (a move).
  Ticket JoinOrLead(const BlockKey& key, bool by_prefetch, bool wants_bytes);
  // Leader only, in two steps, so that it publishes bytes only when someone waits for them. The
  // leader must have published its effects (directory updates) before Close, so a caller
  // arriving later sees them. Close removes the entry (no one can join after it) and returns how
  // many joined wanting the bytes (readers); Wake then releases them. Between the two the leader
  // sets status, desc and (if readers) bytes.
  std::size_t Close(const BlockKey& key, const std::shared_ptr<Fetch>& fetch);
  static void Wake(Fetch& fetch);
  static void Wait(Fetch& fetch);

 private:
  Mutex mu_;
  std::unordered_map<BlockKey, std::shared_ptr<Fetch>> fetches_ TERRACE_GUARDED_BY(mu_);
};

}  // namespace terrace::store_internal
