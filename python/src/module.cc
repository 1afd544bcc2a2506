// _pmsnap: the Python extension behind the `pmsnap` package.
//
// Binds the C++ runtime without libtorch: Python hands tensors over as raw
// views (data_ptr, dtype name, shape), exactly what runtime::TensorView holds,
// and keeps the tensors alive and in place while the engine is open (the
// pure-Python CheckpointedOptimizer does that). What is bound:
//
//   Engine       runtime::Engine plus the Device, IntervalPolicy and
//                ConflictStrategy it uses, built from strings ("simulated:2:64",
//                "every", "adaptive"); hooks, flush, close, restore, stats.
//   CheckpointReader
//                a pool's retained epochs, tensor by tensor, without a model
//                (pmsnap.load_state_dict and the exporters).
//   read_pool    a pool's manifest and commit state, without knowing the model
//                (restore uses it to create lazily-made optimizer state).
//   parameter_units, dense_unit_name, table_of_dense_unit, parameter_of_companion,
//   companion_units,
//   check_embedding_table, moves_rows_without_gradient, PARAM_ROLE, BUFFERS_UNIT,
//   buffer_units, is_buffers_unit
//                the unit rules the C++ hooks follow too
//                (frontend/parameter_units.h), so both front ends lay out
//                parameters, optimizer state and embedding tables alike.
//   RowTracker   touched-row bit vector for one embedding table.
//   Policy, EmbeddingOptions
//                diff::Policy / diff::EmbeddingOptions: an Engine given
//                `encoded_units` checkpoints those units (embedding tables)
//                through a diff::EmbeddingCheckpointer; mark_rows / take_marks
//                feed its RowTrackers, last_checkpoint reports what one wrote.
//   list_checkpoints, recover_table
//                diff::ListCheckpoints / RecoverTable on a pool file (or on
//                an open Engine's pool): any retained checkpoint of a table.
//   Coordinator, EpochAgreement, plan_shards
//                runtime::Coordinator as a Python base class (pmsnap.distributed
//                implements it on torch.distributed), the agreement on it and
//                the owner/replica plan of replicated units (distributed.h).
//   errors       every non-OK Status becomes a pmsnap.Error subclass carrying
//                the C++ message (errors.h).
//
// The GIL is released around every call that may block (opening a pool,
// conflict waits, EndStep, Flush, Close, Restore) so other Python threads run.
//
// Thread-safety: as runtime::Engine: the hooks, flush, close and restore of
// one Engine belong to one Python thread; stats() may be called from any.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <sstream>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cpr.h"
#include "distributed.h"
#include "errors.h"
#include "lowdiff.h"
#include "pmsnap/conflict/strategies.h"
#include "pmsnap/diff/differential_log.h"
#include "pmsnap/diff/embedding_checkpointer.h"
#include "pmsnap/frontend/parameter_units.h"
#include "pmsnap/pmem_layout/manifest.h"
#include "pmsnap/pmem_layout/pool.h"
#include "pmsnap/runtime/coordinator.h"
#include "pmsnap/runtime/cuda_device.h"
#include "pmsnap/runtime/device.h"
#include "pmsnap/runtime/engine.h"
#include "pmsnap/runtime/interval_policy.h"
#include "pmsnap/runtime/stats.h"
#include "pmsnap/tools/cli.h"
#include "row_tracker.h"

