// Engine::Restore's work: copies a pool's newest intact committed epoch back
// into the registered tensors.
//
// Thread-safety: one call at a time per pool, and none beside a checkpoint
// of the same pool (the Engine calls it before the first BeginStep). It runs
// the copies on a oneTBB arena of its own and the calling thread.
#pragma once

#include <vector>

#include "pmsnap/common/status.h"
#include "pmsnap/pmem_layout/pool.h"
#include "pmsnap/runtime/device.h"
#include "pmsnap/runtime/encoder.h"
#include "pmsnap/runtime/engine.h"

namespace pmsnap::runtime {

// Copies every part of the pool's newest committed epoch into `units`'
// tensors, through `device`, on `workers` threads plus the caller, checking
// each part's checksum in the same pass while the pool's data verification
// is pending. A damaged part makes the pool reject that epoch
// (Pool::RejectLatest, with its warning) and the older one is restored over
// it. Encoded units are restored by `encoder` (needed, and not null, when
// any unit is encoded). Returns the restored epoch's iteration and extra
// state; kNotFound when the pool has no committed epoch, kCorruption when
// neither epoch verifies, and the first copy error otherwise (the tensors
// then hold a mix of old and restored bytes).
Result<RestoreResult> RestoreNewestIntactEpoch(layout::Pool& pool, Device& device,
                                               const std::vector<UnitRegistration>& units,
                                               Encoder* encoder, int workers);

}  // namespace pmsnap::runtime
