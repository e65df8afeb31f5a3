#include <list>
#include <unordered_map>

#include "src/store/eviction_policy.h"

namespace terrace::store_internal {
namespace {

class LruPolicy final : public EvictionPolicy {
 public:
  std::string_view name() const override { return "lru"; }

  void OnInsert(const BlockKey& key, std::uint64_t /*size*/) override {
    auto it = pos_.find(key);
    if (it != pos_.end()) {
      order_.splice(order_.end(), order_, it->second);
      return;
    }
    order_.push_back(key);
    pos_.emplace(key, std::prev(order_.end()));
  }

  void OnAccess(const BlockKey& key) override {
    auto it = pos_.find(key);
    if (it != pos_.end()) order_.splice(order_.end(), order_, it->second);
  }

  void OnErase(const BlockKey& key, bool /*evicted*/) override {
    auto it = pos_.find(key);
    if (it == pos_.end()) return;
    order_.erase(it->second);
    pos_.erase(it);
  }

  std::optional<BlockKey> PickVictim(const std::function<bool(const BlockKey&)>& evictable) override {
    for (const auto& k : order_) {  // front = least recently used
      if (evictable(k)) return k;
    }
    return std::nullopt;
  }

  std::uint64_t size() const override { return pos_.size(); }

 private:
  std::list<BlockKey> order_;  // least recent first
  std::unordered_map<BlockKey, std::list<BlockKey>::iterator> pos_;
};

}  // namespace

std::unique_ptr<EvictionPolicy> MakeLruPolicy() { return std::make_unique<LruPolicy>(); }

std::unique_ptr<EvictionPolicy> MakeEvictionPolicy(terrace::EvictionPolicy kind) {
  return kind == terrace::EvictionPolicy::kLru ? MakeLruPolicy() : MakeS3FifoPolicy();
}

}  // namespace terrace::store_internal
