// CheckpointedOptimizer: see checkpointed_optimizer.h.
#include "pmsnap/hooks/checkpointed_optimizer.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/modules/embedding.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <set>
#include <utility>

#include "pmsnap/frontend/parameter_units.h"
#include "pmsnap/hooks/module_buffers.h"
#include "pmsnap/hooks/tracked_embedding.h"
#include "tensor_views.h"

namespace pmsnap::hooks {
namespace {

std::vector<std::pair<std::string, torch::Tensor>> NamedParameters(
    const torch::nn::Module& module) {
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    named.emplace_back(item.key(), item.value());
  }
  return named;
}

// Whether `kind`'s update of `param` changes rows whose gradient is zero
// (then a table's changed rows are all rows, whatever was looked up): the
// rule of frontend::MovesRowsWithoutGradient, given the hyperparameters of
// the parameter's group.
bool MovesRowsWithoutGradient(torch::optim::Optimizer& optimizer, const torch::Tensor& param,
                              OptimizerKind kind) {
  namespace optim = torch::optim;
  for (const optim::OptimizerParamGroup& group : optimizer.param_groups()) {
    for (const torch::Tensor& p : group.params()) {
      if (!p.is_same(param)) continue;
      const optim::OptimizerOptions& options = group.options();
      double momentum = 0;
      double weight_decay = 0;
      switch (kind) {
        case OptimizerKind::kSgd:
          momentum = static_cast<const optim::SGDOptions&>(options).momentum();
          weight_decay = static_cast<const optim::SGDOptions&>(options).weight_decay();
          break;
        case OptimizerKind::kAdam:
          weight_decay = static_cast<const optim::AdamOptions&>(options).weight_decay();
          break;
        case OptimizerKind::kAdamW:
          weight_decay = static_cast<const optim::AdamWOptions&>(options).weight_decay();
          break;
        case OptimizerKind::kAdagrad:
          weight_decay = static_cast<const optim::AdagradOptions&>(options).weight_decay();
          break;
        case OptimizerKind::kRmsprop:
          momentum = static_cast<const optim::RMSpropOptions&>(options).momentum();
          weight_decay = static_cast<const optim::RMSpropOptions&>(options).weight_decay();
          break;
      }
      return frontend::MovesRowsWithoutGradient(OptimizerKindName(kind), momentum, weight_decay);
    }
  }
  return true;
}

// Torch's name of `type` without "torch." ("float32"), as pmsnap's dtypes are named.
std::string DTypeNameOf(c10::ScalarType type) {
  auto dtype = DTypeOf(type);
  return dtype ? layout::DTypeName(*dtype) : std::string(c10::toString(type));
}

// Every embedding module of `module` (itself included), with its name prefix.
std::vector<std::pair<std::string, torch::nn::Module*>> EmbeddingModules(
    torch::nn::Module& module) {
  std::vector<std::pair<std::string, torch::nn::Module*>> out;
  auto is_embedding = [](torch::nn::Module& m) {
    return dynamic_cast<torch::nn::EmbeddingImpl*>(&m) != nullptr ||
           dynamic_cast<torch::nn::EmbeddingBagImpl*>(&m) != nullptr;
  };
  if (is_embedding(module)) out.emplace_back("", &module);
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    if (is_embedding(*item.value())) out.emplace_back(item.key(), item.value().get());
  }
  return out;
}

const torch::Tensor& WeightOf(torch::nn::Module& module) {
  if (auto* e = dynamic_cast<torch::nn::EmbeddingImpl*>(&module)) return e->weight;
  return dynamic_cast<torch::nn::EmbeddingBagImpl&>(module).weight;
}

bool HasMaxNorm(torch::nn::Module& module) {
  if (auto* e = dynamic_cast<torch::nn::EmbeddingImpl*>(&module)) {
    return e->options.max_norm().has_value();
  }
  return dynamic_cast<torch::nn::EmbeddingBagImpl&>(module).options.max_norm().has_value();
}

}  // namespace

