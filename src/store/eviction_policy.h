// EvictionPolicy: picks which block a tier gives up next. One instance per tier, owned by the
// store; the store calls every method under its directory mutex, so implementations need no
// locking of their own (not thread-safe by themselves).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>

#include "terrace/block.h"
#include "terrace/options.h"

namespace terrace::store_internal {

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual std::string_view name() const = 0;

  // `key` became resident (size in bytes). Re-inserting a resident key is treated as an access.
  virtual void OnInsert(const BlockKey& key, std::uint64_t size) = 0;
  // `key` was read. Unknown keys are ignored.
  virtual void OnAccess(const BlockKey& key) = 0;
  // `key` left the tier; `evicted` says the policy's own choice removed it (S3-FIFO remembers
  // such keys in its ghost queue), false for erases and moves. Unknown keys are ignored.
  virtual void OnErase(const BlockKey& key, bool evicted) = 0;
  // The next victim among keys for which `evictable` is true (pinned or busy keys are not), or
  // nullopt. Does not remove it: the caller calls OnErase(key, true) once the copy is gone. May
  // reorder internal queues (that is how S3-FIFO ages keys).
  virtual std::optional<BlockKey> PickVictim(const std::function<bool(const BlockKey&)>& evictable) = 0;

  virtual std::uint64_t size() const = 0;  // resident keys tracked
};

// LRU: evicts the least recently inserted or accessed key.
std::unique_ptr<EvictionPolicy> MakeLruPolicy();
// S3-FIFO (Yang et al., SOSP'23): small FIFO for new keys (evicts while >= 10% of the RESIDENT bytes,
// not of capacity), main FIFO for keys read again, ghost FIFO of keys evicted from small (at most
// max(resident keys, 16)), 2-bit frequency. One-hit keys (scans) leave through small, sparing main.
std::unique_ptr<EvictionPolicy> MakeS3FifoPolicy();
std::unique_ptr<EvictionPolicy> MakeEvictionPolicy(terrace::EvictionPolicy kind);

}  // namespace terrace::store_internal
