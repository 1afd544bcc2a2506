// Embedding tables from Python: RowTracker, diff::Policy and
// diff::EmbeddingOptions, and a table's retained checkpoints
// (diff::ListCheckpoints / RecoverTable) on a pool file or an open pool.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>

#include "pmsnap/pmem_layout/pool.h"

namespace pmsnap::python {

// Retained checkpoints of embedding table `table` in `pool`, oldest first
// (dicts); pmsnap errors naming the table otherwise.
pybind11::list ListCheckpointsOf(const layout::Pool& pool, const std::string& table);
// (info, [float32 arrays]): `table` and its row-shaped state at checkpoint
// `epoch` (default: the newest retained).
pybind11::tuple RecoverTableOf(const layout::Pool& pool, const std::string& table,
                               std::optional<std::uint64_t> epoch);

// Binds RowTracker, Policy, parse_policy, policy_name, EmbeddingOptions,
// list_checkpoints and recover_table (on a pool file).
void RegisterEmbedding(pybind11::module_& module);

}  // namespace pmsnap::python
