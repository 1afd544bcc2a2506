// The coordination interface (runtime::Coordinator) as a Python base class:
// pmsnap.distributed implements it with torch.distributed, so that the C++
// epoch agreement runs on the training's own process groups while the
// extension stays free of libtorch. Also binds runtime::EpochAgreement and
// runtime::PlanShards.
//
// Calls from C++ into the Python methods take the GIL (the engine's hooks run
// with it released). A Python exception in a method becomes a kIOError
// Status naming the rank and carrying the exception's text.
#pragma once

#include <pybind11/pybind11.h>

namespace pmsnap::python {

void RegisterDistributed(pybind11::module_& module);

}  // namespace pmsnap::python
