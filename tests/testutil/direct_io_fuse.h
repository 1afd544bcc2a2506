// A file system that holds files but refuses to map them shared, for the
// bad-environment tests: a minimal in-memory FUSE server, run on a thread
// of the test process, that speaks the kernel's FUSE protocol over
// /dev/fuse directly (no libfuse on a stock Debian machine) and opens every
// file with FOPEN_DIRECT_IO. The kernel then serves read, write, fallocate,
// rename and unlink through the server, and fails mmap(MAP_SHARED) with
// ENODEV, as it does for any direct-I/O FUSE file system (sshfs -o
// direct_io, some network and cluster file systems) that does not opt in to
// FUSE_DIRECT_IO_ALLOW_MMAP. Private mappings still work.
//
// One flat directory (the mount's root), regular files only. Needs
// CAP_SYS_ADMIN to mount (as ScratchMount, testutil/scratch_mount.h):
// Mount returns "skip: ..." where mount(2) is refused, /dev/fuse is missing
// or the kernel has no FUSE.
//
// Thread-safety: Mount, files() and the destructor on the test's thread;
// the server thread only answers the kernel, under `mutex_`. The test's
// file operations on the mount block until the server has answered them
// (files() holds the mutex only to copy, never across such an operation).
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <poll.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <algorithm>
#include <cerrno>
#include <cstdio>  // RENAME_NOREPLACE
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "pmsnap/common/pool_directory.h"

namespace pmsnap::testing {

class DirectIoFuseMount {
 public:
  explicit DirectIoFuseMount(const std::string& tag) {
    std::string pattern = PoolDirectory() + "/pmsnap-test-fuse-" + tag + "-XXXXXX";
    if (::mkdtemp(pattern.data()) != nullptr) dir_ = pattern;
  }
  ~DirectIoFuseMount() {
    if (mounted_ && ::umount2(dir_.c_str(), 0) != 0) ::umount2(dir_.c_str(), MNT_DETACH);
    stop_ = true;
    if (server_.joinable()) server_.join();
    if (fd_ >= 0) ::close(fd_);  // after the join: the server may have closed it
    if (!dir_.empty()) ::rmdir(dir_.c_str());
  }
  DirectIoFuseMount(const DirectIoFuseMount&) = delete;
  DirectIoFuseMount& operator=(const DirectIoFuseMount&) = delete;

  // Mounts the file system on dir(): "" once mounted; else why not,
  // starting "skip: " where this process may not mount.
  std::string Mount() {
    if (dir_.empty()) return "cannot make a mount point under " + PoolDirectory();
    fd_ = ::open("/dev/fuse", O_RDWR | O_CLOEXEC);
    if (fd_ < 0) return std::string("skip: cannot open /dev/fuse: ") + std::strerror(errno);
    const std::string options = "fd=" + std::to_string(fd_) +
                                ",rootmode=40000,user_id=" + std::to_string(::geteuid()) +
                                ",group_id=" + std::to_string(::getegid()) + ",allow_other";
    // The kernel queues FUSE_INIT at mount(2), which does not wait for it;
    // the server starts after: /dev/fuse refuses reads (EPERM) until then.
    if (::mount("pmsnap-direct-io", dir_.c_str(), "fuse", MS_NOSUID | MS_NODEV,
                options.c_str()) != 0) {
      const int err = errno;
      const bool refused = err == EPERM || err == EACCES;
      const bool no_fuse = err == ENODEV;  // a kernel (container) without FUSE
      return std::string(refused || no_fuse ? "skip: " : "") + "mount -t fuse on " + dir_ +
             " failed: " + std::strerror(err) +
             (refused ? " (needs root or CAP_SYS_ADMIN; the tests run as root in CI)"
                      : no_fuse ? " (this kernel has no FUSE)" : "");
    }
    mounted_ = true;
    server_ = std::thread([this] { Serve(); });
    return "";
  }

  const std::string& dir() const { return dir_; }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  // The files the server holds, by name, with their bytes.
  std::map<std::string, std::vector<std::byte>> files() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::map<std::string, std::vector<std::byte>> out;
    for (const auto& [ino, node] : nodes_) out[node.name] = node.bytes;
    return out;
  }

