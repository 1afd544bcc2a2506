// ParameterStepper: see parameter_stepper.h. libtorch throws c10::Error;
// every public entry point catches it here and returns a Status.
#include "pmsnap/hooks/parameter_stepper.h"

#include <c10/util/Exception.h>
#include <c10/util/string_utils.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <new>
#include <unordered_map>
#include <unordered_set>

#include "pmsnap/common/page_prefault.h"
#include "pmsnap/hooks/optimizer_state.h"
#include "libtorch_error.h"
#include "state_arena.h"

namespace pmsnap::hooks {
namespace {

namespace optim = torch::optim;

// libtorch's own key for a parameter's state (see e.g. optim/adam.cpp).
void* StateKeyOf(const torch::Tensor& param) { return param.unsafeGetTensorImpl(); }

Result<OptimizerKind> KindOf(optim::Optimizer& optimizer) {
  // AdamW does not derive from Adam in libtorch, so the order is irrelevant.
  if (dynamic_cast<optim::SGD*>(&optimizer)) return OptimizerKind::kSgd;
  if (dynamic_cast<optim::Adam*>(&optimizer)) return OptimizerKind::kAdam;
  if (dynamic_cast<optim::AdamW*>(&optimizer)) return OptimizerKind::kAdamW;
  if (dynamic_cast<optim::Adagrad*>(&optimizer)) return OptimizerKind::kAdagrad;
  if (dynamic_cast<optim::RMSprop*>(&optimizer)) return OptimizerKind::kRmsprop;
  return Status(StatusCode::kInvalidArgument,
                "unsupported optimizer: pmsnap wraps torch::optim SGD, Adam, AdamW, Adagrad "
                "and RMSprop");
}

// A tensor shaped and laid out like `param` holding `source`, or else `fill`
// (now, or later through `deferred` when given), at a stable address.
torch::Tensor OwnedLike(const torch::Tensor& param, const torch::Tensor& source, double fill,
                        std::vector<std::pair<torch::Tensor, double>>* deferred,
                        StateArena& arena) {
  if (source.defined() && source.is_contiguous() && source.sizes() == param.sizes() &&
      source.dtype() == param.dtype() && source.device() == param.device() &&
      source.storage_offset() == 0 && source.storage().nbytes() == source.nbytes()) {
    // libtorch updates its state in place, so a tensor that owns exactly its
    // storage already has a stable address: taken over, not copied.
    return source;
  }
  torch::Tensor owned = arena.EmptyLike(param);
  if (source.defined()) {
    owned.copy_(source);
  } else if (deferred != nullptr) {
    deferred->emplace_back(owned, fill);
  } else {
    owned.fill_(fill);
  }
  return owned;
}

torch::Tensor StepTensor(int64_t step) {
  return torch::full({1}, step, torch::TensorOptions().dtype(torch::kInt64));
}

std::int64_t& StepOf(ParameterSlot& slot) {
  // "step" is always the last state tensor (see AdoptOrCreateState).
  return *slot.state.back().second.data_ptr<std::int64_t>();
}

template <typename State>
State& StateAs(optim::Optimizer& optimizer, void* key) {
  return static_cast<State&>(*optimizer.state().at(key));
}

// Elements per block of a blocked update: a multiple of 64, so that ATen's
// vectorized loops (at most 2 x 16 floats per iteration) leave the same
// elements to their scalar tail in a block as in the whole tensor.
std::size_t BlockElements(std::size_t block_bytes, std::size_t element_size) {
  return block_bytes / element_size / 64 * 64;
}

// Runs `update(range, decayed_grad, temporary)` over consecutive blocks of
// `params` (the flattened parameter, Flat) and `grad`: `range(t)` is the
// block of `t`, a flattened tensor shaped like params; `decayed_grad` the
// block's gradient plus weight_decay * param (the gradient itself when
// weight_decay is 0); `temporary` a block-sized scratch tensor. Every
// operation of libtorch's update is elementwise, so each element sees
// exactly the arithmetic of the unblocked step.
template <typename Update>
void ForEachBlock(const torch::Tensor& params, const torch::Tensor& grad, double weight_decay,
                  std::size_t block_bytes, torch::Tensor& scratch, Update&& update) {
  torch::NoGradGuard no_grad;
  const std::int64_t block =
      static_cast<std::int64_t>(BlockElements(block_bytes, params.element_size()));
  if (!scratch.defined() || scratch.dtype() != params.dtype() || scratch.numel() < 2 * block) {
    scratch = torch::empty({2 * block}, params.options());
  }
  const torch::Tensor g = grad.view({-1});
  const std::int64_t n = params.numel();
  for (std::int64_t begin = 0; begin < n; begin += block) {
    const std::int64_t length = std::min(block, n - begin);
    auto range = [&](const torch::Tensor& flat) { return flat.narrow(0, begin, length); };
    torch::Tensor g_block = g.narrow(0, begin, length);
    if (weight_decay != 0) {
      // libtorch: grad = grad.add(p, weight_decay), a temporary per step.
      torch::Tensor decayed = scratch.narrow(0, block, length);
      g_block = at::add_out(decayed, g_block, range(params), weight_decay);
    }
    update(range, g_block, scratch.narrow(0, 0, length));
  }
}

torch::Tensor Flat(const torch::Tensor& t) { return t.defined() ? t.view({-1}) : t; }

// libtorch's Adam and AdamW update of one parameter (torch/optim/adam.cpp,
// adamw.cpp: the same ATen operations on the same scalars, in the same
// order), block by block.
template <typename Options, typename State>
void BlockedAdamUpdate(const Options& options, State& state, bool decoupled_decay,
                       const torch::Tensor& param, const torch::Tensor& grad,
                       std::size_t block_bytes, torch::Tensor& scratch) {
  state.step(state.step() + 1);
  const double beta1 = std::get<0>(options.betas());
  const double beta2 = std::get<1>(options.betas());
  const double bias_correction1 = 1 - std::pow(beta1, state.step());
  const double bias_correction2 = 1 - std::pow(beta2, state.step());
  const double denom_scale = std::sqrt(bias_correction2);
  const double step_size = options.lr() / bias_correction1;
  const double decay_factor = 1 - options.lr() * options.weight_decay();
  const bool amsgrad = options.amsgrad();
  const bool decay_param = decoupled_decay && options.weight_decay() != 0;
  const torch::Tensor params = Flat(param);
  const torch::Tensor exp_avg = Flat(state.exp_avg());
  const torch::Tensor exp_avg_sq = Flat(state.exp_avg_sq());
  const torch::Tensor max_exp_avg_sq = Flat(state.max_exp_avg_sq());
  ForEachBlock(params, grad, decoupled_decay ? 0.0 : options.weight_decay(), block_bytes, scratch,
               [&](const auto& range, const torch::Tensor& g, torch::Tensor denom) {
                 torch::Tensor p = range(params);
                 torch::Tensor m = range(exp_avg);
                 torch::Tensor v = range(exp_avg_sq);
                 if (decay_param) p.mul_(decay_factor);
                 m.mul_(beta1).add_(g, 1 - beta1);
                 v.mul_(beta2).addcmul_(g, g, 1 - beta2);
                 if (amsgrad) {
                   torch::Tensor v_max = range(max_exp_avg_sq);
                   at::max_out(v_max, v, v_max);
                   at::sqrt_out(denom, v_max);
                 } else {
                   at::sqrt_out(denom, v);
                 }
                 denom.div_(denom_scale).add_(options.eps());
                 p.addcdiv_(m, denom, -step_size);
               });
}

// libtorch's dense Adagrad update (torch/optim/adagrad.cpp), block by block.
void BlockedAdagradUpdate(const optim::AdagradOptions& options, optim::AdagradParamState& state,
                          const torch::Tensor& param, const torch::Tensor& grad,
                          std::size_t block_bytes, torch::Tensor& scratch) {
  state.step(state.step() + 1);
  const double clr =
      options.lr() / (1 + static_cast<double>(state.step() - 1) * options.lr_decay());
  const torch::Tensor params = Flat(param);
  const torch::Tensor sums = Flat(state.sum());
  ForEachBlock(params, grad, options.weight_decay(), block_bytes, scratch,
               [&](const auto& range, const torch::Tensor& g, torch::Tensor std_dev) {
                 torch::Tensor p = range(params);
                 torch::Tensor sum = range(sums);
                 sum.addcmul_(g, g, 1.0);
                 at::sqrt_out(std_dev, sum);
                 std_dev.add_(options.eps());
                 p.addcdiv_(g, std_dev, -clr);
               });
}

}  // namespace

const char* OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgd:
      return "SGD";
    case OptimizerKind::kAdam:
      return "Adam";
    case OptimizerKind::kAdamW:
      return "AdamW";
    case OptimizerKind::kAdagrad:
      return "Adagrad";
    case OptimizerKind::kRmsprop:
      return "RMSprop";
  }
  return "unknown";
}

