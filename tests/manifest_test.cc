// Manifest encoding, validation, signatures and layout.
#include "pmsnap/pmem_layout/manifest.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testutil/pool_fixtures.h"

namespace pmsnap::layout {
namespace {

using ::testing::HasSubstr;

TEST(ManifestTest, SerializeParseRoundTrips) {
  Manifest manifest = pmsnap::testing::MakeManifest(4, 1234);
  manifest.units[1].flags = kUnitFlagEncoded;
  auto parsed = Manifest::Parse(manifest.Serialize(), "test");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->units, manifest.units);
  EXPECT_EQ(parsed->Signature(), manifest.Signature());
}

TEST(ManifestTest, EveryTruncationIsCorruptionNotACrash) {
  const std::vector<std::byte> bytes = pmsnap::testing::MakeManifest(3, 10).Serialize();
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    auto parsed = Manifest::Parse({bytes.data(), n}, "cut");
    ASSERT_FALSE(parsed.ok()) << n;
    EXPECT_EQ(parsed.status().code(), StatusCode::kCorruption) << n;
  }
}

TEST(ManifestTest, EveryFlippedByteIsDetectedOrHarmless) {
  const Manifest manifest = pmsnap::testing::MakeManifest(3, 10);
  const std::vector<std::byte> bytes = manifest.Serialize();
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    std::vector<std::byte> damaged = bytes;
    damaged[i] ^= std::byte{0xff};
    auto parsed = Manifest::Parse(damaged, "flip");
    // Parsing alone cannot catch a changed name character; the pool's
    // manifest checksum does. It must never crash or accept garbage lengths.
    if (parsed.ok()) {
      EXPECT_NE(parsed->Signature(), manifest.Signature()) << i;
    }
  }
}

TEST(ManifestTest, SignatureChangesWithShapeDtypeAndName) {
  const Manifest base = pmsnap::testing::MakeManifest(2, 64);
  Manifest shape = base, dtype = base, name = base;
  shape.units[0].tensors[0].shape = {16, 5};
  dtype.units[0].tensors[1].dtype = DType::kFloat16;
  name.units[1].name = "renamed";
  EXPECT_NE(base.Signature(), shape.Signature());
  EXPECT_NE(base.Signature(), dtype.Signature());
  EXPECT_NE(base.Signature(), name.Signature());
  EXPECT_THAT(base.FirstDifference(dtype), HasSubstr("dtype float32 vs float16"));
  EXPECT_EQ(base.FirstDifference(base), "");
}

TEST(ManifestTest, ValidateRejectsBadSpecs) {
  Manifest empty_name = pmsnap::testing::MakeManifest(1, 4);
  empty_name.units[0].name = "";
  EXPECT_EQ(empty_name.Validate().code(), StatusCode::kInvalidArgument);
  Manifest negative = pmsnap::testing::MakeManifest(1, 4);
  negative.units[0].tensors[0].shape = {-1};
  EXPECT_THAT(negative.Validate().message(), HasSubstr("negative"));
  Manifest bad_dtype = pmsnap::testing::MakeManifest(1, 4);
  bad_dtype.units[0].tensors[0].dtype = static_cast<DType>(77);
  EXPECT_THAT(bad_dtype.Validate().message(), HasSubstr("dtype"));
}

TEST(LayoutTest, PartsCoverEveryTensorExactlyOnceAndAreAligned) {
  const Manifest manifest = pmsnap::testing::MakeManifest(3, 100000);
  const SlotLayout layout = ComputeLayout(manifest, 64 << 10);
  for (std::uint32_t u = 0; u < layout.units.size(); ++u) {
    for (std::uint32_t t = 0; t < layout.units[u].tensors.size(); ++t) {
      const TensorLayout& tensor = layout.units[u].tensors[t];
      EXPECT_EQ(tensor.slot_offset % kTensorAlignment, 0u);
      std::uint64_t covered = 0;
      for (std::uint32_t p = tensor.first_part; p < tensor.first_part + tensor.part_count; ++p) {
        EXPECT_EQ(layout.parts[p].offset_in_tensor, covered);
        EXPECT_LE(layout.parts[p].bytes, 64u << 10);
        covered += layout.parts[p].bytes;
      }
      EXPECT_EQ(covered, tensor.bytes);
    }
  }
}

TEST(LayoutTest, EncodedUnitsTakeNoSlotBytes) {
  Manifest manifest = pmsnap::testing::MakeManifest(2, 1000);
  const std::uint64_t both = ComputeLayout(manifest, 4096).slot_bytes;
  manifest.units[0].flags = kUnitFlagEncoded;
  const SlotLayout layout = ComputeLayout(manifest, 4096);
  EXPECT_LT(layout.slot_bytes, both);
  EXPECT_EQ(layout.units[0].part_count, 0u);
}

}  // namespace
}  // namespace pmsnap::layout
