// The persistence seam's switches (detail/persistence.h).
#include "detail/persistence.h"

namespace pmsnap::layout::detail {

std::atomic<Persistence*> g_installed_persistence{nullptr};

namespace {
std::atomic<bool> g_drop_commit_record_drain{false};
}  // namespace

Persistence* InstallPersistenceForTesting(Persistence* persistence) {
  return g_installed_persistence.exchange(persistence, std::memory_order_acq_rel);
}

void DropCommitRecordDrainForTesting(bool drop) {
  g_drop_commit_record_drain.store(drop, std::memory_order_relaxed);
}

bool CommitRecordDrainDropped() {
  return g_drop_commit_record_drain.load(std::memory_order_relaxed);
}

}  // namespace pmsnap::layout::detail
