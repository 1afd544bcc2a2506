// File systems a pool cannot live on, by statfs(2) type, and what an errno
// from creating, opening or mapping a pool file means to the caller.
#pragma once

#include <linux/magic.h>

#include <cerrno>
#include <string>

#include "pmsnap/common/status.h"

namespace pmsnap::layout::detail {

// Not exported by <linux/magic.h>: the kernel keeps it in ipc/mqueue.c.
inline constexpr unsigned long kMqueueMagic = 0x19800202;

// Why a pool cannot be created on a file system of statfs type `type`, or ""
// when it can. hugetlbfs: libpmemobj 1.12 aborts the whole process inside
// pmemobj_create there instead of returning an error. mqueue accepts the
// new file (a message queue) and only then fails libpmemobj's
// posix_fallocate with EINVAL, which says nothing about the real cause;
// proc and sysfs refuse the file with ENOENT or EACCES, which reads like a
// missing directory or a permission problem.
inline std::string PoolFileSystemProblem(unsigned long type) {
  constexpr char kWhere[] =
      "; put pools on a DAX file system (real PM) or on tmpfs such as /dev/shm";
  if (type == HUGETLBFS_MAGIC) {
    return std::string("it is on hugetlbfs, where libpmemobj aborts the process creating a pool") +
           kWhere;
  }
  if (type == kMqueueMagic) {
    return std::string(
               "it is on mqueue (POSIX message queues), whose files cannot be "
               "preallocated or mapped") +
           kWhere;
  }
  if (type == PROC_SUPER_MAGIC || type == SYSFS_MAGIC) {
    return std::string("it is on ") + (type == PROC_SUPER_MAGIC ? "proc" : "sysfs") +
           ", a kernel file system that cannot hold a pool file" + kWhere;
  }
  return "";
}

// What an errno from creating, opening or mapping a pool file means: the
// code says what the caller can do about it (kNoSpace: free space or
// inodes; kFailedPrecondition: fix the permissions or the mount, retrying
// as is cannot help), the hint says it in words ("" where errno's own text
// is all there is to say). Other errnos are kIOError.
struct PoolOsError {
  StatusCode code = StatusCode::kIOError;
  const char* hint = "";
};

// Renames `from` to `to` unless `to` exists (then EEXIST, nothing changed):
// renameat2(RENAME_NOREPLACE), or link + unlink on a file system without
// it. 0 or an errno. Pool::Create's last step: a file created at `to`
// after its existence check must never be replaced.
int RenameNoReplace(const char* from, const char* to);

// Tests: called right before Pool::Create's rename with the pool's path
// (a file created there then races the creation). nullptr: none.
void SetBeforeCreateRenameForTesting(void (*hook)(const char* path));

inline PoolOsError ClassifyPoolOsError(int err) {
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      return {StatusCode::kNoSpace, "the file system is full (no free space or inodes left)"};
    case EACCES:
    case EPERM:
      return {StatusCode::kFailedPrecondition, "permission denied"};
    case EROFS:
      return {StatusCode::kFailedPrecondition,
              "the file system is read-only, and libpmemobj maps a pool for writing even to "
              "read it"};
    case ENODEV:
      return {StatusCode::kInvalidArgument,
              "the file system cannot map the file shared, which a pool needs"};
    default:
      return {};
  }
}

}  // namespace pmsnap::layout::detail
