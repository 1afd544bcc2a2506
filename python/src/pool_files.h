// Pool files without a model or an engine: CheckpointReader (a pool's
// retained epochs, tensor by tensor), PoolFileWriter (a pool written epoch by
// epoch with Pool's commit protocol), prune_pool and read_pool.
#pragma once

#include <pybind11/pybind11.h>

namespace pmsnap::python {

void RegisterPoolFiles(pybind11::module_& module);

}  // namespace pmsnap::python
