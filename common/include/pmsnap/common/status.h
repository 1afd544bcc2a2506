// Status and Result<T>: how errors cross module boundaries in pmsnap.
//
// Exceptions never leave a module's public API (libpmemobj and libtorch throw
// or set errno: each module catches at its edge and keeps the message). A
// Status carries a code a caller can branch on and a message a person can act
// on: the file, the unit and what was expected.
//
// Thread-safety: values; no shared state.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>

namespace pmsnap {

enum class StatusCode : std::uint8_t {
  kOk = 0,
  kInvalidArgument,  // caller passed something that can never work
  kNotFound,         // path or unit does not exist
  kNotAPool,         // file exists but is not a pmsnap pool
  kUnsupportedVersion,
  kCorruption,        // checksum or structure mismatch: data loss
  kModelMismatch,     // pool was made for another model
  kNoSpace,           // file system or pool heap too small
  kCapacityExceeded,  // a configured bound (e.g. extra-state size) exceeded
  kIOError,           // the OS or PMDK failed an operation
  kBusy,              // pool is open elsewhere or an epoch is in flight
  kFailedPrecondition,
  kAborted,  // work was abandoned on request
  kInternal,
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "Corruption: <message>", or "OK".
  std::string ToString() const;

  // True for failures that mean persisted bytes cannot be trusted.
  bool is_data_loss() const { return code_ == StatusCode::kCorruption; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Result<T>: a T or a non-OK Status. Accessing value() of an error throws
// std::logic_error with the status message (a programming error, never a
// data path).
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : state_(std::move(value)) {}        // NOLINT: implicit by design
  Result(Status status) : state_(std::move(status)) {  // NOLINT
    if (std::get<Status>(state_).ok()) {
      state_ = Status(StatusCode::kInternal, "Result built from an OK status");
    }
  }

  bool ok() const { return std::holds_alternative<T>(state_); }
  const Status& status() const {
    static const Status kOkStatus;
    return ok() ? kOkStatus : std::get<Status>(state_);
  }
  T& value() & {
    check();
    return std::get<T>(state_);
  }
  const T& value() const& {
    check();
    return std::get<T>(state_);
  }
  T&& value() && {
    check();
    return std::get<T>(std::move(state_));
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

 private:
  void check() const {
    if (!ok()) throw std::logic_error("Result::value() on error: " + status().ToString());
  }
  std::variant<Status, T> state_;
};

inline const char* StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "InvalidArgument";
    case StatusCode::kNotFound:
      return "NotFound";
    case StatusCode::kNotAPool:
      return "NotAPool";
    case StatusCode::kUnsupportedVersion:
      return "UnsupportedVersion";
    case StatusCode::kCorruption:
      return "Corruption";
    case StatusCode::kModelMismatch:
      return "ModelMismatch";
    case StatusCode::kNoSpace:
      return "NoSpace";
    case StatusCode::kCapacityExceeded:
      return "CapacityExceeded";
    case StatusCode::kIOError:
      return "IOError";
    case StatusCode::kBusy:
      return "Busy";
    case StatusCode::kFailedPrecondition:
      return "FailedPrecondition";
    case StatusCode::kAborted:
      return "Aborted";
    case StatusCode::kInternal:
      return "Internal";
  }
  return "Unknown";
}

inline std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(StatusCodeName(code_)) + ": " + message_;
}

}  // namespace pmsnap

// Propagates a non-OK Status from an expression returning Status.
#define PMSNAP_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::pmsnap::Status _pmsnap_status = (expr);        \
    if (!_pmsnap_status.ok()) return _pmsnap_status; \
  } while (0)

#define PMSNAP_CONCAT_INNER(a, b) a##b
#define PMSNAP_CONCAT(a, b) PMSNAP_CONCAT_INNER(a, b)
// Declares `lhs` from a Result<T> expression or returns its Status.
#define PMSNAP_ASSIGN_OR_RETURN(lhs, expr)                    \
  auto PMSNAP_CONCAT(_pmsnap_result_, __LINE__) = (expr);     \
  if (!PMSNAP_CONCAT(_pmsnap_result_, __LINE__).ok())         \
    return PMSNAP_CONCAT(_pmsnap_result_, __LINE__).status(); \
  lhs = std::move(PMSNAP_CONCAT(_pmsnap_result_, __LINE__)).value()