ParameterStepper::ParameterStepper(optim::Optimizer& optimizer, OptimizerKind kind)
    : optimizer_(optimizer), kind_(kind), state_arena_(std::make_unique<StateArena>()) {}

ParameterStepper::~ParameterStepper() { FinishPrefault(); }

Result<std::unique_ptr<ParameterStepper>> ParameterStepper::Create(
    optim::Optimizer& optimizer,
    const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters,
    NewState new_state) {
  PMSNAP_ASSIGN_OR_RETURN(OptimizerKind kind, KindOf(optimizer));
  std::unique_ptr<ParameterStepper> stepper(new ParameterStepper(optimizer, kind));
  stepper->defer_new_state_ = new_state == NewState::kDeferred;
  try {
    std::unordered_map<const void*, std::string> names;
    for (const auto& [name, tensor] : named_parameters) {
      names.emplace(tensor.unsafeGetTensorImpl(), name);
    }
    std::unordered_set<const void*> seen;
    auto& groups = optimizer.param_groups();
    for (std::size_t g = 0; g < groups.size(); ++g) {
      auto& params = groups[g].params();
      for (std::size_t i = 0; i < params.size(); ++i) {
        const torch::Tensor& p = params[i];
        auto found = names.find(p.unsafeGetTensorImpl());
        std::string name = found != names.end()
                               ? found->second
                               : "group" + std::to_string(g) + ".param" + std::to_string(i);
        if (!p.defined()) {
          return Status(StatusCode::kInvalidArgument, "parameter '" + name + "' is undefined");
        }
        if (!seen.insert(p.unsafeGetTensorImpl()).second) {
          return Status(StatusCode::kInvalidArgument,
                        "parameter '" + name + "' appears twice in the optimizer");
        }
        if (!p.device().is_cpu()) {
          return Status(StatusCode::kInvalidArgument,
                        "parameter '" + name + "' is on " + p.device().str() +
                            ": the libtorch hooks support CPU tensors");
        }
        if (!p.is_contiguous()) {
          return Status(StatusCode::kInvalidArgument,
                        "parameter '" + name + "' is not contiguous: pmsnap copies raw bytes");
        }
        stepper->slots_.push_back({std::move(name), p, {}});
        stepper->state_keys_.push_back(StateKeyOf(p));
        stepper->has_momentum_.push_back(false);
        stepper->group_of_slot_.push_back(g);
        stepper->registered_data_.push_back(p.data_ptr());
        PMSNAP_RETURN_IF_ERROR(
            stepper->AdoptOrCreateState(stepper->slots_.size() - 1, groups[g].options()));
      }
    }
    // The engine is given these tensors' addresses and copies from them in
    // the background after a step returns; a parameter whose data the user
    // replaces (set_data, `p.data = ...`) meanwhile would otherwise drop its
    // storage's last reference under that copy.
    for (const ParameterSlot& slot : stepper->slots_) {
      stepper->held_storage_.push_back(slot.param.storage());
      for (const auto& [role, tensor] : slot.state) {
        stepper->held_storage_.push_back(tensor.storage());
      }
    }
  } catch (const c10::Error& error) {
    return LibtorchError("registering optimizer state", error);
  }
  return stepper;
}

