// Test helpers for bad environments: a private mount (a small tmpfs, an
// mqueue) to fill up or make read-only, and a forked child that drops root
// so that mode bits apply to it.
//
// Mounting needs CAP_SYS_ADMIN: as a normal user mount(2) fails with EPERM,
// and Mount returns the reason for the caller's GTEST_SKIP. Tests that
// mount run as root in CI (.ci/run) and in scripts/pmsnap.sh test.
#pragma once

#include <grp.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <set>
#include <string>
#include <utility>

#include "pmsnap/common/status.h"
#include "testutil/temp_pool.h"

namespace pmsnap::testing {

// A fresh directory under PoolDirectory() with a file system mounted on it;
// unmounted and removed on destruction (lazily if something still holds
// it, so that a failing test cannot leave the mount behind busy).
class ScratchMount {
 public:
  explicit ScratchMount(const std::string& tag) {
    std::string pattern = PoolDirectory() + "/pmsnap-test-mnt-" + tag + "-XXXXXX";
    if (::mkdtemp(pattern.data()) != nullptr) dir_ = pattern;
  }
  ~ScratchMount() {
    if (mounted_ && ::umount2(dir_.c_str(), 0) != 0) ::umount2(dir_.c_str(), MNT_DETACH);
    if (!dir_.empty()) ::rmdir(dir_.c_str());
  }
  ScratchMount(const ScratchMount&) = delete;
  ScratchMount& operator=(const ScratchMount&) = delete;

  // mount -t <type> -o <options> none <dir>. "" once mounted; else why not,
  // starting "skip: " where the caller may not mount at all (not root).
  std::string Mount(const std::string& type, const std::string& options) {
    if (dir_.empty()) return "cannot make a mount point under " + PoolDirectory();
    if (::mount("none", dir_.c_str(), type.c_str(), 0, options.c_str()) != 0) {
      const int err = errno;
      const bool refused = err == EPERM || err == EACCES;
      return std::string(refused ? "skip: " : "") + "mount -t " + type + " on " + dir_ +
             " failed: " + std::strerror(err) +
             (refused ? " (needs root or CAP_SYS_ADMIN; the tests run as root in CI)" : "");
    }
    mounted_ = true;
    return "";
  }
  // mount -o remount[,ro],<options> <dir>: "" or why not.
  std::string Remount(const std::string& options, bool read_only) {
    unsigned long flags = MS_REMOUNT;
    if (read_only) flags |= MS_RDONLY;
    if (::mount("none", dir_.c_str(), nullptr, flags, options.c_str()) != 0) {
      return "remount of " + dir_ + " (" + options + ") failed: " + std::strerror(errno);
    }
    return "";
  }

  const std::string& dir() const { return dir_; }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

 private:
  std::string dir_;
  bool mounted_ = false;
};

// Names of the entries of `dir`: a failed creation must leave no file (also
// no "<pool>.creating-<pid>") behind.
inline std::set<std::string> DirectoryEntries(const std::string& dir) {
  std::set<std::string> names;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    names.insert(entry.path().filename().string());
  }
  return names;
}

// The outcome of `body` in a forked child.
struct ChildStatus {
  std::string problem;  // non-empty: the child could not run `body` (why)
  Status status;
};

// Runs `body` in a forked child that first drops root for uid/gid 65534
// ('nobody'; root ignores mode bits) and returns its Status through a pipe.
// A non-root caller is already subject to mode bits: its child keeps its
// identity. The caller must hold no pool open (libpmemobj locks the file)
// and run no other threads that the child would need.
inline ChildStatus RunStatusAsNobody(const std::function<Status()>& body) {
  int fds[2];
  if (::pipe(fds) != 0) return {std::string("pipe: ") + std::strerror(errno), {}};
  const pid_t child = ::fork();
  if (child < 0) return {std::string("fork: ") + std::strerror(errno), {}};
  if (child == 0) {
    ::close(fds[0]);
    std::string out;
    if (::geteuid() == 0 &&
        (::setgroups(0, nullptr) != 0 || ::setgid(65534) != 0 || ::setuid(65534) != 0)) {
      out = std::string("E") + "cannot drop root: " + std::strerror(errno);
    } else {
      const Status status = body();
      out = "S" + std::to_string(static_cast<int>(status.code())) + "\n" + status.message();
    }
    const char* data = out.data();
    std::size_t left = out.size();
    while (left > 0) {
      const ssize_t n = ::write(fds[1], data, left);
      if (n <= 0) break;
      data += n;
      left -= static_cast<std::size_t>(n);
    }
    _exit(0);  // no atexit handlers or gtest teardown in the child
  }
  ::close(fds[1]);
  std::string in;
  char buffer[4096];
  for (ssize_t n; (n = ::read(fds[0], buffer, sizeof(buffer))) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    in.append(buffer, static_cast<std::size_t>(n));
  }
  ::close(fds[0]);
  int wait_status = 0;
  ::waitpid(child, &wait_status, 0);
  if (!WIFEXITED(wait_status) || WEXITSTATUS(wait_status) != 0) {
    return {"child died (wait status " + std::to_string(wait_status) + ")", {}};
  }
  if (in.empty() || in[0] != 'S') return {in.empty() ? "child said nothing" : in.substr(1), {}};
  const std::size_t newline = in.find('\n');
  const int code = std::atoi(in.substr(1, newline).c_str());
  return {"", Status(static_cast<StatusCode>(code),
                     newline == std::string::npos ? "" : in.substr(newline + 1))};
}

}  // namespace pmsnap::testing
