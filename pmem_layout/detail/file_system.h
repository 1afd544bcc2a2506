// File systems a pool cannot live on, by statfs(2) type.
#pragma once

#include <linux/magic.h>

#include <string>

namespace pmsnap::layout::detail {

// Why a pool cannot be created on a file system of statfs type `type`, or ""
// when it can. hugetlbfs: libpmemobj 1.12 aborts the whole process inside
// pmemobj_create there instead of returning an error.
inline std::string PoolFileSystemProblem(unsigned long type) {
  if (type == HUGETLBFS_MAGIC) {
    return "it is on hugetlbfs, where libpmemobj aborts the process creating a pool; put pools "
           "on a DAX file system (real PM) or on tmpfs such as /dev/shm";
  }
  return "";
}

}  // namespace pmsnap::layout::detail
