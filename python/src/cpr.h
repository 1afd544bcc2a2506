// Binding of diff/cpr.h (CPR's PLS ledger, Eq. 1-4 and the full/partial
// decision) for pmsnap.cpr.
#pragma once

#include <pybind11/pybind11.h>

namespace pmsnap::python {

void RegisterCpr(pybind11::module_& module);

}  // namespace pmsnap::python
