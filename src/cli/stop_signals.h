// SIGINT/SIGTERM during a long-running command (the benches): the first signal is only recorded, so
// the command can stop at its next checkpoint, remove what it created and exit with 128 + the signal
// number; a second one kills the process at once (with the signal's default action), after removing
// the files RemoveOnSignal (remove_on_signal.h) guards.
// Thread-safety: StopCheck/StopSignalReceived may be called from any thread; one StopSignals at a time.
#pragma once

#include <csignal>
#include <string_view>

#include "terrace/status.h"

namespace terrace::cli {

// Installs the recording handler for SIGINT and SIGTERM for its lifetime, clears any earlier
// record, and puts the previous handlers back on destruction.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  struct sigaction old_int_ {}, old_term_ {};
};

// The signal received since the StopSignals was installed; 0 when none.
int StopSignalReceived();

// Ok, or Cancelled("stopped by SIGINT") once a signal was received: what a checkpoint returns.
Status StopCheck();

// "SIGINT" / "SIGTERM" ("a signal" for any other).
std::string_view StopSignalName(int sig);

// For a command that stopped at a checkpoint and cleaned up: prints "<who>: stopped by SIGINT<how>"
// on stderr and returns the exit status, 128 + the signal number.
int ExitStopped(std::string_view who, std::string_view how);

// A failed step's exit status: Fail(s)'s, except after a signal, when the failure is the stop itself
// (ExitStopped says so once, after the cleanup) and 1 is returned without a message.
int FailUnlessStopped(const Status& s);

}  // namespace terrace::cli
