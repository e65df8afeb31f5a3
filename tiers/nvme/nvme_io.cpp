// NvmeTier's I/O path: splitting blocks into chunks, staging unaligned ones, running them on the
// engine with the queue kept full.
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "tiers/nvme/nvme_tier.h"
#include "tiers/nvme/staging_pool.h"

namespace terrace {

using nvme::IoOp;
using nvme::IoRequest;
using nvme::kUnit;

void NvmeTier::PlanChunks(std::size_t op, std::uint64_t file_offset, std::uint32_t skip, std::byte* dst,
                          const std::byte* src, std::uint64_t len, std::uint64_t room, std::vector<Chunk>* out) const {
  const std::uint64_t max = staging_->buffer_bytes();  // a multiple of the unit
  const std::byte* base = dst ? dst : src;
  // The caller's byte `done` lies at file_offset + skip + done; only the first chunk starts
  // inside a unit, so every later one starts on a unit boundary.
  for (std::uint64_t done = 0; done < len;) {
    const std::uint32_t head = done == 0 ? skip : 0;
    std::uint64_t n = std::min(max - head, len - done);
    Chunk c;
    c.op = op;
    c.file_offset = file_offset + skip + done - head;
    if (dst) {
      c.dst = dst + done;
    } else {
      c.src = src + done;
    }
    c.len = static_cast<std::uint32_t>(n);
    c.skip = head;
    c.io_len = static_cast<std::uint32_t>(nvme::RoundUp(head + n, kUnit));
    c.staged = head != 0 || reinterpret_cast<std::uintptr_t>(base + done) % kUnit != 0 ||
               (n % kUnit != 0 && done + c.io_len > room);
    if (dst && !c.staged && room > done + c.io_len) c.room_after = room - done - c.io_len;
    out->push_back(c);
    done += n;
  }
}

void NvmeTier::PlanReadChunks(std::size_t op, std::uint64_t file_offset, std::uint32_t skip, std::byte* dst,
                              std::uint64_t len, std::uint64_t room, std::vector<Chunk>* out) const {
  PlanChunks(op, file_offset, skip, dst, nullptr, len, room, out);
}

void NvmeTier::PlanWriteChunks(std::size_t op, std::uint64_t file_offset, std::span<const std::byte> src,
                               std::vector<Chunk>* out) const {
  PlanChunks(op, file_offset, 0, nullptr, src.data(), src.size(), src.size(), out);
}

void NvmeTier::ResolveExternalBuffers(IoOp op, std::span<const Chunk> chunks, std::vector<int>* index) const {
  index->clear();
  MutexLock l(&reg_mu_);
  if (external_.empty()) return;
  index->assign(chunks.size(), -1);
  const int first = static_cast<int>(staging_->count());
  std::size_t last = 0;  // the region the previous chunk fell in: a batch usually lands in one or a few
  for (std::size_t k = 0; k < chunks.size(); ++k) {
    const Chunk& c = chunks[k];
    if (c.staged) continue;
    const std::byte* p = op == IoOp::kWrite ? c.src : c.dst;
    for (std::size_t n = 0; n < external_.size(); ++n) {
      const std::size_t i = (last + n) % external_.size();
      auto* b = static_cast<const std::byte*>(external_[i].iov_base);
      if (p >= b && p + c.io_len <= b + external_[i].iov_len) {
        (*index)[k] = first + static_cast<int>(i);
        last = i;
        break;
      }
    }
  }
}

namespace {

// The largest request a run of adjacent reads is merged into: the size at which the device's
// sequential rate is reached (the raw-read baselines use 1 MiB requests too); a longer run goes
// out as several, which keeps a queue of them in flight.
constexpr std::uint64_t kMaxMergedRead = 1 << 20;

// Whether direct read `next` can ride in `prev`'s request: it starts on disk after a gap of at
// most one unit (0: the next chunk of the same block; kUnit: the descriptor between two
// extents) and in memory the same distance after it, within the room the caller's buffer has
// past prev's last chunk (`room`), in the same registered buffer, and the result stays small.
bool ReadsAlong(const IoRequest& prev, std::uint64_t room, const IoRequest& next) {
  const std::uint64_t prev_end = prev.offset + prev.len;
  if (next.offset < prev_end || next.buf_index != prev.buf_index) return false;
  const std::uint64_t gap = next.offset - prev_end;
  return gap <= kUnit && gap <= room && next.buf == prev.buf + prev.len + gap &&
         prev.len + gap + next.len <= kMaxMergedRead;
}

}  // namespace

void NvmeTier::RunChunks(IoOp op, std::span<Chunk> chunks, const std::function<void(std::size_t, int)>& done) {
  std::vector<IoRequest> reqs;
  std::vector<std::size_t> req_chunk;  // the first chunk of each request
  std::vector<std::size_t> req_end;    // one past its last (more than one: merged reads)
  std::vector<int> bufs;
  std::vector<int> req_buf;  // staging buffer per request, -1 for direct
  reqs.reserve(chunks.size());
  req_chunk.reserve(chunks.size());
  req_buf.reserve(chunks.size());
  // Fixed-buffer indices of the chunks in registered external memory, resolved under one reg_mu_
  // round trip for the whole call (not one per I/O).
  std::vector<int> ext_index;
  ResolveExternalBuffers(op, chunks, &ext_index);
  std::size_t i = 0;
  while (i < chunks.size()) {
    std::size_t staged_needed = 0;
    for (std::size_t j = i; j < chunks.size() && staged_needed < staging_->count(); ++j) staged_needed += chunks[j].staged;
    bufs.clear();
    if (staged_needed > 0) staging_->Acquire(staged_needed, &bufs);
    reqs.clear();
    req_chunk.clear();
    req_end.clear();
    req_buf.clear();
    std::size_t used = 0;
    std::uint64_t last_room = 0;  // room_after of the last chunk in reqs.back()
    for (; i < chunks.size(); ++i) {
      Chunk& c = chunks[i];
      IoRequest r;
      r.op = op;
      r.offset = c.file_offset;
      r.len = c.io_len;
      if (c.staged) {
        if (used == bufs.size()) break;
        int b = bufs[used++];
        std::byte* stage = staging_->data(b);
        r.buf_index = b;
        staged_ios_.fetch_add(1, std::memory_order_relaxed);
        if (op == IoOp::kWrite) {
          std::memcpy(stage, c.src, c.len);
          std::memset(stage + c.len, 0, c.io_len - c.len);
          r.src = stage;
        } else {
          r.buf = stage;
        }
        req_buf.push_back(b);
      } else {
        if (op == IoOp::kWrite) {
          r.src = c.src;
        } else {
          r.buf = c.dst;
        }
        r.buf_index = ext_index.empty() ? -1 : ext_index[i];
        if (op == IoOp::kRead && !reqs.empty() && req_buf.back() < 0 && ReadsAlong(reqs.back(), last_room, r)) {
          reqs.back().len = static_cast<std::uint32_t>(r.offset + r.len - reqs.back().offset);
          req_end.back() = i + 1;
          last_room = c.room_after;
          merged_reads_.fetch_add(1, std::memory_order_relaxed);
          continue;
        }
        req_buf.push_back(-1);
      }
      reqs.push_back(r);
      req_chunk.push_back(i);
      req_end.push_back(i + 1);
      last_room = c.room_after;
    }
    if (op == IoOp::kRead) {
      std::uint64_t bytes = 0;
      for (const IoRequest& r : reqs) bytes += r.len;
      device_read_bytes_.fetch_add(bytes, std::memory_order_relaxed);
    }
    counters_.Add(counters_.queue_depth, reqs.size());
    nvme::RunToCompletion(*engine_, reqs, [&](std::size_t k, int err) {
      const std::uint64_t end = reqs[k].complete_ns != 0 ? reqs[k].complete_ns : SteadyNanos();
      (op == IoOp::kRead ? counters_.read_latency : counters_.write_latency).Record(end - reqs[k].submit_ns);
      for (std::size_t ci = req_chunk[k]; ci < req_end[k]; ++ci) {
        Chunk& c = chunks[ci];  // a staged request holds exactly one chunk
        if (err == 0 && op == IoOp::kRead && req_buf[k] >= 0) {
          std::memcpy(c.dst, staging_->data(req_buf[k]) + c.skip, c.len);
        }
        done(ci, err);
      }
    });
    counters_.queue_depth.fetch_sub(reqs.size(), std::memory_order_relaxed);
    staging_->Release(bufs);
  }
}

Status NvmeTier::IoStatus(IoOp op, int err, const BlockKey& key, std::uint64_t offset) const {
  const char* what = op == IoOp::kRead ? "reading" : "writing";
  std::string where = fmt::format("{} block {} at offset {} of '{}'", what, key.ToString(), offset, data_path_.string());
  if (op == IoOp::kWrite && (err == -ENOSPC || err == -EDQUOT)) {
    // The tier's own space is accounted by the allocator; this is the file system or device under
    // the data file running out (a data file that could not be preallocated, a thin device).
    return Status::IoError(fmt::format("{}: {}; the file system or device holding '{}' is full: free space on it; the "
                                       "block was not stored",
                                       where, std::strerror(-err), data_path_.string()));
  }
  bool retryable = err == -EIO || err == -EAGAIN || err == -EINTR || err == -EBUSY || err == -ETIMEDOUT;
  return Status::IoError(
      fmt::format("{}: {}; {}", where, std::strerror(-err),
                  op == IoOp::kRead ? (retryable ? "retry the get; if it keeps failing, erase the block"
                                                 : "the device rejected the read; check the device and the tier options")
                                    : (retryable ? "the block was not stored; retry the put"
                                                 : "the block was not stored; check the device and the tier options")),
      retryable);
}

}  // namespace terrace
