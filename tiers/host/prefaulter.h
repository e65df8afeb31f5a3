// Prefaulter: one background thread that faults in the pages of freshly mapped host chunks ahead of
// the puts that fill them, so the kernel's page allocation and zeroing (and, for chunks locked with
// MLOCK_ONFAULT, their locking) happen off the putting thread.
//
// Ranges are faulted in the order they were queued with madvise(MADV_POPULATE_WRITE) (Linux >=
// 5.14): 4 KiB-page ranges `piece_bytes` at a time; huge-page ranges (Enqueue's `huge`) one 4 KiB
// page per kHugePageBytes, which faults the whole huge page (MADV_POPULATE_WRITE over a whole huge
// page range is no faster, and populating a huge page while a writer faults it costs both). Faulting
// never changes the bytes of a page that is already present, so writers may copy into a range
// while it is being faulted: a writer that gets ahead faults its pages itself.
// Staying ahead: a range may come with a `frontier` (bytes from the range's start that writers
// have reached, read relaxed as a hint). When the writers are past the prefaulter's position, it
// jumps to two pieces beyond them instead of faulting the same pages as the writer (which makes
// both wait on the same page); the pages it jumped over are queued again at the back, so the whole
// range is still passed over in the end.
// Where the kernel lacks MADV_POPULATE_WRITE the prefaulter stops (note() says why) and writers
// fault pages on first touch, as without it.
//
// Thread-safety: every method may be called concurrently. The destructor abandons queued ranges,
// waits for the piece in progress and joins the thread: destroy the prefaulter before unmapping
// any range queued to it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
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
  // Starts the prefaulter's thread. Unavailable when the OS refuses it (thread or memory limit).
  static Result<std::unique_ptr<Prefaulter>> Create(std::size_t piece_bytes);
  ~Prefaulter();
  Prefaulter(const Prefaulter&) = delete;
  Prefaulter& operator=(const Prefaulter&) = delete;

  // Queues [data, data + bytes) (page-aligned, mapped read-write) to be faulted in. huge: the range
  // is kHugePageBytes-aligned and advised MADV_HUGEPAGE. frontier: null, or bytes from `data` that
  // writers have reached; it must outlive the prefaulter.
  void Enqueue(std::byte* data, std::size_t bytes, bool huge = false,
               const std::atomic<std::uint64_t>* frontier = nullptr);
  // Blocks until every range queued so far has been faulted (or abandoned after a failure).
  void Drain();

  std::uint64_t faulted_bytes() const;  // bytes passed over by MADV_POPULATE_WRITE so far
  std::uint64_t skipped_bytes() const;  // bytes jumped over because writers were there first
  std::string note() const;             // empty, or why faulting ahead stopped

 private:
  struct Range {
    std::byte* data;
    std::size_t bytes;
    bool huge;
    const std::atomic<std::uint64_t>* frontier;
  };
  explicit Prefaulter(std::size_t piece_bytes);  // no thread yet: Create starts it
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
  std::uint64_t skipped_ TERRACE_GUARDED_BY(mu_) = 0;
  std::string note_ TERRACE_GUARDED_BY(mu_);
  std::thread thread_;  // started by Create once the rest is built, joined by the destructor
};

}  // namespace terrace::tiers
