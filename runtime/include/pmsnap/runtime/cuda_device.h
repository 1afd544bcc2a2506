// CudaDevice: live tensors in GPU memory.
//
// Copies to the host run on a dedicated stream per calling thread and wait on
// an event, so workers overlap with training kernels; destinations in the PM
// mapping are registered with cudaHostRegister so the DMA writes straight
// into the pool (falling back to a pinned staging buffer when registration is
// refused). In-device copies use cudaMemcpyAsync device-to-device.
//
// Built only when the CUDA toolkit is found (PMSNAP_WITH_CUDA). Without a GPU,
// or in a build without CUDA, CreateCudaDevice says why and the caller falls
// back to the host device (MakeDevice does that).
//
// Thread-safety: as Device.
#pragma once

#include <memory>
#include <string>

#include "pmsnap/common/status.h"
#include "pmsnap/runtime/device.h"

namespace pmsnap::runtime {

// True when this build contains the CUDA device.
bool CudaSupportCompiled();

// The CUDA device `ordinal`. kFailedPrecondition (with the CUDA error text)
// when the build has no CUDA support or no usable GPU is present.
Result<std::unique_ptr<Device>> CreateCudaDevice(int ordinal = 0);

// Registers a host range (e.g. the PM mapping of a slot) for direct DMA.
// No-op without CUDA. Failure is not fatal: copies then stage through
// pinned memory.
Status RegisterHostMemoryForDevice(void* ptr, std::size_t bytes);

// Device from a spec: "host", "simulated[:GBPS[:MEM_MIB]]", "cuda[:N]".
// A "cuda" spec without a usable GPU falls back to the host device and
// explains why in *note (if given).
Result<std::unique_ptr<Device>> MakeDevice(const std::string& spec, std::string* note = nullptr);

}  // namespace pmsnap::runtime
