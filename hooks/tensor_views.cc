// Tensors as the engine registers them (see tensor_views.h).
#include "tensor_views.h"

namespace pmsnap::hooks {

std::optional<layout::DType> DTypeOf(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float:
      return layout::DType::kFloat32;
    case c10::ScalarType::Double:
      return layout::DType::kFloat64;
    case c10::ScalarType::Half:
      return layout::DType::kFloat16;
    case c10::ScalarType::BFloat16:
      return layout::DType::kBFloat16;
    case c10::ScalarType::Long:
      return layout::DType::kInt64;
    case c10::ScalarType::Int:
      return layout::DType::kInt32;
    case c10::ScalarType::Short:
      return layout::DType::kInt16;
    case c10::ScalarType::Char:
      return layout::DType::kInt8;
    case c10::ScalarType::Byte:
      return layout::DType::kUInt8;
    case c10::ScalarType::Bool:
      return layout::DType::kBool;
    default:
      return std::nullopt;
  }
}

Result<runtime::TensorView> ViewOf(const std::string& unit, const std::string& role,
                                   const torch::Tensor& tensor) {
  auto dtype = DTypeOf(tensor.scalar_type());
  if (!dtype) {
    return Status(StatusCode::kInvalidArgument,
                  "unit '" + unit + "' tensor '" + role + "' has unsupported dtype " +
                      std::string(c10::toString(tensor.scalar_type())));
  }
  runtime::TensorView view;
  view.name = role;
  view.data = tensor.data_ptr();
  view.dtype = *dtype;
  view.shape.assign(tensor.sizes().begin(), tensor.sizes().end());
  return view;
}

}  // namespace pmsnap::hooks
