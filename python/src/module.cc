// _pmsnap: the Python extension behind the `pmsnap` package.
//
// Binds the C++ runtime without libtorch: Python hands tensors over as raw
// views (data_ptr, dtype name, shape), exactly what runtime::TensorView holds,
// and keeps the tensors alive and in place while the engine is open (the
// pure-Python CheckpointedOptimizer does that). What is bound:
//
//   Engine       (py_engine.cc) runtime::Engine plus the Device, IntervalPolicy and
//                ConflictStrategy it uses, built from strings ("simulated:2:64",
//                "every", "adaptive"); hooks, flush, close, restore, stats.
//   CheckpointReader, PoolFileWriter, prune_pool (pool_files.cc)
//                a pool's retained epochs, tensor by tensor, without a model
//                (pmsnap.load_state_dict and the exporters).
//   read_pool    (pool_files.cc) a pool's manifest and commit state, without knowing the model
//                (restore uses it to create lazily-made optimizer state).
//   parameter_units, dense_unit_name, table_of_dense_unit, parameter_of_companion,
//   companion_units,
//   check_embedding_table, moves_rows_without_gradient, PARAM_ROLE, BUFFERS_UNIT,
//   buffer_units, is_buffers_unit (views.cc)
//                the unit rules the C++ hooks follow too
//                (frontend/parameter_units.h), so both front ends lay out
//                parameters, optimizer state and embedding tables alike.
//   RowTracker   (embedding.cc) touched-row bit vector for one embedding table.
//   Policy, EmbeddingOptions (embedding.cc)
//                diff::Policy / diff::EmbeddingOptions: an Engine given
//                `encoded_units` checkpoints those units (embedding tables)
//                through a diff::EmbeddingCheckpointer; mark_rows / take_marks
//                feed its RowTrackers, last_checkpoint reports what one wrote.
//   list_checkpoints, recover_table (embedding.cc)
//                diff::ListCheckpoints / RecoverTable on a pool file (or on
//                an open Engine's pool): any retained checkpoint of a table.
//   Coordinator, EpochAgreement, plan_shards (distributed.cc)
//                runtime::Coordinator as a Python base class (pmsnap.distributed
//                implements it on torch.distributed), the agreement on it and
//                the owner/replica plan of replicated units (distributed.h).
//   errors       (errors.cc) every non-OK Status becomes a pmsnap.Error subclass carrying
//                the C++ message (errors.h).
//   run_cli, describe_device, cuda_support_compiled (cli.cc); LowDiff's
//   differential log and formulas (lowdiff.cc); CPR's ledger (cpr.cc).
//
// The GIL is released around every call that may block (opening a pool,
// conflict waits, EndStep, Flush, Close, Restore) so other Python threads run.
//
// Thread-safety: as runtime::Engine: the hooks, flush, close and restore of
// one Engine belong to one Python thread; stats() may be called from any.
#include <pybind11/pybind11.h>

#include "cli.h"
#include "cpr.h"
#include "distributed.h"
#include "embedding.h"
#include "errors.h"
#include "lowdiff.h"
#include "pool_files.h"
#include "py_engine.h"
#include "views.h"

PYBIND11_MODULE(_pmsnap, m) {
  using namespace pmsnap::python;  // NOLINT: module definition only
  m.doc() = "pmsnap runtime binding (use the `pmsnap` package, not this module)";
  RegisterErrors(m);
  RegisterDistributed(m);
  RegisterLowDiff(m);
  RegisterCpr(m);
  RegisterEngine(m);
  RegisterEmbedding(m);
  RegisterPoolFiles(m);
  RegisterCli(m);
  RegisterUnitRules(m);
}
