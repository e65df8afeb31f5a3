#include "src/experts/mmap_experts.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "src/common/clock.h"
#include "src/model/names.h"
#include "src/model/safetensors_header.h"

namespace terrace::experts {
namespace {

constexpr std::uint16_t kPinned = 0xFFFF;
// Read-around of one page fault can reach this far past an expert's pages (the kernel's window is
// the device's read_ahead_kb, 128 KiB by default; 8 MiB on some virtual disks): the pages outside
// every charged expert within it are dropped after a load.
constexpr std::uint64_t kSpillWindowBytes = 16ull << 20;
constexpr std::size_t kRecentSweeps = 8;  // loads whose spill windows are swept again

}  // namespace

Result<std::unique_ptr<MmapExpertProvider>> MmapExpertProvider::Open(const model::ModelDir& dir,
                                                                     const MmapExpertOptions& options) {
  const model::ModelConfig& c = dir.config();
  std::unique_ptr<MmapExpertProvider> p(new MmapExpertProvider());
  p->budget_ = options.budget_bytes;
  p->page_ = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  p->num_experts_ = c.num_experts;
  p->experts_.resize(static_cast<std::size_t>(c.num_hidden_layers) * static_cast<std::size_t>(std::max(c.num_experts, 0)));

  std::map<std::string, std::size_t> shard_of_path;  // shard path -> shards_ index
  std::vector<model::SafetensorsHeader> headers;
  std::vector<std::set<std::string>> expert_names;  // per shard: stored names of routed-expert tensors
  auto shard_for = [&](const std::string& name) -> Result<std::size_t> {
    const model::SafetensorsFile* f = dir.ShardOf(name);
    if (f == nullptr) return Status::NotFound(fmt::format("tensor '{}' is not in the checkpoint {}", name, dir.dir().string()));
    const std::string path = f->path().string();
    if (auto it = shard_of_path.find(path); it != shard_of_path.end()) return it->second;
    Shard s;
    s.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (s.fd < 0) return Status::IoError(fmt::format("cannot open shard '{}': {}", path, std::strerror(errno)));
    s.size = f->file_size();
    void* m = s.size > 0 ? ::mmap(nullptr, s.size, PROT_READ, MAP_SHARED, s.fd, 0) : MAP_FAILED;
    if (m == MAP_FAILED) {
      const int err = errno;
      ::close(s.fd);
      return Status::IoError(fmt::format("cannot mmap shard '{}': {}", path, std::strerror(err)));
    }
    s.base = static_cast<const std::byte*>(m);
    s.refs.assign((s.size + p->page_ - 1) / p->page_, 0);
    p->shards_.push_back(std::move(s));
    model::SafetensorsHeader h;
    TERRACE_RETURN_IF_ERROR(model::ParseSafetensorsHeader(std::span<const std::byte>(p->shards_.back().base, p->shards_.back().size), path, &h));
    headers.push_back(std::move(h));
    expert_names.emplace_back();
    shard_of_path.emplace(path, p->shards_.size() - 1);
    return p->shards_.size() - 1;
  };

  const std::int64_t L = c.routed_expert_hidden_size, I = c.moe_intermediate_size;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (c.IsDenseLayer(l)) continue;
    for (int e = 0; e < c.num_experts; ++e) {
      Expert& x = p->experts_[static_cast<std::size_t>(l * c.num_experts + e)];
      x.weights.format = model::ExpertFormat::kMxfp4;
      struct P {
        const char* name;
        model::Mxfp4Matrix* m;
        std::int64_t rows, cols;
      };
      std::vector<Range> ranges;
      for (P q : {P{"w1", &x.weights.q1, I, L}, P{"w2", &x.weights.q2, L, I}, P{"w3", &x.weights.q3, I, L}}) {
        const std::byte* data[2] = {nullptr, nullptr};
        int i = 0;
        for (const char* kind : {"weight_packed", "weight_scale"}) {
          const std::string name = model::ExpertTensorName(l, e, q.name, kind);
          TERRACE_ASSIGN_OR_RETURN(std::size_t si, shard_for(name));
          const std::string stored = dir.StoredName(name);
          const auto& entries = headers[si].entries;
          auto it = std::lower_bound(entries.begin(), entries.end(), stored,
                                     [](const model::SafetensorsEntry& a, const std::string& b) { return a.name < b; });
          if (it == entries.end() || it->name != stored)
            return Status::NotFound(fmt::format("tensor '{}' is not in its shard", name));
          const std::vector<std::int64_t> want =
              i == 0 ? std::vector<std::int64_t>{q.rows, q.cols / 2} : std::vector<std::int64_t>{q.rows, q.cols / 32};
          if (it->shape != want)
            return Status::InvalidArgument(fmt::format("tensor '{}' has shape [{}], expected [{}] (an MXFP4 expert)", name,
                                                       fmt::join(it->shape, ", "), fmt::join(want, ", ")));
          const std::uint64_t begin = headers[si].data_start + it->begin, end = headers[si].data_start + it->end;
          data[i++] = p->shards_[si].base + begin;
          if (p->shards_[si].dir_base == nullptr) {
            auto v = dir.Get(name);
            if (v.ok() && !v->data.empty() && v->data.size() == end - begin) {
              const std::byte* b = v->data.data() - begin;  // a whole-file mapping starts on a page
              if (reinterpret_cast<std::uintptr_t>(b) % p->page_ == 0) p->shards_[si].dir_base = b;
            }
          }
          if (end > begin) ranges.push_back(Range{si, begin / p->page_, (end + p->page_ - 1) / p->page_});
          expert_names[si].insert(stored);
        }
        *q.m = model::Mxfp4Matrix{reinterpret_cast<const std::uint8_t*>(data[0]), reinterpret_cast<const std::uint8_t*>(data[1]),
                                  q.rows, q.cols};
      }
      std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
        return a.shard != b.shard ? a.shard < b.shard : a.first < b.first;
      });
      for (const Range& r : ranges) {
        if (!x.ranges.empty() && x.ranges.back().shard == r.shard && r.first <= x.ranges.back().last) {
          x.ranges.back().last = std::max(x.ranges.back().last, r.last);
        } else {
          x.ranges.push_back(r);
        }
      }
    }
  }
  // The header and every other tensor's pages are never dropped (the model reads them through its
  // own mapping of the same files).
  for (std::size_t si = 0; si < p->shards_.size(); ++si) {
    Shard& s = p->shards_[si];
    auto pin = [&](std::uint64_t begin, std::uint64_t end) {
      for (std::uint64_t pg = begin / p->page_; pg < (end + p->page_ - 1) / p->page_ && pg < s.refs.size(); ++pg) s.refs[pg] = kPinned;
    };
    pin(0, headers[si].data_start);
    for (const auto& e : headers[si].entries)
      if (!expert_names[si].count(e.name)) pin(headers[si].data_start + e.begin, headers[si].data_start + e.end);
  }
  return p;
}

