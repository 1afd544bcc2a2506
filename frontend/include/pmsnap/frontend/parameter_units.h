// The rules both CheckpointedOptimizers follow, in one place: the C++ one
// (hooks::CheckpointedOptimizer, libtorch) and the Python one
// (pmsnap.CheckpointedOptimizer, through the _pmsnap extension) call these
// functions, so a rule changed here changes for both.
//
//   * A parameter and its optimizer-state tensors make one unit, named after
//     the parameter, the parameter first (role kParamRole).
//   * An embedding table (a dense float32 [rows, dim] parameter) makes two:
//     the encoded unit "<name>" with the parameter and every state tensor
//     stored row by row with it (float32 [rows] or [rows, dim]: Adagrad's
//     sum, SGD's momentum buffer, Adam's moments), which diff/ checkpoints
//     row by row; and, when anything is left (the step count), the
//     fixed-slot unit "<name>#dense" (DenseUnitName) with the rest. Both are
//     hooked around the table's one update.
//   * Tensors in host memory beside device ones (TensorView::on_host: Adam's
//     `step`, which PyTorch keeps on the CPU next to GPU parameters unless
//     capturable or fused) move into a companion "<unit>#host" unit
//     (HostUnitName, UnitRegistration::on_host), hooked around the same
//     update: the engine copies them with the CPU and the device tensors
//     across the device, in the same epoch, each restored to where it lives.
//     A unit whose tensors are all on the host is itself on_host.
//   * A module's persistent buffers (BatchNorm's running statistics, every
//     buffer in its state_dict) make one unit, kBuffersUnit, a tensor per
//     buffer with the buffer's state_dict key as its role; host buffers of a
//     device model go into its "#host" companion as above. The front end
//     copies the buffers into registered shadows at each step boundary,
//     between that unit's hooks, so they are captured with the step's
//     parameters (forward changes them in place before the next step's
//     hooks could order it).
//   * An optimizer whose update changes rows that got no gradient (momentum,
//     weight decay, moving averages) makes every row of a table "changed"
//     each step (MovesRowsWithoutGradient): its checkpoints stay exact, the
//     differential policies just save nothing.
//
// What each front end keeps to itself, and why, is listed in
// docs/ARCHITECTURE.md ("Differences between the front ends"). These
// functions see tensors as runtime::TensorView (pointer, dtype, shape) and an
// optimizer as its class name plus two hyperparameters: no libtorch, which
// the Python extension must not link.
//
// Thread-safety: pure functions of their arguments; any thread.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pmsnap/common/status.h"
#include "pmsnap/runtime/engine.h"

namespace pmsnap::frontend {

// Role of the parameter itself in its unit (always the unit's first tensor).
inline constexpr std::string_view kParamRole = "param";

// The unit of a module's persistent buffers (file comment). '#' cannot
// start a parameter's name, so it never collides with one.
inline constexpr std::string_view kBuffersUnit = "#buffers";

// Whether `unit` holds module buffers: kBuffersUnit or its host companion.
bool IsBuffersUnit(std::string_view unit);

// The units of a module's persistent buffers, ready for
// runtime::Engine::Open: kBuffersUnit with every device buffer, then its
// HostUnitName companion with the host ones (TensorView::on_host); a unit of
// host buffers only is on_host itself. Each view's name is the buffer's
// state_dict key. None for no buffers. kInvalidArgument naming the buffer
// for an empty name or one given twice.
Result<std::vector<runtime::UnitRegistration>> BufferUnits(std::vector<runtime::TensorView> buffers);

// Name of embedding table `table`'s fixed-slot companion unit: "<table>#dense".
std::string DenseUnitName(std::string_view table);

// The table whose companion unit `unit` is ("emb.weight" for
// "emb.weight#dense"); nullopt for any other unit name. The view points into
// `unit`.
std::optional<std::string_view> TableOfDenseUnit(std::string_view unit);

// Name of unit `unit`'s host companion (its tensors in host memory):
// "<unit>#host".
std::string HostUnitName(std::string_view unit);

// The unit whose host companion `unit` is ("fc.weight" for
// "fc.weight#host", "emb.weight#dense" for "emb.weight#dense#host");
// nullopt for any other unit name. The view points into `unit`.
std::optional<std::string_view> UnitOfHostCompanion(std::string_view unit);

// The parameter whose companion unit `unit` is: "emb.weight" for
// "emb.weight#dense", "emb.weight#host" or "emb.weight#dense#host"; nullopt
// for a parameter's own unit. The view points into `unit`.
std::optional<std::string_view> ParameterOfCompanion(std::string_view unit);

// The companion units parameter `name` may have, in the order
// ParameterUnits lays them out after the parameter's own unit:
// "<name>#host", "<name>#dense", "<name>#dense#host". Readers of a pool
// append each one's tensors, where present, to the parameter's.
std::vector<std::string> CompanionUnitNames(std::string_view name);

// Ok if parameter `table` can be checkpointed as an embedding table: dense
// (`dense_layout`: not a sparse tensor) float32 of shape [rows, dim].
// `dtype_name` is torch's name without "torch." ("float32", "float64", ...).
// Else kInvalidArgument naming the table and what it is instead.
Status CheckTableParameter(std::string_view table, std::string_view dtype_name,
                           std::span<const std::int64_t> shape, bool dense_layout = true);

// Whether `tensor` is stored row by row with a table of `rows` rows (float32
// [rows] or [rows, dim]), so that it goes into the table's encoded unit.
bool IsRowTensor(const runtime::TensorView& tensor, std::int64_t rows);

// The units of parameter `name`, ready for runtime::Engine::Open. `tensors`
// holds the parameter (role kParamRole) first, then its optimizer-state
// tensors in the front end's order; the units keep that order. Not a table:
// one unit with every tensor. `embedding_table`: the encoded unit `name`
// (the parameter and its row tensors), then DenseUnitName(name) with the
// other tensors if there are any (file comment). Then each unit that mixes
// host and device tensors (TensorView::on_host) is followed by its
// HostUnitName companion with the host ones, and a unit of host tensors
// only is on_host itself. Errors: kInvalidArgument naming the parameter if
// `tensors` does not start with its kParamRole tensor, if a table's
// parameter is on the host (an encoded unit cannot be), or (a table)
// CheckTableParameter's.
Result<std::vector<runtime::UnitRegistration>> ParameterUnits(
    std::string_view name, std::vector<runtime::TensorView> tensors, bool embedding_table);

// Whether an update by optimizer `optimizer` (its class name as torch spells
// it: "SGD", "Adagrad", "SparseAdam", "Adam", ...) with the parameter
// group's `momentum` and `weight_decay` changes rows whose gradient is zero.
// Plain SGD (p -= lr * 0), Adagrad (sum += 0; p -= clr * 0 / std) and
// SparseAdam (updates only the gradient's rows) leave them bitwise as they
// were; momentum, weight decay and every other optimizer's moving averages
// do not, and an unknown optimizer is assumed to.
bool MovesRowsWithoutGradient(std::string_view optimizer, double momentum, double weight_decay);

}  // namespace pmsnap::frontend
