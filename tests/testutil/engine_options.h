// Engine options the tests share.
#pragma once

#include <memory>
#include <string>

#include "pmsnap/runtime/engine.h"
#include "pmsnap/runtime/interval_policy.h"

namespace pmsnap::testing {

// A pool at `path` checkpointed every step, quietly (no summary at Close).
inline runtime::EngineOptions EveryStep(const std::string& path) {
  runtime::EngineOptions options;
  options.pool_path = path;
  options.policy = std::make_shared<runtime::EveryKPolicy>(1);
  options.print_summary = false;
  return options;
}

}  // namespace pmsnap::testing