MmapExpertProvider::~MmapExpertProvider() {
  for (Shard& s : shards_) {
    if (s.base != nullptr) ::munmap(const_cast<std::byte*>(s.base), s.size);
    if (s.fd >= 0) ::close(s.fd);
  }
}

std::uint64_t MmapExpertProvider::UnchargedBytes(const Expert& x) const {
  std::uint64_t n = 0;
  for (const Range& r : x.ranges)
    for (std::uint64_t pg = r.first; pg < r.last; ++pg) n += shards_[r.shard].refs[pg] == 0 ? 1 : 0;
  return n * page_;
}

void MmapExpertProvider::Charge(Expert* x) {
  for (const Range& r : x->ranges) {
    auto& refs = shards_[r.shard].refs;
    for (std::uint64_t pg = r.first; pg < r.last; ++pg) {
      if (refs[pg] == kPinned) continue;
      if (refs[pg]++ == 0) stats_.charged_bytes += page_;
    }
  }
  x->charged = true;
  stats_.peak_charged_bytes = std::max(stats_.peak_charged_bytes, stats_.charged_bytes);
}

void MmapExpertProvider::Drop(std::size_t shard, std::uint64_t first, std::uint64_t last) {
  if (last <= first) return;
  const Shard& s = shards_[shard];
  const std::uint64_t off = first * page_, len = std::min((last - first) * page_, s.size - off);
  // The mapping's page-table entries first (a mapped page is not dropped from the page cache),
  // then the file's pages.
  if (::madvise(const_cast<std::byte*>(s.base + off), len, MADV_DONTNEED) != 0) ++stats_.drop_failures;
  if (s.dir_base != nullptr && ::madvise(const_cast<std::byte*>(s.dir_base + off), len, MADV_DONTNEED) != 0) ++stats_.drop_failures;
  if (::posix_fadvise(s.fd, static_cast<off_t>(off), static_cast<off_t>(len), POSIX_FADV_DONTNEED) != 0) ++stats_.drop_failures;
}