namespace pmsnap::python {
namespace {

namespace py = pybind11;
using layout::DType;

// Torch's dtype names without the "torch." prefix.
constexpr std::pair<std::string_view, DType> kDTypes[] = {
    {"float32", DType::kFloat32},   {"float64", DType::kFloat64}, {"float16", DType::kFloat16},
    {"bfloat16", DType::kBFloat16}, {"int64", DType::kInt64},     {"int32", DType::kInt32},
    {"int16", DType::kInt16},       {"int8", DType::kInt8},       {"uint8", DType::kUInt8},
    {"bool", DType::kBool},
};

DType ParseDType(const std::string& name, const std::string& where) {
  for (const auto& [text, dtype] : kDTypes) {
    if (text == name) return dtype;
  }
  throw StatusError(Status(StatusCode::kInvalidArgument,
                           where + ": dtype '" + name +
                               "' cannot be checkpointed (float32/64/16, bfloat16, int64/32/16/8, "
                               "uint8, bool)"));
}

std::string DTypeText(DType dtype) {
  for (const auto& [text, value] : kDTypes) {
    if (value == dtype) return std::string(text);
  }
  return "unknown";
}

// (tensor role, data_ptr, dtype name, shape, on_host) as Python passes it:
// on_host (runtime::TensorView::on_host) for a CPU tensor on a CUDA engine.
using TensorArg =
    std::tuple<std::string, std::uintptr_t, std::string, std::vector<std::int64_t>, bool>;
using UnitArg = std::pair<std::string, std::vector<TensorArg>>;

runtime::TensorView ToTensorView(const TensorArg& tensor, const std::string& unit) {
  const auto& [role, ptr, dtype, shape, on_host] = tensor;
  runtime::TensorView view;
  view.name = role;
  view.data = reinterpret_cast<void*>(ptr);
  view.dtype = ParseDType(dtype, "unit '" + unit + "' tensor '" + role + "'");
  view.shape = shape;
  view.on_host = on_host;
  return view;
}

TensorArg ToTensorArg(const runtime::TensorView& view) {
  return {view.name, reinterpret_cast<std::uintptr_t>(view.data), DTypeText(view.dtype),
          view.shape, view.on_host};
}

// Units as Python sees them: [(unit name, [(role, data_ptr, dtype, shape, on_host)])].
std::vector<UnitArg> ToUnitArgs(const std::vector<runtime::UnitRegistration>& units) {
  std::vector<UnitArg> out;
  for (const runtime::UnitRegistration& unit : units) {
    std::vector<TensorArg> args;
    for (const runtime::TensorView& view : unit.tensors) args.push_back(ToTensorArg(view));
    out.emplace_back(unit.name, std::move(args));
  }
  return out;
}

// frontend::ParameterUnits for Python.
std::vector<UnitArg> ParameterUnitsOf(const std::string& name,
                                      const std::vector<TensorArg>& tensors, bool embedding_table) {
  std::vector<runtime::TensorView> views;
  views.reserve(tensors.size());
  for (const TensorArg& tensor : tensors) views.push_back(ToTensorView(tensor, name));
  return ToUnitArgs(ValueOrThrow(frontend::ParameterUnits(name, std::move(views), embedding_table)));
}

// frontend::BufferUnits for Python.
std::vector<UnitArg> BufferUnitsOf(const std::vector<TensorArg>& buffers) {
  std::vector<runtime::TensorView> views;
  views.reserve(buffers.size());
  for (const TensorArg& buffer : buffers) {
    views.push_back(ToTensorView(buffer, std::string(frontend::kBuffersUnit)));
  }
  return ToUnitArgs(ValueOrThrow(frontend::BufferUnits(std::move(views))));
}

std::vector<runtime::UnitRegistration> ToRegistrations(const std::vector<UnitArg>& units,
                                                       const std::vector<std::string>& encoded) {
  std::vector<runtime::UnitRegistration> out;
  out.reserve(units.size());
  for (const std::string& name : encoded) {
    bool found = false;
    for (const auto& unit : units) found = found || unit.first == name;
    if (!found) {
      throw StatusError(Status(StatusCode::kInvalidArgument,
                               "encoded unit '" + name + "' is not among the registered units"));
    }
  }
  for (const auto& [name, tensors] : units) {
    runtime::UnitRegistration unit;
    unit.name = name;
    for (const std::string& e : encoded) unit.encoded = unit.encoded || e == name;
    for (const TensorArg& tensor : tensors) unit.tensors.push_back(ToTensorView(tensor, name));
    // A unit of host tensors (ParameterUnits' "#host" companions) is on_host;
    // the engine refuses a unit that mixes them.
    unit.on_host = !unit.tensors.empty() && unit.tensors.front().on_host;
    out.push_back(std::move(unit));
  }
  return out;
}

std::shared_ptr<runtime::IntervalPolicy> MakePolicy(const std::string& policy, std::uint64_t every,
                                                    double checkfreq_overhead) {
  if (policy == "continuous") return std::make_shared<runtime::ContinuousPolicy>();
  if (policy == "every") {
    if (every == 0) {
      throw StatusError(Status(StatusCode::kInvalidArgument, "every must be >= 1, got 0"));
    }
    return std::make_shared<runtime::EveryKPolicy>(every);
  }
  if (policy == "checkfreq") {
    if (!(checkfreq_overhead > 0 && checkfreq_overhead < 1)) {
      throw StatusError(Status(
          StatusCode::kInvalidArgument,
          "checkfreq overhead must be in (0, 1), got " + std::to_string(checkfreq_overhead)));
    }
    return std::make_shared<runtime::CheckFreqPolicy>(checkfreq_overhead, every == 0 ? 1 : every);
  }
  throw StatusError(Status(StatusCode::kInvalidArgument,
                           "unknown mode '" + policy + "' (continuous, every or checkfreq)"));
}

std::shared_ptr<runtime::ConflictStrategy> MakeStrategy(const std::string& name,
                                                        std::uint64_t reserve_bytes) {
  conflict::ConflictOptions options;
  options.reserve_bytes = reserve_bytes;
  std::shared_ptr<runtime::ConflictStrategy> strategy = conflict::MakeStrategy(name, options);
  if (strategy == nullptr) {
    throw StatusError(Status(
        StatusCode::kInvalidArgument,
        "unknown conflict strategy '" + name + "' (\"1\", \"2\", \"3\", \"4\" or \"adaptive\")"));
  }
  return strategy;
}

py::dict StatsToDict(const runtime::Stats& stats, bool per_step) {
  py::dict d;
  d["device"] = stats.device;
  d["pm"] = stats.pm;  // "" or "simulated PM (...)"
  d["strategy"] = stats.strategy;
  d["policy"] = stats.policy;
  d["steps"] = stats.steps;
  d["epochs_started"] = stats.epochs_started;
  d["epochs_committed"] = stats.epochs_committed;
  d["epochs_abandoned"] = stats.epochs_abandoned;
  d["epochs_staged"] = stats.epochs_staged;
  d["bytes_written"] = stats.bytes_written;
  d["encoded_bytes_written"] = stats.encoded_bytes_written;
  d["conflicts"] = stats.conflicts;
  d["in_device_fallbacks"] = stats.in_device_fallbacks;
  d["blocked_seconds"] = stats.blocked_seconds;
  d["conflict_wait_seconds"] = stats.conflict_wait_seconds;
  d["boundary_wait_seconds"] = stats.boundary_wait_seconds;
  d["in_device_copy_seconds"] = stats.in_device_copy_seconds;
  d["last_epoch_seconds"] = stats.last_epoch_seconds;
  d["last_committed_iteration"] = stats.last_committed_iteration;
  d["peak_device_extra_bytes"] = stats.peak_device_extra_bytes;
  d["compute_waits_on_copies"] = stats.device_queues.compute_waits_on_copies;
  d["compute_stalls"] = stats.device_queues.compute_stalls;
  d["compute_stall_seconds"] = stats.device_queues.compute_stall_seconds;
  d["staging_peak_bytes"] = stats.device_queues.staging_peak_bytes;
  py::dict memory;
  memory["pool_mapped_bytes"] = stats.memory.pool_mapped_bytes;
  memory["pool_resident_bytes"] = stats.memory.pool_resident_bytes;
  memory["staging_bytes"] = stats.memory.staging_bytes;
  memory["staging_resident_bytes"] = stats.memory.staging_resident_bytes;
  memory["registered_bytes"] = stats.memory.registered_bytes;
  d["memory"] = memory;
  d["wall_seconds"] = stats.wall_seconds;
  d["checkpoints_per_minute"] = stats.checkpoints_per_minute();
  d["summary"] = stats.Summary();
  if (per_step) d["blocked_per_step"] = stats.blocked_per_step;
  py::list units;
  for (const runtime::UnitStats& u : stats.units) {
    py::dict unit;
    unit["name"] = u.name;
    unit["bytes"] = u.bytes;
    unit["snapshots"] = u.snapshots;
    unit["last_copy_seconds"] = u.last_copy_seconds;
    unit["last_persist_seconds"] = u.last_persist_seconds;
    unit["total_copy_seconds"] = u.total_copy_seconds;
    unit["total_persist_seconds"] = u.total_persist_seconds;
    unit["conflicts"] = u.conflicts;
    unit["conflict_wait_seconds"] = u.conflict_wait_seconds;
    py::dict choices;
    for (int s = 1; s <= 4; ++s) choices[py::int_(s)] = u.strategy_counts[s];
    unit["strategy_counts"] = choices;
    units.append(unit);
  }
  d["units"] = units;
  return d;
}

py::dict SlotToDict(const layout::SlotInfo& info) {
  py::dict d;
  d["slot"] = info.slot;
  d["state"] = std::string(layout::SlotStateName(info.state));
  d["epoch"] = info.epoch;
  d["iteration"] = info.iteration;
  d["commit_time_unix_ns"] = info.commit_time_unix_ns;
  d["extra_state_bytes"] = info.extra_state_bytes;
  d["record_valid"] = info.record_valid;
  return d;
}

// An open engine and what it was built from. The device is declared first so
// that it outlives the engine (Engine holds a non-owning pointer to it).
class PyEngine {
 public:
  PyEngine(const std::string& pool, const std::vector<UnitArg>& units, const std::string& device,
           const std::string& policy, std::uint64_t every, double checkfreq_overhead,
           const std::string& strategy, int workers, std::uint64_t part_bytes,
           std::uint64_t extra_state_capacity, std::uint64_t chunk_heap_bytes, bool verify_on_open,
           bool check_free_space, std::uint64_t reserve_bytes, bool print_summary,
           const std::vector<std::string>& encoded_units,
           const std::optional<diff::EmbeddingOptions>& embedding_options,
           const std::string& copy_start, std::shared_ptr<runtime::Coordinator> coordinator,
           std::uint64_t model_fingerprint, bool shard_replicated_state, int replicas,
           std::uintptr_t cuda_stream, const std::vector<int>& worker_cpus,
           int dram_staging_buffers) {
    runtime::EngineOptions options;
    options.pool_path = pool;
    options.pool_options.part_bytes = part_bytes;
    options.pool_options.extra_state_capacity = extra_state_capacity;
    options.pool_options.chunk_heap_bytes = chunk_heap_bytes;
    options.pool_options.check_free_space = check_free_space;
    options.verify_on_open = verify_on_open;
    options.workers = workers;
    options.worker_cpus = worker_cpus;
    options.policy = MakePolicy(policy, every, checkfreq_overhead);
    policy_ = options.policy;
    options.strategy = MakeStrategy(strategy, reserve_bytes);
    options.print_summary = print_summary;
    options.copy_start = ValueOrThrow(runtime::ParseCopyStart(copy_start));
    options.coordinator = std::move(coordinator);
    options.model_fingerprint = model_fingerprint;
    options.shard_replicated_state = shard_replicated_state;
    options.replicas = replicas;
    options.dram_staging_buffers = dram_staging_buffers;
    std::vector<runtime::UnitRegistration> registrations = ToRegistrations(units, encoded_units);
    if (!encoded_units.empty()) {
      checkpointer_ = std::make_shared<diff::EmbeddingCheckpointer>(
          embedding_options.value_or(diff::EmbeddingOptions{}));
      options.encoder = checkpointer_;
    }
    py::gil_scoped_release release;
    runtime::CudaDeviceOptions cuda;
    cuda.compute_stream = cuda_stream;
    device_ = ValueOrThrow(runtime::MakeDevice(device, &device_note_, cuda));
    options.device = device_.get();
    engine_ = ValueOrThrow(runtime::Engine::Open(std::move(options), std::move(registrations)));
  }

