// The logging seam end to end: a store's lines (and its tiers') reach the Logger in StoreOptions, a
// tier's own logger wins over the store's, and a NullLogger leaves stderr untouched.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "terrace/log.h"
#include "terrace/store.h"
#include "test_util.h"

using namespace terrace;

namespace {

struct Line {
  LogLevel level;
  std::string component;
  std::string message;
};

class CapturingLogger final : public Logger {
 public:
  void Log(LogLevel level, std::string_view component, std::string_view message) override {
    std::lock_guard lock(mu_);
    lines_.push_back({level, std::string(component), std::string(message)});
  }
  std::vector<Line> lines() const {
    std::lock_guard lock(mu_);
    return lines_;
  }
  bool Has(std::string_view component, std::string_view fragment) const {
    for (const auto& l : lines()) {
      if (l.component == component && l.message.find(fragment) != std::string::npos) return true;
    }
    return false;
  }

 private:
  mutable std::mutex mu_;
  std::vector<Line> lines_;
};

// A store whose HBM tier is emulated: opening it always produces the "emulated" line.
StoreOptions EmulatedHbmStore() {
  StoreOptions o;
  o.hbm.mode = HbmMode::kEmulated;
  o.hbm.capacity_bytes = 4 * kMiB;
  o.host.capacity_bytes = 4 * kMiB;
  o.host.chunk_bytes = 1 * kMiB;
  o.host.pin = false;
  return o;
}

// Everything written to file descriptor 2 while fn runs.
std::string CaptureStderr(const std::function<void()>& fn) {
  testing::TempDir dir("log");
  const std::string path = (dir.path() / "stderr.txt").string();
  std::fflush(stderr);
  const int saved = ::dup(2);
  REQUIRE(saved >= 0);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  ::dup2(fd, 2);
  ::close(fd);
  fn();
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE("the store's Logger receives its tiers' lines") {
  auto capture = std::make_shared<CapturingLogger>();
  StoreOptions o = EmulatedHbmStore();
  o.logger = capture;
  auto store = Store::Open(o);
  REQUIRE(store.ok());
  REQUIRE(capture->Has("hbm", "emulated in host memory"));
  for (const auto& l : capture->lines()) {
    CHECK(l.message.find('\n') == std::string::npos);  // one line each, no trailing newline
  }
}

TEST_CASE("a tier's own Logger wins over the store's") {
  auto store_log = std::make_shared<CapturingLogger>();
  auto hbm_log = std::make_shared<CapturingLogger>();
  StoreOptions o = EmulatedHbmStore();
  o.logger = store_log;
  o.hbm.logger = hbm_log;
  auto store = Store::Open(o);
  REQUIRE(store.ok());
  CHECK(hbm_log->Has("hbm", "emulated in host memory"));
  CHECK_FALSE(store_log->Has("hbm", "emulated in host memory"));
}

TEST_CASE("a NullLogger silences the store; the default logger writes to stderr") {
  // The control: without a logger the line goes to stderr, so the capture below would see it.
  const std::string with_default = CaptureStderr([] {
    auto store = Store::Open(EmulatedHbmStore());
    REQUIRE(store.ok());
  });
  CHECK(with_default.find("[terrace hbm] emulated in host memory") != std::string::npos);

  const std::string with_null = CaptureStderr([] {
    StoreOptions o = EmulatedHbmStore();
    o.logger = NullLogger();
    auto store = Store::Open(o);
    REQUIRE(store.ok());
    std::vector<std::byte> data(8192, std::byte{7}), out(8192);
    const BlockKey key = testing::TestKey(1);
    REQUIRE((*store)->Put(key, data).ok());
    REQUIRE((*store)->Get(key, out).ok());
  });
  CHECK(with_null.empty());
}