void MmapExpertProvider::Evict(int index) {
  Expert& x = experts_[static_cast<std::size_t>(index)];
  for (const Range& r : x.ranges) {
    auto& refs = shards_[r.shard].refs;
    std::uint64_t run = r.first;  // start of the current run of pages that became uncharged
    bool in_run = false;
    for (std::uint64_t pg = r.first; pg <= r.last; ++pg) {
      bool freed = false;
      if (pg < r.last && refs[pg] != kPinned) {
        if (--refs[pg] == 0) {
          freed = true;
          stats_.charged_bytes -= page_;
        }
      }
      if (freed && !in_run) {
        run = pg;
        in_run = true;
      } else if (!freed && in_run) {
        Drop(r.shard, run, pg);
        in_run = false;
      }
    }
  }
  x.charged = false;
  lru_.erase(x.lru);
  ++stats_.evictions;
}

void MmapExpertProvider::DropSpill(const Expert& x) {
  const std::uint64_t w = kSpillWindowBytes / page_;
  for (const Range& r : x.ranges) {
    const Shard& s = shards_[r.shard];
    for (auto [lo, hi] : {std::pair{r.first > w ? r.first - w : 0, r.first}, std::pair{r.last, std::min<std::uint64_t>(r.last + w, s.refs.size())}}) {
      if (hi <= lo) continue;
      const std::uint64_t off = lo * page_, len = std::min((hi - lo) * page_, s.size - off);
      std::vector<unsigned char> vec(hi - lo);
      if (::mincore(const_cast<std::byte*>(s.base + off), len, vec.data()) != 0) {
        ++stats_.drop_failures;
        continue;
      }
      std::uint64_t run = lo;
      bool in_run = false;
      for (std::uint64_t pg = lo; pg <= hi; ++pg) {
        const bool spill = pg < hi && (vec[pg - lo] & 1u) != 0 && s.refs[pg] == 0;
        if (spill && !in_run) {
          run = pg;
          in_run = true;
        } else if (!spill && in_run) {
          Drop(r.shard, run, pg);
          stats_.spill_dropped_bytes += (pg - run) * page_;
          in_run = false;
        }
      }
    }
  }
}

Result<const model::ExpertWeights*> MmapExpertProvider::Acquire(int layer, int expert) {
  const std::size_t n = experts_.size();
  const auto index = static_cast<std::size_t>(layer) * static_cast<std::size_t>(num_experts_) + static_cast<std::size_t>(expert);
  if (layer < 0 || expert < 0 || expert >= num_experts_ || index >= n || experts_[index].ranges.empty())
    return Status::InvalidArgument(fmt::format("expert {} of layer {} is not a routed expert of this checkpoint", expert, layer));
  Expert& x = experts_[index];
  if (x.charged) {
    ++stats_.hits;
    lru_.splice(lru_.end(), lru_, x.lru);
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    while (budget_ > 0 && stats_.charged_bytes + UnchargedBytes(x) > budget_) {
      auto victim = std::find_if(lru_.begin(), lru_.end(), [&](int i) { return experts_[static_cast<std::size_t>(i)].leases == 0; });
      if (victim == lru_.end()) {
        ++stats_.overcommits;
        break;
      }
      Evict(*victim);
    }
    stats_.drop_ns += NanosSince(t0);
    Charge(&x);
    x.lru = lru_.insert(lru_.end(), static_cast<int>(index));
    x.fresh = true;
    ++stats_.loads;
  }
  ++x.leases;
  return &x.weights;
}