// Forwards the stepper's per-parameter events to the engine's hooks (an
// embedding table's two units around its one update).
class CheckpointedOptimizer::EngineObserver final : public StepObserver {
 public:
  EngineObserver(runtime::Engine& engine, const std::vector<std::uint32_t>& units,
                 const std::vector<std::uint32_t>& dense_units)
      : engine_(engine), units_(units), dense_units_(dense_units) {}
  Status BeforeUpdate(std::size_t index) override {
    PMSNAP_RETURN_IF_ERROR(engine_.BeforeUpdate(units_[index]));
    if (dense_units_[index] == kNoUnit) return Status::Ok();
    return engine_.BeforeUpdate(dense_units_[index]);
  }
  Status AfterUpdate(std::size_t index) override {
    PMSNAP_RETURN_IF_ERROR(engine_.AfterUpdate(units_[index]));
    if (dense_units_[index] == kNoUnit) return Status::Ok();
    return engine_.AfterUpdate(dense_units_[index]);
  }

 private:
  runtime::Engine& engine_;
  const std::vector<std::uint32_t>& units_;
  const std::vector<std::uint32_t>& dense_units_;
};

// What the hooks reach their optimizer through. The parameter, not the
// optimizer, owns a hook, and other code may keep one alive (a hook set
// later that chains to ours): once the hooks are taken off, owner is null
// and such a hook only calls the one it replaced.
struct CheckpointedOptimizer::HookLink {
  CheckpointedOptimizer* owner = nullptr;
};

class CheckpointedOptimizer::BackwardHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  BackwardHook(std::shared_ptr<HookLink> link, std::size_t index,
               std::unique_ptr<torch::autograd::PostAccumulateGradHook> previous)
      : link_(std::move(link)), index_(index), previous_(std::move(previous)) {}
  void operator()(const torch::autograd::Variable& tensor) override {
    // The hook the parameter had first, as hooks registered earlier run first.
    if (previous_ != nullptr) (*previous_)(tensor);
    if (link_->owner != nullptr) link_->owner->UpdateInBackward(index_);
  }
  const HookLink* link() const { return link_.get(); }
  std::unique_ptr<torch::autograd::PostAccumulateGradHook> TakePrevious() {
    return std::move(previous_);
  }

 private:
  std::shared_ptr<HookLink> link_;
  std::size_t index_;
  std::unique_ptr<torch::autograd::PostAccumulateGradHook> previous_;
};

CheckpointedOptimizer::CheckpointedOptimizer(std::unique_ptr<ParameterStepper> stepper,
                                             std::unique_ptr<runtime::Engine> engine)
    : stepper_(std::move(stepper)), engine_(std::move(engine)) {}

CheckpointedOptimizer::~CheckpointedOptimizer() {
  RemoveBackwardHooks();
  for (const std::weak_ptr<torch::nn::Module>& weak : bound_modules_) {
    std::shared_ptr<torch::nn::Module> module = weak.lock();
    RowMarker* marker = module ? MarkerOf(*module) : nullptr;
    if (marker != nullptr && marker->checkpointer() == embeddings_.get()) marker->Unbind();
  }
  if (engine_) (void)engine_->Close(runtime::CloseMode::kFinish);
}

bool CheckpointedOptimizer::MarksAllRows(const std::string& name) const {
  for (const TableSlot& table : tables_) {
    if (stepper_->slots()[table.slot].name == name) return table.mark_all;
  }
  return false;
}

Result<std::vector<std::string>> CheckpointedOptimizer::TrackEmbeddings(torch::nn::Module& module) {
  std::vector<std::string> bound;
  if (!embeddings_) return bound;
  std::vector<std::pair<std::string, torch::nn::Module*>> modules;
  try {
    modules = EmbeddingModules(module);
  } catch (const c10::Error& error) {
    return Status(StatusCode::kInvalidArgument, std::string("listing the module's embeddings: "
                                                            "libtorch: ") +
                                                    error.what_without_backtrace());
  }
  for (const auto& [prefix, m] : modules) {
    RowMarker* marker = MarkerOf(*m);
    if (marker == nullptr) continue;
    const void* weight = WeightOf(*m).data_ptr();
    for (const TableSlot& table : tables_) {
      const ParameterSlot& slot = stepper_->slots()[table.slot];
      if (slot.param.data_ptr() != weight) continue;
      PMSNAP_RETURN_IF_ERROR(marker->Bind(embeddings_, slot.name));
      bound.push_back(slot.name);
      std::weak_ptr<torch::nn::Module> weak =
          m == &module ? module.weak_from_this() : module.named_modules("", false)[prefix];
      bound_modules_.push_back(std::move(weak));
    }
  }
  return bound;
}

