#include "cpr.h"

#include <pybind11/stl.h>

#include <cstddef>
#include <string>
#include <vector>

#include "errors.h"
#include "pmsnap/diff/cpr.h"

namespace pmsnap::python {
namespace {

namespace py = pybind11;
using diff::cpr::CostModel;
using diff::cpr::PlsLedger;
using diff::cpr::RecoveryPlan;

std::span<const std::byte> BytesOf(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

py::bytes ToBytes(const std::vector<std::byte>& v) {
  return py::bytes(reinterpret_cast<const char*>(v.data()), v.size());
}

py::dict PlanToDict(const RecoveryPlan& p) {
  py::dict d;
  d["partial"] = p.partial;
  d["target_pls"] = p.target_pls;
  d["emb_shards"] = p.emb_shards;
  d["partial_interval"] = p.partial_interval;
  d["full_interval"] = p.full_interval;
  d["partial_overhead"] = p.partial_overhead;
  d["full_overhead"] = p.full_overhead;
  d["expected_pls"] = p.expected_pls;
  d["save_interval"] = p.save_interval;
  d["reason"] = p.reason;
  return d;
}

}  // namespace

void RegisterCpr(py::module_& m) {
  m.def("cpr_save_interval_for_pls", &diff::cpr::SaveIntervalForPls, py::arg("target_pls"),
        py::arg("emb_shards"), py::arg("mean_time_to_failure"),
        "Eq. 4 solved for the interval: 2 * PLS * N_emb * T_fail.");
  m.def("cpr_expected_pls", &diff::cpr::ExpectedPls, py::arg("save_interval"),
        py::arg("emb_shards"), py::arg("mean_time_to_failure"),
        "Eq. 4: 0.5 * T_save / (T_fail * N_emb).");
  m.def(
      "cpr_overheads",
      [](double save, double load, double reschedule, double t_fail, double total,
         double interval) {
        const CostModel cost{save, load, reschedule, t_fail, total};
        py::dict d;
        d["full"] = diff::cpr::FullRecoveryOverhead(cost, interval);
        d["partial"] = diff::cpr::PartialRecoveryOverhead(cost, interval);
        d["full_optimal_interval"] = diff::cpr::OptimalFullRecoveryInterval(cost);
        return d;
      },
      py::arg("save_seconds"), py::arg("load_seconds"), py::arg("reschedule_seconds"),
      py::arg("mean_time_to_failure"), py::arg("total_seconds"), py::arg("save_interval"),
      "Eq. 1 (full) and Eq. 2 (partial) at `save_interval`, and sqrt(2 O_save T_fail).");
  m.def(
      "cpr_plan",
      [](double save, double load, double reschedule, double t_fail, double total, double pls,
         std::uint32_t shards, double min_benefit) {
        auto plan = diff::cpr::PlanRecovery({save, load, reschedule, t_fail, total}, pls, shards,
                                            min_benefit);
        ThrowIfError(plan.status());
        return PlanToDict(*plan);
      },
      py::arg("save_seconds"), py::arg("load_seconds"), py::arg("reschedule_seconds"),
      py::arg("mean_time_to_failure"), py::arg("total_seconds"), py::arg("target_pls"),
      py::arg("emb_shards"), py::arg("min_relative_benefit") = 0.05,
      "diff::cpr::PlanRecovery as a dict: partial or full, both intervals and overheads.");

  py::class_<PlsLedger>(m, "PlsLedger", "diff::cpr::PlsLedger: PLS (Eq. 3) over failures.")
      .def(py::init<std::uint64_t, std::uint32_t>(), py::arg("total_samples"),
           py::arg("emb_shards"))
      .def(
          "record_failure",
          [](PlsLedger& l, std::uint64_t samples, const std::vector<std::uint64_t>& saves) {
            ThrowIfError(l.RecordFailure(samples, saves));
          },
          py::arg("samples"), py::arg("samples_at_last_save"),
          "A failure at `samples` of shards last saved at `samples_at_last_save` (one each).")
      .def_property_readonly("pls", &PlsLedger::pls)
      .def_property_readonly("total_samples", &PlsLedger::total_samples)
      .def_property_readonly("emb_shards", &PlsLedger::emb_shards)
      .def_property_readonly("lost_samples", &PlsLedger::lost_samples)
      .def_property_readonly("failed_shards", &PlsLedger::failed_shards)
      .def_property_readonly("failures",
                             [](const PlsLedger& l) {
                               py::list out;
                               for (const auto& f : l.failures()) {
                                 py::dict d;
                                 d["samples"] = f.samples;
                                 d["lost_samples"] = f.lost_samples;
                                 d["failed_shards"] = f.failed_shards;
                                 d["pls_after"] = f.pls_after;
                                 out.append(d);
                               }
                               return out;
                             })
      .def("serialize", [](const PlsLedger& l) { return ToBytes(l.Serialize()); })
      .def_static(
          "parse",
          [](const py::bytes& b) {
            auto ledger = PlsLedger::Parse(BytesOf(std::string(b)));
            ThrowIfError(ledger.status());
            return *ledger;
          },
          py::arg("image"))
      .def("__repr__", [](const PlsLedger& l) {
        return "PlsLedger(pls=" + std::to_string(l.pls()) +
               ", failed_shards=" + std::to_string(l.failed_shards()) +
               ", emb_shards=" + std::to_string(l.emb_shards()) + ")";
      });
  m.def(
      "find_pls_ledger",
      [](const py::bytes& blob) -> std::optional<PlsLedger> {
        return diff::cpr::FindPlsLedger(BytesOf(std::string(blob)));
      },
      py::arg("blob"), "The first intact PLS ledger inside `blob` (e.g. extra state), or None.");
}

}  // namespace pmsnap::python
