#include "tiers/nvme/power_cut.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <rocksdb/env.h>
#include <rocksdb/file_system.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "src/common/aligned_buffer.h"
#include "src/common/mutex.h"
#include "tiers/nvme/format.h"

namespace terrace::nvme {

namespace {

constexpr const char* kCutMessage = "simulated power cut";

AlignedBuffer AllocAligned(std::size_t n) { return AlignedBuffer(n, kUnit); }

// One data-file write not yet known to be durable, with the bytes it replaced.
struct Undo {
  std::uint64_t offset = 0;
  std::uint32_t len = 0;
  AlignedBuffer old;
  AlignedBuffer new_bytes;  // what the write carried (kTorn mixes the two per sector)
  bool completed = false;  // the engine reported the write done (a later sync covers it)
};

// A RocksDB file written under tracking. Guarded by State::mu.
struct FileState {
  std::uint64_t size = 0;    // bytes appended (what the file holds now)
  std::uint64_t synced = 0;  // bytes covered by the last successful Sync/Fsync
  bool created = false;      // created under tracking (dropped at Cut() if never synced)
  bool ever_synced = false;
};

}  // namespace

struct PowerCut::State {
  explicit State(std::uint64_t seed, LostWrite m) : rng(seed), mode(m) {}

  // Counts one event; false when the power is (now) off and the event must fail.
  bool Event() {
    MutexLock l(&mu);
    return EventLocked();
  }
  bool EventLocked() TERRACE_REQUIRES(mu) {
    if (off) return false;
    if (events >= trigger) {
      off = true;
      return false;
    }
    ++events;
    return true;
  }
  bool Off() {
    MutexLock l(&mu);
    return off;
  }

  Mutex mu;
  std::mt19937_64 rng TERRACE_GUARDED_BY(mu);
  LostWrite mode;
  bool off TERRACE_GUARDED_BY(mu) = false;
  bool cut_done TERRACE_GUARDED_BY(mu) = false;
  std::uint64_t events TERRACE_GUARDED_BY(mu) = 0;
  std::uint64_t trigger TERRACE_GUARDED_BY(mu) = UINT64_MAX;  // power off when events reaches it
  int data_fd = -1;                                           // dup of the tier's data file descriptor
  std::uint64_t next_undo TERRACE_GUARDED_BY(mu) = 0;
  std::map<std::uint64_t, Undo> undo TERRACE_GUARDED_BY(mu);  // by issue order
  std::map<std::string, std::shared_ptr<FileState>> files TERRACE_GUARDED_BY(mu);  // by RocksDB's file name
  std::shared_ptr<rocksdb::FileSystem> fs;
  std::unique_ptr<rocksdb::Env> env;
};

namespace {

rocksdb::IOStatus CutError() { return rocksdb::IOStatus::IOError(kCutMessage); }

class PowerCutEngine final : public IoEngine {
 public:
  PowerCutEngine(std::unique_ptr<IoEngine> base, std::shared_ptr<PowerCut::State> s)
      : base_(std::move(base)), s_(std::move(s)) {}

  void Execute(std::span<IoRequest> reqs, const IoCompletion* on_complete) override {
    std::vector<IoRequest> fwd;
    std::vector<std::size_t> fwd_map;
    std::vector<std::uint64_t> undo_id;
    std::vector<std::size_t> failed;
    {
      MutexLock l(&s_->mu);
      for (std::size_t i = 0; i < reqs.size(); ++i) {
        IoRequest& r = reqs[i];
        bool ok = r.op == IoOp::kRead ? !s_->off : s_->EventLocked();
        std::uint64_t id = UINT64_MAX;
        if (ok && r.op == IoOp::kWrite) {
          Undo u;
          u.offset = r.offset;
          u.len = r.len;
          u.old = AllocAligned(r.len);
          u.new_bytes = AllocAligned(r.len);
          ssize_t got = u.old.data() && u.new_bytes.data() ? ::pread(s_->data_fd, u.old.data(), r.len, static_cast<off_t>(r.offset)) : -1;
          if (got < 0) {
            ok = false;  // cannot keep an undo copy: fail the write rather than make it unrevertable
          } else {
            if (static_cast<std::uint32_t>(got) < r.len) std::memset(u.old.data() + got, 0, r.len - got);
            std::memcpy(u.new_bytes.data(), r.src, r.len);
            id = s_->next_undo++;
            s_->undo.emplace(id, std::move(u));
          }
        }
        if (!ok) {
          failed.push_back(i);
          continue;
        }
        fwd.push_back(r);
        fwd_map.push_back(i);
        undo_id.push_back(id);
      }
    }
    for (std::size_t i : failed) {
      reqs[i].result = -EIO;
      reqs[i].submit_ns = SteadyNanos();
      reqs[i].complete_ns = 0;
      if (on_complete) (*on_complete)(i);
    }
    if (fwd.empty()) return;
    IoCompletion cb = [&](std::size_t j) {
      std::size_t i = fwd_map[j];
      reqs[i].result = fwd[j].result;
      reqs[i].submit_ns = fwd[j].submit_ns;
      reqs[i].complete_ns = fwd[j].complete_ns;
      if (undo_id[j] != UINT64_MAX) {
        MutexLock l(&s_->mu);
        auto it = s_->undo.find(undo_id[j]);
        if (it != s_->undo.end()) it->second.completed = true;
      }
      if (on_complete) (*on_complete)(i);
    };
    base_->Execute(fwd, &cb);
  }