  void BeginStep(std::uint64_t step) {
    runtime::Engine& e = engine();
    Status status;
    {
      // Every-k and CheckFreq wait here for the epoch in flight: other Python
      // threads run meanwhile (LowDiffPlus's training thread, while its
      // replica thread waits). The coordinator's callbacks take the GIL back.
      py::gil_scoped_release release;
      status = e.BeginStep(step);
    }
    ThrowIfError(status);
  }
  void BeforeUpdate(std::uint32_t unit) {
    runtime::Engine& e = engine();
    Status status;
    {
      // A conflict may wait for a worker's copy.
      py::gil_scoped_release release;
      status = e.BeforeUpdate(unit);
    }
    ThrowIfError(status);
  }
  void AfterUpdate(std::uint32_t unit) { ThrowIfError(engine().AfterUpdate(unit)); }
  void EndStep(const py::bytes& extra_state) {
    CallWithBytes(extra_state, [](runtime::Engine& e, std::span<const std::byte> bytes) {
      return e.EndStep(bytes);
    });
  }
  void CheckpointLastStep(const py::bytes& extra_state) {
    CallWithBytes(extra_state, [](runtime::Engine& e, std::span<const std::byte> bytes) {
      return e.CheckpointLastStep(bytes);
    });
  }
  // Calls `call` on the engine with `bytes`' contents, without the GIL
  // (`bytes` keeps them alive; the engine copies them).
  template <typename Call>
  void CallWithBytes(const py::bytes& bytes, Call call) {
    runtime::Engine& e = engine();
    char* data = nullptr;
    Py_ssize_t size = 0;
    if (PyBytes_AsStringAndSize(bytes.ptr(), &data, &size) != 0) {
      throw py::error_already_set();
    }
    Status status;
    {
      py::gil_scoped_release release;
      status = call(e, std::span<const std::byte>(reinterpret_cast<const std::byte*>(data),
                                                  static_cast<std::size_t>(size)));
    }
    ThrowIfError(status);
  }
  void Flush() {
    runtime::Engine& e = engine();
    Status status;
    {
      py::gil_scoped_release release;
      status = e.Flush();
    }
    ThrowIfError(status);
  }
  // Closes and destroys the engine; later calls raise FailedPreconditionError
  // (stats() keeps answering with the stats taken at Close).
  void Close(bool abandon) {
    if (engine_ == nullptr) return;
    Status status;
    {
      py::gil_scoped_release release;
      // The differential log writes the pool's chunk heap: it goes first.
      if (differential_log_ != nullptr) {
        if (abandon) {
          differential_log_->Abandon();
        } else {
          Status closed = differential_log_->Close();
          if (!closed.ok() && closed.code() != StatusCode::kFailedPrecondition) status = closed;
        }
        differential_log_.reset();
      }
      Status engine_status =
          engine_->Close(abandon ? runtime::CloseMode::kAbandon : runtime::CloseMode::kFinish);
      if (status.ok()) status = engine_status;
      // Destroying the engine releases the pool file (a restore followed by
      // training reopens it); its last stats stay readable.
      final_stats_ = engine_->stats();
      engine_.reset();
    }
    ThrowIfError(status);
  }
  py::tuple Restore() {
    runtime::Engine& e = engine();
    std::optional<Result<runtime::RestoreResult>> result;
    {
      py::gil_scoped_release release;
      result.emplace(e.Restore());
    }
    runtime::RestoreResult value = ValueOrThrow(std::move(*result));
    restored_extra_state_is_own_ = value.extra_state_is_own;
    return py::make_tuple(value.iteration, value.epoch,
                          py::bytes(reinterpret_cast<const char*>(value.extra_state.data()),
                                    value.extra_state.size()));
  }
  // RestoreResult::extra_state_is_own of the last restore (true before one).
  bool restored_extra_state_is_own() const { return restored_extra_state_is_own_; }
  std::optional<std::uint32_t> FindUnit(const std::string& name) const {
    return engine().FindUnit(name);
  }

  // --- embedding tables (encoded units) ---
  diff::RowTracker& Tracker(const std::string& table) {
    engine();  // closed engines refuse
    diff::RowTracker* tracker = checkpointer_ ? checkpointer_->tracker(table) : nullptr;
    if (tracker == nullptr) {
      throw StatusError(
          Status(StatusCode::kNotFound, "no embedding table '" + table + "' in pool " +
                                            engine().pool().path() +
                                            " (tables are the units registered as encoded)"));
    }
    return *tracker;
  }
  // Marks `count` row ids (int64/int32 at `ptr`) in `table`'s tracker.
  void MarkRows(const std::string& table, std::uintptr_t ptr, std::size_t count,
                const std::string& dtype) {
    diff::RowTracker& tracker = Tracker(table);
    if (count == 0) return;
    if (ptr == 0) {
      throw StatusError(Status(StatusCode::kInvalidArgument, "row ids have no data pointer"));
    }
    Status status;
    if (dtype == "int64") {
      py::gil_scoped_release release;
      status = tracker.Mark(
          std::span<const std::int64_t>(reinterpret_cast<const std::int64_t*>(ptr), count));
    } else if (dtype == "int32") {
      const auto* ids = reinterpret_cast<const std::int32_t*>(ptr);
      std::vector<std::int64_t> wide(ids, ids + count);
      py::gil_scoped_release release;
      status = tracker.Mark(wide);
    } else {
      status = Status(StatusCode::kInvalidArgument, "row ids must be int64 or int32, got " + dtype);
    }
    ThrowIfError(status);
  }
  // Moves the rows `source` (a Python EmbeddingTracker's bit vector) holds
  // into `table`'s tracker and clears `source`.
  void TakeMarks(const std::string& table, RowTracker& source) {
    diff::RowTracker& tracker = Tracker(table);
    if (source.rows() != tracker.rows()) {
      throw StatusError(Status(StatusCode::kInvalidArgument,
                               "embedding table '" + table + "' has " +
                                   std::to_string(tracker.rows()) + " rows, its tracker " +
                                   std::to_string(source.rows())));
    }
    Status status;
    {
      py::gil_scoped_release release;
      status = tracker.Mark(source.Touched());
    }
    ThrowIfError(status);
    source.Clear();
  }
  void MarkAllRows(const std::string& table) { Tracker(table).MarkAll(); }
  std::vector<std::int64_t> MarkedRows(const std::string& table) {
    std::vector<std::int64_t> out;
    for (std::uint64_t row : Tracker(table).marked().SetIndices()) {
      out.push_back(static_cast<std::int64_t>(row));
    }
    return out;
  }
  py::dict LastCheckpoint(const std::string& table) {
    Tracker(table);  // unknown tables raise
    const diff::TableCheckpointStats s = checkpointer_->last_checkpoint(table);
    py::dict d;
    d["epoch"] = s.epoch;
    d["rows_written"] = s.rows_written;
    d["bytes_written"] = s.bytes_written;
    d["full"] = s.full;
    d["construction_seconds"] = s.construction_seconds;
    d["extractions"] = s.extractions;
    d["live_chunks"] = s.live_chunks;
    d["select_seconds"] = s.select_seconds;
    d["access_record_bytes"] = s.access_record_bytes;
    return d;
  }
  std::vector<std::string> Tables() const {
    std::vector<std::string> out;
    if (!checkpointer_ || engine_ == nullptr) return out;
    const layout::Manifest& manifest = engine_->pool().manifest();
    for (const layout::UnitSpec& unit : manifest.units) {
      if (unit.flags & layout::kUnitFlagEncoded) out.push_back(unit.name);
    }
    return out;
  }
  const layout::Pool& pool() const { return engine().pool(); }
  // LowDiff (lowdiff.cc): a differential log on this engine's pool, closed
  // by Close before the pool.
  std::shared_ptr<diff::DifferentialLog> OpenDifferentialLog(
      std::uint32_t batch, std::optional<std::uint64_t> resume_after) {
    runtime::Engine& e = engine();
    if (differential_log_ != nullptr) {
      throw StatusError(Status(StatusCode::kFailedPrecondition,
                               "pool " + e.pool().path() + " already has a differential log open"));
    }
    diff::DifferentialLogOptions options;
    options.batch = batch;
    options.resume_after = resume_after;
    std::optional<Result<std::unique_ptr<diff::DifferentialLog>>> result;
    {
      py::gil_scoped_release release;
      result.emplace(diff::DifferentialLog::Open(e.pool(), options));
    }
    differential_log_ = ValueOrThrow(std::move(*result));
    return differential_log_;
  }
  // Changes the interval of an "every" policy (LowDiff's full checkpoints
  // every round(1/f*) steps, re-tuned as measurements move), counting from
  // step `anchor` (runtime::EveryKPolicy::set_every).
  void SetEvery(std::uint64_t every, std::uint64_t anchor) {
    auto* policy = dynamic_cast<runtime::EveryKPolicy*>(policy_.get());
    if (policy == nullptr || every == 0) {
      throw StatusError(Status(StatusCode::kInvalidArgument,
                               "set_every needs policy \"every\" and every >= 1 (pool " +
                                   engine().pool().path() + ")"));
    }
    policy->set_every(every, anchor);
  }
  py::dict Stats(bool per_step) const {
    if (engine_ == nullptr && final_stats_.has_value()) return StatsToDict(*final_stats_, per_step);
    return StatsToDict(engine().stats(), per_step);
  }
  bool closed() const { return engine_ == nullptr; }
  std::uint32_t unit_count() const { return engine().unit_count(); }
  std::string device_name() const { return engine().device().name(); }
  const std::string& device_note() const { return device_note_; }
  std::string strategy_name() const { return engine().strategy().name(); }
  std::string policy_name() const { return engine().policy().name(); }
  std::string pool_path() const { return engine().pool().path(); }
  std::uint64_t pool_file_bytes() const { return engine().pool().file_bytes(); }
  bool captures_this_step() const { return engine().CapturesThisStep(); }
  bool epoch_in_flight() const { return engine().EpochInFlight(); }

