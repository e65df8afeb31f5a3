#include <catch2/catch.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <string>

#include "terrace/status.h"

using terrace::Code;
using terrace::Result;
using terrace::Status;

namespace {
Result<int> Half(int x) {
  if (x % 2) return Status::InvalidArgument("odd");
  return x / 2;
}
Status Quarter(int x, int* out) {
  TERRACE_ASSIGN_OR_RETURN(int h, Half(x));
  TERRACE_ASSIGN_OR_RETURN(*out, Half(h));
  return Status::Ok();
}
}  // namespace

TEST_CASE("Status carries code, retryable flag and message") {
  Status ok;
  CHECK(ok.ok());
  CHECK(ok.ToString() == "OK");
  Status io = Status::IoError("read /x failed", true);
  CHECK_FALSE(io.ok());
  CHECK(io.code() == Code::kIoError);
  CHECK(io.retryable());
  CHECK(io.ToString() == "IOError (retryable): read /x failed");
  Status copy = io;
  CHECK(copy.message() == io.message());
  CHECK(Status::Corruption("c").WithContext("key 1").message() == "key 1: c");
  CHECK(Status().WithContext("x").ok());
}

TEST_CASE("Result and the propagation macros") {
  int out = 0;
  CHECK(Quarter(8, &out).ok());
  CHECK(out == 2);
  Status s = Quarter(6, &out);
  CHECK(s.IsInvalidArgument());
  Result<int> r = Status();  // an OK status cannot make an empty Result
  CHECK(r.status().code() == Code::kInternal);
}

TEST_CASE("value() of an error Result aborts with the Status instead of throwing") {
  int pipe_fds[2];
  REQUIRE(::pipe(pipe_fds) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::signal(SIGABRT, SIG_DFL);  // Catch2's fatal-signal handler otherwise
    ::dup2(pipe_fds[1], STDERR_FILENO);
    ::close(pipe_fds[0]);
    try {
      const Result<int> r = Half(3);
      const int v = r.value();  // must neither return nor throw std::bad_variant_access
      ::_exit(v == 0 ? 3 : 4);
    } catch (...) {
      ::_exit(5);
    }
  }
  ::close(pipe_fds[1]);
  std::string err;
  char buf[256];
  for (ssize_t n; (n = ::read(pipe_fds[0], buf, sizeof buf)) > 0;) err.append(buf, size_t(n));
  ::close(pipe_fds[0]);
  int wstatus = 0;
  REQUIRE(::waitpid(child, &wstatus, 0) == child);
  CHECK(WIFSIGNALED(wstatus));
  CHECK((WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGABRT));
  CHECK(err.find("Result::value() called on an error Result") != std::string::npos);
  CHECK(err.find("InvalidArgument: odd") != std::string::npos);
}
