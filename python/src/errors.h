// Python exceptions for pmsnap Status codes.
//
// Every failure of the C++ runtime reaches Python as an exception whose
// message is the Status message (it names the pool file, the unit, what was
// expected) and whose class says what kind of failure it was:
//
//   pmsnap.Error (RuntimeError)            base of all of them; .code = "NoSpace", ...
//     InvalidArgumentError (+ ValueError)  a bad argument, e.g. a device spec
//     ModelMismatchError   (+ ValueError)  the pool was made for other units/shapes
//     NoSpaceError         (+ OSError)     file system or pool too small
//     NotFoundError        (+ FileNotFoundError)
//     NotAPoolError, UnsupportedVersionError, CorruptionError,
//     CapacityExceededError, StorageIOError, BusyError,
//     FailedPreconditionError, AbortedError, InternalError
//
// Binding code throws StatusError (ThrowIfError); the translator registered by
// RegisterErrors turns it into the class above.
//
// Thread-safety: RegisterErrors runs once at import; the translator runs with
// the GIL held.
#pragma once

#include <pybind11/pybind11.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "pmsnap/common/status.h"

namespace pmsnap::python {

class StatusError : public std::runtime_error {
 public:
  explicit StatusError(Status status)
      : std::runtime_error(status.message()), status_(std::move(status)) {}
  const Status& status() const { return status_; }

 private:
  Status status_;
};

inline void ThrowIfError(const Status& status) {
  if (!status.ok()) throw StatusError(status);
}

template <typename T>
T ValueOrThrow(Result<T> result) {
  if (!result.ok()) throw StatusError(result.status());
  return std::move(result).value();
}

// Runs `call` (returning a Status or a Result<T>) with the GIL released, so
// that other Python threads run while it blocks; back under the GIL, throws
// its error, or returns the Result's value. Caller holds the GIL.
template <typename Call>
auto CallWithoutGil(Call&& call) {
  using Returned = std::invoke_result_t<Call>;
  std::optional<Returned> returned;
  {
    pybind11::gil_scoped_release release;
    returned.emplace(std::forward<Call>(call)());
  }
  if constexpr (std::is_same_v<Returned, Status>) {
    ThrowIfError(*returned);
  } else {
    return ValueOrThrow(std::move(*returned));
  }
}

// Creates the exception classes as attributes of `module` and registers the
// StatusError translator.
void RegisterErrors(pybind11::module_& module);

}  // namespace pmsnap::python
