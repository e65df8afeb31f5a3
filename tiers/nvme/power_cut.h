// PowerCut: a simulated power loss for the NVMe tier, for tests and `terrace store drill`.
//
// There is no device-mapper "flakey" target here, so this follows RocksDB's own fault-injection
// file system: an I/O layer remembers what was made durable, and Cut() throws everything else away.
//
// - Data file: PowerCut wraps the tier's IoEngine. Every write is recorded with an undo copy of the
//   bytes it replaced (read back before the write is issued). A write becomes durable only when a
//   SyncData() that started after the write completed returns 0; then its undo copy is dropped.
//   At Cut() every write that never became durable is undone newest first, independently per
//   4 KiB unit, according to LostWrite: its old bytes come back (kRevert), the new bytes stay
//   (kKeep: a device that happened to persist them), or each 512-byte sector is old or new at
//   random (kTorn: a write torn at the device's atomic sector, which checksums must catch).
//   kMixed draws one of these three per unit. kGarbage (random bytes over the whole unit) is
//   harsher than any device that honours its atomic write unit; it is not part of kMixed.
// - Index: index_env() is a RocksDB Env whose file system tracks each file's synced length
//   (Sync/Fsync). At Cut() every tracked file is truncated to its last synced length, and a file
//   created under tracking that was never synced is deleted. Renames and deletions are treated as
//   durable when they return (RocksDB syncs the directory after them). Files that existed before
//   tracking started and were never reopened for writing are left as they are.
// - The moment: every data write request, data sync, index append and index sync is one
//   "event". CutAfter(n) turns the power off at the n-th next event (that event already fails);
//   from then on every data read/write/sync and every index append/sync/create/rename/delete
//   fails with EIO ("simulated power cut"), so nothing the tier does after the cut is acknowledged
//   or persisted. PowerOff() does it now.
//
// Use: make a PowerCut, open the tier with WrapEngine(...) as its engine factory and index_env()
// as its index Env, run a workload (recording what the tier acknowledged), let the cut happen,
// close the tier, call Cut(), then reopen the store without the hooks and check it. A PowerCut
// serves one such round; its Env must outlive the tier that uses it.
// Thread-safety: the engine and Env may be used from any number of threads; Cut() must run after
// the tier using them is closed.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "terrace/status.h"
#include "tiers/nvme/io_engine.h"

namespace rocksdb {
class Env;
}  // namespace rocksdb

namespace terrace::nvme {

// What Cut() does to a 4 KiB unit of a data-file write that was never made durable.
enum class LostWrite : std::uint8_t { kRevert = 0, kKeep, kTorn, kMixed, kGarbage };
inline constexpr std::uint64_t kAtomicSectorBytes = 512;  // kTorn's granularity

struct PowerCutReport {
  std::uint64_t events = 0;                // events before the power went off
  std::uint64_t data_writes_lost = 0;      // data-file writes that were not durable
  std::uint64_t data_units_reverted = 0;   // 4 KiB units given back their old bytes
  std::uint64_t data_units_torn = 0;       // units left with a random mix of old and new sectors
  std::uint64_t data_units_garbage = 0;    // units overwritten with random bytes
  std::uint64_t data_units_kept = 0;       // units left with the new bytes
  std::uint64_t index_files_truncated = 0; // RocksDB files cut back to their synced length
  std::uint64_t index_files_dropped = 0;   // RocksDB files created and never synced, deleted
  std::uint64_t index_bytes_dropped = 0;
  std::string ToString() const;
};

class PowerCut {
 public:
  explicit PowerCut(std::uint64_t seed, LostWrite mode = LostWrite::kMixed);
  ~PowerCut();
  PowerCut(const PowerCut&) = delete;
  PowerCut& operator=(const PowerCut&) = delete;

  // An engine factory that wraps what `base` makes. Only one engine per PowerCut.
  IoEngineFactory WrapEngine(IoEngineFactory base);
  // The Env for the tier's RocksDB index; owned by this PowerCut.
  rocksdb::Env* index_env();

  // The power goes off at the n-th next event (n = 0: the next one). Replaces an earlier CutAfter.
  void CutAfter(std::uint64_t n);
  void PowerOff();
  bool powered_off() const;
  std::uint64_t events() const;  // events so far (those after the power went off not counted)

  // Throws away everything that was not durable (see above). Call once, after the tier is closed;
  // powers off first if the power is still on. IoError if the data file or index cannot be
  // restored (the round is then void).
  Result<PowerCutReport> Cut();

  struct State;  // shared with the engine and file system wrappers (power_cut.cpp)

 private:
  std::shared_ptr<State> s_;
};

}  // namespace terrace::nvme
