// The front ends' shared rules: see parameter_units.h.
#include "pmsnap/frontend/parameter_units.h"

#include <set>
#include <utility>

#include "pmsnap/pmem_layout/manifest.h"

namespace pmsnap::frontend {
namespace {

constexpr std::string_view kDenseSuffix = "#dense";
constexpr std::string_view kHostSuffix = "#host";

std::optional<std::string_view> WithoutSuffix(std::string_view unit, std::string_view suffix) {
  if (unit.size() <= suffix.size() || !unit.ends_with(suffix)) return std::nullopt;
  return unit.substr(0, unit.size() - suffix.size());
}

// Moves host tensors out of units that mix them with device tensors, into
// a "#host" companion right after each (ParameterUnits' last rule).
Result<std::vector<runtime::UnitRegistration>> SplitHostTensors(
    std::vector<runtime::UnitRegistration> units) {
  std::vector<runtime::UnitRegistration> out;
  for (runtime::UnitRegistration& unit : units) {
    runtime::UnitRegistration host;
    host.name = HostUnitName(unit.name);
    host.on_host = true;
    std::vector<runtime::TensorView> device;
    for (runtime::TensorView& tensor : unit.tensors) {
      (tensor.on_host ? host.tensors : device).push_back(std::move(tensor));
    }
    if (device.empty()) {  // all on the host: the unit itself is
      unit.tensors = std::move(host.tensors);
      unit.on_host = true;
    } else {
      unit.tensors = std::move(device);
    }
    if (unit.on_host && unit.encoded) {
      return Status(StatusCode::kInvalidArgument,
                    "embedding table '" + unit.name +
                        "': its parameter and row state are in host memory while the engine's "
                        "device is not: move the table to the device, or checkpoint it on the "
                        "host device");
    }
    const bool companion = !unit.on_host && !host.tensors.empty();
    out.push_back(std::move(unit));
    if (companion) out.push_back(std::move(host));
  }
  return out;
}

}  // namespace

std::string DenseUnitName(std::string_view table) {
  std::string name(table);
  name += kDenseSuffix;
  return name;
}

std::optional<std::string_view> TableOfDenseUnit(std::string_view unit) {
  return WithoutSuffix(unit, kDenseSuffix);
}

std::string HostUnitName(std::string_view unit) {
  std::string name(unit);
  name += kHostSuffix;
  return name;
}

std::optional<std::string_view> UnitOfHostCompanion(std::string_view unit) {
  return WithoutSuffix(unit, kHostSuffix);
}

std::optional<std::string_view> ParameterOfCompanion(std::string_view unit) {
  const std::optional<std::string_view> of_host = UnitOfHostCompanion(unit);
  const std::string_view owner = of_host.value_or(unit);
  if (const std::optional<std::string_view> table = TableOfDenseUnit(owner)) return table;
  return of_host;
}

std::vector<std::string> CompanionUnitNames(std::string_view name) {
  return {HostUnitName(name), DenseUnitName(name), HostUnitName(DenseUnitName(name))};
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
    return SplitHostTensors({std::move(unit)});
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
  return SplitHostTensors(std::move(units));
}

bool IsBuffersUnit(std::string_view unit) {
  return unit == kBuffersUnit || UnitOfHostCompanion(unit) == kBuffersUnit;
}

Result<std::vector<runtime::UnitRegistration>> BufferUnits(
    std::vector<runtime::TensorView> buffers) {
  if (buffers.empty()) return std::vector<runtime::UnitRegistration>{};
  std::set<std::string> seen;
  for (const runtime::TensorView& buffer : buffers) {
    if (buffer.name.empty() || !seen.insert(buffer.name).second) {
      return Status(StatusCode::kInvalidArgument,
                    "module buffer '" + buffer.name + "' " +
                        (buffer.name.empty() ? "has no name" : "is given twice"));
    }
  }
  runtime::UnitRegistration unit;
  unit.name = std::string(kBuffersUnit);
  unit.tensors = std::move(buffers);
  return SplitHostTensors({std::move(unit)});
}

bool MovesRowsWithoutGradient(std::string_view optimizer, double momentum, double weight_decay) {
  if (optimizer == "SGD") return momentum != 0 || weight_decay != 0;
  if (optimizer == "Adagrad") return weight_decay != 0;
  if (optimizer == "SparseAdam") return false;
  return true;
}

}  // namespace pmsnap::frontend
