// Files to remove when SIGINT or SIGTERM ends the process: the temporary file an output writer is
// filling, so that a Ctrl-C never leaves a hidden partial file behind.
// Thread-safety: RemoveOnSignal may be constructed and destroyed on any thread;
// RemoveGuardedFilesAndDie is async-signal-safe.
#pragma once

#include <csignal>
#include <filesystem>

namespace terrace::cli {

// Removes the file `path` if SIGINT or SIGTERM ends the process while the guard lives (a signal with
// its default action, or a StopSignals' second one): for a temporary file a writer is filling. While
// a guard lives, a SIGINT/SIGTERM whose action is the default gets a handler that removes the guarded
// files and then takes the default action. At most 16 paths are guarded at once (more are not).
class RemoveOnSignal {
 public:
  explicit RemoveOnSignal(const std::filesystem::path& path);
  ~RemoveOnSignal();
  RemoveOnSignal(const RemoveOnSignal&) = delete;
  RemoveOnSignal& operator=(const RemoveOnSignal&) = delete;

 private:
  int slot_ = -1;
};

// Unlinks every path a live RemoveOnSignal guards, then ends the process with `sig`'s default
// action (raised; from inside a handler of `sig` it takes effect when the handler returns). While a
// StopSignalHold lives it only records `sig` and returns; the hold's end does the rest.
void RemoveGuardedFilesAndDie(int sig);

// While one lives, a signal that would end the process (a StopSignals' second SIGINT/SIGTERM, or one
// a RemoveOnSignal handles, taken by any thread; or SIGINT, SIGTERM, SIGHUP sent to this thread)
// ends it only when the hold ends: for a step that must not be cut in two (a store's marker and its
// folder). One at a time; the hold should be short.
class StopSignalHold {
 public:
  StopSignalHold();
  ~StopSignalHold();
  StopSignalHold(const StopSignalHold&) = delete;
  StopSignalHold& operator=(const StopSignalHold&) = delete;

 private:
  sigset_t old_mask_ {};
};

}  // namespace terrace::cli
