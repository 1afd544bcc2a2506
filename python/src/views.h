// Tensor views and units as Python hands them over, dtype names, and the
// unit rules both front ends share (frontend/parameter_units.h), for the
// bindings in this folder.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "pmsnap/pmem_layout/manifest.h"
#include "pmsnap/runtime/engine.h"

namespace pmsnap::python {

// The dtype named `name` (torch's names without "torch."); InvalidArgument
// naming `where` for any other (thrown as a pmsnap error).
layout::DType ParseDType(const std::string& name, const std::string& where);
std::string DTypeText(layout::DType dtype);

// (tensor role, data_ptr, dtype name, shape, on_host) as Python passes it:
// on_host (runtime::TensorView::on_host) for a CPU tensor on a CUDA engine.
using TensorArg =
    std::tuple<std::string, std::uintptr_t, std::string, std::vector<std::int64_t>, bool>;
using UnitArg = std::pair<std::string, std::vector<TensorArg>>;

// Units as Python sees them: [(unit name, [(role, data_ptr, dtype, shape, on_host)])].
std::vector<UnitArg> ToUnitArgs(const std::vector<runtime::UnitRegistration>& units);
// The engine's registrations for `units`; errors name the unit and tensor
// (thrown as pmsnap errors).
std::vector<runtime::UnitRegistration> ToRegistrations(const std::vector<UnitArg>& units,
                                                       const std::vector<std::string>& encoded);

// Binds the unit rules (parameter_units, buffer_units, companion names,
// PARAM_ROLE, BUFFERS_UNIT, DTYPES).
void RegisterUnitRules(pybind11::module_& module);

}  // namespace pmsnap::python
