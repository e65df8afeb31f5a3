// The raw I/O seam of the NVMe tier: positioned reads and writes on the data file, and fdatasync.
//
// Production uses the io_uring engine (uring_engine.h); tests wrap it in FaultInjectingIoEngine
// (fault_engine.h). An engine issues each request exactly once and reports the raw result; the
// driver RunToCompletion() resubmits short transfers and retries -EAGAIN / -EINTR, so retries
// behave the same under every engine.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>

#include "src/common/clock.h"
#include "terrace/status.h"

namespace terrace::nvme {

enum class IoOp : std::uint8_t { kRead = 0, kWrite = 1 };

struct IoRequest {
  IoOp op = IoOp::kRead;
  std::uint64_t offset = 0;  // bytes into the data file
  // Not owned; must stay valid until the request completes. Exactly one is set, by op:
  std::byte* buf = nullptr;        // kRead: where the bytes land
  const std::byte* src = nullptr;  // kWrite: the bytes to write; the engine never writes through it
  std::uint32_t len = 0;     // bytes
  int buf_index = -1;        // registered buffer holding [buf, buf+len) (fixed I/O), or -1
  int result = 0;            // out: bytes transferred (possibly fewer than len) or -errno
  std::uint64_t submit_ns = 0;  // out: steady-clock time the engine queued it (latency stats)
  // out: steady-clock time the engine reaped its completion, before any callback ran; 0 when the
  // engine did not stamp it (the caller uses the time its callback runs).
  std::uint64_t complete_ns = 0;
};

// Called on the submitting thread when request `index` of the span completes.
using IoCompletion = std::function<void(std::size_t index)>;

class IoEngine {
 public:
  virtual ~IoEngine() = default;

  // Issues every request once, keeping up to queue_depth() in flight and submitting many per
  // system call; returns when all have completed. Thread-safe: concurrent callers use separate
  // rings (or wait for one). `on_complete` may be null.
  virtual void Execute(std::span<IoRequest> reqs, const IoCompletion* on_complete) = 0;

  // fdatasync of the data file: 0 or -errno.
  virtual int SyncData() = 0;

  // Replaces the registered (fixed) buffer table; entry i becomes buf_index i. Waits for
  // in-flight I/O. On failure, the engine keeps working without fixed buffers.
  virtual Status RegisterBuffers(std::span<const iovec> bufs) = 0;
  // True when the last RegisterBuffers succeeded (buf_index is honoured).
  virtual bool fixed_buffers() const = 0;

  virtual unsigned queue_depth() const = 0;
  virtual std::string_view name() const = 0;
};

struct IoEngineConfig {
  int fd = -1;                // data file, opened by the tier, owned by the tier
  unsigned queue_depth = 32;  // per ring
  unsigned rings = 1;         // one per I/O thread
};

using IoEngineFactory = std::function<Result<std::unique_ptr<IoEngine>>(const IoEngineConfig&)>;

// Runs `reqs` to completion on `engine`: short transfers are resubmitted for the remainder,
// -EAGAIN / -EINTR retried (bounded), an unexpected end of file becomes -EIO. `on_done(i, err)` runs
// once per request with err 0 (fully transferred) or -errno. Requests are modified in place.
void RunToCompletion(IoEngine& engine, std::span<IoRequest> reqs,
                     const std::function<void(std::size_t, int)>& on_done);

}  // namespace terrace::nvme
