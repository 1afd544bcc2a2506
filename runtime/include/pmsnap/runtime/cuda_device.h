// CudaDevice: live tensors in GPU memory.
//
// Ordered by events, never by stream flags (docs/ARCHITECTURE.md, "GPU
// ordering"): the engine records an event on the compute stream (torch's
// current stream, CudaDeviceOptions::compute_stream) after each captured
// update; copies run on non-blocking streams, one per calling thread, and
// wait for that event with cudaStreamWaitEvent; a conflict makes the compute
// stream wait for the copy's event (cudaStreamWaitEvent(compute, copy_done))
// instead of blocking the host, and the compute stream's stall there is
// measured with timing events (cudaEventElapsedTime, Device::queue_stats).
// Workers learn that a copy is done from its event, then persist.
//
// Destinations in the PM mapping are registered with cudaHostRegister
// (Device::RegisterHostDestination) so the DMA writes straight into the
// pool; where registration fails, copies into the mapping go through a
// bounded pinned staging ring (CudaDeviceOptions::staging_ring_bytes) that
// never grows with the model; such a copy is synchronous for the thread that
// queues it (a conflict on the training thread then waits on the host). Restore copies from the mapping straight into
// device memory. In-device copies use cudaMemcpyAsync device-to-device.
//
// Built only when the CUDA toolkit is found (PMSNAP_WITH_CUDA). Without a GPU,
// or in a build without CUDA, CreateCudaDevice says why and the caller falls
// back to the host device (MakeDevice does that).
//
// Thread-safety: as Device.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "pmsnap/common/status.h"
#include "pmsnap/runtime/device.h"

namespace pmsnap::runtime {

// True when this build contains the CUDA device.
bool CudaSupportCompiled();

struct CudaDeviceOptions {
  // The stream training kernels run on, as a cudaStream_t's value: torch's
  // current stream (torch.cuda.current_stream().cuda_stream in Python,
  // c10::cuda::getCurrentCUDAStream() in C++). 0: the legacy default
  // stream, torch's unless told otherwise.
  std::uintptr_t compute_stream = 0;
  // Pinned staging ring for destinations that could not be registered: its
  // size, and the chunk one copy moves at a time.
  std::uint64_t staging_ring_bytes = 64ull << 20;
  std::uint64_t staging_chunk_bytes = 4ull << 20;
  // Tests: refuse every registration, as a file system that cannot be
  // registered would, so copies take the staging ring.
  bool testing_refuse_registration = false;
};

// The CUDA device `ordinal`. kFailedPrecondition (with the CUDA error text)
// when the build has no CUDA support or no usable GPU is present.
Result<std::unique_ptr<Device>> CreateCudaDevice(int ordinal = 0, CudaDeviceOptions options = {});

// Device from a spec: "host", "simulated[:GBPS[:MEM_MIB]]", "cuda[:N]".
// A "cuda" spec without a usable GPU falls back to the host device and
// explains why in *note (if given). `cuda` configures a CUDA device (its
// compute stream: torch's current stream).
Result<std::unique_ptr<Device>> MakeDevice(const std::string& spec, std::string* note = nullptr,
                                           const CudaDeviceOptions& cuda = {});

}  // namespace pmsnap::runtime
