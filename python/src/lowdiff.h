// LowDiff's differential log (diff::DifferentialLog) and the Eq. 8-10 and
// merge helpers, for python/pmsnap/lowdiff.py. The log itself is opened by
// an Engine (py_engine.cc, Engine.open_differential_log), whose pool it writes;
// the engine closes it before it closes the pool.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

#include "pmsnap/pmem_layout/pool.h"

namespace pmsnap::python {

void RegisterLowDiff(pybind11::module_& module);

// [(iteration, [(dtype, shape, bytes)])] after `after`, oldest first, up to
// the first gap (diff::ReadDifferentials).
pybind11::list ReadDifferentialsOf(const layout::Pool& pool, std::uint64_t after);

}  // namespace pmsnap::python