Status CheckpointedOptimizer::MarkTableRows(const std::vector<bool>* skip) {
  Status first = Status::Ok();
  for (const TableSlot& table : tables_) {
    if (skip != nullptr && (*skip)[table.slot]) continue;
    Status status = MarkTableRows(table);
    if (first.ok()) first = status;
  }
  return first;
}

Status CheckpointedOptimizer::MarkTableRows(const TableSlot& table) {
  const torch::Tensor& param = stepper_->slots()[table.slot].param;
  const torch::Tensor& grad = param.grad();
  if (!grad.defined()) return Status::Ok();  // not updated this step
  if (table.mark_all) {
    table.tracker->MarkAll();
    return Status::Ok();
  }
  if (!table.from_gradient) return Status::Ok();  // lookups marked the rows
  Status status = Status::Ok();
  try {
    torch::NoGradGuard no_grad;
    torch::Tensor rows;
    if (grad.is_sparse()) {
      rows = grad._indices().select(0, 0);
    } else {
      rows = grad.reshape({grad.size(0), -1}).ne(0).any(1).nonzero().reshape({-1});
    }
    rows = rows.to(torch::kCPU, torch::kLong).contiguous();
    status = table.tracker->Mark(std::span<const std::int64_t>(
        rows.data_ptr<std::int64_t>(), static_cast<std::size_t>(rows.numel())));
  } catch (const c10::Error& error) {
    status = Status(StatusCode::kInvalidArgument, "embedding table '" + table.tracker->table() +
                                                      "': reading its gradient's rows: libtorch: " +
                                                      error.what_without_backtrace());
  }
  // The checkpoints stay exact with every row marked.
  if (!status.ok()) table.tracker->MarkAll();
  return status;
}

Result<std::unique_ptr<CheckpointedOptimizer>> CheckpointedOptimizer::Create(
    const torch::nn::Module& module, torch::optim::Optimizer& optimizer,
    runtime::EngineOptions options, EmbeddingTables embeddings, UpdateMode update_mode,
    BufferMode buffer_mode) {
  ModuleBuffers buffers;
  if (buffer_mode == BufferMode::kCheckpoint) {
    PMSNAP_ASSIGN_OR_RETURN(buffers, ModuleBuffers::Of(module));
  }
  std::vector<std::pair<std::string, torch::Tensor>> named;
  try {
    named = NamedParameters(module);
  } catch (const c10::Error& error) {
    return Status(StatusCode::kInvalidArgument,
                  std::string("listing the module's parameters: libtorch: ") +
                      error.what_without_backtrace());
  }
  // Binding the trackers changes where the modules mark, not the model.
  return CreateImpl(named, optimizer, std::move(options), std::move(embeddings),
                    const_cast<torch::nn::Module*>(&module), update_mode, std::move(buffers));
}

Result<std::unique_ptr<CheckpointedOptimizer>> CheckpointedOptimizer::Create(
    const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters,
    torch::optim::Optimizer& optimizer, runtime::EngineOptions options, EmbeddingTables embeddings,
    UpdateMode update_mode) {
  return CreateImpl(named_parameters, optimizer, std::move(options), std::move(embeddings), nullptr,
                    update_mode, ModuleBuffers());
}