  int SyncData() override {
    std::vector<std::uint64_t> covered;
    {
      MutexLock l(&s_->mu);
      if (!s_->EventLocked()) return -EIO;
      for (const auto& [id, u] : s_->undo) {
        if (u.completed) covered.push_back(id);
      }
    }
    int r = base_->SyncData();
    if (r == 0) {
      MutexLock l(&s_->mu);
      for (std::uint64_t id : covered) s_->undo.erase(id);
    }
    return r;
  }

  Status RegisterBuffers(std::span<const iovec> bufs) override { return base_->RegisterBuffers(bufs); }
  bool fixed_buffers() const override { return base_->fixed_buffers(); }
  unsigned queue_depth() const override { return base_->queue_depth(); }
  std::string_view name() const override { return "power-cut"; }

 private:
  std::unique_ptr<IoEngine> base_;
  std::shared_ptr<PowerCut::State> s_;
};

class TrackedFile final : public rocksdb::FSWritableFileOwnerWrapper {
 public:
  TrackedFile(std::unique_ptr<rocksdb::FSWritableFile> t, std::shared_ptr<PowerCut::State> s,
              std::shared_ptr<FileState> f)
      : FSWritableFileOwnerWrapper(std::move(t)), s_(std::move(s)), f_(std::move(f)) {}

  rocksdb::IOStatus Append(const rocksdb::Slice& data, const rocksdb::IOOptions& o, rocksdb::IODebugContext* d) override {
    if (!s_->Event()) return CutError();
    rocksdb::IOStatus st = target()->Append(data, o, d);
    if (st.ok()) Grow(data.size());
    return st;
  }
  rocksdb::IOStatus Append(const rocksdb::Slice& data, const rocksdb::IOOptions& o,
                           const rocksdb::DataVerificationInfo& v, rocksdb::IODebugContext* d) override {
    if (!s_->Event()) return CutError();
    rocksdb::IOStatus st = target()->Append(data, o, v, d);
    if (st.ok()) Grow(data.size());
    return st;
  }
  rocksdb::IOStatus PositionedAppend(const rocksdb::Slice& data, uint64_t offset, const rocksdb::IOOptions& o,
                                     rocksdb::IODebugContext* d) override {
    if (!s_->Event()) return CutError();
    rocksdb::IOStatus st = target()->PositionedAppend(data, offset, o, d);
    if (st.ok()) SetSizeAtLeast(offset + data.size());
    return st;
  }
  rocksdb::IOStatus PositionedAppend(const rocksdb::Slice& data, uint64_t offset, const rocksdb::IOOptions& o,
                                     const rocksdb::DataVerificationInfo& v, rocksdb::IODebugContext* d) override {
    if (!s_->Event()) return CutError();
    rocksdb::IOStatus st = target()->PositionedAppend(data, offset, o, v, d);
    if (st.ok()) SetSizeAtLeast(offset + data.size());
    return st;
  }
  rocksdb::IOStatus Truncate(uint64_t size, const rocksdb::IOOptions& o, rocksdb::IODebugContext* d) override {
    if (s_->Off()) return CutError();
    rocksdb::IOStatus st = target()->Truncate(size, o, d);
    if (st.ok()) {
      MutexLock l(&s_->mu);
      f_->size = size;
      f_->synced = std::min(f_->synced, size);
    }
    return st;
  }
  rocksdb::IOStatus Flush(const rocksdb::IOOptions& o, rocksdb::IODebugContext* d) override {
    if (s_->Off()) return CutError();
    return target()->Flush(o, d);
  }
  rocksdb::IOStatus Sync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* d) override {
    return Synced([&] { return target()->Sync(o, d); });
  }
  rocksdb::IOStatus Fsync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* d) override {
    return Synced([&] { return target()->Fsync(o, d); });
  }
  rocksdb::IOStatus RangeSync(uint64_t offset, uint64_t n, const rocksdb::IOOptions& o,
                              rocksdb::IODebugContext* d) override {
    if (s_->Off()) return CutError();
    return target()->RangeSync(offset, n, o, d);  // sync_file_range: not a durability point
  }