void MmapExpertProvider::Release(int layer, int expert) {
  const auto index = static_cast<std::size_t>(layer) * static_cast<std::size_t>(num_experts_) + static_cast<std::size_t>(expert);
  if (layer < 0 || expert < 0 || expert >= num_experts_ || index >= experts_.size()) return;
  Expert& x = experts_[index];
  if (x.leases > 0) --x.leases;
  if (x.fresh && budget_ > 0) {
    const auto t0 = std::chrono::steady_clock::now();
    if (recent_.size() == kRecentSweeps) recent_.erase(recent_.begin());
    recent_.push_back(static_cast<int>(index));
    for (int i : recent_) DropSpill(experts_[static_cast<std::size_t>(i)]);
    stats_.drop_ns += NanosSince(t0);
  }
  x.fresh = false;
}

std::uint64_t MmapExpertProvider::expert_page_bytes() const {
  std::uint64_t n = 0;
  for (const Shard& s : shards_)
    for (std::uint16_t r : s.refs) n += r != kPinned ? 1 : 0;
  return n * page_;
}

std::uint64_t MmapExpertProvider::max_expert_span_bytes() const {
  std::uint64_t most = 0;
  for (const Expert& x : experts_) {
    std::uint64_t pages = 0;
    for (const Range& r : x.ranges)
      for (std::uint64_t pg = r.first; pg < r.last; ++pg) pages += shards_[r.shard].refs[pg] != kPinned ? 1 : 0;
    most = std::max(most, pages);
  }
  return most * page_;
}

bool MmapExpertProvider::Settle(int timeout_ms, int quiet_ms) {
  if (budget_ == 0) return true;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  auto clean_since = std::chrono::steady_clock::now();
  for (;;) {
    bool left = false;
    for (std::size_t si = 0; si < shards_.size(); ++si) {
      const Shard& s = shards_[si];
      std::vector<unsigned char> vec(s.refs.size());
      if (::mincore(const_cast<std::byte*>(s.base), s.size, vec.data()) != 0) return false;
      std::uint64_t run = 0;
      bool in_run = false;
      for (std::uint64_t pg = 0; pg <= vec.size(); ++pg) {
        const bool stray = pg < vec.size() && (vec[pg] & 1u) != 0 && s.refs[pg] == 0;
        if (stray && !in_run) {
          run = pg;
          in_run = true;
        } else if (!stray && in_run) {
          Drop(si, run, pg);
          stats_.spill_dropped_bytes += (pg - run) * page_;
          left = true;
          in_run = false;
        }
      }
    }
    const auto now = std::chrono::steady_clock::now();
    if (left) clean_since = now;
    if (!left && now - clean_since >= std::chrono::milliseconds(quiet_ms)) return true;
    if (now > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

Result<std::uint64_t> MmapExpertProvider::ResidentExpertBytes() const {
  std::uint64_t n = 0;
  for (const Shard& s : shards_) {
    std::vector<unsigned char> vec(s.refs.size());
    if (::mincore(const_cast<std::byte*>(s.base), s.size, vec.data()) != 0)
      return Status::IoError(fmt::format("mincore over a checkpoint shard failed: {}", std::strerror(errno)));
    for (std::size_t pg = 0; pg < vec.size(); ++pg) n += (vec[pg] & 1u) != 0 && s.refs[pg] != kPinned ? 1 : 0;
  }
  return n * page_;
}

}  // namespace terrace::experts
