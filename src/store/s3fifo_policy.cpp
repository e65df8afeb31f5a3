#include <algorithm>
#include <list>
#include <unordered_map>

#include "src/store/eviction_policy.h"

namespace terrace::store_internal {
namespace {

class S3FifoPolicy final : public EvictionPolicy {
 public:
  std::string_view name() const override { return "s3fifo"; }

  void OnInsert(const BlockKey& key, std::uint64_t size) override {
    auto it = nodes_.find(key);
    if (it != nodes_.end()) {
      Node& n = it->second;
      Account(n, -1);
      n.size = size;
      Account(n, +1);
      Bump(n);
      return;
    }
    auto g = ghost_index_.find(key);
    bool was_ghost = g != ghost_index_.end();
    if (was_ghost) {
      ghost_.erase(g->second);
      ghost_index_.erase(g);
    }
    Node n;
    n.size = size;
    n.in_main = was_ghost;
    auto& q = n.in_main ? main_ : small_;
    q.push_back(key);
    n.pos = std::prev(q.end());
    Account(n, +1);
    nodes_.emplace(key, n);
  }

  void OnAccess(const BlockKey& key) override {
    auto it = nodes_.find(key);
    if (it != nodes_.end()) Bump(it->second);
  }

  void OnErase(const BlockKey& key, bool evicted) override {
    auto it = nodes_.find(key);
    if (it == nodes_.end()) return;
    Node& n = it->second;
    Account(n, -1);
    (n.in_main ? main_ : small_).erase(n.pos);
    bool to_ghost = evicted && !n.in_main;
    nodes_.erase(it);
    if (to_ghost && !ghost_index_.contains(key)) {
      ghost_.push_back(key);
      ghost_index_.emplace(key, std::prev(ghost_.end()));
      std::size_t limit = std::max<std::size_t>(nodes_.size(), 16);
      while (ghost_.size() > limit) {
        ghost_index_.erase(ghost_.front());
        ghost_.pop_front();
      }
    }
  }

  std::optional<BlockKey> PickVictim(const std::function<bool(const BlockKey&)>& evictable) override {
    // A queue is exhausted after a lap of consecutive skips (unevictable keys); a freq decrement
    // or a small -> main move is progress and starts the count again. Every key is examined a
    // bounded number of times: each lap of main spends one freq level (<= 3) of every key in it.
    std::size_t small_skips = 0, main_skips = 0;
    std::size_t budget = 6 * nodes_.size() + 8;
    while (budget-- > 0) {
      bool small_exhausted = small_skips >= small_.size();
      bool main_exhausted = main_skips >= main_.size();
      if (small_exhausted && main_exhausted) return std::nullopt;
      bool from_small = !small_exhausted && (main_exhausted || small_bytes_ * 10 >= total_bytes_);
      if (from_small) {
        BlockKey k = small_.front();
        Node& n = nodes_.at(k);
        if (!evictable(k)) {
          small_.splice(small_.end(), small_, n.pos);
          ++small_skips;
          continue;
        }
        if (n.freq > 0) {  // read again while in small: it earns a place in main
          small_bytes_ -= n.size;
          main_.splice(main_.end(), small_, n.pos);
          n.in_main = true;
          n.freq = 0;
          main_skips = 0;
          continue;
        }
        return k;
      }
      BlockKey k = main_.front();
      Node& n = nodes_.at(k);
      if (!evictable(k)) {
        main_.splice(main_.end(), main_, n.pos);
        ++main_skips;
        continue;
      }
      if (n.freq > 0) {
        --n.freq;
        main_.splice(main_.end(), main_, n.pos);
        main_skips = 0;  // progress: main is exhausted only after a whole lap of skips
        continue;
      }
      return k;
    }
    return std::nullopt;
  }

  std::uint64_t size() const override { return nodes_.size(); }

 private:
  struct Node {
    std::list<BlockKey>::iterator pos;
    std::uint64_t size = 0;
    std::uint8_t freq = 0;  // 0..3
    bool in_main = false;
  };

  static void Bump(Node& n) { n.freq = static_cast<std::uint8_t>(std::min(n.freq + 1, 3)); }

  void Account(const Node& n, int sign) {
    if (sign > 0) {
      total_bytes_ += n.size;
      if (!n.in_main) small_bytes_ += n.size;
    } else {
      total_bytes_ -= n.size;
      if (!n.in_main) small_bytes_ -= n.size;
    }
  }

  std::unordered_map<BlockKey, Node> nodes_;
  std::list<BlockKey> small_;  // FIFO, oldest first
  std::list<BlockKey> main_;   // FIFO, oldest first
  std::list<BlockKey> ghost_;  // keys evicted from small, oldest first
  std::unordered_map<BlockKey, std::list<BlockKey>::iterator> ghost_index_;
  std::uint64_t small_bytes_ = 0;
  std::uint64_t total_bytes_ = 0;
};

}  // namespace

std::unique_ptr<EvictionPolicy> MakeS3FifoPolicy() { return std::make_unique<S3FifoPolicy>(); }

}  // namespace terrace::store_internal