 private:
  template <typename F>
  rocksdb::IOStatus Synced(F&& sync) {
    std::uint64_t size;
    {
      MutexLock l(&s_->mu);
      if (!s_->EventLocked()) return CutError();
      size = f_->size;
    }
    rocksdb::IOStatus st = sync();
    if (st.ok()) {
      MutexLock l(&s_->mu);
      f_->synced = std::max(f_->synced, std::min(size, f_->size));
      f_->ever_synced = true;
    }
    return st;
  }
  void Grow(std::uint64_t n) {
    MutexLock l(&s_->mu);
    f_->size += n;
  }
  void SetSizeAtLeast(std::uint64_t n) {
    MutexLock l(&s_->mu);
    f_->size = std::max(f_->size, n);
  }

  std::shared_ptr<PowerCut::State> s_;
  std::shared_ptr<FileState> f_;
};

class PowerCutFs final : public rocksdb::FileSystemWrapper {
 public:
  PowerCutFs(std::shared_ptr<rocksdb::FileSystem> base, std::shared_ptr<PowerCut::State> s)
      : FileSystemWrapper(std::move(base)), s_(std::move(s)) {}
  const char* Name() const override { return "TerracePowerCutFileSystem"; }

  rocksdb::IOStatus NewWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                    std::unique_ptr<rocksdb::FSWritableFile>* r, rocksdb::IODebugContext* d) override {
    if (!s_->Event()) return CutError();
    std::unique_ptr<rocksdb::FSWritableFile> file;
    rocksdb::IOStatus st = target()->NewWritableFile(f, o, &file, d);
    if (!st.ok()) return st;
    auto state = std::make_shared<FileState>();
    state->created = true;
    {
      MutexLock l(&s_->mu);
      s_->files[f] = state;
    }
    *r = std::make_unique<TrackedFile>(std::move(file), s_, std::move(state));
    return st;
  }
  rocksdb::IOStatus ReopenWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                       std::unique_ptr<rocksdb::FSWritableFile>* r,
                                       rocksdb::IODebugContext* d) override {
    if (s_->Off()) return CutError();
    // What the file holds before this open is as durable as it was: an untracked file counts as
    // synced up to its current size (the file system's size, not the writer's byte count, which
    // starts at 0 for a reopened file).
    struct stat before {};
    const bool existed = ::stat(f.c_str(), &before) == 0;
    std::unique_ptr<rocksdb::FSWritableFile> file;
    rocksdb::IOStatus st = target()->ReopenWritableFile(f, o, &file, d);
    if (!st.ok()) return st;
    std::shared_ptr<FileState> state;
    {
      MutexLock l(&s_->mu);
      auto& slot = s_->files[f];
      if (!slot) {
        slot = std::make_shared<FileState>();
        slot->size = slot->synced = existed ? static_cast<std::uint64_t>(before.st_size) : 0;
        slot->created = !existed;
        slot->ever_synced = existed;
      }
      state = slot;
    }
    *r = std::make_unique<TrackedFile>(std::move(file), s_, std::move(state));
    return st;
  }
  rocksdb::IOStatus ReuseWritableFile(const std::string& f, const std::string& old, const rocksdb::FileOptions& o,
                                      std::unique_ptr<rocksdb::FSWritableFile>* r,
                                      rocksdb::IODebugContext* d) override {
    // A recycled log: treated as a rename followed by a new file (RocksDB overwrites it from 0).
    if (!s_->Event()) return CutError();
    std::unique_ptr<rocksdb::FSWritableFile> file;
    rocksdb::IOStatus st = target()->ReuseWritableFile(f, old, o, &file, d);
    if (!st.ok()) return st;
    auto state = std::make_shared<FileState>();
    state->created = true;
    {
      MutexLock l(&s_->mu);
      s_->files.erase(old);
      s_->files[f] = state;
    }
    *r = std::make_unique<TrackedFile>(std::move(file), s_, std::move(state));
    return st;
  }
  rocksdb::IOStatus NewRandomRWFile(const std::string& f, const rocksdb::FileOptions& o,
                                    std::unique_ptr<rocksdb::FSRandomRWFile>* r, rocksdb::IODebugContext* d) override {
    if (s_->Off()) return CutError();
    return target()->NewRandomRWFile(f, o, r, d);
  }
  rocksdb::IOStatus RenameFile(const std::string& from, const std::string& to, const rocksdb::IOOptions& o,
                               rocksdb::IODebugContext* d) override {
    if (s_->Off()) return CutError();
    rocksdb::IOStatus st = target()->RenameFile(from, to, o, d);
    if (st.ok()) {
      MutexLock l(&s_->mu);
      auto it = s_->files.find(from);
      if (it != s_->files.end()) {
        s_->files[to] = it->second;
        s_->files.erase(it);
      } else {
        s_->files.erase(to);
      }
    }
    return st;
  }
  rocksdb::IOStatus LinkFile(const std::string& from, const std::string& to, const rocksdb::IOOptions& o,
                             rocksdb::IODebugContext* d) override {
    if (s_->Off()) return CutError();
    return target()->LinkFile(from, to, o, d);
  }
  rocksdb::IOStatus DeleteFile(const std::string& f, const rocksdb::IOOptions& o, rocksdb::IODebugContext* d) override {
    if (s_->Off()) return CutError();
    rocksdb::IOStatus st = target()->DeleteFile(f, o, d);
    if (st.ok()) {
      MutexLock l(&s_->mu);
      s_->files.erase(f);
    }
    return st;
  }
  rocksdb::IOStatus Truncate(const std::string& f, size_t size, const rocksdb::IOOptions& o,
                             rocksdb::IODebugContext* d) override {
    if (s_->Off()) return CutError();
    rocksdb::IOStatus st = target()->Truncate(f, size, o, d);
    if (st.ok()) {
      MutexLock l(&s_->mu);
      auto it = s_->files.find(f);
      if (it != s_->files.end()) {
        it->second->size = size;
        it->second->synced = std::min<std::uint64_t>(it->second->synced, size);
      }
    }
    return st;
  }
  rocksdb::IOStatus CreateDir(const std::string& d, const rocksdb::IOOptions& o, rocksdb::IODebugContext* g) override {
    if (s_->Off()) return CutError();
    return target()->CreateDir(d, o, g);
  }
  rocksdb::IOStatus CreateDirIfMissing(const std::string& d, const rocksdb::IOOptions& o,
                                       rocksdb::IODebugContext* g) override {
    if (s_->Off()) return CutError();
    return target()->CreateDirIfMissing(d, o, g);
  }
  rocksdb::IOStatus DeleteDir(const std::string& d, const rocksdb::IOOptions& o, rocksdb::IODebugContext* g) override {
    if (s_->Off()) return CutError();
    return target()->DeleteDir(d, o, g);
  }

 private:
  std::shared_ptr<PowerCut::State> s_;
};

}  // namespace

