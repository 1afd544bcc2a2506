// The C++ command line (`python -m pmsnap info/verify/...`) with its output
// captured, and device descriptions, for pmsnap.cli.
#pragma once

#include <pybind11/pybind11.h>

namespace pmsnap::python {

void RegisterCli(pybind11::module_& module);

}  // namespace pmsnap::python
