// Stats: what checkpointing cost the training thread and what it achieved.
//
// Thread-safety: a Stats value is a snapshot; Engine::stats() may be called
// from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pmsnap/runtime/device.h"

namespace pmsnap::runtime {

struct UnitStats {
  std::string name;
  std::uint64_t bytes = 0;
  std::uint64_t snapshots = 0;
  double last_copy_seconds = 0;     // device -> host (or into PM), summed over parts
  double last_persist_seconds = 0;  // flush/drain/checksum after the copy
  double total_copy_seconds = 0;
  double total_persist_seconds = 0;
  std::uint64_t conflicts = 0;
  double conflict_wait_seconds = 0;
  std::uint64_t strategy_counts[5] = {0, 0, 0, 0, 0};  // index: StrategyChoice (1..4)
};

// What an engine holds in this process's memory, in bytes, taken when
// Engine::stats() is called (after Close: as it was at Close).
struct MemoryStats {
  std::uint64_t pool_mapped_bytes = 0;    // the pool file's mapping (Pool::mapping)
  // Of it in memory now (mincore: the file's pages in the page cache). On
  // tmpfs (/dev/shm, emulated PM) that is DRAM, the whole file from its
  // creation; on a DAX file system, PM.
  std::uint64_t pool_resident_bytes = 0;
  std::uint64_t staging_bytes = 0;           // EngineOptions::dram_staging_buffers, mapped
  std::uint64_t staging_resident_bytes = 0;  // of them in memory now
  // Host memory registered (pinned, page-locked) with the device as copy
  // destinations: the pool's slots and the staging buffers on a GPU.
  std::uint64_t registered_bytes = 0;
};

struct Stats {
  std::string device;    // Device::name(), e.g. "simulated(...)"
  std::string pm;        // "" on the machine's PM, else "simulated PM (...)" (PmBandwidth)
  std::string strategy;  // ConflictStrategy::name()
  std::string policy;    // IntervalPolicy::name()
  std::uint64_t steps = 0;
  std::uint64_t epochs_started = 0;
  std::uint64_t epochs_committed = 0;
  std::uint64_t epochs_abandoned = 0;
  // Of epochs_started: captured into host memory while the previous epoch
  // was still persisting (EngineOptions::dram_staging_buffers).
  std::uint64_t epochs_staged = 0;
  std::uint64_t bytes_written = 0;          // unit bytes persisted into slots
  std::uint64_t encoded_bytes_written = 0;  // chunk bytes written by the encoder
  std::uint64_t held_bytes = 0;  // captured bytes whose copies waited for EndStep (CopyStart)
  std::uint64_t conflicts = 0;
  std::uint64_t in_device_fallbacks = 0;  // strategy wanted device memory and fell back to 2
  double blocked_seconds = 0;             // training thread inside hooks, all steps
  double conflict_wait_seconds = 0;       // of which waiting for snapshots
  double boundary_wait_seconds = 0;   // of which waiting for the previous epoch (fixed intervals)
  double in_device_copy_seconds = 0;  // of which in-device copies by strategies
  double last_epoch_seconds = 0;      // capture start (staged: pool begin) -> commit
  std::uint64_t last_committed_iteration = 0;
  std::uint64_t peak_device_extra_bytes = 0;
  // The device's queues (Device::queue_stats): compute-stream waits for
  // copies that conflicts asked for, GPU-side stalls, and the staging ring.
  DeviceQueueStats device_queues;
  MemoryStats memory;
  double wall_seconds = 0;  // engine open -> now
  // Training-thread blocked time per step (last 65536 steps).
  std::vector<double> blocked_per_step;
  std::vector<UnitStats> units;

  // One line: "pmsnap: 812 steps, 790 checkpoints committed (...)".
  std::string Summary() const;
  double checkpoints_per_minute() const {
    return wall_seconds > 0 ? epochs_committed * 60.0 / wall_seconds : 0;
  }
};

}  // namespace pmsnap::runtime