 private:
  runtime::Engine& engine() const {
    if (engine_ == nullptr) {
      throw StatusError(Status(StatusCode::kFailedPrecondition, "pmsnap engine is closed"));
    }
    return *engine_;
  }

  std::string device_note_;
  std::optional<runtime::Stats> final_stats_;  // taken at Close
  bool restored_extra_state_is_own_ = true;
  std::unique_ptr<runtime::Device> device_;
  std::shared_ptr<diff::EmbeddingCheckpointer> checkpointer_;  // also held by the engine
  std::shared_ptr<runtime::IntervalPolicy> policy_;             // also held by the engine
  std::unique_ptr<runtime::Engine> engine_;
  std::shared_ptr<diff::DifferentialLog> differential_log_;  // closed before engine_
};

// "full", "one-shot", "incremental", "intermittent", "incrcp" (and
// diff::PolicyName's spellings) -> Policy.
diff::Policy ParsePolicy(const std::string& name) {
  static constexpr std::pair<std::string_view, diff::Policy> kNames[] = {
      {"full", diff::Policy::kFull},
      {"one-shot", diff::Policy::kOneShotDifferential},
      {"oneshot", diff::Policy::kOneShotDifferential},
      {"one-shot-differential", diff::Policy::kOneShotDifferential},
      {"differential", diff::Policy::kOneShotDifferential},
      {"incremental", diff::Policy::kConsecutiveIncremental},
      {"consecutive", diff::Policy::kConsecutiveIncremental},
      {"consecutive-incremental", diff::Policy::kConsecutiveIncremental},
      {"intermittent", diff::Policy::kIntermittentDifferential},
      {"intermittent-differential", diff::Policy::kIntermittentDifferential},
      {"check-n-run", diff::Policy::kIntermittentDifferential},
      {"incrcp", diff::Policy::kIncrCP},
      {"incrcp-2d", diff::Policy::kIncrCP},
      {"mfu", diff::Policy::kMostFrequentlyUsed},
      {"cpr-mfu", diff::Policy::kMostFrequentlyUsed},
      {"ssu", diff::Policy::kSubSampledUsed},
      {"cpr-ssu", diff::Policy::kSubSampledUsed},
  };
  for (const auto& [text, policy] : kNames) {
    if (text == name) return policy;
  }
  throw StatusError(Status(StatusCode::kInvalidArgument,
                           "unknown embedding policy '" + name +
                               "' (full, one-shot, incremental, intermittent, incrcp, mfu or ssu)"));
}

py::dict CheckpointInfoToDict(const diff::CheckpointInfo& info) {
  py::dict d;
  d["epoch"] = info.epoch;
  d["iteration"] = info.iteration;
  d["chunks"] = info.chunks;
  d["chunk_bytes"] = info.chunk_bytes;
  d["policy"] = std::string(diff::PolicyName(info.policy));
  return d;
}

// (info dict, [float32 array of rows x elems_per_row per tensor]).
py::tuple RecoveredToPython(diff::RecoveredTable table) {
  py::dict info;
  info["epoch"] = table.epoch;
  info["iteration"] = table.iteration;
  info["rows"] = table.rows;
  py::list arrays;
  for (std::size_t t = 0; t < table.tensors.size(); ++t) {
    const auto rows = static_cast<py::ssize_t>(table.rows);
    const auto elems = static_cast<py::ssize_t>(table.elems_per_row[t]);
    py::array_t<float> array({rows, elems});
    std::copy(table.tensors[t].begin(), table.tensors[t].end(), array.mutable_data());
    arrays.append(array);
  }
  return py::make_tuple(info, arrays);
}

std::unique_ptr<layout::Pool> OpenForReading(const std::string& path) {
  py::gil_scoped_release release;
  layout::OpenOptions options;
  options.verify_data = false;  // chunks are verified as they are read
  options.read_only = true;
  return ValueOrThrow(layout::Pool::Open(path, options));
}

py::list ListCheckpointsOf(const layout::Pool& pool, const std::string& table) {
  std::optional<Result<std::vector<diff::CheckpointInfo>>> result;
  {
    py::gil_scoped_release release;
    result.emplace(diff::ListCheckpoints(pool, table));
  }
  py::list out;
  for (const diff::CheckpointInfo& info : ValueOrThrow(std::move(*result))) {
    out.append(CheckpointInfoToDict(info));
  }
  return out;
}

py::tuple RecoverTableOf(const layout::Pool& pool, const std::string& table,
                         std::optional<std::uint64_t> epoch) {
  std::optional<Result<diff::RecoveredTable>> result;
  {
    py::gil_scoped_release release;
    result.emplace(diff::RecoverTable(pool, table, epoch));
  }
  return RecoveredToPython(ValueOrThrow(std::move(*result)));
}


// A pool opened to read its checkpoints without a model (pmsnap.load_state_dict,
// the exporters and the `pmsnap list/export/diff` commands). Nothing is
// verified or read at open (no data verification, no prefault of the
// mapping): a tensor's bytes are read, and their checksums checked, only
// when that tensor is asked for, so reading one tensor of a large pool reads
// only that tensor. After each read the pages of the pool mapping it went
// through are dropped from this process's page table (the file keeps them),
// so that reading a whole pool tensor by tensor keeps the resident set
// bounded by the largest tensor instead of growing to the pool's size.
//
// Epochs: a retained epoch is one whose slot is COMPLETE with a commit record
// that verifies (two at most, the pool's two slots). Errors name the pool and
// the epoch. Writes nothing of pmsnap's own to the file (libpmemobj's open
// updates its run id in its pool descriptor).
//
// Thread-safety: one Python thread at a time (the GIL is released around
// reads, which the object does not share).
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& path) {
    py::gil_scoped_release release;
    layout::OpenOptions options;
    options.verify_data = false;
    options.read_only = true;
    pool_ = ValueOrThrow(layout::Pool::Open(path, options));
  }

  py::dict Describe() const {
    const layout::Pool& pool = this->pool();
    py::dict d;
    d["path"] = pool.path();
    d["file_bytes"] = pool.file_bytes();
    d["part_bytes"] = pool.options().part_bytes;
    d["created_unix_ns"] = pool.created_unix_ns();
    py::dict group;
    group["run_id"] = pool.group().run_id;
    group["rank"] = pool.group().rank;
    group["world_size"] = pool.group().world_size;
    group["model_fingerprint"] = pool.group().model_fingerprint;
    d["group"] = group;
    py::list units;
    for (std::size_t u = 0; u < pool.manifest().units.size(); ++u) {
      const layout::UnitSpec& unit = pool.manifest().units[u];
      py::list tensors;
      for (const layout::TensorSpec& t : unit.tensors) {
        tensors.append(py::make_tuple(t.name, DTypeText(t.dtype), t.shape, t.bytes()));
      }
      units.append(py::make_tuple(unit.name, (unit.flags & layout::kUnitFlagEncoded) != 0,
                                  tensors));
    }
    d["units"] = units;
    d["slots"] = py::make_tuple(SlotToDict(pool.slot_info(0)), SlotToDict(pool.slot_info(1)));
    d["warnings"] = pool.warnings();
    return d;
  }

  // Retained epochs, newest first: [{epoch, iteration, commit_time_unix_ns,
  // slot, extra_state_bytes}].
  py::list Epochs() const {
    pool();  // closed readers refuse
    std::vector<layout::SnapshotView> views;
    for (int s = 0; s < 2; ++s) {
      Result<layout::SnapshotView> view = pool_->Slot(s);
      if (view.ok()) views.push_back(*view);
    }
    std::sort(views.begin(), views.end(),
              [](const auto& a, const auto& b) { return a.epoch() > b.epoch(); });
    py::list out;
    for (const layout::SnapshotView& v : views) {
      py::dict d;
      d["epoch"] = v.epoch();
      d["iteration"] = v.iteration();
      d["commit_time_unix_ns"] = v.commit_time_unix_ns();
      d["slot"] = v.slot();
      d["extra_state_bytes"] = v.extra_state().size();
      out.append(d);
    }
    return out;
  }

