// CheckpointedOptimizer: see checkpointed_optimizer.h.
#include "pmsnap/hooks/checkpointed_optimizer.h"

#include <c10/util/Exception.h>

#include <filesystem>
#include <optional>

namespace pmsnap::hooks {
namespace {

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

std::vector<std::pair<std::string, torch::Tensor>> NamedParameters(
    const torch::nn::Module& module) {
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    named.emplace_back(item.key(), item.value());
  }
  return named;
}

}  // namespace

// Forwards the stepper's per-parameter events to the engine's hooks.
class CheckpointedOptimizer::EngineObserver final : public StepObserver {
 public:
  EngineObserver(runtime::Engine& engine, const std::vector<std::uint32_t>& units)
      : engine_(engine), units_(units) {}
  Status BeforeUpdate(std::size_t index) override { return engine_.BeforeUpdate(units_[index]); }
  Status AfterUpdate(std::size_t index) override { return engine_.AfterUpdate(units_[index]); }

 private:
  runtime::Engine& engine_;
  const std::vector<std::uint32_t>& units_;
};

CheckpointedOptimizer::CheckpointedOptimizer(std::unique_ptr<ParameterStepper> stepper,
                                             std::unique_ptr<runtime::Engine> engine)
    : stepper_(std::move(stepper)), engine_(std::move(engine)) {}

CheckpointedOptimizer::~CheckpointedOptimizer() {
  if (engine_) (void)engine_->Close(runtime::CloseMode::kFinish);
}

Result<std::unique_ptr<CheckpointedOptimizer>> CheckpointedOptimizer::Create(
    const torch::nn::Module& module, torch::optim::Optimizer& optimizer,
    runtime::EngineOptions options) {
  try {
    return Create(NamedParameters(module), optimizer, std::move(options));
  } catch (const c10::Error& error) {
    return Status(StatusCode::kInvalidArgument,
                  std::string("listing the module's parameters: libtorch: ") +
                      error.what_without_backtrace());
  }
}

Result<std::unique_ptr<CheckpointedOptimizer>> CheckpointedOptimizer::Create(
    const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters,
    torch::optim::Optimizer& optimizer, runtime::EngineOptions options) {
  PMSNAP_ASSIGN_OR_RETURN(std::unique_ptr<ParameterStepper> stepper,
                          ParameterStepper::Create(optimizer, named_parameters));
  std::vector<runtime::UnitRegistration> units;
  try {
    for (const ParameterSlot& slot : stepper->slots()) {
      runtime::UnitRegistration unit;
      unit.name = slot.name;
      PMSNAP_ASSIGN_OR_RETURN(runtime::TensorView param, ViewOf(slot.name, "param", slot.param));
      unit.tensors.push_back(std::move(param));
      for (const auto& [role, tensor] : slot.state) {
        PMSNAP_ASSIGN_OR_RETURN(runtime::TensorView view, ViewOf(slot.name, role, tensor));
        unit.tensors.push_back(std::move(view));
      }
      units.push_back(std::move(unit));
    }
  } catch (const c10::Error& error) {
    return Status(
        StatusCode::kInvalidArgument,
        std::string("describing the parameters: libtorch: ") + error.what_without_backtrace());
  }
  const std::string pool_path = options.pool_path;
  auto engine = runtime::Engine::Open(std::move(options), std::move(units));
  if (!engine.ok()) {
    const Status& status = engine.status();
    if (status.code() == StatusCode::kModelMismatch) {
      return Status(status.code(), "pool " + pool_path + " was made for another model (" +
                                       OptimizerKindName(stepper->kind()) +
                                       " over these parameters differs): " + status.message());
    }
    return status;
  }
  std::unique_ptr<CheckpointedOptimizer> checkpointed(
      new CheckpointedOptimizer(std::move(stepper), std::move(engine).value()));
  for (const ParameterSlot& slot : checkpointed->stepper_->slots()) {
    auto unit = checkpointed->engine_->FindUnit(slot.name);
    if (!unit) {
      return Status(StatusCode::kInternal, "engine lost unit '" + slot.name + "'");
    }
    checkpointed->unit_of_slot_.push_back(*unit);
  }
  return checkpointed;
}

Status CheckpointedOptimizer::Step(std::span<const std::byte> extra_state) {
  // Checked before BeginStep so that a refused step leaves no trace.
  PMSNAP_RETURN_IF_ERROR(stepper_->CheckUnchanged());
  const std::uint64_t step = iteration_ + 1;
  stepped_ = true;
  Status begin = engine_->BeginStep(step);
  EngineObserver observer(*engine_, unit_of_slot_);
  // Without a step boundary the engine's hooks would be out of order: still
  // update the model (training must not depend on checkpointing), unhooked.
  Status update = stepper_->Step(begin.ok() ? &observer : nullptr);
  iteration_ = step;
  if (!begin.ok()) return begin;
  if (update.code() == StatusCode::kFailedPrecondition) return update;
  Status end = engine_->EndStep(extra_state);
  return update.ok() ? end : update;
}

Result<RestoreInfo> CheckpointedOptimizer::Restore() {
  if (stepped_) {
    return Status(StatusCode::kFailedPrecondition,
                  "Restore must come before the first Step: training already changed the "
                  "registered tensors");
  }
  PMSNAP_ASSIGN_OR_RETURN(runtime::RestoreResult restored, engine_->Restore());
  PMSNAP_RETURN_IF_ERROR(stepper_->SyncFromSlots());
  iteration_ = restored.iteration;
  RestoreInfo info;
  info.iteration = restored.iteration;
  info.epoch = restored.epoch;
  info.extra_state = std::move(restored.extra_state);
  return info;
}

Status CheckpointedOptimizer::Flush() { return engine_->Flush(); }

Status CheckpointedOptimizer::Close(runtime::CloseMode mode) { return engine_->Close(mode); }

Result<RestoreInfo> RestoreFromPool(const torch::nn::Module& module,
                                    torch::optim::Optimizer& optimizer,
                                    runtime::EngineOptions options) {
  std::error_code error;
  if (!std::filesystem::exists(options.pool_path, error)) {
    return Status(StatusCode::kNotFound, "no pool at " + options.pool_path);
  }
  PMSNAP_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointedOptimizer> checkpointed,
                          CheckpointedOptimizer::Create(module, optimizer, std::move(options)));
  PMSNAP_ASSIGN_OR_RETURN(RestoreInfo info, checkpointed->Restore());
  PMSNAP_RETURN_IF_ERROR(checkpointed->Close(runtime::CloseMode::kAbandon));
  return info;
}

}  // namespace pmsnap::hooks
