// Encoder: the pipeline stage for units that are not copied whole into the
// fixed slots (embedding tables with differential, incremental or quantized
// checkpoints). Their payload goes into the pool's chunk heap, tagged with
// the epoch, so one commit covers dense and encoded state together.
//
// Life cycle, per encoded unit and epoch:
//   OnCaptured (training thread, right after the unit's update for the
//   captured step) -> Encode (a worker: read the live tensors through the
//   device, write and seal chunks for the epoch; once it returns the live
//   tensors are no longer read) -> the epoch commits -> OnCommitted (the
//   committing thread: free chunks no retained checkpoint needs).
// A crash before the commit leaves only chunks of an uncommitted epoch,
// which the pool frees at the next BeginEpoch.
//
// Thread-safety: Encode may run concurrently for different units, and
// beside OnCaptured of another unit of the same epoch (training thread).
// The other calls are serialized by the engine: OnCommitted / OnAbandoned
// run after every Encode of their epoch returned and before the next
// epoch's first OnCaptured. Overview: docs/ARCHITECTURE.md, "Embedding
// tables: diff/ and the chunk heap".
#pragma once

#include <cstdint>
#include <vector>

#include "pmsnap/common/status.h"
#include "pmsnap/pmem_layout/chunk_heap.h"
#include "pmsnap/pmem_layout/manifest.h"

namespace pmsnap::runtime {

class Device;
struct UnitRegistration;

class Encoder {
 public:
  virtual ~Encoder() = default;
  // Once, after the pool is open and before any other call, on the thread
  // that opens the engine. `chunks` is the pool's chunk heap: everything the
  // encoder writes goes there, and it resumes from the chunks of epochs up
  // to `last_committed_epoch` (0: none committed; newer chunks belong to an
  // epoch that never committed). `encoded_units` are the ids (into `units`
  // and `manifest.units`) of the units flagged encoded. `chunks`, `manifest`,
  // `units` and `device` outlive every later call. An error (a unit the
  // encoder cannot take, damaged state in the heap) fails the engine's open.
  virtual Status Attach(layout::ChunkHeap& chunks, const layout::Manifest& manifest,
                        std::uint64_t last_committed_epoch,
                        const std::vector<UnitRegistration>& units,
                        const std::vector<std::uint32_t>& encoded_units, Device& device) = 0;
  virtual Status OnCaptured(std::uint32_t unit, std::uint64_t epoch, std::uint64_t iteration) = 0;
  virtual Status Encode(std::uint32_t unit, std::uint64_t epoch) = 0;
  virtual Status OnCommitted(std::uint64_t epoch) = 0;
  // The epoch was abandoned: forget what OnCaptured/Encode prepared for it.
  virtual void OnAbandoned(std::uint64_t epoch) = 0;
  // Writes the unit's state as of committed `epoch` into its live tensors.
  virtual Status Restore(std::uint32_t unit, std::uint64_t epoch) = 0;
  // Chunk bytes written so far (for stats).
  virtual std::uint64_t bytes_written() const = 0;
};

}  // namespace pmsnap::runtime
