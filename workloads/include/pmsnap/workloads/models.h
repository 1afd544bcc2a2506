// Models the demo, the benchmarks and the tests train: a plain MLP stack, a
// DLRM-like recommender (bottom MLP, embedding-bag tables, pairwise
// dot-product interaction, top MLP) and a transformer-encoder stack. They are
// ordinary libtorch modules: pmsnap sees only their parameters.
//
// Parameters are created in registration order from torch's global RNG, so
// torch::manual_seed(s) before construction gives the same weights each run.
// Thread-safety: libtorch modules; one training thread at a time.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace pmsnap::workloads {

// Linear layers widths[0] -> widths[1] -> ... -> widths.back(), a ReLU after
// each but the last (and after the last too when `relu_after_last`).
// widths needs at least two entries; fewer gives an empty stack.
torch::nn::Sequential MlpStack(const std::vector<std::int64_t>& widths, bool relu_after_last);

struct DlrmOptions {
  std::int64_t tables = 8;           // embedding-bag tables (sum mode), "emb0"...
  std::int64_t rows = 100000;        // rows per table
  std::int64_t dim = 32;             // embedding width = bottom MLP output
  std::int64_t dense_features = 13;  // as in the Criteo data set
  // Hidden widths of the bottom MLP (dense_features -> ... -> dim) and of
  // the top MLP (dim + pairwise dots -> ... -> 1).
  std::vector<std::int64_t> bottom_hidden = {256, 64};
  std::vector<std::int64_t> top_hidden = {256, 64};
};

// Modules "bottom", "emb<t>" for each table, "top".
struct DlrmImpl : torch::nn::Module {
  explicit DlrmImpl(const DlrmOptions& options);

  // dense: [B, dense_features]; ids[t]: table t's ids of the whole batch,
  // flat, bag b starting at offsets[b]. Returns one logit per sample, [B].
  torch::Tensor forward(const torch::Tensor& dense, const std::vector<torch::Tensor>& ids,
                        const torch::Tensor& offsets);

  torch::nn::Sequential bottom{nullptr}, top{nullptr};
  std::vector<torch::nn::EmbeddingBag> tables;
  torch::Tensor pair_rows, pair_cols;  // upper triangle of the feature x feature dots
};
TORCH_MODULE(Dlrm);

struct TransformerOptions {
  std::int64_t dim = 512;   // model width; feed-forward 4 x dim, no dropout
  std::int64_t layers = 4;  // encoder blocks, "block0"...
  std::int64_t heads = 8;
};

// Encoder blocks followed by a linear "head" of the same width.
struct TransformerImpl : torch::nn::Module {
  explicit TransformerImpl(const TransformerOptions& options);

  // x: [sequence, batch, dim] (libtorch's encoder layout); same shape out.
  torch::Tensor forward(torch::Tensor x);

  std::vector<torch::nn::TransformerEncoderLayer> layers;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Transformer);

}  // namespace pmsnap::workloads