// Gives slot `index` its state tensors: copies of libtorch's state if it has
// some for the parameter, else what libtorch would create on the first
// update. Installs them in libtorch's state map, so libtorch updates the
// stepper's tensors in place from then on.
Status ParameterStepper::AdoptOrCreateState(std::size_t index,
                                            const optim::OptimizerOptions& options) {
  ParameterSlot& slot = slots_[index];
  const torch::Tensor& p = slot.param;
  void* const key = state_keys_[index];
  auto& state_map = optimizer_.state();
  auto existing = state_map.find(key);
  const bool has_state = existing != state_map.end();
  torch::NoGradGuard no_grad;
  auto* deferred = defer_new_state_ ? &deferred_fills_ : nullptr;
  auto owned_like = [&](const torch::Tensor& source, double fill) {
    return OwnedLike(p, source, fill, deferred, *state_arena_);
  };

  switch (kind_) {
    case OptimizerKind::kSgd: {
      const auto& o = static_cast<const optim::SGDOptions&>(options);
      has_momentum_[index] = o.momentum() != 0;
      torch::Tensor old_buffer;
      if (has_state) {
        old_buffer = static_cast<optim::SGDParamState&>(*existing->second).momentum_buffer();
      }
      if (has_momentum_[index]) {
        torch::Tensor buffer = owned_like(old_buffer, 0.0);
        slot.state.emplace_back("momentum_buffer", buffer);
        // Without existing state libtorch still owns initialisation (a clone
        // of the first gradient): AfterOptimizerStep adopts it.
        if (has_state && old_buffer.defined()) {
          StateAs<optim::SGDParamState>(optimizer_, key).momentum_buffer(buffer);
        }
      }
      slot.state.emplace_back("step", StepTensor(old_buffer.defined() ? 1 : 0));
      return Status::Ok();
    }
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW: {
      // AdamParamState and AdamWParamState have the same fields; handle both.
      auto fill = [&](auto* state, bool amsgrad) {
        auto& s = *state;
        torch::Tensor exp_avg = owned_like(s.exp_avg(), 0.0);
        torch::Tensor exp_avg_sq = owned_like(s.exp_avg_sq(), 0.0);
        s.exp_avg(exp_avg);
        s.exp_avg_sq(exp_avg_sq);
        slot.state.emplace_back("exp_avg", exp_avg);
        slot.state.emplace_back("exp_avg_sq", exp_avg_sq);
        if (amsgrad) {
          torch::Tensor max_sq = owned_like(s.max_exp_avg_sq(), 0.0);
          s.max_exp_avg_sq(max_sq);
          slot.state.emplace_back("max_exp_avg_sq", max_sq);
        }
        slot.state.emplace_back("step", StepTensor(s.step()));
      };
      if (kind_ == OptimizerKind::kAdam) {
        if (!has_state) state_map[key] = std::make_unique<optim::AdamParamState>();
        fill(&StateAs<optim::AdamParamState>(optimizer_, key),
             static_cast<const optim::AdamOptions&>(options).amsgrad());
      } else {
        if (!has_state) state_map[key] = std::make_unique<optim::AdamWParamState>();
        fill(&StateAs<optim::AdamWParamState>(optimizer_, key),
             static_cast<const optim::AdamWOptions&>(options).amsgrad());
      }
      return Status::Ok();
    }
    case OptimizerKind::kAdagrad: {
      const auto& o = static_cast<const optim::AdagradOptions&>(options);
      if (!has_state) state_map[key] = std::make_unique<optim::AdagradParamState>();
      auto& s = StateAs<optim::AdagradParamState>(optimizer_, key);
      torch::Tensor sum = owned_like(s.sum(), o.initial_accumulator_value());
      s.sum(sum);
      slot.state.emplace_back("sum", sum);
      slot.state.emplace_back("step", StepTensor(s.step()));
      return Status::Ok();
    }
    case OptimizerKind::kRmsprop: {
      const auto& o = static_cast<const optim::RMSpropOptions&>(options);
      if (!has_state) state_map[key] = std::make_unique<optim::RMSpropParamState>();
      auto& s = StateAs<optim::RMSpropParamState>(optimizer_, key);
      torch::Tensor square_avg = owned_like(s.square_avg(), 0.0);
      s.square_avg(square_avg);
      slot.state.emplace_back("square_avg", square_avg);
      if (o.momentum() > 0) {
        torch::Tensor buffer = owned_like(s.momentum_buffer(), 0.0);
        s.momentum_buffer(buffer);
        slot.state.emplace_back("momentum_buffer", buffer);
      }
      if (o.centered()) {
        torch::Tensor grad_avg = owned_like(s.grad_avg(), 0.0);
        s.grad_avg(grad_avg);
        slot.state.emplace_back("grad_avg", grad_avg);
      }
      slot.state.emplace_back("step", StepTensor(s.step()));
      return Status::Ok();
    }
  }
  return Status(StatusCode::kInternal, "unknown optimizer kind");
}

