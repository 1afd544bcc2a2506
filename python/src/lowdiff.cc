#include "lowdiff.h"

#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "errors.h"
#include "pmsnap/diff/differential_log.h"

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

  py::class_<diff::HeapBounds>(m, "HeapBounds",
                               "What a chunk heap holds of a differential log (diff::HeapBounds).")
      .def_readonly("max_batch", &diff::HeapBounds::max_batch)
      .def("max_interval", &diff::HeapBounds::MaxInterval, py::arg("batch"));
  m.def(
      "heap_bounds",
      [](double differential_bytes, std::uint64_t heap_bytes, std::uint32_t max_batch) {
        return ValueOrThrow(diff::BoundsOfHeap(differential_bytes, heap_bytes, max_batch));
      },
      py::arg("differential_bytes"), py::arg("heap_bytes"), py::arg("max_batch") = 64,
      "diff::BoundsOfHeap: the largest batch and the longest full interval the heap holds.");
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