Result<std::unique_ptr<CheckpointedOptimizer>> CheckpointedOptimizer::CreateImpl(
    const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters,
    torch::optim::Optimizer& optimizer, runtime::EngineOptions options, EmbeddingTables embeddings,
    torch::nn::Module* module, UpdateMode update_mode, ModuleBuffers buffers) {
  // The state is filled once the pool shows whether a restore will
  // overwrite it (a pass over twice the model's bytes for Adam).
  PMSNAP_ASSIGN_OR_RETURN(
      std::unique_ptr<ParameterStepper> stepper,
      ParameterStepper::Create(optimizer, named_parameters, ParameterStepper::NewState::kDeferred));
  const std::vector<ParameterSlot>& slots = stepper->slots();
  // slot index -> whether it is an embedding table
  std::vector<bool> is_table(slots.size(), false);
  if (!embeddings.names.empty()) {
    if (options.encoder) {
      return Status(StatusCode::kInvalidArgument,
                    "embedding tables need the CheckpointedOptimizer's own encoder, but "
                    "EngineOptions::encoder is already set");
    }
    for (const std::string& name : embeddings.names) {
      auto it = std::find_if(slots.begin(), slots.end(),
                             [&](const ParameterSlot& slot) { return slot.name == name; });
      if (it == slots.end()) {
        std::string known;
        for (std::size_t i = 0; i < slots.size() && i < 8; ++i) {
          known += (i ? ", " : "") + slots[i].name;
        }
        return Status(StatusCode::kInvalidArgument,
                      "embedding table '" + name + "' is not a parameter of the optimizer (" +
                          std::to_string(slots.size()) + " parameters: " + known +
                          (slots.size() > 8 ? ", ..." : "") + ")");
      }
      const std::size_t index = static_cast<std::size_t>(it - slots.begin());
      if (is_table[index]) {
        return Status(StatusCode::kInvalidArgument, "embedding table '" + name + "' named twice");
      }
      PMSNAP_RETURN_IF_ERROR(
          frontend::CheckTableParameter(name, DTypeNameOf(it->param.scalar_type()),
                                        it->param.sizes(), it->param.layout() == torch::kStrided));
      is_table[index] = true;
    }
    if (module != nullptr) {
      // Tables whose module rewrites rows in its forward pass (max_norm), and
      // kLookups tables nothing would mark.
      std::set<std::string> tracked;
      try {
        for (const auto& [prefix, m] : EmbeddingModules(*module)) {
          const void* weight = WeightOf(*m).data_ptr();
          for (std::size_t i = 0; i < slots.size(); ++i) {
            if (!is_table[i] || slots[i].param.data_ptr() != weight) continue;
            if (HasMaxNorm(*m)) {
              return Status(StatusCode::kInvalidArgument,
                            "embedding table '" + slots[i].name +
                                "': its module uses max_norm, which rewrites looked-up rows in "
                                "the forward pass, outside the optimizer step that pmsnap "
                                "checkpoints around");
            }
            if (MarkerOf(*m) != nullptr) tracked.insert(slots[i].name);
          }
        }
      } catch (const c10::Error& error) {
        return Status(StatusCode::kInvalidArgument,
                      std::string("listing the module's embeddings: libtorch: ") +
                          error.what_without_backtrace());
      }
      if (embeddings.rows == RowSource::kLookups) {
        for (const std::string& name : embeddings.names) {
          if (tracked.count(name) == 0) {
            return Status(StatusCode::kInvalidArgument,
                          "embedding table '" + name +
                              "' has no TrackedEmbedding / TrackedEmbeddingBag module to mark "
                              "its looked-up rows: wrap its module, or use "
                              "RowSource::kGradients");
          }
        }
      }
    }
  }

  std::vector<runtime::UnitRegistration> units;
  try {
    for (std::size_t i = 0; i < slots.size(); ++i) {
      const ParameterSlot& slot = slots[i];
      std::vector<runtime::TensorView> views;
      PMSNAP_ASSIGN_OR_RETURN(runtime::TensorView param,
                              ViewOf(slot.name, std::string(frontend::kParamRole), slot.param));
      views.push_back(std::move(param));
      for (const auto& [role, tensor] : slot.state) {
        PMSNAP_ASSIGN_OR_RETURN(runtime::TensorView view, ViewOf(slot.name, role, tensor));
        views.push_back(std::move(view));
      }
      PMSNAP_ASSIGN_OR_RETURN(std::vector<runtime::UnitRegistration> parameter_units,
                              frontend::ParameterUnits(slot.name, std::move(views), is_table[i]));
      for (runtime::UnitRegistration& unit : parameter_units) units.push_back(std::move(unit));
    }
  } catch (const c10::Error& error) {
    return Status(
        StatusCode::kInvalidArgument,
        std::string("describing the parameters: libtorch: ") + error.what_without_backtrace());
  }
  PMSNAP_ASSIGN_OR_RETURN(std::vector<runtime::UnitRegistration> buffer_units, buffers.Units());
  for (const runtime::UnitRegistration& unit : buffer_units) units.push_back(unit);
  std::shared_ptr<diff::EmbeddingCheckpointer> checkpointer;
  if (!embeddings.names.empty()) {
    checkpointer = std::make_shared<diff::EmbeddingCheckpointer>(embeddings.options);
    options.encoder = checkpointer;
  }
  if (update_mode == UpdateMode::kInBackward && options.copy_start == runtime::CopyStart::kAuto) {
    // kAuto would hold the last captures of the step until EndStep, which
    // comes after the rest of backward: the copies have more time from the
    // update on.
    options.copy_start = runtime::CopyStart::kAfterUpdate;
  }
  const std::string pool_path = options.pool_path;
  // While the pool opens (mostly libpmemobj's boot), the state's pages are
  // faulted in: the restore or the fill below then writes to mapped memory.
  stepper->StartPrefault();
  auto engine = runtime::Engine::Open(std::move(options), std::move(units));
  stepper->FinishPrefault();
  if (!engine.ok()) {
    const Status& status = engine.status();
    if (status.code() == StatusCode::kModelMismatch) {
      return Status(status.code(), "pool " + pool_path + " was made for another model (" +
                                       OptimizerKindName(stepper->kind()) +
                                       " over these parameters differs): " + status.message());
    }
    return status;
  }
  if (!(*engine)->pool().last_committed_epoch()) {
    PMSNAP_RETURN_IF_ERROR(stepper->InitializeDeferredState());  // nothing to restore
  }
  std::unique_ptr<CheckpointedOptimizer> checkpointed(
      new CheckpointedOptimizer(std::move(stepper), std::move(engine).value()));
  checkpointed->embeddings_ = std::move(checkpointer);
  const std::vector<ParameterSlot>& live = checkpointed->stepper_->slots();
  for (std::size_t i = 0; i < live.size(); ++i) {
    const ParameterSlot& slot = live[i];
    auto unit = checkpointed->engine_->FindUnit(slot.name);
    if (!unit) {
      return Status(StatusCode::kInternal, "engine lost unit '" + slot.name + "'");
    }
    checkpointed->unit_of_slot_.push_back(*unit);
    std::uint32_t dense_unit = kNoUnit;
    if (is_table[i]) {
      if (auto found = checkpointed->engine_->FindUnit(frontend::DenseUnitName(slot.name))) {
        dense_unit = *found;
      }
      TableSlot table;
      table.slot = i;
      table.tracker = checkpointed->embeddings_->tracker(slot.name);
      if (table.tracker == nullptr) {
        return Status(StatusCode::kInternal,
                      "embedding checkpointer lost table '" + slot.name + "'");
      }
      table.mark_all =
          MovesRowsWithoutGradient(optimizer, slot.param, checkpointed->stepper_->kind());
      table.from_gradient = embeddings.rows == RowSource::kGradients;
      checkpointed->tables_.push_back(table);
    }
    checkpointed->dense_unit_of_slot_.push_back(dense_unit);
  }
  if (module != nullptr && embeddings.rows == RowSource::kLookups &&
      checkpointed->embeddings_ != nullptr) {
    PMSNAP_ASSIGN_OR_RETURN(std::vector<std::string> bound, checkpointed->TrackEmbeddings(*module));
    (void)bound;  // every table has a tracked module (checked above)
  }
  for (const runtime::UnitRegistration& unit : buffer_units) {
    auto id = checkpointed->engine_->FindUnit(unit.name);
    if (!id) return Status(StatusCode::kInternal, "engine lost unit '" + unit.name + "'");
    checkpointed->buffer_units_.push_back(*id);
  }
  checkpointed->buffers_ = std::move(buffers);
  checkpointed->update_mode_ = update_mode;
  if (update_mode == UpdateMode::kInBackward) {
    PMSNAP_RETURN_IF_ERROR(checkpointed->InstallBackwardHooks());
  }
  return checkpointed;
}