  // Every checksum of the pool (layout::Pool::Verify, deep): {epoch:
  // [problems]} for the committed slots, the chunk heap's under -1. Then
  // BusyError if a process opened the pool while it was read.
  py::dict Verify() const {
    const layout::Pool& pool = this->pool();
    layout::VerifyReport report;
    {
      py::gil_scoped_release release;
      report = pool.Verify(/*deep=*/true);
    }
    ThrowIfError(pool.CheckUndisturbed());
    py::dict out;
    for (const auto& slot : report.slots) {
      if (slot.info.state == layout::SlotState::kComplete) out[py::int_(slot.info.epoch)] = slot.problems;
    }
    out[py::int_(-1)] = report.chunk_problems;
    return out;
  }

  py::bytes ExtraState(std::uint64_t epoch) const {
    const layout::SnapshotView view = ViewOf(epoch);
    return py::bytes(reinterpret_cast<const char*>(view.extra_state().data()),
                     view.extra_state().size());
  }

  // Copies tensor `tensor` of unit `unit` at `epoch` to `dst` (tensor bytes),
  // checking every part's checksum; kCorruption naming pool, epoch, unit,
  // tensor and byte range otherwise.
  void ReadTensor(std::uint64_t epoch, std::uint32_t unit, std::uint32_t tensor,
                  std::uintptr_t dst) const {
    const layout::SnapshotView view = ViewOf(epoch);
    const layout::TensorLayout& t = TensorOf(unit, tensor);
    Status status;
    {
      py::gil_scoped_release release;
      auto* out = reinterpret_cast<std::byte*>(dst);
      for (std::uint32_t p = t.first_part; p < t.first_part + t.part_count && status.ok(); ++p) {
        status = pool_->ReadPart(view, p, out + pool_->layout().parts[p].offset_in_tensor);
      }
      ReleasePages(view.slot(), t);
    }
    ThrowIfError(Annotate(status, epoch));
  }

  // Checks the checksums of a tensor's parts without copying them (before a
  // zero-copy view of it is handed out).
  void VerifyTensor(std::uint64_t epoch, std::uint32_t unit, std::uint32_t tensor) const {
    const layout::SnapshotView view = ViewOf(epoch);
    const layout::TensorLayout& t = TensorOf(unit, tensor);
    Status status;
    {
      py::gil_scoped_release release;
      for (std::uint32_t p = t.first_part; p < t.first_part + t.part_count && status.ok(); ++p) {
        status = pool_->VerifyPart(view, p);
      }
      ReleasePages(view.slot(), t);
    }
    ThrowIfError(Annotate(status, epoch));
  }

  // Offset of a tensor's bytes at `epoch` in the pool file (a single-file
  // pool's offsets are file offsets), to map it read-only.
  std::uint64_t TensorFileOffset(std::uint64_t epoch, std::uint32_t unit,
                                 std::uint32_t tensor) const {
    const layout::SnapshotView view = ViewOf(epoch);
    return pool_->regions().slot_data[view.slot()].offset + TensorOf(unit, tensor).slot_offset;
  }

  const layout::Pool& pool() const {
    if (pool_ == nullptr) {
      throw StatusError(Status(StatusCode::kFailedPrecondition, "checkpoint reader is closed"));
    }
    return *pool_;
  }
  // Releases the pool (its lock and mapping) now rather than when Python
  // collects the reader; later calls raise FailedPreconditionError.
  void Close() {
    py::gil_scoped_release release;
    pool_.reset();
  }

 private:
  layout::SnapshotView ViewOf(std::uint64_t epoch) const {
    pool();  // closed readers refuse
    Result<layout::SnapshotView> view = pool_->Slot(static_cast<int>(epoch % 2));
    if (view.ok() && view->epoch() == epoch) return *view;
    std::string retained;
    for (int s = 0; s < 2; ++s) {
      Result<layout::SnapshotView> other = pool_->Slot(s);
      if (!other.ok()) continue;
      retained += (retained.empty() ? "" : ", ") + std::to_string(other->epoch()) +
                  " (iteration " + std::to_string(other->iteration()) + ")";
    }
    throw StatusError(Status(StatusCode::kNotFound,
                             "pool " + pool_->path() + ": epoch " + std::to_string(epoch) +
                                 " is not retained (retained epochs: " +
                                 (retained.empty() ? std::string("none") : retained) + ")"));
  }

  const layout::TensorLayout& TensorOf(std::uint32_t unit, std::uint32_t tensor) const {
    const layout::SlotLayout& layout = pool_->layout();
    const layout::Manifest& manifest = pool_->manifest();
    if (unit >= manifest.units.size() || tensor >= layout.units[unit].tensors.size() ||
        (manifest.units[unit].flags & layout::kUnitFlagEncoded)) {
      throw StatusError(Status(StatusCode::kInvalidArgument,
                               "pool " + pool_->path() + ": no slot tensor " +
                                   std::to_string(tensor) + " in unit " + std::to_string(unit)));
    }
    return layout.units[unit].tensors[tensor];
  }

  // Adds pool and epoch to a message that does not name them already.
  Status Annotate(const Status& status, std::uint64_t epoch) const {
    if (status.ok() || status.message().find(pool_->path()) != std::string_view::npos) {
      return status;
    }
    return Status(status.code(), "pool " + pool_->path() + " epoch " + std::to_string(epoch) +
                                     ": " + std::string(status.message()));
  }

  // Drops the whole pages of a tensor's bytes from this process's page table;
  // the data stays in the file (MAP_SHARED), a later read faults it back in.
  void ReleasePages(int slot, const layout::TensorLayout& t) const {
    const std::span<std::byte> mapping = pool_->slot_mapping(slot);
    const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
    const auto begin = reinterpret_cast<std::uintptr_t>(mapping.data() + t.slot_offset);
    const std::uintptr_t first = (begin + page - 1) / page * page;
    const std::uintptr_t last = (begin + t.bytes) / page * page;
    if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
  }

  std::unique_ptr<layout::Pool> pool_;
};


// A pool written epoch by epoch without the engine (pmsnap.dcp.PoolWriter, a
// DCP StorageWriter): Pool's own writer protocol, BeginEpoch -> WriteTensor
// for every tensor -> Commit(extra state), so a crash anywhere leaves the
// pool at its previous commit. Creates the pool for `units` [(name,
// [(role, dtype, shape)])] or opens an existing one made for exactly those
// (kModelMismatch naming the first difference otherwise).
//
// Thread-safety: one Python thread at a time.
class PoolFileWriter {
 public:
  PoolFileWriter(const std::string& path,
                 const std::vector<std::pair<std::string, std::vector<std::tuple<
                     std::string, std::string, std::vector<std::int64_t>>>>>& units,
                 std::uint64_t extra_state_capacity, std::uint64_t part_bytes) {
    layout::Manifest manifest;
    for (const auto& [name, tensors] : units) {
      layout::UnitSpec unit;
      unit.name = name;
      for (const auto& [role, dtype, shape] : tensors) {
        unit.tensors.push_back({role, ParseDType(dtype, "unit '" + name + "'"), shape});
      }
      manifest.units.push_back(std::move(unit));
    }
    py::gil_scoped_release release;
    if (access(path.c_str(), F_OK) == 0) {
      layout::OpenOptions options;
      options.prefault_mapping = false;
      pool_ = ValueOrThrow(layout::Pool::Open(path, manifest, options));
    } else {
      layout::PoolOptions options;
      options.extra_state_capacity = extra_state_capacity;
      options.part_bytes = part_bytes;
      options.prefault_mapping = false;
      pool_ = ValueOrThrow(layout::Pool::Create(path, manifest, options));
    }
  }

  // Iteration of the newest committed epoch, or None.
  std::optional<std::uint64_t> LatestIteration() const {
    Result<layout::SnapshotView> latest = pool().Latest();
    if (!latest.ok()) return std::nullopt;
    return latest->iteration();
  }
  std::uint64_t Begin(std::uint64_t iteration) { return ValueOrThrow(pool().BeginEpoch(iteration)); }
  void WriteTensor(std::uint32_t unit, std::uint32_t tensor, std::uintptr_t src) {
    Status status;
    {
      py::gil_scoped_release release;
      status = pool().WriteTensor(unit, tensor, reinterpret_cast<const void*>(src));
    }
    ThrowIfError(status);
  }
  void Commit(const py::bytes& extra_state) {
    const std::string data = extra_state;
    Status status;
    {
      py::gil_scoped_release release;
      status = pool().Commit(std::span<const std::byte>(
          reinterpret_cast<const std::byte*>(data.data()), data.size()));
    }
    ThrowIfError(status);
  }
  void Abandon() { pool().Abandon(); }
  void Close() {
    py::gil_scoped_release release;
    pool_.reset();
  }