Status ParameterStepper::CheckUnchanged() const {
  std::size_t index = 0;
  for (const auto& group : optimizer_.param_groups()) {
    for (const auto& p : group.params()) {
      if (index >= slots_.size()) {
        return Status(StatusCode::kFailedPrecondition,
                      "the optimizer gained parameters after checkpointing started (" +
                          std::to_string(slots_.size()) +
                          " registered): register every parameter group before creating the "
                          "checkpointed optimizer, and use a new pool for the new model");
      }
      const ParameterSlot& slot = slots_[index];
      if (!p.defined() || p.unsafeGetTensorImpl() != slot.param.unsafeGetTensorImpl() ||
          p.data_ptr() != registered_data_[index]) {
        return Status(StatusCode::kFailedPrecondition,
                      "parameter '" + slot.name +
                          "' was replaced or reallocated after checkpointing started (e.g. "
                          "its dtype, shape or device changed): the pool holds the registered "
                          "tensor");
      }
      ++index;
    }
  }
  if (index != slots_.size()) {
    return Status(StatusCode::kFailedPrecondition,
                  "the optimizer lost parameters after checkpointing started (" +
                      std::to_string(slots_.size()) + " registered, " + std::to_string(index) +
                      " now)");
  }
  return Status::Ok();
}

// Right after libtorch updated slot `index`, before its after-hook: brings
// the stepper's tensors in line with libtorch's state.
void ParameterStepper::AfterOptimizerStep(std::size_t index) {
  ParameterSlot& slot = slots_[index];
  void* const key = state_keys_[index];
  switch (kind_) {
    case OptimizerKind::kSgd: {
      if (has_momentum_[index]) {
        auto& s = StateAs<optim::SGDParamState>(optimizer_, key);
        torch::Tensor& buffer = slot.state.front().second;
        if (!s.momentum_buffer().is_same(buffer)) {
          // libtorch just created the buffer as a clone of the first gradient.
          buffer.copy_(s.momentum_buffer());
          s.momentum_buffer(buffer);
        }
      }
      ++StepOf(slot);
      return;
    }
    case OptimizerKind::kAdam:
      StepOf(slot) = StateAs<optim::AdamParamState>(optimizer_, key).step();
      return;
    case OptimizerKind::kAdamW:
      StepOf(slot) = StateAs<optim::AdamWParamState>(optimizer_, key).step();
      return;
    case OptimizerKind::kAdagrad:
      StepOf(slot) = StateAs<optim::AdagradParamState>(optimizer_, key).step();
      return;
    case OptimizerKind::kRmsprop:
      StepOf(slot) = StateAs<optim::RMSpropParamState>(optimizer_, key).step();
      return;
  }
}