Status CheckpointedOptimizer::InstallBackwardHooks() {
  namespace impl = torch::autograd::impl;
  const std::vector<ParameterSlot>& slots = stepper_->slots();
  backward_ = {};
  backward_.updated.assign(slots.size(), false);
  hook_link_ = std::make_shared<HookLink>(HookLink{this});
  try {
    for (std::size_t i = 0; i < slots.size(); ++i) {
      const torch::Tensor& param = slots[i].param;
      std::unique_ptr<torch::autograd::PostAccumulateGradHook> previous;
      if (impl::get_autograd_meta(param) != nullptr) {
        previous = std::move(impl::post_acc_grad_hooks(param));
      }
      impl::set_post_acc_grad_hooks(
          param, std::make_unique<BackwardHook>(hook_link_, i, std::move(previous)));
    }
  } catch (const c10::Error& error) {
    RemoveBackwardHooks();
    return Status(StatusCode::kInvalidArgument,
                  std::string("setting the parameters' post-accumulate-grad hooks: libtorch: ") +
                      error.what_without_backtrace());
  }
  return Status::Ok();
}

void CheckpointedOptimizer::RemoveBackwardHooks() {
  namespace impl = torch::autograd::impl;
  if (hook_link_ == nullptr) return;
  hook_link_->owner = nullptr;
  for (const ParameterSlot& slot : stepper_->slots()) {
    try {
      if (impl::get_autograd_meta(slot.param) == nullptr) continue;
      auto& installed = impl::post_acc_grad_hooks(slot.param);
      // A hook set after ours replaced it (and owns it, if at all): left alone.
      auto* ours = dynamic_cast<BackwardHook*>(installed.get());
      if (ours != nullptr && ours->link() == hook_link_.get()) installed = ours->TakePrevious();
    } catch (const c10::Error&) {
      // The hook stays, unlinked: it only calls the one it replaced.
    }
  }
  hook_link_.reset();
}

