// Layout::kTorchFused is byte-identical to PyTorch's fused rowwise prepack
// ops (quantized::embedding_bag_byte_prepack / _4bit_prepack / _2bit_prepack,
// called through the c10 dispatcher on the same tables), and our decoder reads
// PyTorch's bytes, including optimized_qparams=True output, the way PyTorch's
// own unpack ops do. Built only when PMSNAP_WITH_TORCH.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "pmsnap/quant/quant.h"
#include "testutil/quant_checks.h"

namespace pmsnap::quant {
namespace {

using workloads::MakeTable;
using workloads::OwnedTable;
using workloads::RowShape;

at::Tensor AsTensor(const OwnedTable& t) {
  return at::from_blob(const_cast<float*>(t.values.data()),
                       {static_cast<int64_t>(t.rows), static_cast<int64_t>(t.dim)},
                       at::TensorOptions().dtype(at::kFloat));
}

at::Tensor TorchPrepack(int bits, const at::Tensor& weight, bool optimized = false,
                        int64_t nbins = 200, double ratio = 0.16) {
  auto& dispatcher = c10::Dispatcher::singleton();
  if (bits == 8) {
    static auto op = dispatcher.findSchemaOrThrow("quantized::embedding_bag_byte_prepack", "")
                         .typed<at::Tensor(const at::Tensor&)>();
    return op.call(weight);
  }
  const char* name =
      bits == 4 ? "quantized::embedding_bag_4bit_prepack" : "quantized::embedding_bag_2bit_prepack";
  auto op = dispatcher.findSchemaOrThrow(name, "")
                .typed<at::Tensor(const at::Tensor&, bool, int64_t, double)>();
  return op.call(weight, optimized, nbins, ratio);
}

at::Tensor TorchUnpack(int bits, const at::Tensor& packed) {
  const char* name = bits == 8   ? "quantized::embedding_bag_byte_unpack"
                     : bits == 4 ? "quantized::embedding_bag_4bit_unpack"
                                 : "quantized::embedding_bag_2bit_unpack";
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow(name, "")
                .typed<at::Tensor(const at::Tensor&)>();
  return op.call(packed);
}

QuantOptions TorchOptions(int bits) {
  QuantOptions options;
  options.layout = Layout::kTorchFused;
  options.bits = bits;
  options.scale_type = bits == 8 ? ScaleType::kFp32 : ScaleType::kFp16;
  return options;
}

class TorchInteropTest : public ::testing::TestWithParam<std::tuple<int, RowShape, std::uint32_t>> {
};

TEST_P(TorchInteropTest, BytesEqualPyTorchPrepack) {
  const auto [bits, shape, dim] = GetParam();
  auto table = MakeTable(shape, 700, dim, 900 + dim + bits);
  // Awkward rows too: constant, all zero, one outlier, large magnitudes.
  std::fill_n(table.row(0), dim, 0.37f);
  std::fill_n(table.row(1), dim, 0.0f);
  table.row(2)[dim / 2] = 40.0f;
  for (std::uint32_t c = 0; c < dim; ++c) table.row(3)[c] *= 5000.0f;
  try {
    const at::Tensor expected = TorchPrepack(bits, AsTensor(table)).contiguous();
    auto ours = Quantize(table.view(), TorchOptions(bits));
    ASSERT_TRUE(ours.ok()) << ours.status().ToString();
    ASSERT_EQ(static_cast<std::uint64_t>(expected.numel()), ours->payload.size());
    const auto* torch_bytes = expected.data_ptr<std::uint8_t>();
    for (std::uint64_t r = 0; r < table.rows; ++r) {
      const std::uint64_t rb = ours->spec.row_bytes();
      ASSERT_EQ(0, std::memcmp(torch_bytes + r * rb, ours->payload.data() + r * rb, rb))
          << bits << "-bit dim " << dim << " row " << r;
    }
  } catch (const std::exception& e) {
    FAIL() << "libtorch threw: " << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(PrepackOps, TorchInteropTest,
                         ::testing::Combine(::testing::Values(2, 4, 8),
                                            ::testing::Values(RowShape::kNormal,
                                                              RowShape::kHeavyTailed),
                                            ::testing::Values(8u, 64u, 128u, 200u)),
                         testing::TupleParamName());

TEST(TorchInteropReadTest, OurDecoderReadsPyTorchBytesLikePyTorch) {
  const auto table = MakeTable(RowShape::kHeavyTailed, 300, 64, 5);
  for (int bits : {2, 4, 8}) {
    for (bool optimized : {false, true}) {
      if (bits == 8 && optimized) continue;  // the byte op has no search
      try {
        const at::Tensor packed = TorchPrepack(bits, AsTensor(table), optimized).contiguous();
        const at::Tensor reference = TorchUnpack(bits, packed).contiguous();
        QuantizedView view;
        view.spec = SpecFor(TorchOptions(bits), 64, 300);
        view.payload = {packed.data_ptr<std::uint8_t>(), static_cast<std::size_t>(packed.numel())};
        std::vector<float> ours(300 * 64);
        ASSERT_TRUE(Dequantize(view, ours.data()).ok());
        const float* expected = reference.data_ptr<float>();
        for (std::size_t i = 0; i < ours.size(); ++i) {
          ASSERT_NEAR(ours[i], expected[i], 1e-6f * (1.0f + std::fabs(expected[i])))
              << bits << "-bit optimized=" << optimized << " element " << i;
        }
      } catch (const std::exception& e) {
        FAIL() << "libtorch threw: " << e.what();
      }
    }
  }
}

}  // namespace
}  // namespace pmsnap::quant
