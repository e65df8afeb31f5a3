// The benchmark's mmap baseline (docs/experts.md, "Benchmark"): routed experts read zero-copy
// through a read-only mmap of the checkpoint's safetensors shards, as llama.cpp reads them, the page
// cache being the expert cache. With a byte budget it stands for a machine whose RAM holds only that
// share of the experts: touched experts are kept in LRU order and the pages of an evicted one are
// dropped from the page cache (madvise(MADV_DONTNEED) on the mapping, then
// posix_fadvise(POSIX_FADV_DONTNEED) on the file range), so the kernel must read them again.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <vector>

#include "src/model/safetensors.h"
#include "terrace/model_weights.h"
#include "terrace/status.h"

namespace terrace::experts {

struct MmapExpertOptions {
  // Page-cache bytes the routed experts may hold; 0 = unbounded (the kernel keeps what it reads).
  std::uint64_t budget_bytes = 0;
};

struct MmapExpertStats {
  std::uint64_t loads = 0;      // acquires of an expert that was not charged (its pages had to be read)
  std::uint64_t hits = 0;       // acquires of a charged expert
  std::uint64_t evictions = 0;  // experts whose pages were dropped to make room
  std::uint64_t charged_bytes = 0, peak_charged_bytes = 0;  // whole pages of the charged experts
  // Loads that left charged bytes over the budget: every other charged expert was leased, or the
  // expert's own pages exceed the budget (max_expert_span_bytes).
  std::uint64_t overcommits = 0;
  std::uint64_t spill_dropped_bytes = 0;  // read-ahead pages outside any charged expert, dropped after a load
  std::uint64_t drop_failures = 0;        // madvise / posix_fadvise calls that failed
  // Forward-thread time spent evicting and sweeping (mincore, madvise, posix_fadvise): the work a
  // RAM-limited machine's kernel reclaim would do on another thread, so the bench can report the
  // baseline with and without it.
  std::uint64_t drop_ns = 0;
};

// Not thread-safe: one forward thread acquires and releases (as model::Model does). The mapping and
// file descriptors live as long as the provider; `dir` must outlive it (Drop also unmaps pages
// from `dir`'s mapping of the same files).
class MmapExpertProvider final : public model::ExpertProvider {
 public:
  // Maps every shard that holds a routed expert (MAP_SHARED, PROT_READ). Errors name the shard or
  // tensor; F32/BF16 experts are refused (the baseline serves MXFP4 checkpoints).
  static Result<std::unique_ptr<MmapExpertProvider>> Open(const model::ModelDir& dir, const MmapExpertOptions& options);
  ~MmapExpertProvider() override;
  MmapExpertProvider(const MmapExpertProvider&) = delete;
  MmapExpertProvider& operator=(const MmapExpertProvider&) = delete;

  Result<const model::ExpertWeights*> Acquire(int layer, int expert) override;
  void Release(int layer, int expert) override;

  const MmapExpertStats& stats() const { return stats_; }
  std::uint64_t budget_bytes() const { return budget_; }
  // Whole pages covering every routed expert's tensors (what an unbounded run can end up holding).
  std::uint64_t expert_page_bytes() const;
  // The chargeable pages (whole pages, less those shared with non-expert tensors) of the largest
  // single expert: a budget below this overcommits on every load of that expert.
  std::uint64_t max_expert_span_bytes() const;
  // mincore() over the pages of every routed expert: bytes of them now in the page cache.
  Result<std::uint64_t> ResidentExpertBytes() const;
  // Budgeted only: drops every expert page in the page cache that no charged expert covers (the
  // kernel's read-ahead around a fault can land after the sweep at release: pages still under I/O
  // are neither dropped nor reported by mincore until their read completes), retrying until no
  // such page has been seen for `quiet_ms` or `timeout_ms` has passed (then false). Afterwards
  // ResidentExpertBytes() <= budget_bytes() unless a read-ahead outlasted `quiet_ms`. Untimed use
  // (tests, reports).
  bool Settle(int timeout_ms = 1000, int quiet_ms = 20);

 private:
  struct Range {  // pages [first, last) of one shard
    std::size_t shard;
    std::uint64_t first, last;
  };
  struct Shard {
    int fd = -1;
    const std::byte* base = nullptr;
    // `dir`'s own mapping of the same file (the model loads its other weights through it, and the
    // kernel's fault-around maps cached neighbouring pages into it): a page mapped there is not
    // dropped from the page cache either, so Drop unmaps the range there too. nullptr if unknown.
    const std::byte* dir_base = nullptr;
    std::uint64_t size = 0;
    std::vector<std::uint16_t> refs;  // per page: charged experts covering it; kPinned for non-expert tensors
  };
  struct Expert {
    model::ExpertWeights weights;
    std::vector<Range> ranges;  // merged page ranges of its six tensors
    bool charged = false;
    int leases = 0;
    bool fresh = false;  // loaded and not yet released: drop its read-ahead spill at release
    std::list<int>::iterator lru;
  };
  MmapExpertProvider() = default;
  std::uint64_t UnchargedBytes(const Expert& x) const;
  void Charge(Expert* x);
  void Evict(int index);
  void Drop(std::size_t shard, std::uint64_t first, std::uint64_t last);  // pages, uncharged only
  void DropSpill(const Expert& x);

  std::uint64_t budget_ = 0, page_ = 4096;
  int num_experts_ = 0;
  std::vector<Shard> shards_;
  std::vector<Expert> experts_;  // [layer * num_experts + expert]; empty ranges for dense layers
  std::list<int> lru_;           // charged experts, least recently used first
  // The experts loaded last: their read-ahead spill is swept again at every later load's release,
  // because read-ahead still in flight at the first sweep lands afterwards (pages under I/O are
  // not dropped).
  std::vector<int> recent_;
  MmapExpertStats stats_;
};

}  // namespace terrace::experts
