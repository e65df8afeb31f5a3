#include "stop_signals.h"

#include <pthread.h>

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
std::atomic<bool> g_held{false};     // a StopSignalHold lives
std::atomic<int> g_held_signal{0};  // the second signal that came during it

// The first signal is recorded; a second one ends the process (when no StopSignalHold lives).
extern "C" void OnStopSignal(int sig) {
  int none = 0;
  if (g_stop_signal.compare_exchange_strong(none, sig)) return;
  if (g_held.load()) {
    g_held_signal.store(sig);
    if (g_held.load()) return;  // else the hold ended meanwhile and may have missed it
  }
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

StopSignalHold::StopSignalHold() {
  sigset_t set;
  sigemptyset(&set);
  for (const int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, sig);
  ::pthread_sigmask(SIG_BLOCK, &set, &old_mask_);
  g_held_signal.store(0);
  g_held.store(true);
}

StopSignalHold::~StopSignalHold() {
  g_held.store(false);
  if (const int sig = g_held_signal.exchange(0); sig != 0) RemoveGuardedFilesAndDie(sig);
  ::pthread_sigmask(SIG_SETMASK, &old_mask_, nullptr);  // a signal sent to this thread meanwhile comes now
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
