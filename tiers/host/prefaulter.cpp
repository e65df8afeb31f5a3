#include "tiers/host/prefaulter.h"

#include "tiers/host/pinned_memory.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "src/common/start_thread.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14 uapi value, for older headers
#endif

namespace terrace::tiers {

Status PopulateNow(std::byte* data, std::size_t bytes) {
  if (bytes == 0) return Status::Ok();
  if (::madvise(data, bytes, MADV_POPULATE_WRITE) == 0) return Status::Ok();
  const int err = errno;
  if (err != EINVAL) {
    return Status::OutOfCapacity(fmt::format("faulting in {} MiB of host memory at open failed: madvise"
                                             "(MADV_POPULATE_WRITE): {}; lower HostTierOptions::populate_bytes or free memory",
                                             bytes >> 20, std::strerror(err)));
  }
  // Kernel before 5.14: a write per page faults it in; the memory is fresh and zero-filled.
  for (std::size_t off = 0; off < bytes; off += 4096) {
    reinterpret_cast<volatile unsigned char*>(data)[off] = 0;
  }
  return Status::Ok();
}

Prefaulter::Prefaulter(std::size_t piece_bytes) : piece_bytes_(std::max<std::size_t>(piece_bytes, 4096)) {}

Result<std::unique_ptr<Prefaulter>> Prefaulter::Create(std::size_t piece_bytes) {
  std::unique_ptr<Prefaulter> p(new Prefaulter(piece_bytes));
  Prefaulter* raw = p.get();
  TERRACE_ASSIGN_OR_RETURN(p->thread_, StartThread("the host tier's prefault thread", [raw] { raw->Run(); }));
  return p;
}

Prefaulter::~Prefaulter() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
    queue_.clear();
    work_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
}

void Prefaulter::Enqueue(std::byte* data, std::size_t bytes, bool huge, const std::atomic<std::uint64_t>* frontier) {
  MutexLock lock(&mu_);
  if (failed_ || stop_ || bytes == 0) return;
  queue_.push_back(Range{data, bytes, huge, frontier});
  work_.Signal();
}

void Prefaulter::Drain() {
  MutexLock lock(&mu_);
  while (busy_ || !queue_.empty()) idle_.Wait(&mu_);
}

std::uint64_t Prefaulter::faulted_bytes() const {
  MutexLock lock(&mu_);
  return faulted_;
}

std::uint64_t Prefaulter::skipped_bytes() const {
  MutexLock lock(&mu_);
  return skipped_;
}

std::string Prefaulter::note() const {
  MutexLock lock(&mu_);
  return note_;
}

void Prefaulter::Run() {
  MutexLock lock(&mu_);
  for (;;) {
    while (!stop_ && queue_.empty()) work_.Wait(&mu_);
    if (stop_) break;
    Range r = queue_.front();
    queue_.pop_front();
    busy_ = true;
    // Huge-page ranges: one kHugePageBytes step per call, populating its first 4 KiB page.
    const std::size_t step = r.huge ? kHugePageBytes : piece_bytes_;
    std::size_t off = 0;
    while (off < r.bytes && !stop_) {
      if (r.frontier != nullptr) {
        const std::uint64_t reached = std::min<std::uint64_t>(r.frontier->load(std::memory_order_relaxed), r.bytes);
        if (reached > off) {
          // Writers are ahead: resume two steps past them; what lies between is queued again.
          const std::size_t to = std::min<std::size_t>(r.bytes, (reached + step - 1) / step * step + 2 * step);
          queue_.push_back(Range{r.data + off, to - off, r.huge, nullptr});
          skipped_ += to - off;
          off = to;
          continue;
        }
      }
      const std::size_t len = std::min(step, r.bytes - off);
      const std::size_t populate = r.huge && len == kHugePageBytes ? 4096 : len;
      lock.Unlock();
      const int rc = ::madvise(r.data + off, populate, MADV_POPULATE_WRITE);
      const int err = errno;
      lock.Lock();
      if (rc != 0) {
        // EINVAL: the kernel predates MADV_POPULATE_WRITE; ENOMEM/EFAULT: no memory for the pages.
        // Either way writers fault their pages themselves, as without a prefaulter.
        failed_ = true;
        note_ = fmt::format("faulting ahead stopped: madvise(MADV_POPULATE_WRITE) failed: {}{}", std::strerror(err),
                            err == EINVAL ? " (needs Linux >= 5.14)" : "");
        queue_.clear();
        break;
      }
      faulted_ += len;
      off += len;
    }
    busy_ = false;
    if (queue_.empty()) idle_.SignalAll();
  }
  busy_ = false;
  idle_.SignalAll();
}

}  // namespace terrace::tiers
