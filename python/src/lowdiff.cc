#include "lowdiff.h"

#include <pybind11/stl.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <span>
#include <vector>

#include "errors.h"
#include "pmsnap/diff/differential_log.h"
#include "pmsnap/diff/lowdiff_controller.h"
#include "pmsnap/frontend/replica_pipeline.h"
#include "pmsnap/runtime/coordinator.h"

namespace py = pybind11;

namespace pmsnap::python {
namespace {

using diff::DifferentialLog;

// pieces: [(data_ptr, nbytes, dtype, shape)]; the caller keeps the memory
// unchanged until wait_copied(iteration) returned.
Status Append(DifferentialLog& log, std::uint64_t iteration, const py::list& pieces) {
  std::vector<diff::DifferentialPiece> out;
  out.reserve(pieces.size());
  for (const py::handle& item : pieces) {
    auto t = item.cast<py::tuple>();
    diff::DifferentialPiece p;
    p.data = reinterpret_cast<const std::byte*>(t[0].cast<std::uintptr_t>());
    p.bytes = t[1].cast<std::uint64_t>();
    p.dtype = t[2].cast<std::uint32_t>();
    p.shape = t[3].cast<std::vector<std::int64_t>>();
    out.push_back(std::move(p));
  }
  py::gil_scoped_release release;
  return log.Append(iteration, std::move(out));
}

py::dict StatsOf(const diff::DifferentialLogStats& s) {
  py::dict d;
  d["appended"] = s.appended;
  d["durable"] = s.durable;
  d["last_durable_iteration"] = s.last_durable_iteration;
  d["buffered"] = s.buffered;
  d["batches_written"] = s.batches_written;
  d["bytes_written"] = s.bytes_written;
  d["chunks_freed"] = s.chunks_freed;
  d["live_chunks"] = s.live_chunks;
  d["heap_used_bytes"] = s.heap_used_bytes;
  d["heap_capacity_bytes"] = s.heap_capacity_bytes;
  d["batch"] = s.batch;
  d["max_loss"] = s.max_loss;
  d["write_seconds"] = s.write_seconds;
  d["copy_wait_seconds"] = s.copy_wait_seconds;
  d["write_bandwidth"] = s.write_bandwidth();
  return d;
}

diff::ConfigurationInputs Inputs(double w, double s, double rd, double rf, double m, double it,
                                 std::uint32_t n) {
  diff::ConfigurationInputs in;
  in.write_bandwidth = w;
  in.full_bytes = s;
  in.merge_seconds = rd;
  in.load_full_seconds = rf;
  in.mtbf_seconds = m;
  in.iteration_seconds = it;
  in.world_size = n;
  return in;
}

py::dict StatsOf(const diff::LowDiffControllerStats& s) {
  py::dict d;
  d["full_every"] = s.full_every;
  d["batch"] = s.batch;
  d["heap_max_full_every"] =
      s.heap_max_full_every ? py::object(py::int_(s.heap_max_full_every)) : py::object(py::none());
  d["bytes_handed"] = s.bytes_handed;
  if (s.tuned) {
    d["f_star"] = s.f_star;
    d["b_star"] = s.b_star;
    py::dict inputs;
    inputs["write_bandwidth"] = s.inputs.write_bandwidth;
    inputs["full_bytes"] = s.inputs.full_bytes;
    inputs["merge_seconds"] = s.inputs.merge_seconds;
    inputs["mtbf_seconds"] = s.inputs.mtbf_seconds;
    inputs["iteration_seconds"] = s.inputs.iteration_seconds;
    inputs["world_size"] = s.inputs.world_size;
    d["inputs"] = inputs;
  }
  return d;
}

// A Python callable(every, anchor) as the controller's SetFullInterval: its
// exception becomes a Status naming it (the controller runs without the GIL).
diff::LowDiffController::SetFullInterval FullIntervalSetter(py::function set_full_interval) {
  auto shared = std::make_shared<py::function>(std::move(set_full_interval));
  return [shared](std::uint64_t every, std::uint64_t anchor) {
    py::gil_scoped_acquire gil;
    try {
      (*shared)(every, anchor);
      return Status::Ok();
    } catch (py::error_already_set& e) {
      return Status(StatusCode::kFailedPrecondition,
                    std::string("LowDiff: setting the full-checkpoint interval raised ") + e.what());
    }
  };
}

// float32 buffers by address: weights (n floats) and deltas (n floats each).
std::vector<std::span<const float>> Spans(const std::vector<std::uintptr_t>& deltas,
                                          std::uint64_t n) {
  std::vector<std::span<const float>> out;
  for (std::uintptr_t p : deltas) out.emplace_back(reinterpret_cast<const float*>(p), n);
  return out;
}

}  // namespace

py::list ReadDifferentialsOf(const layout::Pool& pool, std::uint64_t after) {
  std::vector<diff::Differential> diffs =
      CallWithoutGil([&] { return diff::ReadDifferentials(pool, after); });
  py::list out;
  for (const diff::Differential& d : diffs) {
    py::list pieces;
    for (const diff::StoredPiece& p : d.pieces) {
      pieces.append(py::make_tuple(
          p.dtype, p.shape,
          py::bytes(reinterpret_cast<const char*>(p.bytes.data()), p.bytes.size())));
    }
    out.append(py::make_tuple(d.iteration, pieces));
  }
  return out;
}

void RegisterLowDiff(py::module_& m) {
  py::class_<DifferentialLog, std::shared_ptr<DifferentialLog>>(
      m, "DifferentialLog",
      "diff::DifferentialLog: LowDiff's batched differential chunks in an engine's pool "
      "(Engine.open_differential_log).")
      .def(
          "append",
          [](DifferentialLog& log, std::uint64_t iteration, const py::list& pieces) {
            ThrowIfError(Append(log, iteration, pieces));
          },
          py::arg("iteration"), py::arg("pieces"),
          "pieces: [(data_ptr, nbytes, dtype, shape)], referenced, not copied: keep them "
          "unchanged until wait_copied(iteration) returned.")
      .def(
          "wait_copied",
          [](DifferentialLog& log, std::uint64_t it) { CallWithoutGil([&] { return log.WaitCopied(it); }); },
          py::arg("iteration"))
      .def("wait_written", [](DifferentialLog& log) { CallWithoutGil([&] { return log.WaitWritten(); }); })
      .def("flush", [](DifferentialLog& log) { CallWithoutGil([&] { return log.Flush(); }); })
      .def("close", [](DifferentialLog& log) { CallWithoutGil([&] { return log.Close(); }); })
      .def("abandon", [](DifferentialLog& log) {
        py::gil_scoped_release release;
        log.Abandon();
      })
      .def(
          "retire",
          [](DifferentialLog& log, std::uint64_t it) { CallWithoutGil([&] { return log.Retire(it); }); },
          py::arg("full_iteration"))
      .def(
          "set_batch",
          [](DifferentialLog& log, std::uint32_t b) { ThrowIfError(log.SetBatch(b)); },
          py::arg("batch"))
      .def("stats", [](const DifferentialLog& log) { return StatsOf(log.stats()); })
      .def(
          "differential_bytes",
          [](const DifferentialLog& log, std::uint64_t bytes_handed) {
            return diff::MeasuredDifferentialBytes(log.stats(), bytes_handed);
          },
          py::arg("bytes_handed"),
          "Bytes per differential now: the newest chunk's, or bytes_handed per appended one "
          "before any chunk (diff::MeasuredDifferentialBytes); 0 before any.");

  py::class_<diff::LowDiffController>(
      m, "LowDiffController",
      "diff::LowDiffController: LowDiff's full-checkpoint steps, retirement, Eq. 10 retuning "
      "and the ranks' agreement (python/pmsnap/lowdiff.py supplies tensors and collectives).")
      .def(py::init([](std::uint64_t full_every, std::uint64_t initial_full_every,
                       std::uint32_t batch, std::uint32_t initial_batch, std::uint32_t max_batch,
                       double mtbf_seconds, std::uint32_t world_size,
                       std::shared_ptr<runtime::Coordinator> agreement,
                       py::function set_full_interval) {
             diff::LowDiffControllerOptions o;
             o.full_every = full_every;
             o.initial_full_every = initial_full_every;
             o.batch = batch;
             o.initial_batch = initial_batch;
             o.max_batch = max_batch;
             o.mtbf_seconds = mtbf_seconds;
             o.world_size = world_size;
             return ValueOrThrow(diff::LowDiffController::Create(
                 o, std::move(agreement), FullIntervalSetter(std::move(set_full_interval))));
           }),
           py::arg("full_every"), py::arg("initial_full_every"), py::arg("batch"),
           py::arg("initial_batch"), py::arg("max_batch"), py::arg("mtbf_seconds"),
           py::arg("world_size"), py::arg("agreement"), py::arg("set_full_interval"),
           "full_every / batch 0: tuned. agreement: a Coordinator of the controller's own (None "
           "alone). set_full_interval(every, anchor): the engine's full-checkpoint steps.")
      .def(
          "attach",
          [](diff::LowDiffController& c, std::shared_ptr<DifferentialLog> log,
             std::optional<std::uint64_t> resume_after, std::optional<std::uint64_t> full_iteration) {
            CallWithoutGil([&] { return c.Attach(std::move(log), resume_after, full_iteration); });
          },
          py::arg("log"), py::arg("resume_after") = py::none(),
          py::arg("full_iteration") = py::none())
      .def("count_handed", &diff::LowDiffController::CountHanded, py::arg("bytes"))
      .def(
          "observe",
          [](diff::LowDiffController& c, std::uint64_t iteration, double step_seconds,
             const py::dict& engine_stats) {
            diff::FullCheckpointProgress progress;
            progress.last_committed_iteration =
                engine_stats["last_committed_iteration"].cast<std::uint64_t>();
            progress.epochs_committed = engine_stats["epochs_committed"].cast<std::uint64_t>();
            progress.bytes_written = engine_stats["bytes_written"].cast<std::uint64_t>();
            progress.last_epoch_seconds = engine_stats["last_epoch_seconds"].cast<double>();
            CallWithoutGil([&] { return c.Observe(iteration, step_seconds, progress); });
          },
          py::arg("iteration"), py::arg("step_seconds"), py::arg("engine_stats"),
          "After each step on every rank (it all-reduces at the tuning steps); engine_stats: "
          "CheckpointedOptimizer.stats().")
      .def_static(
          "agree_on_replay_reach",
          [](runtime::Coordinator* coordinator, std::uint64_t full_iteration,
             std::uint64_t available) {
            return CallWithoutGil([&] {
              return diff::LowDiffController::AgreeOnReplayReach(coordinator, full_iteration,
                                                                 available);
            });
          },
          py::arg("coordinator"), py::arg("full_iteration"), py::arg("available"))
      .def_property_readonly("full_every", &diff::LowDiffController::full_every)
      .def_property_readonly("batch", &diff::LowDiffController::batch)
      .def_property_readonly("tunes_full_every", &diff::LowDiffController::tunes_full_every)
      .def_property_readonly("log", &diff::LowDiffController::log)
      .def("stats", [](const diff::LowDiffController& c) { return StatsOf(c.stats()); });

  using frontend::ReplicaPipeline;
  py::class_<ReplicaPipeline>(
      m, "ReplicaPipeline",
      "frontend::ReplicaPipeline: LowDiff+'s hand-over, two-buffer copy and replica schedule "
      "(python/pmsnap/lowdiff_plus.py supplies the tensors and threads). Blocking calls "
      "release the GIL.")
      .def(py::init<std::vector<std::string>, std::string, std::uint64_t>(), py::arg("names"),
           py::arg("owner"), py::arg("iteration"))
      .def(
          "claim",
          [](ReplicaPipeline& p, const std::vector<std::size_t>& indices) {
            return ValueOrThrow(p.Claim(indices));
          },
          py::arg("indices"))
      .def(
          "queue",
          [](ReplicaPipeline& p, const std::vector<std::size_t>& indices, std::uint64_t it) {
            p.Queue(indices, it);
          },
          py::arg("indices"), py::arg("iteration"))
      .def(
          "check_handed_over",
          [](const ReplicaPipeline& p, const std::vector<bool>& with_gradient) {
            ThrowIfError(p.CheckHandedOver(with_gradient));
          },
          py::arg("with_gradient"))
      .def("finish_step",
           [](ReplicaPipeline& p) { return CallWithoutGil([&] { return p.FinishStep(); }); })
      .def("release", &ReplicaPipeline::Release, py::arg("iteration"))
      .def("next_copies",
           [](ReplicaPipeline& p) -> py::object {
             std::optional<std::vector<ReplicaPipeline::Copy>> copies;
             {
               py::gil_scoped_release release;
               copies = p.NextCopies();
             }
             if (!copies) return py::none();
             py::list out;
             for (const auto& c : *copies) out.append(py::make_tuple(c.iteration, c.index));
             return out;
           },
           "[(iteration, index)] of one iteration once its buffer is free; None once stopping.")
      .def("copies_done", &ReplicaPipeline::CopiesDone, py::arg("count"), py::arg("bytes"))
      .def("next_iteration",
           [](ReplicaPipeline& p) -> py::object {
             std::optional<ReplicaPipeline::Next> next;
             {
               py::gil_scoped_release release;
               next = p.NextIteration();
             }
             if (!next) return py::none();
             return py::make_tuple(next->iteration, next->apply);
           },
           "(iteration, apply) for the replica; None once stopping and drained.")
      .def("applied", &ReplicaPipeline::Applied, py::arg("iteration"))
      .def(
          "record_error",
          [](ReplicaPipeline& p, const std::string& message) {
            p.RecordError(Status(StatusCode::kInternal, message));
          },
          py::arg("message"))
      .def(
          "wait_for_replica",
          [](ReplicaPipeline& p, std::uint64_t it) {
            CallWithoutGil([&] { return p.WaitForReplica(it); });
          },
          py::arg("iteration"))
      .def("restored", &ReplicaPipeline::Restored, py::arg("iteration"))
      .def(
          "close",
          [](ReplicaPipeline& p, bool finish) {
            py::gil_scoped_release release;
            return p.Close(finish, nullptr);
          },
          py::arg("finish"), "False if already closed.")
      .def_property_readonly("iteration", &ReplicaPipeline::iteration)
      .def_property_readonly("closed", &ReplicaPipeline::closed)
      .def("stats", [](const ReplicaPipeline& p) {
        const frontend::ReplicaPipelineStats s = p.stats();
        py::dict d;
        d["iterations"] = s.iterations;
        d["replica_iteration"] = s.replica_iteration;
        d["gradient_bytes_snapshotted"] = s.gradient_bytes_snapshotted;
        d["training_wait_seconds"] = s.training_wait_seconds;
        return d;
      });

  m.def(
      "optimal_configuration",
      [](double w, double s, double rd, double m_, double it, std::uint32_t n,
         std::uint32_t max_batch, std::uint64_t max_interval) {
        diff::Configuration c = ValueOrThrow(
            diff::OptimalConfiguration(Inputs(w, s, rd, 0, m_, it, n), max_batch, max_interval));
        py::dict d;
        d["f_star"] = c.f_star;
        d["b_star"] = c.b_star;
        d["full_interval"] = c.full_interval;
        d["batch"] = c.batch;
        return d;
      },
      py::arg("write_bandwidth"), py::arg("full_bytes"), py::arg("merge_seconds"),
      py::arg("mtbf_seconds"), py::arg("iteration_seconds"), py::arg("world_size") = 1,
      py::arg("max_batch") = 64, py::arg("max_interval") = std::uint64_t{1} << 20,
      "Eq. 10 of LowDiff: {f_star, b_star, full_interval, batch} (diff::OptimalConfiguration).");
  m.def(
      "wasted_seconds",
      [](double w, double s, double rd, double rf, double m_, double it, std::uint32_t n, double f,
         double b, double training_seconds) {
        return diff::WastedSeconds(Inputs(w, s, rd, rf, m_, it, n), f, b, training_seconds);
      },
      py::arg("write_bandwidth"), py::arg("full_bytes"), py::arg("merge_seconds"),
      py::arg("load_full_seconds"), py::arg("mtbf_seconds"), py::arg("iteration_seconds"),
      py::arg("world_size"), py::arg("f"), py::arg("b"), py::arg("training_seconds"),
      "Eq. 8 of LowDiff: wasted seconds across all workers (diff::WastedSeconds).");
  m.def(
      "merge_sequential",
      [](std::uintptr_t weights, std::uint64_t n, const std::vector<std::uintptr_t>& deltas) {
        py::gil_scoped_release release;
        diff::MergeSequential({reinterpret_cast<float*>(weights), n}, Spans(deltas, n));
      },
      py::arg("weights_ptr"), py::arg("numel"), py::arg("delta_ptrs"),
      "float32 weights += d1, += d2, ... in order (diff::MergeSequential).");
  m.def(
      "merge_parallel",
      [](std::uintptr_t weights, std::uint64_t n, const std::vector<std::uintptr_t>& deltas,
         unsigned threads) {
        py::gil_scoped_release release;
        return diff::MergeParallel({reinterpret_cast<float*>(weights), n}, Spans(deltas, n),
                                   threads);
      },
      py::arg("weights_ptr"), py::arg("numel"), py::arg("delta_ptrs"), py::arg("threads") = 0,
      "The log-n pairwise merge (diff::MergeParallel); returns its number of levels.");
}

}  // namespace pmsnap::python