 private:
  struct Node {
    std::string name;
    std::uint32_t mode = S_IFREG | 0644;
    std::vector<std::byte> bytes;
  };
  static constexpr std::uint64_t kRoot = FUSE_ROOT_ID;

  void Serve() {
    std::vector<char> buffer(1 << 20);
    while (!stop_) {
      pollfd p{fd_, POLLIN, 0};
      const int ready = ::poll(&p, 1, 100);  // wake up to see stop_, nothing is timed by it
      if (ready <= 0) continue;
      const ssize_t n = ::read(fd_, buffer.data(), buffer.size());
      if (n < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == ENOENT) continue;
        if (errno != ENODEV) {
          // Anything but the unmount: closing the device aborts the
          // connection, so the test's calls fail (ENOTCONN) instead of hanging.
          ::close(fd_);
          fd_ = -1;
        }
        return;
      }
      if (static_cast<std::size_t>(n) < sizeof(fuse_in_header)) continue;
      Handle(buffer.data(), static_cast<std::size_t>(n));
    }
  }

  void Reply(std::uint64_t unique, int error, const void* data = nullptr, std::size_t bytes = 0) {
    fuse_out_header out{};
    out.len = static_cast<std::uint32_t>(sizeof(out) + (error == 0 ? bytes : 0));
    out.error = -error;
    out.unique = unique;
    std::vector<char> message(out.len);
    std::memcpy(message.data(), &out, sizeof(out));
    if (error == 0 && bytes != 0) std::memcpy(message.data() + sizeof(out), data, bytes);
    (void)::write(fd_, message.data(), message.size());
  }

  fuse_attr AttrOf(std::uint64_t ino) const {
    fuse_attr attr{};
    attr.ino = ino;
    attr.nlink = 1;
    attr.uid = ::geteuid();
    attr.gid = ::getegid();
    attr.blksize = 4096;
    if (ino == kRoot) {
      attr.mode = S_IFDIR | 0755;
      attr.nlink = 2;
    } else {
      const Node& node = nodes_.at(ino);
      attr.mode = node.mode;
      attr.size = node.bytes.size();
      attr.blocks = (node.bytes.size() + 511) / 512;
    }
    return attr;
  }
  fuse_entry_out EntryOf(std::uint64_t ino) const {
    fuse_entry_out entry{};
    entry.nodeid = ino;
    entry.attr = AttrOf(ino);  // entry_valid/attr_valid 0: the kernel asks again
    return entry;
  }
  std::uint64_t Find(const std::string& name) const {
    for (const auto& [ino, node] : nodes_) {
      if (node.name == name) return ino;
    }
    return 0;
  }

  void Handle(const char* request, std::size_t bytes) {
    fuse_in_header in;
    std::memcpy(&in, request, sizeof(in));
    const char* arg = request + sizeof(in);
    const std::size_t arg_bytes = bytes - sizeof(in);
    (void)arg_bytes;
    std::unique_lock<std::mutex> lock(mutex_);
    switch (in.opcode) {
      case FUSE_INIT: {
        fuse_init_in init;
        std::memcpy(&init, arg, sizeof(init));
        fuse_init_out out{};
        out.major = FUSE_KERNEL_VERSION;
        out.minor = std::min<std::uint32_t>(init.minor, FUSE_KERNEL_MINOR_VERSION);
        out.max_readahead = init.max_readahead;
        out.flags = FUSE_BIG_WRITES | FUSE_MAX_PAGES;  // no FUSE_DIRECT_IO_ALLOW_MMAP
        out.max_background = 16;
        out.congestion_threshold = 12;
        out.max_write = 128 << 10;
        out.time_gran = 1;
        out.max_pages = 32;
        return Reply(in.unique, 0, &out, sizeof(out));
      }
      case FUSE_LOOKUP: {
        const std::uint64_t ino = in.nodeid == kRoot ? Find(arg) : 0;
        if (ino == 0) return Reply(in.unique, ENOENT);
        const fuse_entry_out entry = EntryOf(ino);
        return Reply(in.unique, 0, &entry, sizeof(entry));
      }
      case FUSE_GETATTR: {
        if (in.nodeid != kRoot && nodes_.count(in.nodeid) == 0) return Reply(in.unique, ENOENT);
        fuse_attr_out out{};
        out.attr = AttrOf(in.nodeid);
        return Reply(in.unique, 0, &out, sizeof(out));
      }
      case FUSE_SETATTR: {
        fuse_setattr_in set;
        std::memcpy(&set, arg, sizeof(set));
        if (in.nodeid != kRoot) {
          auto it = nodes_.find(in.nodeid);
          if (it == nodes_.end()) return Reply(in.unique, ENOENT);
          if (set.valid & FATTR_SIZE) it->second.bytes.resize(set.size);
          if (set.valid & FATTR_MODE) it->second.mode = S_IFREG | (set.mode & 07777);
        }
        fuse_attr_out out{};
        out.attr = AttrOf(in.nodeid);
        return Reply(in.unique, 0, &out, sizeof(out));
      }
      case FUSE_CREATE:
      case FUSE_MKNOD: {
        std::uint32_t mode = 0;
        const char* name = nullptr;
        if (in.opcode == FUSE_CREATE) {
          fuse_create_in create;
          std::memcpy(&create, arg, sizeof(create));
          mode = create.mode;
          name = arg + sizeof(create);
        } else {
          fuse_mknod_in mknod;
          std::memcpy(&mknod, arg, sizeof(mknod));
          mode = mknod.mode;
          name = arg + sizeof(mknod);
        }
        if (in.nodeid != kRoot || !S_ISREG(mode)) return Reply(in.unique, EPERM);
        if (Find(name) != 0) return Reply(in.unique, EEXIST);
        const std::uint64_t ino = next_ino_++;
        nodes_[ino] = Node{name, S_IFREG | (mode & 07777), {}};
        struct {
          fuse_entry_out entry;
          fuse_open_out open;
        } out{};
        out.entry = EntryOf(ino);
        out.open.open_flags = FOPEN_DIRECT_IO;
        return Reply(in.unique, 0, &out,
                     in.opcode == FUSE_CREATE ? sizeof(out) : sizeof(out.entry));
      }
      case FUSE_OPEN:
      case FUSE_OPENDIR: {
        fuse_open_out out{};
        out.open_flags = in.opcode == FUSE_OPEN ? FOPEN_DIRECT_IO : 0;
        return Reply(in.unique, 0, &out, sizeof(out));
      }
      case FUSE_READ: {
        fuse_read_in read;
        std::memcpy(&read, arg, sizeof(read));
        auto it = nodes_.find(in.nodeid);
        if (it == nodes_.end()) return Reply(in.unique, ENOENT);
        const std::vector<std::byte>& data = it->second.bytes;
        const std::uint64_t begin = std::min<std::uint64_t>(read.offset, data.size());
        const std::uint64_t end = std::min<std::uint64_t>(begin + read.size, data.size());
        return Reply(in.unique, 0, data.data() + begin, end - begin);
      }
      case FUSE_WRITE: {
        fuse_write_in write;
        std::memcpy(&write, arg, sizeof(write));
        auto it = nodes_.find(in.nodeid);
        if (it == nodes_.end()) return Reply(in.unique, ENOENT);
        std::vector<std::byte>& data = it->second.bytes;
        if (data.size() < write.offset + write.size) data.resize(write.offset + write.size);
        std::memcpy(data.data() + write.offset, arg + sizeof(write), write.size);
        fuse_write_out out{};
        out.size = write.size;
        return Reply(in.unique, 0, &out, sizeof(out));
      }
      case FUSE_FALLOCATE: {
        fuse_fallocate_in allocate;
        std::memcpy(&allocate, arg, sizeof(allocate));
        auto it = nodes_.find(in.nodeid);
        if (it == nodes_.end()) return Reply(in.unique, ENOENT);
        if (allocate.mode != 0) return Reply(in.unique, EOPNOTSUPP);
        std::vector<std::byte>& data = it->second.bytes;
        if (data.size() < allocate.offset + allocate.length) {
          data.resize(allocate.offset + allocate.length);
        }
        return Reply(in.unique, 0);
      }
      case FUSE_UNLINK: {
        const std::uint64_t ino = in.nodeid == kRoot ? Find(arg) : 0;
        if (ino == 0) return Reply(in.unique, ENOENT);
        nodes_.erase(ino);
        return Reply(in.unique, 0);
      }
      case FUSE_RENAME:
      case FUSE_RENAME2: {
        std::uint64_t new_dir = 0;
        std::uint32_t flags = 0;
        const char* names = nullptr;
        if (in.opcode == FUSE_RENAME) {
          fuse_rename_in rename;
          std::memcpy(&rename, arg, sizeof(rename));
          new_dir = rename.newdir;
          names = arg + sizeof(rename);
        } else {
          fuse_rename2_in rename;
          std::memcpy(&rename, arg, sizeof(rename));
          new_dir = rename.newdir;
          flags = rename.flags;
          names = arg + sizeof(rename);
        }
        const std::string from = names;
        const std::string to = names + from.size() + 1;
        if (in.nodeid != kRoot || new_dir != kRoot || (flags & ~RENAME_NOREPLACE) != 0) {
          return Reply(in.unique, EINVAL);
        }
        const std::uint64_t ino = Find(from);
        if (ino == 0) return Reply(in.unique, ENOENT);
        if (const std::uint64_t existing = Find(to); existing != 0 && existing != ino) {
          if (flags & RENAME_NOREPLACE) return Reply(in.unique, EEXIST);
          nodes_.erase(existing);
        }
        nodes_[ino].name = to;
        return Reply(in.unique, 0);
      }
      case FUSE_READDIR: {
        fuse_read_in read;
        std::memcpy(&read, arg, sizeof(read));
        std::vector<char> out;
        std::uint64_t index = 0;
        for (const auto& [ino, node] : nodes_) {
          if (index++ < read.offset) continue;
          const std::size_t record = FUSE_REC_ALIGN(FUSE_NAME_OFFSET + node.name.size());
          if (out.size() + record > read.size) break;
          fuse_dirent entry{};
          entry.ino = ino;
          entry.off = index;
          entry.namelen = static_cast<std::uint32_t>(node.name.size());
          entry.type = DT_REG;
          const std::size_t at = out.size();
          out.resize(at + record, 0);
          std::memcpy(out.data() + at, &entry, FUSE_NAME_OFFSET);
          std::memcpy(out.data() + at + FUSE_NAME_OFFSET, node.name.data(), node.name.size());
        }
        return Reply(in.unique, 0, out.data(), out.size());
      }
      case FUSE_STATFS: {
        fuse_statfs_out out{};
        out.st.bsize = out.st.frsize = 4096;
        out.st.blocks = out.st.bfree = out.st.bavail = 1 << 20;  // 4 GiB
        out.st.files = out.st.ffree = 1 << 20;
        out.st.namelen = 255;
        return Reply(in.unique, 0, &out, sizeof(out));
      }
      case FUSE_FLUSH:
      case FUSE_RELEASE:
      case FUSE_RELEASEDIR:
      case FUSE_FSYNC:
      case FUSE_FSYNCDIR:
      case FUSE_ACCESS:
      case FUSE_DESTROY:
        return Reply(in.unique, 0);
      case FUSE_FORGET:
      case FUSE_BATCH_FORGET:
      case FUSE_INTERRUPT:
        return;  // no reply
      default:
        return Reply(in.unique, ENOSYS);
    }
  }

  std::string dir_;
  int fd_ = -1;  // the server thread may close it (and set -1) before it ends
  bool mounted_ = false;
  std::atomic<bool> stop_{false};
  std::thread server_;
  mutable std::mutex mutex_;  // guards nodes_, next_ino_
  std::map<std::uint64_t, Node> nodes_;
  std::uint64_t next_ino_ = 2;
};

}  // namespace pmsnap::testing