 private:
  layout::Pool& pool() const {
    if (pool_ == nullptr) {
      throw StatusError(Status(StatusCode::kFailedPrecondition, "pool writer is closed"));
    }
    return *pool_;
  }
  std::unique_ptr<layout::Pool> pool_;
};

// `pmsnap prune POOL --keep N`: keeps the newest `keep` (>= 1) retained
// epochs; with the pool's two slots only keep 1 drops anything (the older
// epoch, Pool::DiscardOlderEpoch). The pool is opened with full data
// verification, so a damaged newest slot is never what is kept.
py::dict PrunePool(const std::string& path, std::uint64_t keep) {
  if (keep < 1) {
    throw StatusError(Status(StatusCode::kInvalidArgument,
                             "pool " + path + ": prune must keep at least 1 epoch"));
  }
  std::unique_ptr<layout::Pool> pool;
  std::optional<std::uint64_t> dropped;
  {
    py::gil_scoped_release release;
    layout::OpenOptions options;
    options.prefault_mapping = false;
    pool = ValueOrThrow(layout::Pool::Open(path, options));
    if (keep < 2) dropped = ValueOrThrow(pool->DiscardOlderEpoch());
  }
  py::list kept;
  for (int s = 0; s < 2; ++s) {
    Result<layout::SnapshotView> view = pool->Slot(s);
    if (view.ok()) kept.append(view->epoch());
  }
  kept.attr("sort")(py::arg("reverse") = true);
  py::dict d;
  d["pool"] = path;
  d["kept"] = kept;
  d["dropped"] = dropped ? py::list(py::make_tuple(*dropped)) : py::list();
  d["warnings"] = pool->warnings();
  return d;
}

// Manifest and commit state of an existing pool, for code that does not know
// the model yet (restore creates lazily-made optimizer state from it).
py::dict ReadPool(const std::string& path, bool verify_data) {
  std::unique_ptr<layout::Pool> pool;
  {
    py::gil_scoped_release release;
    layout::OpenOptions options;
    options.verify_data = verify_data;
    options.read_only = true;
    pool = ValueOrThrow(layout::Pool::Open(path, options));
  }
  py::dict d;
  d["path"] = pool->path();
  d["format_version"] = pool->format_version();
  d["file_bytes"] = pool->file_bytes();
  d["part_bytes"] = pool->options().part_bytes;
  d["extra_state_capacity"] = pool->options().extra_state_capacity;
  d["chunk_heap_bytes"] = pool->options().chunk_heap_bytes;
  py::list units;
  for (const layout::UnitSpec& unit : pool->manifest().units) {
    py::list tensors;
    for (const layout::TensorSpec& t : unit.tensors) {
      tensors.append(py::make_tuple(t.name, DTypeText(t.dtype), t.shape));
    }
    units.append(py::make_tuple(unit.name, tensors));
  }
  d["units"] = units;
  py::list encoded;
  for (const layout::UnitSpec& unit : pool->manifest().units) {
    if (unit.flags & layout::kUnitFlagEncoded) encoded.append(unit.name);
  }
  d["encoded_units"] = encoded;
  d["slots"] = py::make_tuple(SlotToDict(pool->slot_info(0)), SlotToDict(pool->slot_info(1)));
  Result<layout::SnapshotView> latest = pool->Latest();
  if (latest.ok()) {
    py::dict l;
    l["epoch"] = latest->epoch();
    l["iteration"] = latest->iteration();
    l["slot"] = latest->slot();
    d["latest"] = l;
  } else {
    d["latest"] = py::none();
  }
  d["warnings"] = pool->warnings();
  return d;
}

// `python -m pmsnap ...`: the C++ command line, output captured.
py::tuple RunCli(const std::vector<std::string>& args) {
  std::ostringstream out;
  std::ostringstream err;
  int code = 0;
  {
    py::gil_scoped_release release;
    code = tools::RunCli(args, out, err);
  }
  return py::make_tuple(code, out.str(), err.str());
}

py::tuple DescribeDevice(const std::string& spec) {
  std::string note;
  std::unique_ptr<runtime::Device> device = ValueOrThrow(runtime::MakeDevice(spec, &note));
  return py::make_tuple(device->name(), note);
}

void MarkRows(RowTracker& tracker, std::uintptr_t ptr, std::size_t count,
              const std::string& dtype) {
  if (count == 0) return;
  if (ptr == 0) {
    throw StatusError(Status(StatusCode::kInvalidArgument, "row ids have no data pointer"));
  }
  if (dtype != "int64" && dtype != "int32") {
    throw StatusError(
        Status(StatusCode::kInvalidArgument, "row ids must be int64 or int32, got " + dtype));
  }
  py::gil_scoped_release release;
  if (dtype == "int64") {
    tracker.Mark(reinterpret_cast<const std::int64_t*>(ptr), count);
  } else {
    tracker.Mark(reinterpret_cast<const std::int32_t*>(ptr), count);
  }
}

// Writes the touched ids into an int64 buffer of `capacity` elements;
// returns how many were written.
std::size_t TouchedInto(const RowTracker& tracker, std::uintptr_t ptr, std::size_t capacity) {
  const std::vector<std::int64_t> ids = tracker.Touched();
  if (ids.size() > capacity) {
    throw StatusError(
        Status(StatusCode::kInvalidArgument, "buffer holds " + std::to_string(capacity) + " ids, " +
                                                 std::to_string(ids.size()) + " rows are touched"));
  }
  auto* out = reinterpret_cast<std::int64_t*>(ptr);
  for (std::size_t i = 0; i < ids.size(); ++i) out[i] = ids[i];
  return ids.size();
}

}  // namespace
}  // namespace pmsnap::python

