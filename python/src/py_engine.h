// runtime::Engine for Python (class Engine), with the Device,
// IntervalPolicy and ConflictStrategy it uses built from strings
// ("simulated:2:64", "every", "adaptive").
#pragma once

#include <pybind11/pybind11.h>

namespace pmsnap::python {

void RegisterEngine(pybind11::module_& module);

}  // namespace pmsnap::python
