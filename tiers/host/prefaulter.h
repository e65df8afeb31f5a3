// Prefaulter: one background thread that faults in the pages of freshly mapped host chunks ahead of
// the puts that fill them, so the kernel's page allocation and zeroing (and, for chunks locked with
// MLOCK_ONFAULT, their locking) happen off the putting thread.
//
// Ranges are faulted in the order they were queued, `piece_bytes` at a time, with
// madvise(MADV_POPULATE_WRITE) (Linux >= 5.14). Faulting never changes the bytes of a page that is
// already present, so writers may copy into a range while it is being faulted: a writer that gets
// ahead faults its pages itself, and the prefaulter then passes over them at page-table speed.
// Where the kernel lacks MADV_POPULATE_WRITE the prefaulter stops (note() says why) and writers
// fault pages on first touch, as without it.
//
// Thread-safety: every method may be called concurrently. The destructor abandons queued ranges,
// waits for the piece in progress and joins the thread: destroy the prefaulter before unmapping
// any range queued to it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <thread>

#include "src/common/mutex.h"
#include "terrace/status.h"

namespace terrace::tiers {

// Faults in (and, for MLOCK_ONFAULT chunks, locks) [data, data + bytes) on the calling thread
// (page-aligned, mapped read-write, not yet written by anyone else: where the kernel lacks
// MADV_POPULATE_WRITE each page is touched with a write of zero). OutOfCapacity when the kernel
// has no memory for the pages.
Status PopulateNow(std::byte* data, std::size_t bytes);

class Prefaulter {
 public:
  explicit Prefaulter(std::size_t piece_bytes);
  ~Prefaulter();
  Prefaulter(const Prefaulter&) = delete;
  Prefaulter& operator=(const Prefaulter&) = delete;

  // Queues [data, data + bytes) (page-aligned, mapped read-write) to be faulted in.
  void Enqueue(std::byte* data, std::size_t bytes);
  // Blocks until every range queued so far has been faulted (or abandoned after a failure).
  void Drain();

  std::uint64_t faulted_bytes() const;  // bytes passed over by MADV_POPULATE_WRITE so far
  std::string note() const;             // empty, or why faulting ahead stopped

 private:
  struct Range {
    std::byte* data;
    std::size_t bytes;
  };
  void Run();

  const std::size_t piece_bytes_;
  mutable Mutex mu_;
  CondVar work_;  // with mu_: a range was queued or stop_ was set
  CondVar idle_;  // with mu_: the queue became empty and no piece is in progress
  std::deque<Range> queue_ TERRACE_GUARDED_BY(mu_);
  bool busy_ TERRACE_GUARDED_BY(mu_) = false;  // a range taken off the queue is being faulted
  bool stop_ TERRACE_GUARDED_BY(mu_) = false;
  bool failed_ TERRACE_GUARDED_BY(mu_) = false;
  std::uint64_t faulted_ TERRACE_GUARDED_BY(mu_) = 0;
  std::string note_ TERRACE_GUARDED_BY(mu_);
  std::thread thread_;  // started last, joined by the destructor
};

}  // namespace terrace::tiers