Status ParameterStepper::InitializeDeferredState() {
  FinishPrefault();
  try {
    torch::NoGradGuard no_grad;
    while (!deferred_fills_.empty()) {
      deferred_fills_.back().first.fill_(deferred_fills_.back().second);
      deferred_fills_.pop_back();
    }
  } catch (const c10::Error& error) {
    return LibtorchError("initializing optimizer state", error);
  }
  return Status::Ok();
}

void ParameterStepper::DiscardDeferredState() {
  FinishPrefault();
  deferred_fills_.clear();
}

void ParameterStepper::StartPrefault() {
  if (prefault_ != nullptr) return;
  try {
    std::vector<PrefaultRange> ranges;
    for (const auto& [tensor, fill] : deferred_fills_) {
      if (tensor.is_cpu()) {
        ranges.push_back({static_cast<std::byte*>(tensor.data_ptr()), tensor.nbytes()});
      }
    }
    // Touches rather than MADV_POPULATE_WRITE: beside libpmemobj's open
    // (which maps and unmaps) that madvise ran up to ten times slower on a
    // 740 MB state. Pieces of a huge page, so the two threads split evenly.
    prefault_ = std::make_unique<PagePrefaulter>(ranges, PrefaultMethod::kTouch,
                                                 StateArena::kHugePageBytes);
  } catch (const std::bad_alloc&) {
    // Only a head start: the first writes fault the pages in as before.
  }
}

