#include "distributed.h"

#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "errors.h"
#include "pmsnap/runtime/coordinator.h"
#include "pmsnap/runtime/epoch_agreement.h"
#include "pmsnap/runtime/sharding.h"

namespace pmsnap::python {
namespace {

namespace py = pybind11;

// Python subclasses override the snake_case methods below.
class PyCoordinator : public runtime::Coordinator {
 public:
  int rank() const override {
    py::gil_scoped_acquire gil;
    PYBIND11_OVERRIDE_PURE_NAME(int, runtime::Coordinator, "rank", rank);
  }
  int world_size() const override {
    py::gil_scoped_acquire gil;
    PYBIND11_OVERRIDE_PURE_NAME(int, runtime::Coordinator, "world_size", world_size);
  }

  Status StartMinAllReduce(std::span<const std::int64_t> values) override {
    return Call("start_min_all_reduce", [&](const py::function& f) {
      f(std::vector<std::int64_t>(values.begin(), values.end()));
      return Status::Ok();
    });
  }

  Result<std::vector<std::int64_t>> FinishMinAllReduce() override {
    std::vector<std::int64_t> out;
    Status status = Call("finish_min_all_reduce", [&](const py::function& f) {
      out = f().cast<std::vector<std::int64_t>>();
      return Status::Ok();
    });
    if (!status.ok()) return status;
    return out;
  }

  Status Broadcast(std::span<std::byte> bytes, int root) override {
    return Call("broadcast", [&](const py::function& f) {
      py::bytes mine(reinterpret_cast<const char*>(bytes.data()), bytes.size());
      const std::string theirs = f(mine, root).cast<std::string>();
      if (theirs.size() != bytes.size()) {
        return Status(StatusCode::kInternal,
                      "broadcast returned " + std::to_string(theirs.size()) + " bytes, expected " +
                          std::to_string(bytes.size()));
      }
      std::memcpy(bytes.data(), theirs.data(), theirs.size());
      return Status::Ok();
    });
  }

 private:
  // Looks up the Python override `name` and runs `body` with it, turning a
  // missing method or a Python exception into a Status.
  template <typename Body>
  Status Call(const char* name, Body&& body) {
    py::gil_scoped_acquire gil;
    py::function method = py::get_override(static_cast<const runtime::Coordinator*>(this), name);
    if (!method) {
      return Status(StatusCode::kInternal,
                    std::string("pmsnap Coordinator subclass does not define ") + name + "()");
    }
    try {
      return body(method);
    } catch (py::error_already_set& e) {
      return Status(StatusCode::kIOError,
                    "rank " + RankText() + ": " + name + "() raised " + e.what());
    } catch (const py::cast_error& e) {
      return Status(StatusCode::kInternal,
                    "rank " + RankText() + ": " + name + "() returned the wrong type: " + e.what());
    }
  }
  std::string RankText() {
    try {
      return std::to_string(rank());
    } catch (...) {
      return "?";
    }
  }
};

}  // namespace

void RegisterDistributed(py::module_& m) {
  py::class_<runtime::Coordinator, PyCoordinator, std::shared_ptr<runtime::Coordinator>>(
      m, "Coordinator",
      "Collectives pmsnap needs across ranks; subclass it (pmsnap.distributed does).")
      .def(py::init<>());

  py::class_<runtime::EpochAgreement>(m, "EpochAgreement")
      .def(py::init([](std::shared_ptr<runtime::Coordinator> coordinator) {
             return ValueOrThrow(runtime::EpochAgreement::Create(std::move(coordinator)));
           }),
           py::arg("coordinator"), py::keep_alive<1, 2>())
      .def(
          "at_boundary",
          [](runtime::EpochAgreement& self, std::uint64_t step,
             std::optional<std::uint64_t> committed, bool healthy, bool wants_epoch) {
            const runtime::LocalEpochState local{committed, healthy};
            py::gil_scoped_release release;
            return ValueOrThrow(
                self.AtBoundary(step, local, wants_epoch, false, [&] { return local; }));
          },
          py::arg("step"), py::arg("committed"), py::arg("healthy") = true,
          py::arg("wants_epoch") = true)
      .def("on_epoch_opened", &runtime::EpochAgreement::OnEpochOpened, py::arg("step"))
      .def(
          "agree_on_restore",
          [](runtime::EpochAgreement& self, const std::vector<std::uint64_t>& intact,
             bool never_committed, bool committed_twice) {
            const runtime::RankHoldings mine{.intact = intact,
                                             .never_committed = never_committed,
                                             .committed_twice = committed_twice};
            py::gil_scoped_release release;
            return ValueOrThrow(self.AgreeOnRestore(mine));
          },
          py::arg("intact"), py::arg("never_committed") = false,
          py::arg("committed_twice") = false)
      .def("finish",
           [](runtime::EpochAgreement& self) {
             py::gil_scoped_release release;
             ThrowIfError(self.Finish());
           })
      .def_property_readonly("global_committed", &runtime::EpochAgreement::global_committed);

  m.def(
      "plan_shards",
      [](const std::vector<std::uint64_t>& unit_bytes, int world_size, int replicas) {
        runtime::ShardPlan plan = ValueOrThrow(runtime::PlanShards(unit_bytes, world_size, replicas));
        return py::make_tuple(plan.holders, plan.bytes_per_rank);
      },
      py::arg("unit_bytes"), py::arg("world_size"), py::arg("replicas") = 1,
      "(holders, bytes_per_rank): holders[u] lists the ranks that write unit u, owner first.");
}

}  // namespace pmsnap::python
