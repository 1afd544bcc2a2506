// Tracked embedding modules: see tracked_embedding.h.
#include "pmsnap/hooks/tracked_embedding.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <span>
#include <utility>

namespace pmsnap::hooks {

RowMarker::RowMarker(std::int64_t rows, std::optional<std::int64_t> padding_idx, bool marks_padding)
    : padding_(-1), own_("", static_cast<std::uint64_t>(rows < 0 ? 0 : rows)), target_(&own_) {
  if (padding_idx && !marks_padding) {
    // libtorch accepts a negative padding_idx counted from the end.
    padding_ = *padding_idx < 0 ? *padding_idx + rows : *padding_idx;
  }
}

Status RowMarker::Mark(const torch::Tensor& ids) {
  if (!ids.defined() || ids.numel() == 0) return Status::Ok();
  torch::Tensor flat;
  try {
    torch::NoGradGuard no_grad;
    flat = ids.reshape({-1});
    if (flat.device().type() != torch::kCPU) flat = flat.cpu();
    if (flat.scalar_type() != torch::kLong) flat = flat.to(torch::kLong);
    if (padding_ >= 0) flat = flat.masked_select(flat.ne(padding_));
    flat = flat.contiguous();
  } catch (const c10::Error& error) {
    return Status(StatusCode::kInvalidArgument,
                  "embedding table '" + target_->table() +
                      "': reading lookup ids: libtorch: " + error.what_without_backtrace());
  }
  return target_->Mark(std::span<const std::int64_t>(flat.data_ptr<std::int64_t>(),
                                                     static_cast<std::size_t>(flat.numel())));
}

Status RowMarker::Bind(std::shared_ptr<diff::EmbeddingCheckpointer> checkpointer,
                       const std::string& table) {
  if (checkpointer == nullptr) {
    return Status(StatusCode::kInvalidArgument, "binding table '" + table + "': no checkpointer");
  }
  diff::RowTracker* tracker = checkpointer->tracker(table);
  if (tracker == nullptr) {
    return Status(StatusCode::kNotFound,
                  "embedding table '" + table +
                      "' is not an encoded unit of this checkpointer (is its engine open?)");
  }
  if (tracker->rows() != own_.rows()) {
    return Status(StatusCode::kInvalidArgument,
                  "embedding table '" + table + "' has " + std::to_string(tracker->rows()) +
                      " rows in the checkpointer, the module " + std::to_string(own_.rows()));
  }
  checkpointer_ = std::move(checkpointer);
  target_ = tracker;
  return Status::Ok();
}

void RowMarker::Unbind() {
  target_ = &own_;
  checkpointer_.reset();
}

namespace {

// Marks after a successful lookup; a failure here is a broken invariant.
void MarkOrThrow(RowMarker& marker, const torch::Tensor& ids) {
  Status status = marker.Mark(ids);
  TORCH_CHECK(status.ok(), "pmsnap: marking looked-up rows failed: ", status.message());
}

std::optional<std::int64_t> ToStd(const c10::optional<std::int64_t>& value) {
  return value.has_value() ? std::optional<std::int64_t>(*value) : std::nullopt;
}

}  // namespace

TrackedEmbeddingImpl::TrackedEmbeddingImpl(const torch::nn::EmbeddingOptions& options)
    : torch::nn::EmbeddingImpl(options),
      marker_(options.num_embeddings(), ToStd(options.padding_idx()),
              options.max_norm().has_value()) {}

torch::Tensor TrackedEmbeddingImpl::forward(const torch::Tensor& indices) {
  torch::Tensor out = torch::nn::EmbeddingImpl::forward(indices);
  MarkOrThrow(marker_, indices);
  return out;
}

TrackedEmbeddingBagImpl::TrackedEmbeddingBagImpl(const torch::nn::EmbeddingBagOptions& options)
    : torch::nn::EmbeddingBagImpl(options),
      marker_(options.num_embeddings(), ToStd(options.padding_idx()),
              options.max_norm().has_value()) {}

torch::Tensor TrackedEmbeddingBagImpl::forward(const torch::Tensor& input,
                                               const torch::Tensor& offsets,
                                               const torch::Tensor& per_sample_weights) {
  torch::Tensor out = torch::nn::EmbeddingBagImpl::forward(input, offsets, per_sample_weights);
  MarkOrThrow(marker_, input);
  return out;
}

RowMarker* MarkerOf(torch::nn::Module& module) {
  if (auto* embedding = dynamic_cast<TrackedEmbeddingImpl*>(&module)) return &embedding->rows();
  if (auto* bag = dynamic_cast<TrackedEmbeddingBagImpl*>(&module)) return &bag->rows();
  return nullptr;
}

}  // namespace pmsnap::hooks
