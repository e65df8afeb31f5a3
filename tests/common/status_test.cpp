#include <catch2/catch.hpp>

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
