// KeyMap<V>: the hash map behind every directory keyed by BlockKey (the store's directory, the
// NVMe tier's index). absl::flat_hash_map: open addressing with SIMD group probing, values held
// inline, so a lookup costs about two cache misses (the control group and the slot) instead of the
// bucket-node-node chain of std::unordered_map, and batched lookups can prefetch ahead (Prefetch).
//
// Contract: like absl::flat_hash_map, an insert may move every value; never hold a reference or
// iterator into the map across an insert. Not thread-safe; callers guard it with their own mutex.
#pragma once

#include <absl/container/flat_hash_map.h>

#include "terrace/block.h"

namespace terrace {

struct BlockKeyHasher {
  std::size_t operator()(const BlockKey& k) const noexcept { return k.Hash(); }
};

template <class V>
using KeyMap = absl::flat_hash_map<BlockKey, V, BlockKeyHasher>;

}  // namespace terrace
