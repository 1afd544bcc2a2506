#include "views.h"

#include <pybind11/stl.h>

#include <optional>
#include <string_view>

#include "errors.h"
#include "pmsnap/frontend/parameter_units.h"

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

}  // namespace

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

std::vector<UnitArg> ToUnitArgs(const std::vector<runtime::UnitRegistration>& units) {
  std::vector<UnitArg> out;
  for (const runtime::UnitRegistration& unit : units) {
    std::vector<TensorArg> args;
    for (const runtime::TensorView& view : unit.tensors) args.push_back(ToTensorArg(view));
    out.emplace_back(unit.name, std::move(args));
  }
  return out;
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

void RegisterUnitRules(py::module_& m) {
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

}  // namespace pmsnap::python