void ParameterStepper::FinishPrefault() {
  if (prefault_ == nullptr) return;
  prefault_->Finish();
  prefault_.reset();
}

Status ParameterStepper::Step(StepObserver* observer) {
  return Step(observer, std::vector<bool>(slots_.size(), false));
}

Status ParameterStepper::Step(StepObserver* observer, const std::vector<bool>& skip) {
  if (skip.size() != slots_.size()) {
    return Status(StatusCode::kInvalidArgument, "step: " + std::to_string(skip.size()) +
                                                    " skip entries for " +
                                                    std::to_string(slots_.size()) + " parameters");
  }
  PMSNAP_RETURN_IF_ERROR(CheckUnchanged());
  PMSNAP_RETURN_IF_ERROR(InitializeDeferredState());
  // Last slot first: the order backward produces gradients.
  std::vector<std::size_t> indices;
  indices.reserve(slots_.size());
  for (std::size_t i = slots_.size(); i-- > 0;) {
    if (!skip[i]) indices.push_back(i);
  }
  return UpdateSlots(observer, indices);
}

Status ParameterStepper::StepOne(std::size_t index, StepObserver* observer) {
  if (index >= slots_.size()) {
    return Status(StatusCode::kInvalidArgument, "step of parameter " + std::to_string(index) +
                                                    " of " + std::to_string(slots_.size()));
  }
  PMSNAP_RETURN_IF_ERROR(InitializeDeferredState());
  if (!slots_[index].param.grad().defined()) return Status::Ok();
  return UpdateSlots(observer, {index});
}

Status ParameterStepper::UpdateSlots(StepObserver* observer,
                                     const std::vector<std::size_t>& indices) {
  // Hide every gradient so that the optimizer's step() touches exactly the
  // one parameter whose gradient is shown.
  std::vector<torch::Tensor> grads(slots_.size());
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    grads[i] = slots_[i].param.grad();
    if (grads[i].defined()) slots_[i].param.mutable_grad() = torch::Tensor();
  }
  Status status;
  try {
    status = StepLocked(observer, grads, indices);
  } catch (const c10::Error& error) {
    status = LibtorchError("optimizer step", error);
  }
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    slots_[i].param.mutable_grad() = grads[i];
  }
  return status;
}

Status ParameterStepper::StepLocked(StepObserver* observer, const std::vector<torch::Tensor>& grads,
                                    const std::vector<std::size_t>& indices) {
  Status first_error;
  for (const std::size_t i : indices) {
    if (!grads[i].defined()) continue;  // no gradient: libtorch would skip it too
    if (observer != nullptr) {
      first_error = observer->BeforeUpdate(i);
      if (!first_error.ok()) observer = nullptr;
    }
    if (UsesBlockedStep(i, grads[i])) {
      BlockedStep(i, grads[i]);
    } else {
      torch::Tensor& param = slots_[i].param;
      param.mutable_grad() = grads[i];
      optimizer_.step();
      param.mutable_grad() = torch::Tensor();
    }
    AfterOptimizerStep(i);
    if (observer != nullptr) {
      first_error = observer->AfterUpdate(i);
      if (!first_error.ok()) observer = nullptr;
    }
  }
  return first_error;
}

bool ParameterStepper::UsesBlockedStep(std::size_t index, const torch::Tensor& grad) const {
  if (kind_ != OptimizerKind::kAdam && kind_ != OptimizerKind::kAdamW &&
      kind_ != OptimizerKind::kAdagrad) {
    return false;
  }
  const torch::Tensor& param = slots_[index].param;
  const std::size_t block_elements = BlockElements(block_bytes_, param.element_size());
  // A sparse or oddly shaped gradient goes to libtorch, which handles or reports it.
  return block_elements > 0 && param.numel() > static_cast<std::int64_t>(block_elements) &&
         param.nbytes() >= min_blocked_bytes_ && param.is_floating_point() &&
         grad.layout() == torch::kStrided && grad.is_contiguous() &&
         grad.sizes() == param.sizes() && grad.dtype() == param.dtype() &&
         grad.device() == param.device();
}

