// A libtorch exception as a Status (internal to hooks/): exceptions never
// leave the hooks' API, and the message keeps libtorch's own words.
#pragma once

#include <c10/util/Exception.h>

#include <string>

#include "pmsnap/common/status.h"

namespace pmsnap::hooks {

// "<what>: libtorch: <libtorch's message without its backtrace>".
inline Status LibtorchError(const std::string& what, const c10::Error& error,
                            StatusCode code = StatusCode::kInvalidArgument) {
  return Status(code, what + ": libtorch: " + error.what_without_backtrace());
}

}  // namespace pmsnap::hooks
