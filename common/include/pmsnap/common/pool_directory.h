// PoolDirectory: where tools, tests and benchmarks put pools and scratch
// files unless told otherwise. /dev/shm by default, because a pool on tmpfs
// with PMEM_IS_PMEM_FORCE=1 takes the persistent-memory code path (README,
// "Where pools live"); $PMSNAP_POOL_DIR moves them, e.g. onto a DAX mount.
//
// Thread-safety: reads the environment; safe unless another thread calls
// setenv/putenv at the same time.
#pragma once

#include <cstdlib>
#include <string>

namespace pmsnap {

// $PMSNAP_POOL_DIR when it is set and not empty, else "/dev/shm". Never
// fails; whether the directory exists is the caller's concern (the pool
// calls name the path in their errors).
inline std::string PoolDirectory() {
  const char* dir = std::getenv("PMSNAP_POOL_DIR");
  return dir != nullptr && *dir != '\0' ? dir : "/dev/shm";
}

}  // namespace pmsnap
