#include "terrace/log.h"

#include <cstdio>
#include <string>

namespace terrace {
namespace {

class StderrSink final : public Logger {
 public:
  explicit StderrSink(LogLevel min) : min_(min) {}
  void Log(LogLevel level, std::string_view component, std::string_view message) override {
    if (level < min_ || level == LogLevel::kOff) return;
    std::string line = "[terrace ";
    line.append(component).append("] ");
    if (level == LogLevel::kWarning) line += "warning: ";
    if (level == LogLevel::kError) line += "error: ";
    line.append(message).push_back('\n');
    std::fwrite(line.data(), 1, line.size(), stderr);  // one write: lines from threads do not interleave
  }

 private:
  LogLevel min_;
};

class NullSink final : public Logger {
 public:
  void Log(LogLevel, std::string_view, std::string_view) override {}
};

}  // namespace

std::string_view LogLevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
    case LogLevel::kOff: return "off";
  }
  return "unknown";
}

std::shared_ptr<Logger> StderrLogger(LogLevel min_level) { return std::make_shared<StderrSink>(min_level); }

std::shared_ptr<Logger> NullLogger() { return std::make_shared<NullSink>(); }

std::shared_ptr<Logger> LoggerOrDefault(std::shared_ptr<Logger> logger) {
  if (logger) return logger;
  static const std::shared_ptr<Logger> kDefault = StderrLogger();
  return kDefault;
}

}  // namespace terrace
