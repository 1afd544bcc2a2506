// Engine::Restore's copy of a committed epoch into the tensors
// (detail/engine_restore.h).
#include "detail/engine_restore.h"

#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <atomic>
#include <cstddef>
#include <mutex>
#include <optional>

namespace pmsnap::runtime {
namespace {

// Copies every part of `view` into the registered tensors on `workers`
// threads and the calling thread, checking the checksums if the pool's data
// verification is still pending (fused into the copy when the CPU addresses
// the tensors). Returns a part that failed its checksum, if any.
Result<std::optional<std::uint32_t>> RestoreParts(layout::Pool& pool, Device& device,
                                                  const std::vector<UnitRegistration>& units,
                                                  int workers, const layout::SnapshotView& view) {
  const std::vector<layout::PartLayout>& parts = pool.layout().parts;
  const bool verify = pool.data_verification_pending();
  // The pool copies straight into CPU-addressable tensors; a device gets
  // the part across its link after the check.
  const bool host = device.cpu_addressable();
  constexpr std::uint32_t kNone = ~0u;
  std::atomic<std::uint32_t> damaged{kNone};
  std::mutex failure_mutex;  // guards failure
  Status failure;
  auto restore_part = [&](std::uint32_t p) {
    const layout::PartLayout& part = parts[p];
    std::byte* dst =
        static_cast<std::byte*>(units[part.unit].tensors[part.tensor].data) + part.offset_in_tensor;
    Status status;
    if (host) {
      status = verify ? pool.ReadPart(view, p, dst) : pool.CopyPart(view, p, dst);
    } else {
      if (!verify) pool.PrefaultPart(view, p);
      status = verify ? pool.VerifyPart(view, p) : Status::Ok();
      if (status.ok()) {
        status = device.CopyFromHost(
            dst, view.tensor(part.unit, part.tensor).data() + part.offset_in_tensor, part.bytes);
      }
    }
    if (status.code() == StatusCode::kCorruption) {
      std::uint32_t expected = kNone;
      damaged.compare_exchange_strong(expected, p);
    } else if (!status.ok()) {
      std::lock_guard<std::mutex> lock(failure_mutex);
      if (failure.ok()) failure = status;
    }
  };
  // The caller joins the workers. A device copy waits on its link while
  // the CPU could check the next part: one more thread keeps both busy.
  tbb::task_arena restore_arena(workers + (host ? 1 : 2));
  restore_arena.execute([&] {
    tbb::parallel_for(std::uint32_t{0}, static_cast<std::uint32_t>(parts.size()),
                      [&](std::uint32_t p) {
                        if (damaged.load(std::memory_order_relaxed) == kNone) restore_part(p);
                      });
  });
  if (!failure.ok()) return failure;
  if (damaged.load() == kNone) return std::optional<std::uint32_t>();
  return std::optional<std::uint32_t>(damaged.load());
}

}  // namespace

Result<RestoreResult> RestoreNewestIntactEpoch(layout::Pool& pool, Device& device,
                                               const std::vector<UnitRegistration>& units,
                                               Encoder* encoder, int workers) {
  PMSNAP_ASSIGN_OR_RETURN(layout::SnapshotView view, pool.Latest());
  while (true) {
    PMSNAP_ASSIGN_OR_RETURN(std::optional<std::uint32_t> damaged,
                            RestoreParts(pool, device, units, workers, view));
    if (!damaged) break;
    // The newest checkpoint is damaged: restore the older one over it (it was
    // verified in full when the pool switched to it).
    PMSNAP_RETURN_IF_ERROR(pool.RejectLatest(*damaged));
    PMSNAP_ASSIGN_OR_RETURN(view, pool.Latest());
  }
  for (std::uint32_t u = 0; u < units.size(); ++u) {
    if (units[u].encoded) PMSNAP_RETURN_IF_ERROR(encoder->Restore(u, view.epoch()));
  }
  RestoreResult result;
  result.iteration = view.iteration();
  result.epoch = view.epoch();
  result.extra_state.assign(view.extra_state().begin(), view.extra_state().end());
  return result;
}

}  // namespace pmsnap::runtime
