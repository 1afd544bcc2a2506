#include "cli.h"

#include <pybind11/stl.h>

#include <sstream>
#include <string>
#include <vector>

#include "errors.h"
#include "pmsnap/runtime/cuda_device.h"
#include "pmsnap/runtime/device.h"
#include "pmsnap/tools/cli.h"

namespace pmsnap::python {
namespace {

namespace py = pybind11;

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

}  // namespace

void RegisterCli(py::module_& m) {
  m.def("run_cli", &RunCli, py::arg("args"),
        "Runs the pmsnap command line (info/verify); returns (exit_code, stdout, stderr).");
  m.def("describe_device", &DescribeDevice, py::arg("spec"),
        "-> (device name, note); raises InvalidArgumentError for a bad spec.");
  m.def("cuda_support_compiled", &pmsnap::runtime::CudaSupportCompiled);
}

}  // namespace pmsnap::python