void CheckpointedOptimizer::UpdateInBackward(std::size_t index) {
  BackwardStep& b = backward_;
  if (b.updated[index]) {
    // Thrown, since nothing else stops backward(); the autograd engine
    // rethrows it from backward().
    throw c10::ValueError(
        {__func__, __FILE__, static_cast<std::uint32_t>(__LINE__)},
        "pmsnap: parameter '" + stepper_->slots()[index].name +
            "' got a second gradient before Step(): with UpdateMode::kInBackward each "
            "parameter is updated as soon as its gradient is accumulated, so accumulating "
            "gradients over several backward passes would change the result; call Step() "
            "after every backward pass, or use UpdateMode::kInStep");
  }
  if (!b.begun) {
    b.begun = true;
    // What Step checks first; Step reports a failure, with nothing updated.
    Status checked = stepper_->CheckUnchanged();
    if (checked.ok()) checked = stepper_->InitializeDeferredState();
    if (!checked.ok()) {
      b.refused = true;
      return;
    }
    stepped_ = true;
    b.begin = engine_->BeginStep(iteration_ + 1);
    b.observed = b.begin.ok();
  }
  if (b.refused) return;
  // Before the table's update: its capture takes the rows marked so far.
  // Marked even when unobserved, as Step does: a later differential
  // checkpoint must still see the rows this update changes.
  for (const TableSlot& table : tables_) {
    if (table.slot != index) continue;
    Status marked = MarkTableRows(table);
    if (b.marked.ok()) b.marked = marked;
  }
  EngineObserver observer(*engine_, unit_of_slot_, dense_unit_of_slot_);
  Status update = stepper_->StepOne(index, b.observed ? &observer : nullptr);
  b.updated[index] = true;
  if (!update.ok()) {
    // The rest of the iteration's updates run unobserved; Step returns it.
    if (b.error.ok()) b.error = update;
    b.observed = false;
  }
}

Status CheckpointedOptimizer::FinishBackwardStep(std::span<const std::byte> extra_state) {
  BackwardStep b = std::exchange(backward_, {});
  backward_.updated.assign(b.updated.size(), false);
  const std::uint64_t step = iteration_ + 1;
  Status marked = MarkTableRows(&b.updated);
  if (!b.marked.ok()) marked = b.marked;
  EngineObserver observer(*engine_, unit_of_slot_, dense_unit_of_slot_);
  // The parameters whose hook did not fire: a gradient set by hand, or one
  // that does not require grad.
  Status update = stepper_->Step(b.observed ? &observer : nullptr, b.updated);
  Status captured = CaptureBuffers(b.observed && update.ok());
  // Part of the iteration was done in backward: it counts, whatever failed.
  iteration_ = step;
  if (!b.begin.ok()) return b.begin;
  if (update.code() == StatusCode::kFailedPrecondition) return update;
  Status end = engine_->EndStep(extra_state);
  if (!b.error.ok()) return b.error;
  if (!update.ok()) return update;
  if (!captured.ok()) return captured;
  return end.ok() ? marked : end;
}

