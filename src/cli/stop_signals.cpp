#include "stop_signals.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <string>

#include <fmt/format.h>

#include "src/cli/command.h"
#include "src/cli/remove_on_signal.h"

namespace terrace::cli {
namespace {

std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler stores into it");

// The first signal is recorded; a second one ends the process, saying so (write(2): async-signal-safe).
extern "C" void OnStopSignal(int sig) {
  int none = 0;
  if (g_stop_signal.compare_exchange_strong(none, sig)) return;
  static constexpr char kInt[] = "\nterrace: a second stop signal (SIGINT): stopping at once\n";
  static constexpr char kTerm[] = "\nterrace: a second stop signal (SIGTERM): stopping at once\n";
  if (sig == SIGTERM) (void)!::write(STDERR_FILENO, kTerm, sizeof kTerm - 1);
  else (void)!::write(STDERR_FILENO, kInt, sizeof kInt - 1);
  RemoveGuardedFilesAndDie(sig);
}

}  // namespace

StopSignals::StopSignals() {
  g_stop_signal.store(0);
  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  sigemptyset(&sa.sa_mask);
  // A second Ctrl-C ends the process at once (the user insists: stop now): OnStopSignal.
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &sa, &old_int_);
  ::sigaction(SIGTERM, &sa, &old_term_);
}

StopSignals::~StopSignals() {
  ::sigaction(SIGINT, &old_int_, nullptr);
  ::sigaction(SIGTERM, &old_term_, nullptr);
}

int StopSignalReceived() { return g_stop_signal.load(); }

std::string_view StopSignalName(int sig) {
  switch (sig) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    default: return "a signal";
  }
}

Status StopCheck() {
  const int sig = g_stop_signal.load();
  if (sig == 0) return Status::Ok();
  return Status::Cancelled(std::string("stopped by ") + std::string(StopSignalName(sig)));
}

int ExitStopped(std::string_view who, std::string_view how) {
  const int sig = g_stop_signal.load();
  fmt::print(stderr, "{}: stopped by {}{}\n", who, StopSignalName(sig), how);
  return 128 + sig;
}

int FailUnlessStopped(const Status& s) { return g_stop_signal.load() != 0 ? 1 : Fail(s.ToString()); }

}  // namespace terrace::cli
