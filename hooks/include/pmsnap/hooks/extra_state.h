// Extra state: what a training run needs besides parameters and optimizer
// state to resume exactly where it stopped (the data-loader position, the
// random-number generator), packed into the bytes pmsnap stores with every
// epoch (Engine::EndStep / CheckpointedOptimizer::Step).
//
// Format (little-endian, bounds-checked on parse): "PMSX", u32 version (1),
// u64 data_position, u32 rng length + bytes, u32 user length + bytes.
//
// Thread-safety: Pack/Unpack are pure. The RNG functions read and write
// libtorch's global CPU generator, which libtorch guards with its own mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "pmsnap/common/status.h"

namespace pmsnap::hooks {

struct ExtraState {
  // Batches (or samples; the caller's unit) consumed so far.
  std::uint64_t data_position = 0;
  // libtorch's CPU generator state (CaptureCpuRngState), or empty.
  std::vector<std::byte> rng_state;
  // Anything else (LR scheduler, epoch counters...), opaque to pmsnap.
  std::vector<std::byte> user;

  bool operator==(const ExtraState&) const = default;
};

std::vector<std::byte> PackExtraState(const ExtraState& state);

// Parses PackExtraState output. kCorruption naming what is wrong for bytes
// that are not a packed ExtraState (wrong magic, version or lengths).
Result<ExtraState> UnpackExtraState(std::span<const std::byte> bytes);

// The default CPU generator's state (what torch.get_rng_state() returns).
Result<std::vector<std::byte>> CaptureCpuRngState();

// Sets the default CPU generator's state to bytes from CaptureCpuRngState.
// kInvalidArgument (libtorch's message) if they are not a generator state.
Status RestoreCpuRngState(std::span<const std::byte> state);

}  // namespace pmsnap::hooks
