// Status and Result<T>: Terrace's one error idiom. No exception crosses the public API.
//
// An OK Status holds no allocation; a failed one carries a code, a retryable flag and a message
// that names the object involved (key, path, field) and says what to do next.
// Thread-safety: values; distinct objects may be used from different threads freely.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace terrace {

enum class Code : std::uint8_t {
  kOk = 0,
  kNotFound,         // the key / file / tensor does not exist
  kOutOfCapacity,    // a tier or device is full (or a block is larger than the tier)
  kIoError,          // the OS failed an I/O; see retryable()
  kCorruption,       // stored bytes failed validation; the data was dropped, never returned
  kInvalidArgument,  // the caller passed something malformed
  kCancelled,        // the operation was cancelled before it finished
  kTimedOut,         // a deadline passed
  kUnavailable,      // a resource (device, driver) is not present on this machine
  kInternal,         // a Terrace bug; please report it
};

std::string_view CodeName(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(const Status& other) : state_(other.state_ ? std::make_unique<State>(*other.state_) : nullptr) {}
  Status& operator=(const Status& other) {
    if (this != &other) state_ = other.state_ ? std::make_unique<State>(*other.state_) : nullptr;
    return *this;
  }
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;

  static Status Ok() { return Status(); }
  static Status NotFound(std::string msg) { return Status(Code::kNotFound, std::move(msg)); }
  static Status OutOfCapacity(std::string msg) { return Status(Code::kOutOfCapacity, std::move(msg)); }
  // retryable: the same call may succeed later (EAGAIN, EINTR, transient device error).
  static Status IoError(std::string msg, bool retryable = false) {
    return Status(Code::kIoError, std::move(msg), retryable);
  }
  static Status Corruption(std::string msg) { return Status(Code::kCorruption, std::move(msg)); }
  static Status InvalidArgument(std::string msg) { return Status(Code::kInvalidArgument, std::move(msg)); }
  static Status Cancelled(std::string msg) { return Status(Code::kCancelled, std::move(msg)); }
  static Status TimedOut(std::string msg) { return Status(Code::kTimedOut, std::move(msg), true); }
  static Status Unavailable(std::string msg) { return Status(Code::kUnavailable, std::move(msg)); }
  static Status Internal(std::string msg) { return Status(Code::kInternal, std::move(msg)); }

  bool ok() const { return state_ == nullptr; }
  Code code() const { return state_ ? state_->code : Code::kOk; }
  bool retryable() const { return state_ && state_->retryable; }
  // Empty for OK.
  const std::string& message() const;
  // "OK" or "<code name>: <message>".
  std::string ToString() const;

  bool IsNotFound() const { return code() == Code::kNotFound; }
  bool IsCorruption() const { return code() == Code::kCorruption; }
  bool IsOutOfCapacity() const { return code() == Code::kOutOfCapacity; }
  bool IsIoError() const { return code() == Code::kIoError; }
  bool IsInvalidArgument() const { return code() == Code::kInvalidArgument; }

  // Returns a copy whose message is "<context>: <message>"; OK stays OK.
  Status WithContext(std::string_view context) const;

 private:
  struct State {
    Code code;
    bool retryable;
    std::string message;
  };
  Status(Code code, std::string msg, bool retryable = false)
      : state_(std::make_unique<State>(State{code, retryable, std::move(msg)})) {}

  std::unique_ptr<State> state_;
};

namespace internal {
// Prints "<what was accessed> on an error Result: <status>" to stderr and aborts.
[[noreturn]] void DieOnErrorResultAccess(const Status& status);
}  // namespace internal

// Result<T>: a value or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}              // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {        // NOLINT(google-explicit-constructor)
    if (std::get<Status>(v_).ok()) v_ = Status::Internal("Result constructed from an OK Status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  // OK when a value is held.
  Status status() const { return ok() ? Status::Ok() : std::get<Status>(v_); }

  // Precondition: ok(). Breaking it is a programming error, not a recoverable one: the process
  // prints the held Status to stderr and aborts (no exception crosses the API).
  T& value() & { return *Held(); }
  const T& value() const& { return *Held(); }
  T&& value() && { return std::move(*Held()); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  T* Held() {
    if (T* p = std::get_if<T>(&v_)) return p;
    internal::DieOnErrorResultAccess(*std::get_if<Status>(&v_));
  }
  const T* Held() const {
    if (const T* p = std::get_if<T>(&v_)) return p;
    internal::DieOnErrorResultAccess(*std::get_if<Status>(&v_));
  }

  std::variant<T, Status> v_;
};

}  // namespace terrace

#define TERRACE_CONCAT_INNER_(a, b) a##b
#define TERRACE_CONCAT_(a, b) TERRACE_CONCAT_INNER_(a, b)

// Returns the Status from the enclosing function if `expr` (a Status) is not OK.
#define TERRACE_RETURN_IF_ERROR(expr)                 \
  do {                                                \
    ::terrace::Status terrace_status_ = (expr);       \
    if (!terrace_status_.ok()) return terrace_status_; \
  } while (0)

// `lhs = value of expr` (a Result<T>), or returns its Status from the enclosing function.
#define TERRACE_ASSIGN_OR_RETURN(lhs, expr) \
  TERRACE_ASSIGN_OR_RETURN_IMPL_(TERRACE_CONCAT_(terrace_result_, __LINE__), lhs, expr)
#define TERRACE_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return tmp.status();                  \
  lhs = std::move(tmp).value()