Status CheckpointedOptimizer::Step(std::span<const std::byte> extra_state) {
  if (backward_.begun && !backward_.refused) return FinishBackwardStep(extra_state);
  // No hook fired (or the first one refused): a whole step, as in kInStep.
  if (backward_.begun) {
    backward_.begun = backward_.refused = false;
  }
  // Checked before BeginStep so that a refused step leaves no trace.
  PMSNAP_RETURN_IF_ERROR(stepper_->CheckUnchanged());
  // Training without a restore: the state gets its initial values before the
  // first checkpoint can capture it.
  PMSNAP_RETURN_IF_ERROR(stepper_->InitializeDeferredState());
  const std::uint64_t step = iteration_ + 1;
  stepped_ = true;
  // Before any table's update: its capture takes the rows marked so far.
  Status marked = MarkTableRows();
  Status begin = engine_->BeginStep(step);
  EngineObserver observer(*engine_, unit_of_slot_, dense_unit_of_slot_);
  // Without a step boundary the engine's hooks would be out of order: still
  // update the model (training must not depend on checkpointing), unhooked.
  Status update = stepper_->Step(begin.ok() ? &observer : nullptr);
  Status captured = CaptureBuffers(begin.ok() && update.ok());
  iteration_ = step;
  if (!begin.ok()) return begin;
  if (update.code() == StatusCode::kFailedPrecondition) return update;
  Status end = engine_->EndStep(extra_state);
  if (!update.ok()) return update;
  if (!captured.ok()) return captured;
  return end.ok() ? marked : end;
}

Result<RestoreInfo> CheckpointedOptimizer::Restore() {
  if (stepped_) {
    return Status(StatusCode::kFailedPrecondition,
                  "Restore must come before the first Step: training already changed the "
                  "registered tensors");
  }
  // The restore writes to the addresses registered at Create: a parameter
  // replaced since (set_data) would silently keep its new values.
  PMSNAP_RETURN_IF_ERROR(stepper_->CheckUnchanged());
  Result<runtime::RestoreResult> restored_or = engine_->Restore();
  if (!restored_or.ok()) {
    // Whatever the failed restore left, the state starts from its initial values.
    (void)stepper_->InitializeDeferredState();
    return restored_or.status();
  }
  runtime::RestoreResult restored = std::move(restored_or).value();
  stepper_->DiscardDeferredState();  // every registered tensor was overwritten
  PMSNAP_RETURN_IF_ERROR(stepper_->SyncFromSlots());
  PMSNAP_RETURN_IF_ERROR(buffers_.RestoreInto());
  iteration_ = restored.iteration;
  RestoreInfo info;
  info.iteration = restored.iteration;
  info.epoch = restored.epoch;
  info.extra_state = std::move(restored.extra_state);
  return info;
}

Status CheckpointedOptimizer::CaptureBuffers(bool observed) {
  if (buffers_.empty()) return Status::Ok();
  if (observed) {
    for (std::uint32_t unit : buffer_units_) PMSNAP_RETURN_IF_ERROR(engine_->BeforeUpdate(unit));
  }
  PMSNAP_RETURN_IF_ERROR(buffers_.Capture());
  if (observed) {
    for (std::uint32_t unit : buffer_units_) PMSNAP_RETURN_IF_ERROR(engine_->AfterUpdate(unit));
  }
  return Status::Ok();
}

Status CheckpointedOptimizer::Flush() { return engine_->Flush(); }

Status CheckpointedOptimizer::Close(runtime::CloseMode mode) {
  RemoveBackwardHooks();
  return engine_->Close(mode);
}

Result<RestoreInfo> RestoreFromPool(const torch::nn::Module& module,
                                    torch::optim::Optimizer& optimizer,
                                    runtime::EngineOptions options, EmbeddingTables embeddings,
                                    BufferMode buffers) {
  std::error_code error;
  if (!std::filesystem::exists(options.pool_path, error)) {
    return Status(StatusCode::kNotFound, "no pool at " + options.pool_path);
  }
  // No step follows: nothing needs to mark rows.
  embeddings.rows = RowSource::kGradients;
  PMSNAP_ASSIGN_OR_RETURN(
      std::unique_ptr<CheckpointedOptimizer> checkpointed,
      CheckpointedOptimizer::Create(module, optimizer, std::move(options), std::move(embeddings),
                                    UpdateMode::kInStep, buffers));
  PMSNAP_ASSIGN_OR_RETURN(RestoreInfo info, checkpointed->Restore());
  PMSNAP_RETURN_IF_ERROR(checkpointed->Close(runtime::CloseMode::kAbandon));
  return info;
}

}  // namespace pmsnap::hooks
