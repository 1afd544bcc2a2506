#include "py_engine.h"

#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "embedding.h"
#include "errors.h"
#include "lowdiff.h"
#include "pmsnap/conflict/strategies.h"
#include "pmsnap/diff/differential_log.h"
#include "pmsnap/diff/embedding_checkpointer.h"
#include "pmsnap/runtime/coordinator.h"
#include "pmsnap/runtime/cuda_device.h"
#include "pmsnap/runtime/device.h"
#include "pmsnap/runtime/engine.h"
#include "pmsnap/runtime/interval_policy.h"
#include "pmsnap/runtime/stats.h"
#include "row_tracker.h"
#include "views.h"

namespace pmsnap::python {
namespace {

namespace py = pybind11;

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
    // Every-k and CheckFreq wait here for the epoch in flight: other Python
    // threads run meanwhile (LowDiffPlus's training thread, while its
    // replica thread waits). The coordinator's callbacks take the GIL back.
    CallWithoutGil([&] { return e.BeginStep(step); });
  }
  void BeforeUpdate(std::uint32_t unit) {
    runtime::Engine& e = engine();
    CallWithoutGil([&] { return e.BeforeUpdate(unit); });  // a conflict may wait for a copy
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
    CallWithoutGil([&] {
      return call(e, std::span<const std::byte>(reinterpret_cast<const std::byte*>(data),
                                                static_cast<std::size_t>(size)));
    });
  }
  void Flush() {
    runtime::Engine& e = engine();
    CallWithoutGil([&] { return e.Flush(); });
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
    runtime::RestoreResult value = CallWithoutGil([&] { return e.Restore(); });
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
    CallWithoutGil([&] { return tracker.Mark(source.Touched()); });
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
    differential_log_ =
        CallWithoutGil([&] { return diff::DifferentialLog::Open(e.pool(), options); });
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

}  // namespace

void RegisterEngine(py::module_& m) {
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
}

}  // namespace pmsnap::python