std::string PowerCutReport::ToString() const {
  return fmt::format("power cut after {} events: {} data writes not durable ({} units reverted, {} torn, {} scrambled, {} "
                     "kept); index: {} files truncated, {} dropped, {} bytes lost",
                     events, data_writes_lost, data_units_reverted, data_units_torn, data_units_garbage, data_units_kept,
                     index_files_truncated, index_files_dropped, index_bytes_dropped);
}

PowerCut::PowerCut(std::uint64_t seed, LostWrite mode) : s_(std::make_shared<State>(seed, mode)) {
  s_->fs = std::make_shared<PowerCutFs>(rocksdb::FileSystem::Default(), s_);
  s_->env = rocksdb::NewCompositeEnv(s_->fs);
}

PowerCut::~PowerCut() {
  if (s_->data_fd >= 0) ::close(s_->data_fd);
  // The file system wrapper holds the state it belongs to: break that cycle.
  s_->env.reset();
  s_->fs.reset();
}

IoEngineFactory PowerCut::WrapEngine(IoEngineFactory base) {
  std::shared_ptr<State> s = s_;
  return [s, base = std::move(base)](const IoEngineConfig& cfg) -> Result<std::unique_ptr<IoEngine>> {
    TERRACE_ASSIGN_OR_RETURN(auto engine, base(cfg));
    int fd = ::fcntl(cfg.fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return Status::IoError(fmt::format("power-cut engine: cannot dup the data file: {}", std::strerror(errno)));
    {
      MutexLock l(&s->mu);
      if (s->data_fd >= 0) ::close(s->data_fd);
      s->data_fd = fd;
    }
    return std::unique_ptr<IoEngine>(std::make_unique<PowerCutEngine>(std::move(engine), s));
  };
}

rocksdb::Env* PowerCut::index_env() { return s_->env.get(); }

void PowerCut::CutAfter(std::uint64_t n) {
  MutexLock l(&s_->mu);
  s_->trigger = s_->events + n;
}

void PowerCut::PowerOff() {
  MutexLock l(&s_->mu);
  s_->off = true;
}

bool PowerCut::powered_off() const { return s_->Off(); }

std::uint64_t PowerCut::events() const {
  MutexLock l(&s_->mu);
  return s_->events;
}

Result<PowerCutReport> PowerCut::Cut() {
  MutexLock l(&s_->mu);
  if (s_->cut_done) return Status::Internal("PowerCut::Cut() called twice");
  s_->off = true;
  s_->cut_done = true;
  PowerCutReport rep;
  rep.events = s_->events;

  // Data file: newest first, so overlapping writes unwind to the oldest undo copy's bytes.
  std::uniform_int_distribution<int> pick(0, 2);
  for (auto it = s_->undo.rbegin(); it != s_->undo.rend(); ++it) {
    Undo& u = it->second;
    ++rep.data_writes_lost;
    // O_DIRECT needs unit-aligned transfers; the tier's O_DIRECT writes are whole units. A buffered
    // write may be unaligned: it is then one unit.
    const bool aligned = u.offset % kUnit == 0 && u.len % kUnit == 0;
    const std::uint64_t unit = aligned ? kUnit : std::max<std::uint32_t>(u.len, 1);
    AlignedBuffer garbage = AllocAligned(unit);
    if (!garbage.data()) return Status::OutOfCapacity("power cut: cannot allocate a scratch unit");
    for (std::uint64_t pos = 0; pos < u.len; pos += unit) {
      const std::uint64_t n = std::min<std::uint64_t>(unit, u.len - pos);
      LostWrite m = s_->mode == LostWrite::kMixed ? static_cast<LostWrite>(pick(s_->rng)) : s_->mode;  // 0..2
      const std::byte* src = nullptr;
      if (m == LostWrite::kRevert) {
        src = u.old.data() + pos;
        ++rep.data_units_reverted;
      } else if (m == LostWrite::kTorn) {
        // What the device holds now is the new bytes; put the old ones back in a random subset of
        // sectors. Each sector is wholly old or wholly new, never a mix.
        std::memcpy(garbage.data(), u.new_bytes.data() + pos, n);
        for (std::uint64_t sec = 0; sec < n; sec += kAtomicSectorBytes) {
          if (s_->rng() & 1) {
            std::memcpy(garbage.data() + sec, u.old.data() + pos + sec, std::min<std::uint64_t>(kAtomicSectorBytes, n - sec));
          }
        }
        src = garbage.data();
        ++rep.data_units_torn;
      } else if (m == LostWrite::kGarbage) {
        for (std::uint64_t b = 0; b < n; ++b) garbage.data()[b] = static_cast<std::byte>(s_->rng());
        src = garbage.data();
        ++rep.data_units_garbage;
      } else {
        ++rep.data_units_kept;
        continue;
      }
      if (::pwrite(s_->data_fd, src, n, static_cast<off_t>(u.offset + pos)) != static_cast<ssize_t>(n)) {
        return Status::IoError(fmt::format("power cut: cannot restore the data file at offset {}: {}", u.offset + pos,
                                           std::strerror(errno)));
      }
    }
  }
  s_->undo.clear();
  if (s_->data_fd >= 0 && ::fdatasync(s_->data_fd) != 0) {
    return Status::IoError(fmt::format("power cut: fdatasync of the data file failed: {}", std::strerror(errno)));
  }

  // Index: cut each tracked file back to what a sync covered. RocksDB's names are file system
  // paths (the default file system cannot truncate by name, so this uses the system calls).
  for (const auto& [name, f] : s_->files) {
    struct stat st {};
    if (::stat(name.c_str(), &st) != 0) continue;  // already gone
    const auto on_disk = static_cast<std::uint64_t>(st.st_size);
    if (f->created && !f->ever_synced) {
      if (::unlink(name.c_str()) != 0) {
        return Status::IoError(fmt::format("power cut: cannot drop '{}': {}", name, std::strerror(errno)));
      }
      ++rep.index_files_dropped;
      rep.index_bytes_dropped += on_disk;
    } else if (on_disk > f->synced) {
      if (::truncate(name.c_str(), static_cast<off_t>(f->synced)) != 0) {
        return Status::IoError(fmt::format("power cut: cannot truncate '{}': {}", name, std::strerror(errno)));
      }
      ++rep.index_files_truncated;
      rep.index_bytes_dropped += on_disk - f->synced;
    }
  }
  s_->files.clear();
  return rep;
}

}  // namespace terrace::nvme
