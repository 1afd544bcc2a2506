// Builds without the CUDA toolkit: the CUDA device reports that it is absent.
#include "pmsnap/runtime/cuda_device.h"

namespace pmsnap::runtime {

bool CudaSupportCompiled() { return false; }

Result<std::unique_ptr<Device>> CreateCudaDevice(int, CudaDeviceOptions) {
  return Status(StatusCode::kFailedPrecondition,
                "this pmsnap build has no CUDA support (configure with the CUDA toolkit present "
                "or -DPMSNAP_WITH_CUDA=ON)");
}

}  // namespace pmsnap::runtime
