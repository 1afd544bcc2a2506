// Tracked embedding modules: torch::nn::Embedding and torch::nn::EmbeddingBag
// that mark every row a forward lookup reads in a diff::RowTracker, so the
// differential and incremental embedding checkpoints (diff/) write only the
// rows a step can have changed (Check-N-Run 5.1: the rows read in the forward
// pass are the rows the backward pass updates).
//
//   TrackedEmbeddingBag bag(torch::nn::EmbeddingBagOptions(100000, 16)
//                               .mode(torch::kSum));
//   register_module("bag", bag);              // parameter "bag.weight"
//   ... CheckpointedOptimizer::Create(model, adagrad, engine, tables)
//       binds "bag.weight"'s RowTracker to the module (BindTracker).
//
// The modules derive from the libtorch modules, so parameter names, options,
// initialization and outputs are exactly libtorch's (the forward calls the
// base forward); only the marking is added. Marking happens after the base
// lookup succeeded (libtorch rejects ids out of range first), from the index
// tensor (int64 or int32, any shape, any device: copied to the host). Rows
// equal to `padding_idx` are never updated by libtorch and are not marked;
// with `max_norm` the lookup itself rewrites the rows it reads, so every id
// is marked (CheckpointedOptimizer refuses such tables: the engine cannot
// see writes made outside the optimizer step).
//
// Until bound, a module marks into a RowTracker it owns (tables named ""),
// handy for tracking without checkpoints. clone() yields a plain libtorch
// module (libtorch's Cloneable<EmbeddingImpl>), without tracking.
//
// Thread-safety: forward marks on the calling (training) thread; the bound
// tracker belongs to that thread (diff/row_tracker.h). Bind before training.
#pragma once

#include <torch/nn/modules/embedding.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "pmsnap/common/status.h"
#include "pmsnap/diff/embedding_checkpointer.h"
#include "pmsnap/diff/row_tracker.h"

namespace pmsnap::hooks {

// Where a tracked module's lookups go: its own tracker, or the tracker of an
// encoded table of an EmbeddingCheckpointer (kept alive by the binding).
class RowMarker {
 public:
  RowMarker(std::int64_t rows, std::optional<std::int64_t> padding_idx, bool marks_padding);

  // Marks the rows in `ids` (int64/int32 indices of a successful lookup).
  // kInvalidArgument (libtorch's message kept) for an index tensor that
  // cannot be read as integers, or an id outside the table.
  Status Mark(const torch::Tensor& ids);

  // Routes marks to `checkpointer`'s tracker of `table` from now on.
  // kNotFound if the checkpointer has no such encoded table (it must be
  // attached, i.e. its Engine open); kInvalidArgument if its row count
  // differs from the module's. Marks already made in the module's own
  // tracker stay there.
  Status Bind(std::shared_ptr<diff::EmbeddingCheckpointer> checkpointer, const std::string& table);
  // Back to the module's own tracker.
  void Unbind();
  bool bound() const { return checkpointer_ != nullptr; }
  // The tracker lookups mark now (never null).
  diff::RowTracker* tracker() { return target_; }
  const diff::RowTracker* tracker() const { return target_; }
  // The checkpointer bound to, or null.
  const diff::EmbeddingCheckpointer* checkpointer() const { return checkpointer_.get(); }

 private:
  std::int64_t padding_;  // -1: none or marked like any row
  diff::RowTracker own_;
  std::shared_ptr<diff::EmbeddingCheckpointer> checkpointer_;
  diff::RowTracker* target_;
};

// torch::nn::Embedding that marks the rows of every lookup.
class TrackedEmbeddingImpl : public torch::nn::EmbeddingImpl {
 public:
  TrackedEmbeddingImpl(std::int64_t num_embeddings, std::int64_t embedding_dim)
      : TrackedEmbeddingImpl(torch::nn::EmbeddingOptions(num_embeddings, embedding_dim)) {}
  explicit TrackedEmbeddingImpl(const torch::nn::EmbeddingOptions& options);

  // EmbeddingImpl::forward, then marks `indices`. Throws c10::Error as
  // libtorch's forward does (marking cannot fail after a lookup succeeded).
  torch::Tensor forward(const torch::Tensor& indices);

  RowMarker& rows() { return marker_; }
  const RowMarker& rows() const { return marker_; }

 private:
  RowMarker marker_;
};
TORCH_MODULE(TrackedEmbedding);

// torch::nn::EmbeddingBag that marks the rows of every lookup.
class TrackedEmbeddingBagImpl : public torch::nn::EmbeddingBagImpl {
 public:
  TrackedEmbeddingBagImpl(std::int64_t num_embeddings, std::int64_t embedding_dim)
      : TrackedEmbeddingBagImpl(torch::nn::EmbeddingBagOptions(num_embeddings, embedding_dim)) {}
  explicit TrackedEmbeddingBagImpl(const torch::nn::EmbeddingBagOptions& options);

  // EmbeddingBagImpl::forward, then marks `input`.
  torch::Tensor forward(const torch::Tensor& input, const torch::Tensor& offsets = {},
                        const torch::Tensor& per_sample_weights = {});

  RowMarker& rows() { return marker_; }
  const RowMarker& rows() const { return marker_; }

 private:
  RowMarker marker_;
};
TORCH_MODULE(TrackedEmbeddingBag);

// The marker of `module` if it is a TrackedEmbedding(Bag)Impl, else null.
RowMarker* MarkerOf(torch::nn::Module& module);

}  // namespace pmsnap::hooks
