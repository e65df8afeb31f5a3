#include "terrace/status.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "src/common/reworded.h"

namespace terrace {

std::string_view CodeName(Code code) {
  switch (code) {
    case Code::kOk: return "OK";
    case Code::kNotFound: return "NotFound";
    case Code::kOutOfCapacity: return "OutOfCapacity";
    case Code::kIoError: return "IOError";
    case Code::kCorruption: return "Corruption";
    case Code::kInvalidArgument: return "InvalidArgument";
    case Code::kCancelled: return "Cancelled";
    case Code::kTimedOut: return "TimedOut";
    case Code::kUnavailable: return "Unavailable";
    case Code::kInternal: return "Internal";
  }
  return "Unknown";
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return state_ ? state_->message : kEmpty;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string s(CodeName(state_->code));
  if (state_->retryable) s += " (retryable)";
  s += ": ";
  s += state_->message;
  return s;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return Status();
  Status s(*this);
  s.state_->message = std::string(context) + ": " + s.state_->message;
  return s;
}

Status Reworded(const Status& s, std::string message) {
  switch (s.code()) {
    case Code::kNotFound: return Status::NotFound(std::move(message));
    case Code::kOutOfCapacity: return Status::OutOfCapacity(std::move(message));
    case Code::kIoError: return Status::IoError(std::move(message), s.retryable());
    case Code::kCorruption: return Status::Corruption(std::move(message));
    case Code::kInvalidArgument: return Status::InvalidArgument(std::move(message));
    case Code::kCancelled: return Status::Cancelled(std::move(message));
    case Code::kTimedOut: return Status::TimedOut(std::move(message));
    case Code::kUnavailable: return Status::Unavailable(std::move(message));
    case Code::kOk:
    case Code::kInternal: break;
  }
  return Status::Internal(std::move(message));
}

namespace internal {

void DieOnErrorResultAccess(const Status& status) {
  std::fprintf(stderr,
               "terrace: Result::value() called on an error Result (check ok() first): %s\n",
               status.ToString().c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace internal

}  // namespace terrace
