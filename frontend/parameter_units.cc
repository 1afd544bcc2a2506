// The front ends' shared rules: see parameter_units.h.
#include "pmsnap/frontend/parameter_units.h"

#include <utility>

#include "pmsnap/pmem_layout/manifest.h"

namespace pmsnap::frontend {
namespace {

constexpr std::string_view kDenseSuffix = "#dense";

}  // namespace

std::string DenseUnitName(std::string_view table) {
  std::string name(table);
  name += kDenseSuffix;
  return name;
}

std::optional<std::string_view> TableOfDenseUnit(std::string_view unit) {
  if (unit.size() <= kDenseSuffix.size() || !unit.ends_with(kDenseSuffix)) return std::nullopt;
  return unit.substr(0, unit.size() - kDenseSuffix.size());
}

Status CheckTableParameter(std::string_view table, std::string_view dtype_name,
                           std::span<const std::int64_t> shape, bool dense_layout) {
  if (dense_layout && dtype_name == "float32" && shape.size() == 2) return Status::Ok();
  return Status(StatusCode::kInvalidArgument,
                "embedding table '" + std::string(table) +
                    "' must be a dense float32 [rows, dim] parameter, got " +
                    (dense_layout ? "" : "sparse ") + std::string(dtype_name) + " " +
                    layout::ShapeToString(shape));
}

bool IsRowTensor(const runtime::TensorView& tensor, std::int64_t rows) {
  return tensor.dtype == layout::DType::kFloat32 &&
         (tensor.shape.size() == 1 || tensor.shape.size() == 2) && tensor.shape[0] == rows;
}

Result<std::vector<runtime::UnitRegistration>> ParameterUnits(
    std::string_view name, std::vector<runtime::TensorView> tensors, bool embedding_table) {
  if (tensors.empty() || tensors.front().name != kParamRole) {
    return Status(
        StatusCode::kInvalidArgument,
        "parameter '" + std::string(name) + "': its unit must start with the '" +
            std::string(kParamRole) + "' tensor, got " +
            (tensors.empty() ? std::string("no tensors") : "'" + tensors.front().name + "'"));
  }
  runtime::UnitRegistration unit;
  unit.name = std::string(name);
  unit.encoded = embedding_table;
  if (!embedding_table) {
    unit.tensors = std::move(tensors);
    return std::vector<runtime::UnitRegistration>{std::move(unit)};
  }
  const runtime::TensorView& param = tensors.front();
  PMSNAP_RETURN_IF_ERROR(CheckTableParameter(name, layout::DTypeName(param.dtype), param.shape));
  const std::int64_t rows = param.shape[0];
  runtime::UnitRegistration dense;
  dense.name = DenseUnitName(name);
  for (runtime::TensorView& tensor : tensors) {
    // The parameter itself is a row tensor (checked above).
    (IsRowTensor(tensor, rows) ? unit : dense).tensors.push_back(std::move(tensor));
  }
  std::vector<runtime::UnitRegistration> units;
  units.push_back(std::move(unit));
  if (!dense.tensors.empty()) units.push_back(std::move(dense));
  return units;
}

bool MovesRowsWithoutGradient(std::string_view optimizer, double momentum, double weight_decay) {
  if (optimizer == "SGD") return momentum != 0 || weight_decay != 0;
  if (optimizer == "Adagrad") return weight_decay != 0;
  if (optimizer == "SparseAdam") return false;
  return true;
}

}  // namespace pmsnap::frontend