PYBIND11_MODULE(_pmsnap, m) {
  namespace py = pybind11;
  using namespace pmsnap::python;  // NOLINT: module definition only
  m.doc() = "pmsnap runtime binding (use the `pmsnap` package, not this module)";
  RegisterErrors(m);
  RegisterDistributed(m);
  RegisterLowDiff(m);
  RegisterCpr(m);

  py::class_<PyEngine>(m, "Engine")
      .def(py::init<const std::string&, const std::vector<UnitArg>&, const std::string&,
                    const std::string&, std::uint64_t, double, const std::string&, int,
                    std::uint64_t, std::uint64_t, std::uint64_t, bool, bool, std::uint64_t, bool,
                    const std::vector<std::string>&,
                    const std::optional<pmsnap::diff::EmbeddingOptions>&, const std::string&,
                    std::shared_ptr<pmsnap::runtime::Coordinator>, std::uint64_t, bool, int,
                    std::uintptr_t, const std::vector<int>&, int>(),
           py::arg("pool"), py::arg("units"), py::kw_only(), py::arg("device") = "host",
           py::arg("policy") = "continuous", py::arg("every") = 1,
           py::arg("checkfreq_overhead") = 0.035, py::arg("strategy") = "adaptive",
           py::arg("workers") = 2, py::arg("part_bytes") = std::uint64_t{4} << 20,
           py::arg("extra_state_capacity") = std::uint64_t{256} << 10,
           py::arg("chunk_heap_bytes") = 0, py::arg("verify_on_open") = true,
           py::arg("check_free_space") = true, py::arg("reserve_bytes") = 0,
           py::arg("print_summary") = false, py::arg("encoded_units") = std::vector<std::string>{},
           py::arg("embedding_options") = std::nullopt, py::arg("copy_start") = "auto",
           py::arg("coordinator") = nullptr, py::arg("model_fingerprint") = 0,
           py::arg("shard_replicated_state") = false, py::arg("replicas") = 1,
           py::arg("cuda_stream") = 0,
           py::arg("worker_cpus") = std::vector<int>{}, py::arg("dram_staging_buffers") = 0,
           // The Python coordinator's methods must outlive the engine's calls.
           py::keep_alive<1, 20>(),
           "Opens (or creates) the pool for `units`: "
           "[(name, [(role, data_ptr, dtype, shape, on_host)])] (on_host: a CPU tensor while "
           "`device` is cuda; a unit's tensors are all on the host or none); "
           "`encoded_units` (embedding tables) go through a diff::EmbeddingCheckpointer. "
           "`cuda_stream`: the stream the optimizer's kernels run on, "
           "torch.cuda.current_stream().cuda_stream (0: the legacy default stream); copies "
           "are ordered after its updates by events.")
      .def("begin_step", &PyEngine::BeginStep, py::arg("step"))
      .def("before_update", &PyEngine::BeforeUpdate, py::arg("unit"))
      .def("after_update", &PyEngine::AfterUpdate, py::arg("unit"))
      .def("end_step", &PyEngine::EndStep, py::arg("extra_state") = py::bytes())
      .def("flush", &PyEngine::Flush)
      .def("checkpoint_last_step", &PyEngine::CheckpointLastStep, py::arg("extra_state"),
           "Between steps: checkpoints the last step if no epoch captured it "
           "(runtime::Engine::CheckpointLastStep) and waits for its commit.")
      .def("close", &PyEngine::Close, py::arg("abandon") = false)
      .def("restore", &PyEngine::Restore, "-> (iteration, epoch, extra_state bytes)")
      .def_property_readonly("restored_extra_state_is_own",
                             &PyEngine::restored_extra_state_is_own,
                             "False after a restore whose extra state came from another rank "
                             "(this rank's pool was lost; runtime::RestoreResult)")
      .def("find_unit", &PyEngine::FindUnit, py::arg("name"))
      .def("mark_rows", &PyEngine::MarkRows, py::arg("table"), py::arg("ptr"), py::arg("count"),
           py::arg("dtype"), "Marks row ids (int64/int32 at `ptr`) as changed in `table`.")
      .def("take_marks", &PyEngine::TakeMarks, py::arg("table"), py::arg("tracker"),
           "Marks the rows a RowTracker holds in `table` and clears the RowTracker.")
      .def("mark_all_rows", &PyEngine::MarkAllRows, py::arg("table"))
      .def("marked_rows", &PyEngine::MarkedRows, py::arg("table"),
           "Rows of `table` marked since its last checkpoint (sorted).")
      .def("last_checkpoint", &PyEngine::LastCheckpoint, py::arg("table"),
           "What `table`'s last committed checkpoint wrote (dict).")
      .def(
          "list_checkpoints",
          [](const PyEngine& e, const std::string& table) {
            return ListCheckpointsOf(e.pool(), table);
          },
          py::arg("table"))
      .def(
          "recover_table",
          [](const PyEngine& e, const std::string& table, std::optional<std::uint64_t> epoch) {
            return RecoverTableOf(e.pool(), table, epoch);
          },
          py::arg("table"), py::arg("epoch") = std::nullopt)
      .def("open_differential_log", &PyEngine::OpenDifferentialLog, py::arg("batch") = 1,
           py::arg("resume_after") = std::nullopt,
           "LowDiff: a DifferentialLog on this pool's chunk heap (closed with the engine).")
      .def(
          "read_differentials",
          [](const PyEngine& e, std::uint64_t after) { return ReadDifferentialsOf(e.pool(), after); },
          py::arg("after"), "[(iteration, [(dtype, shape, bytes)])] after `after`, up to a gap.")
      .def("set_every", &PyEngine::SetEvery, py::arg("every"), py::arg("anchor") = 0)
      .def_property_readonly(
          "captures_this_step", &PyEngine::captures_this_step,
          "Whether the step begun by begin_step is captured (its end_step extra state is kept).")
      .def_property_readonly(
          "epoch_in_flight", &PyEngine::epoch_in_flight,
          "Whether an epoch is still copying or persisting.")
      .def_property_readonly("tables", &PyEngine::Tables)
      .def("stats", &PyEngine::Stats, py::arg("per_step") = false)
      .def_property_readonly("closed", &PyEngine::closed)
      .def_property_readonly("unit_count", &PyEngine::unit_count)
      .def_property_readonly("device_name", &PyEngine::device_name)
      .def_property_readonly("device_note", &PyEngine::device_note)
      .def_property_readonly("strategy_name", &PyEngine::strategy_name)
      .def_property_readonly("policy_name", &PyEngine::policy_name)
      .def_property_readonly("pool_path", &PyEngine::pool_path)
      .def_property_readonly("pool_file_bytes", &PyEngine::pool_file_bytes);

  py::class_<RowTracker>(m, "RowTracker")
      .def(py::init<std::uint64_t>(), py::arg("rows"))
      .def("mark", &MarkRows, py::arg("ptr"), py::arg("count"), py::arg("dtype"),
           "Marks `count` row ids (int64 or int32) at address `ptr`.")
      .def("mark_one", &RowTracker::MarkOne, py::arg("row"))
      .def("is_touched", &RowTracker::IsTouched, py::arg("row"))
      .def("touched_into", &TouchedInto, py::arg("ptr"), py::arg("capacity"))
      .def("touched", &RowTracker::Touched)
      .def("clear", &RowTracker::Clear)
      .def_property_readonly("touched_count", &RowTracker::touched_count)
      .def_property_readonly("rows", &RowTracker::rows)
      .def_property_readonly("out_of_range", &RowTracker::out_of_range);

  py::enum_<pmsnap::diff::Policy>(m, "Policy")
      .value("FULL", pmsnap::diff::Policy::kFull)
      .value("ONE_SHOT_DIFFERENTIAL", pmsnap::diff::Policy::kOneShotDifferential)
      .value("CONSECUTIVE_INCREMENTAL", pmsnap::diff::Policy::kConsecutiveIncremental)
      .value("INTERMITTENT_DIFFERENTIAL", pmsnap::diff::Policy::kIntermittentDifferential)
      .value("INCRCP", pmsnap::diff::Policy::kIncrCP)
      .value("MFU", pmsnap::diff::Policy::kMostFrequentlyUsed)
      .value("SSU", pmsnap::diff::Policy::kSubSampledUsed);
  m.def("parse_policy", &ParsePolicy, py::arg("name"),
        "Policy for \"full\", \"one-shot\", \"incremental\", \"intermittent\", \"incrcp\", "
        "\"mfu\" or \"ssu\".");
  m.def("policy_name",
        [](pmsnap::diff::Policy p) { return std::string(pmsnap::diff::PolicyName(p)); });

  using pmsnap::diff::EmbeddingOptions;
  py::class_<EmbeddingOptions>(m, "EmbeddingOptions",
                               "diff::EmbeddingOptions: policy, retention, quantization, IncrCP.")
      .def(py::init<>())
      .def_readwrite("policy", &EmbeddingOptions::policy)
      .def_readwrite("retain", &EmbeddingOptions::retain)
      .def_property(
          "quantize", [](const EmbeddingOptions& o) { return o.quantize.enabled; },
          [](EmbeddingOptions& o, bool v) { o.quantize.enabled = v; })
      .def_property(
          "quantize_bits", [](const EmbeddingOptions& o) { return o.quantize.bits; },
          [](EmbeddingOptions& o, int bits) {
            if (bits != 0 && bits != 2 && bits != 3 && bits != 4 && bits != 8) {
              throw StatusError(pmsnap::Status(pmsnap::StatusCode::kInvalidArgument,
                                               "quantize_bits must be 2, 3, 4 or 8 (0: from "
                                               "expected_resumes), got " +
                                                   std::to_string(bits)));
            }
            o.quantize.bits = bits;
          })
      .def_property(
          "expected_resumes", [](const EmbeddingOptions& o) { return o.quantize.expected_resumes; },
          [](EmbeddingOptions& o, double v) { o.quantize.expected_resumes = v; })
      .def_property(
          "duplicate_ratio_threshold",
          [](const EmbeddingOptions& o) { return o.incrcp.duplicate_ratio_threshold; },
          [](EmbeddingOptions& o, double v) { o.incrcp.duplicate_ratio_threshold = v; })
      .def_property(
          "bloom_bits_per_key",
          [](const EmbeddingOptions& o) { return o.incrcp.bloom_bits_per_key; },
          [](EmbeddingOptions& o, std::uint32_t v) { o.incrcp.bloom_bits_per_key = v; })
      .def_property(
          "concatenate", [](const EmbeddingOptions& o) { return o.incrcp.concatenate; },
          [](EmbeddingOptions& o, bool v) { o.incrcp.concatenate = v; })
      .def_property(
          "reset_baseline", [](const EmbeddingOptions& o) { return o.incrcp.reset_baseline; },
          [](EmbeddingOptions& o, bool v) { o.incrcp.reset_baseline = v; })
      .def_property(
          "priority_ratio", [](const EmbeddingOptions& o) { return o.priority.ratio; },
          [](EmbeddingOptions& o, double v) { o.priority.ratio = v; },
          "CPR-MFU / CPR-SSU: r, the fraction of rows each checkpoint writes.")
      .def_property(
          "ssu_period", [](const EmbeddingOptions& o) { return o.priority.ssu_period; },
          [](EmbeddingOptions& o, std::uint32_t v) { o.priority.ssu_period = v; })
      .def_property(
          "baseline_every", [](const EmbeddingOptions& o) { return o.priority.baseline_every; },
          [](EmbeddingOptions& o, std::uint32_t v) { o.priority.baseline_every = v; })
      .def_property(
          "priority_seed", [](const EmbeddingOptions& o) { return o.priority.seed; },
          [](EmbeddingOptions& o, std::uint64_t v) { o.priority.seed = v; })
      .def("__repr__", [](const EmbeddingOptions& o) {
        return std::string("EmbeddingOptions(policy=") + pmsnap::diff::PolicyName(o.policy) +
               ", retain=" + std::to_string(o.retain) +
               ", quantize=" + (o.quantize.enabled ? "True" : "False") +
               ", quantize_bits=" + std::to_string(o.quantize.bits) + ")";
      });

  m.def(
      "list_checkpoints",
      [](const std::string& path, const std::string& table) {
        return ListCheckpointsOf(*OpenForReading(path), table);
      },
      py::arg("path"), py::arg("table"),
      "Retained checkpoints of embedding table `table` in pool `path`, oldest first.");
  m.def(
      "recover_table",
      [](const std::string& path, const std::string& table, std::optional<std::uint64_t> epoch) {
        return RecoverTableOf(*OpenForReading(path), table, epoch);
      },
      py::arg("path"), py::arg("table"), py::arg("epoch") = std::nullopt,
      "-> (info, [float32 arrays]): `table` (and its row-shaped state) at checkpoint `epoch` "
      "(default: the newest retained).");


  py::class_<CheckpointReader>(m, "CheckpointReader",
                               "A pool opened to read its retained checkpoints without a model.")
      .def(py::init<const std::string&>(), py::arg("path"))
      .def("describe", &CheckpointReader::Describe,
           "Path, rank group, units [(name, encoded, [(role, dtype, shape, bytes)])], slots.")
      .def("epochs", &CheckpointReader::Epochs, "Retained epochs, newest first.")
      .def("verify", &CheckpointReader::Verify,
           "Every checksum: {epoch: [problems]} for the committed slots, chunk problems under "
           "-1; BusyError if another process opened the pool meanwhile.")
      .def("close", &CheckpointReader::Close, "Releases the pool file now.")
      .def("extra_state", &CheckpointReader::ExtraState, py::arg("epoch"))
      .def("read_tensor", &CheckpointReader::ReadTensor, py::arg("epoch"), py::arg("unit"),
           py::arg("tensor"), py::arg("dst"))
      .def("verify_tensor", &CheckpointReader::VerifyTensor, py::arg("epoch"), py::arg("unit"),
           py::arg("tensor"))
      .def("tensor_file_offset", &CheckpointReader::TensorFileOffset, py::arg("epoch"),
           py::arg("unit"), py::arg("tensor"))
      .def(
          "recover_table",
          [](const CheckpointReader& r, const std::string& table, std::uint64_t epoch) {
            return RecoverTableOf(r.pool(), table, epoch);
          },
          py::arg("table"), py::arg("epoch"))
      .def(
          "list_checkpoints",
          [](const CheckpointReader& r, const std::string& table) {
            return ListCheckpointsOf(r.pool(), table);
          },
          py::arg("table"));


  py::class_<PoolFileWriter>(m, "PoolFileWriter",
                             "A pool written epoch by epoch with Pool's commit protocol.")
      .def(py::init<const std::string&,
                    const std::vector<std::pair<
                        std::string, std::vector<std::tuple<std::string, std::string,
                                                            std::vector<std::int64_t>>>>>&,
                    std::uint64_t, std::uint64_t>(),
           py::arg("path"), py::arg("units"), py::arg("extra_state_capacity"),
           py::arg("part_bytes") = std::uint64_t{4} << 20)
      .def("latest_iteration", &PoolFileWriter::LatestIteration)
      .def("begin", &PoolFileWriter::Begin, py::arg("iteration"))
      .def("write_tensor", &PoolFileWriter::WriteTensor, py::arg("unit"), py::arg("tensor"),
           py::arg("src"))
      .def("commit", &PoolFileWriter::Commit, py::arg("extra_state"))
      .def("abandon", &PoolFileWriter::Abandon)
      .def("close", &PoolFileWriter::Close);

  m.def("prune_pool", &PrunePool, py::arg("path"), py::arg("keep"),
        "Keeps the newest `keep` retained epochs of pool `path` -> {pool, kept, dropped}.");
  m.def("read_pool", &ReadPool, py::arg("path"), py::arg("verify_data") = false,
        "Manifest, options and commit state of an existing pool.");
  m.def("run_cli", &RunCli, py::arg("args"),
        "Runs the pmsnap command line (info/verify); returns (exit_code, stdout, stderr).");
  m.def("describe_device", &DescribeDevice, py::arg("spec"),
        "-> (device name, note); raises InvalidArgumentError for a bad spec.");
  m.def("cuda_support_compiled", &pmsnap::runtime::CudaSupportCompiled);

  namespace frontend = pmsnap::frontend;
  m.attr("PARAM_ROLE") = std::string(frontend::kParamRole);
  m.attr("BUFFERS_UNIT") = std::string(frontend::kBuffersUnit);
  m.def("buffer_units", &BufferUnitsOf, py::arg("buffers"),
        "-> [(unit name, views)]: a module's persistent buffers [(state_dict key, data_ptr, "
        "dtype, shape, on_host)] as frontend::BufferUnits lays them out (\"#buffers\" and its "
        "\"#host\" companion); [] for none.");
  m.def(
      "is_buffers_unit", [](const std::string& unit) { return frontend::IsBuffersUnit(unit); },
      py::arg("unit"), "Whether pool unit `unit` holds module buffers.");
  m.def("parameter_units", &ParameterUnitsOf, py::arg("name"), py::arg("tensors"),
        py::arg("embedding_table") = false,
        "-> [(unit name, [(role, data_ptr, dtype, shape, on_host)])]: parameter `name`'s units, "
        "its tensors (the \"param\" one first) split as frontend::ParameterUnits splits them "
        "(CPU tensors of a CUDA engine, on_host, into a \"#host\" companion); "
        "InvalidArgumentError naming the parameter otherwise.");
  m.def(
      "dense_unit_name", [](const std::string& table) { return frontend::DenseUnitName(table); },
      py::arg("table"), "Name of embedding table `table`'s dense companion unit.");
  m.def(
      "parameter_of_companion",
      [](const std::string& unit) -> std::optional<std::string> {
        auto of = frontend::ParameterOfCompanion(unit);
        return of ? std::optional<std::string>(std::string(*of)) : std::nullopt;
      },
      py::arg("unit"),
      "The parameter whose companion unit `unit` is (\"#dense\", \"#host\", "
      "\"#dense#host\"), or None for a parameter's own unit.");
  m.def(
      "companion_units",
      [](const std::string& name) { return frontend::CompanionUnitNames(name); }, py::arg("name"),
      "The names of parameter `name`'s possible companion units, in layout order.");
  m.def(
      "table_of_dense_unit",
      [](const std::string& unit) -> std::optional<std::string> {
        auto table = frontend::TableOfDenseUnit(unit);
        if (!table) return std::nullopt;
        return std::string(*table);
      },
      py::arg("unit"), "The table whose dense companion `unit` is, or None.");
  m.def(
      "check_embedding_table",
      [](const std::string& table, const std::string& dtype, const std::vector<std::int64_t>& shape,
         bool dense_layout) {
        ThrowIfError(frontend::CheckTableParameter(table, dtype, shape, dense_layout));
      },
      py::arg("table"), py::arg("dtype"), py::arg("shape"), py::arg("dense_layout") = true,
      "InvalidArgumentError unless parameter `table` is a dense float32 [rows, dim] tensor.");
  m.def("moves_rows_without_gradient", &frontend::MovesRowsWithoutGradient, py::arg("optimizer"),
        py::arg("momentum") = 0.0, py::arg("weight_decay") = 0.0,
        "Whether optimizer class `optimizer` (\"SGD\", \"Adagrad\", ...) with these "
        "hyperparameters changes embedding rows that got no gradient.");
  m.attr("DTYPES") = [] {
    py::list names;
    for (const auto& [text, dtype] : kDTypes) names.append(std::string(text));
    return names;
  }();
}
