#include "embedding.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <memory>
#include <utility>
#include <vector>

#include "errors.h"
#include "pmsnap/diff/embedding_checkpointer.h"
#include "row_tracker.h"

namespace pmsnap::python {
namespace {

namespace py = pybind11;

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

py::list ListCheckpointsOf(const layout::Pool& pool, const std::string& table) {
  py::list out;
  for (const diff::CheckpointInfo& info :
       CallWithoutGil([&] { return diff::ListCheckpoints(pool, table); })) {
    out.append(CheckpointInfoToDict(info));
  }
  return out;
}

py::tuple RecoverTableOf(const layout::Pool& pool, const std::string& table,
                         std::optional<std::uint64_t> epoch) {
  return RecoveredToPython(CallWithoutGil([&] { return diff::RecoverTable(pool, table, epoch); }));
}

void RegisterEmbedding(py::module_& m) {
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
}

}  // namespace pmsnap::python
