// Logging seam: where the library's few diagnostic lines go. An embedder (a Python process, an
// inference engine) passes its own Logger in the options to capture or silence them; by default
// lines go to stderr at kInfo and above.
//
// Thread-safety: Logger::Log may be called from any library thread at the same time; an
// implementation must be thread-safe. Ownership: options hold a shared_ptr; the library keeps a copy
// for as long as the object that logs lives.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace terrace {

enum class LogLevel : std::uint8_t { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kOff = 4 };

// "debug", "info", "warning", "error", "off".
std::string_view LogLevelName(LogLevel level);

class Logger {
 public:
  virtual ~Logger() = default;
  // `component` names the part that logs ("nvme", "host", "hbm", "store"); `message` is one line
  // without a trailing newline.
  virtual void Log(LogLevel level, std::string_view component, std::string_view message) = 0;
};

// Writes "[terrace <component>] <message>" (with "warning: " / "error: " before the message at
// those levels) to stderr for every line at `min_level` or above. One write per line.
std::shared_ptr<Logger> StderrLogger(LogLevel min_level = LogLevel::kInfo);
// Discards everything.
std::shared_ptr<Logger> NullLogger();
// `logger` itself, or the default StderrLogger() when it is null. Never returns null.
std::shared_ptr<Logger> LoggerOrDefault(std::shared_ptr<Logger> logger);

// Logs `message` the first time Log() is called on this object and never again: for conditions
// that hold for the whole process (an emulated device, a refused mlock). Thread-safe.
class LogOnce {
 public:
  void Log(Logger& logger, LogLevel level, std::string_view component, std::string_view message) {
    if (!done_.exchange(true, std::memory_order_relaxed)) logger.Log(level, component, message);
  }

 private:
  std::atomic<bool> done_{false};
};

}  // namespace terrace
