// Tensors as the engine registers them (runtime::TensorView), shared by the
// libtorch front end's files. Internal to hooks/.
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <torch/types.h>

#include <optional>
#include <string>

#include "pmsnap/common/status.h"
#include "pmsnap/pmem_layout/manifest.h"
#include "pmsnap/runtime/engine.h"

namespace pmsnap::hooks {

// pmsnap's dtype for libtorch's `type`; nullopt for one pmsnap cannot store.
std::optional<layout::DType> DTypeOf(c10::ScalarType type);

// `tensor` as role `role` of unit `unit`: its data pointer, dtype and shape
// (the caller checked it is contiguous CPU memory). kInvalidArgument naming
// the unit and role for an unsupported dtype.
Result<runtime::TensorView> ViewOf(const std::string& unit, const std::string& role,
                                   const torch::Tensor& tensor);

}  // namespace pmsnap::hooks
