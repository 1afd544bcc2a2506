// How much memory a range or this process holds, for the memory figures in
// runtime::Stats, the demo and the benchmarks.
//
//  - ResidentBytes: bytes of [address, address + bytes) in memory now
//    (mincore). For a file mapping that is the file's pages in the page
//    cache, wherever they were faulted: a pool on tmpfs (/dev/shm) counts in
//    full, since it is allocated at creation and lives in DRAM.
//  - PeakRssBytes / CurrentRssBytes: this process's resident set, its peak
//    (VmHWM of /proc/self/status) and now (/proc/self/statm);
//    ResetPeakRss starts the peak again from the current resident set
//    (/proc/self/clear_refs), e.g. between a benchmark's methods.
//
// Thread-safety: every function is safe from any thread. None fails: an
// answer the kernel refuses is 0.
#pragma once

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace pmsnap {

inline std::uint64_t ResidentBytes(const void* address, std::size_t bytes) {
  if (address == nullptr || bytes == 0) return 0;
  const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto first = reinterpret_cast<std::uintptr_t>(address) & ~(page - 1);
  const auto end = reinterpret_cast<std::uintptr_t>(address) + bytes;
  const std::size_t pages = (end - first + page - 1) / page;
  std::vector<unsigned char> resident(pages);
  if (::mincore(reinterpret_cast<void*>(first), end - first, resident.data()) != 0) return 0;
  std::uint64_t count = 0;
  for (unsigned char r : resident) count += r & 1;
  // Whole pages are resident; a range that ends inside one counts its own bytes.
  return std::min<std::uint64_t>(count * page, bytes);
}

inline std::uint64_t PeakRssBytes() {
  std::FILE* status = std::fopen("/proc/self/status", "r");
  if (status != nullptr) {
    char line[256];
    unsigned long long kib = 0;
    bool found = false;
    while (!found && std::fgets(line, sizeof(line), status) != nullptr) {
      found = std::sscanf(line, "VmHWM: %llu kB", &kib) == 1;
    }
    std::fclose(status);
    if (found) return static_cast<std::uint64_t>(kib) * 1024;
  }
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) != 0) return 0;
  return static_cast<std::uint64_t>(usage.ru_maxrss) * 1024;  // Linux: KiB
}

// False where the kernel refuses (then PeakRssBytes stays the process's).
inline bool ResetPeakRss() {
  std::FILE* clear_refs = std::fopen("/proc/self/clear_refs", "w");
  if (clear_refs == nullptr) return false;
  const bool written = std::fputs("5", clear_refs) >= 0;
  return std::fclose(clear_refs) == 0 && written;
}

inline std::uint64_t CurrentRssBytes() {
  std::FILE* statm = std::fopen("/proc/self/statm", "r");
  if (statm == nullptr) return 0;
  unsigned long long size = 0, resident = 0;
  const int read = std::fscanf(statm, "%llu %llu", &size, &resident);
  std::fclose(statm);
  return read == 2 ? resident * static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE)) : 0;
}

}  // namespace pmsnap
