// StateArena: the optimizer state that pmsnap allocates itself (a fresh
// optimizer, or a restore into one) packed into 2 MiB-aligned regions that
// are advised for transparent huge pages.
//
// Why: a restarted trainer first touches all of its optimizer state inside
// Restore's copy, one page fault per page. Tensors allocated one by one
// (libtorch aligns to 64 bytes) get huge pages only for the 2 MiB-aligned
// pages that fit inside each tensor, so none for a 1 MiB tensor and one for
// a 3 MiB tensor at best; packed regions are huge-page backed end to end (a
// transformer's cold restore measured ~25% faster). Regions are reserved
// address space: only touched pages cost memory, so packing wastes at most
// the tail of one 2 MiB page per region.
//
// Thread-safety: one owner thread (the stepper's). Tensors it returns are
// ordinary CPU tensors and may be used and freed from any thread; a region is
// unmapped when its last tensor is freed.
#pragma once

#include <torch/torch.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

namespace pmsnap::hooks {

class StateArena {
 public:
  static constexpr std::size_t kHugePageBytes = 2u << 20;
  static constexpr std::size_t kDefaultRegionBytes = 64u << 20;

  explicit StateArena(std::size_t region_bytes = kDefaultRegionBytes)
      : region_bytes_(region_bytes) {}

  // An uninitialized contiguous tensor with `like`'s sizes and options.
  // CPU tensors come from the arena; others (a CUDA parameter) from libtorch.
  // Throws c10::Error like torch::empty when the address space runs out.
  torch::Tensor EmptyLike(const torch::Tensor& like);

 private:
  struct Region;
  std::size_t region_bytes_;
  std::shared_ptr<Region> region_;  // the one being filled
  std::size_t used_ = 0;
};

// Faults in the pages of memory ranges for writing, without changing what
// they hold, on a thread of its own while the caller does other work; the
// caller then helps with what is left (Finish). A restarted trainer's
// optimizer state is fresh memory: the kernel zeroes each page on its first
// touch, which would otherwise happen inside the restore's copy, after the
// pool has opened, rather than beside the open.
// The ranges must stay mapped until Finish returns. If no thread can be
// started, Finish does the whole work on the caller's.
// Thread-safety: Finish (and the destructor) from the owner thread only.
class PageWarmer {
 public:
  explicit PageWarmer(const std::vector<std::pair<std::byte*, std::size_t>>& ranges);
  ~PageWarmer() { Finish(); }
  PageWarmer(const PageWarmer&) = delete;
  PageWarmer& operator=(const PageWarmer&) = delete;

  // Faults in the pieces the thread has not started, then waits for it.
  // Idempotent.
  void Finish();

 private:
  void Work();
  // Pieces of at most a huge page, so the two threads split the work evenly.
  std::vector<std::pair<std::byte*, std::size_t>> pieces_;
  std::atomic<std::size_t> next_{0};
  std::jthread thread_;
};

}  // namespace pmsnap::hooks
