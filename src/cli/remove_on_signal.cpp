#include "src/cli/remove_on_signal.h"

#include <pthread.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <climits>
#include <csignal>
#include <cstring>
#include <mutex>
#include <string>

namespace terrace::cli {
namespace {

// RemoveOnSignal's paths: a slot is claimed (taken), filled, then armed; the handler reads armed ones.
struct GuardSlot {
  std::atomic<bool> taken{false};
  std::atomic<bool> armed{false};
  char path[PATH_MAX] = {};
};
std::array<GuardSlot, 16> g_guards;

std::atomic<bool> g_held{false};    // a StopSignalHold lives
std::atomic<int> g_held_signal{0};  // the signal that would have ended the process during it

extern "C" void OnFatalSignal(int sig) { RemoveGuardedFilesAndDie(sig); }

// While guards live, OnFatalSignal replaces the default action of SIGINT and SIGTERM.
std::mutex g_install_mu;
int g_live_guards = 0;              // guarded by g_install_mu
bool g_installed[2] = {false, false};  // guarded by g_install_mu: SIGINT, SIGTERM
constexpr int kGuardedSignals[2] = {SIGINT, SIGTERM};

void InstallFatalHandlers() {
  std::lock_guard<std::mutex> lock(g_install_mu);
  if (g_live_guards++ > 0) return;
  for (int i = 0; i < 2; ++i) {
    struct sigaction old {};
    ::sigaction(kGuardedSignals[i], nullptr, &old);
    g_installed[i] = !(old.sa_flags & SA_SIGINFO) && old.sa_handler == SIG_DFL;
    if (!g_installed[i]) continue;  // ignored, or a StopSignals' handler (which calls RemoveGuardedFilesAndDie itself)
    struct sigaction sa {};
    sa.sa_handler = OnFatalSignal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    ::sigaction(kGuardedSignals[i], &sa, nullptr);
  }
}

void RemoveFatalHandlers() {
  std::lock_guard<std::mutex> lock(g_install_mu);
  if (--g_live_guards > 0) return;
  for (int i = 0; i < 2; ++i) {
    struct sigaction cur {};
    ::sigaction(kGuardedSignals[i], nullptr, &cur);
    if (g_installed[i] && cur.sa_handler == OnFatalSignal) ::signal(kGuardedSignals[i], SIG_DFL);
    g_installed[i] = false;
  }
}

}  // namespace

void RemoveGuardedFilesAndDie(int sig) {
  if (g_held.load()) {
    g_held_signal.store(sig);
    if (g_held.load()) return;  // else the hold ended meanwhile and may have missed it
  }
  for (GuardSlot& g : g_guards) {
    if (g.armed.load()) ::unlink(g.path);
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);  // in a handler: blocked until it returns, then the default action ends the process
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

RemoveOnSignal::RemoveOnSignal(const std::filesystem::path& path) {
  std::error_code ec;
  const std::string abs = std::filesystem::absolute(path, ec).string();  // the handler must not depend on the cwd
  if (ec || abs.size() >= PATH_MAX) return;
  for (int i = 0; i < static_cast<int>(g_guards.size()); ++i) {
    bool free = false;
    if (!g_guards[i].taken.compare_exchange_strong(free, true)) continue;
    std::memcpy(g_guards[i].path, abs.c_str(), abs.size() + 1);
    g_guards[i].armed.store(true);
    slot_ = i;
    InstallFatalHandlers();
    return;
  }
}

RemoveOnSignal::~RemoveOnSignal() {
  if (slot_ < 0) return;
  RemoveFatalHandlers();
  g_guards[slot_].armed.store(false);
  g_guards[slot_].taken.store(false);
}

}  // namespace terrace::cli