void ParameterStepper::BlockedStep(std::size_t index, const torch::Tensor& grad) {
  ++blocked_updates_;
  const auto& options = optimizer_.param_groups()[group_of_slot_[index]].options();
  void* const key = state_keys_[index];
  const torch::Tensor& param = slots_[index].param;
  switch (kind_) {
    case OptimizerKind::kAdam:
      BlockedAdamUpdate(static_cast<const optim::AdamOptions&>(options),
                        StateAs<optim::AdamParamState>(optimizer_, key), /*decoupled_decay=*/false,
                        param, grad, block_bytes_, block_scratch_);
      return;
    case OptimizerKind::kAdamW:
      BlockedAdamUpdate(static_cast<const optim::AdamWOptions&>(options),
                        StateAs<optim::AdamWParamState>(optimizer_, key), /*decoupled_decay=*/true,
                        param, grad, block_bytes_, block_scratch_);
      return;
    case OptimizerKind::kAdagrad:
      BlockedAdagradUpdate(static_cast<const optim::AdagradOptions&>(options),
                           StateAs<optim::AdagradParamState>(optimizer_, key), param, grad,
                           block_bytes_, block_scratch_);
      return;
    case OptimizerKind::kSgd:
    case OptimizerKind::kRmsprop:
      break;  // UsesBlockedStep excludes them
  }
}

Status ParameterStepper::SyncFromSlots() {
  try {
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      ParameterSlot& slot = slots_[i];
      void* const key = state_keys_[i];
      const std::int64_t step = StepOf(slot);
      switch (kind_) {
        case OptimizerKind::kSgd: {
          if (!has_momentum_[i]) break;
          auto& state_map = optimizer_.state();
          if (step == 0) {
            // Never updated: libtorch must clone the first gradient itself.
            state_map.erase(key);
          } else {
            if (state_map.find(key) == state_map.end()) {
              state_map[key] = std::make_unique<optim::SGDParamState>();
            }
            StateAs<optim::SGDParamState>(optimizer_, key)
                .momentum_buffer(slot.state.front().second);
          }
          break;
        }
        case OptimizerKind::kAdam:
          StateAs<optim::AdamParamState>(optimizer_, key).step(step);
          break;
        case OptimizerKind::kAdamW:
          StateAs<optim::AdamWParamState>(optimizer_, key).step(step);
          break;
        case OptimizerKind::kAdagrad:
          StateAs<optim::AdagradParamState>(optimizer_, key).step(step);
          break;
        case OptimizerKind::kRmsprop:
          StateAs<optim::RMSpropParamState>(optimizer_, key).step(step);
          break;
      }
    }
  } catch (const c10::Error& error) {
    return LibtorchError("restoring optimizer state", error);
  } catch (const std::out_of_range&) {
    return Status(StatusCode::kInternal, "optimizer state vanished after registration");
  }
  return Status::Ok();
}

OptimizerStateView ViewOptimizerState(optim::Optimizer& optimizer, const torch::Tensor& param) {
  OptimizerStateView view;
  auto it = optimizer.state().find(StateKeyOf(param));
  if (it == optimizer.state().end()) return view;
  view.present = true;
  auto add = [&](const torch::Tensor& t) {
    if (t.defined()) view.tensors.push_back(t);
  };
  optim::OptimizerParamState* state = it->second.get();
  if (auto* sgd = dynamic_cast<optim::SGDParamState*>(state)) {
    add(sgd->momentum_buffer());
  } else if (auto* adam = dynamic_cast<optim::AdamParamState*>(state)) {
    add(adam->exp_avg()), add(adam->exp_avg_sq()), add(adam->max_exp_avg_sq());
    view.step = adam->step();
  } else if (auto* adamw = dynamic_cast<optim::AdamWParamState*>(state)) {
    add(adamw->exp_avg()), add(adamw->exp_avg_sq()), add(adamw->max_exp_avg_sq());
    view.step = adamw->step();
  } else if (auto* adagrad = dynamic_cast<optim::AdagradParamState*>(state)) {
    add(adagrad->sum());
    view.step = adagrad->step();
  } else if (auto* rmsprop = dynamic_cast<optim::RMSpropParamState*>(state)) {
    add(rmsprop->square_avg()), add(rmsprop->momentum_buffer()), add(rmsprop->grad_avg());
    view.step = rmsprop->step();
  }
  return view;
}

}  // namespace pmsnap::hooks
