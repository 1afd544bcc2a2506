// Serialized form: a round trip keeps every byte and needs nothing else to
// dequantize; truncated, bit-flipped or inconsistent input gives kCorruption
// (or kUnsupportedVersion) with a message naming what is wrong, never a crash.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "pmsnap/quant/format.h"
#include "testutil/quant_checks.h"

namespace pmsnap::quant {
namespace {

std::vector<std::uint8_t> SerializedSample(Method method = Method::kAdaptive, int bits = 3) {
  const auto table = workloads::MakeTable(workloads::RowShape::kNormal, 21, 13, 77);
  QuantOptions options;
  options.method = method;
  options.bits = bits;
  options.adaptive = {25, 0.5f};
  auto q = Quantize(table.view(), options);
  EXPECT_TRUE(q.ok());
  return Serialize(q->view());
}

// Rewrites the header checksum so a test can reach the field checks behind it.
void Reseal(std::vector<std::uint8_t>& bytes) {
  const std::uint32_t crc = Crc32c({bytes.data(), 60});
  std::memcpy(bytes.data() + 60, &crc, 4);
}

std::string Message(const std::vector<std::uint8_t>& bytes) {
  auto parsed = Parse(bytes);
  return parsed.ok() ? std::string("OK") : parsed.status().ToString();
}

TEST(FormatTest, RoundTripIsSelfDescribing) {
  for (Method method :
       {Method::kSymmetric, Method::kAsymmetric, Method::kAdaptive, Method::kKMeans}) {
    for (int bits : {2, 3, 4, 8}) {
      const auto table = workloads::MakeTable(workloads::RowShape::kHeavyTailed, 33, 19, 5);
      QuantOptions options;
      options.method = method;
      options.bits = bits;
      options.scale_type = bits == 8 ? ScaleType::kFp32 : ScaleType::kFp16;
      auto q = Quantize(table.view(), options);
      ASSERT_TRUE(q.ok());
      const std::vector<std::uint8_t> bytes = Serialize(q->view());
      ASSERT_EQ(bytes.size(), SerializedSize(q->spec));
      auto parsed = Parse(bytes);
      ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
      EXPECT_EQ(parsed->spec.method, method);
      EXPECT_EQ(parsed->spec.bits, bits);
      EXPECT_EQ(parsed->spec.dim, 19u);
      EXPECT_EQ(parsed->spec.rows, 33u);
      EXPECT_EQ(parsed->spec.scale_type, options.scale_type);
      EXPECT_TRUE(std::equal(parsed->payload.begin(), parsed->payload.end(), q->payload.begin(),
                             q->payload.end()));
      // Only the parsed view is used to dequantize.
      EXPECT_EQ(testing::DequantizeAll(*parsed), testing::DequantizeAll(q->view()));
    }
  }
}

TEST(FormatTest, EveryTruncationIsReported) {
  const auto bytes = SerializedSample();
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    auto parsed = Parse({bytes.data(), n});
    ASSERT_FALSE(parsed.ok()) << n;
    EXPECT_EQ(parsed.status().code(), StatusCode::kCorruption);
    EXPECT_NE(parsed.status().message().find("truncated"), std::string::npos)
        << n << ": " << parsed.status().message();
  }
  auto longer = bytes;
  longer.push_back(0);
  EXPECT_NE(Message(longer).find("trailing bytes"), std::string::npos);
}

TEST(FormatTest, EveryHeaderBitFlipIsDetected) {
  const auto bytes = SerializedSample();
  for (std::size_t byte = 0; byte < kSerializedHeaderBytes; ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      auto corrupt = bytes;
      corrupt[byte] ^= static_cast<std::uint8_t>(1u << bit);
      auto parsed = Parse(corrupt);
      ASSERT_FALSE(parsed.ok()) << byte << ":" << bit;
      EXPECT_TRUE(parsed.status().code() == StatusCode::kCorruption ||
                  parsed.status().code() == StatusCode::kUnsupportedVersion)
          << parsed.status().ToString();
    }
  }
}

TEST(FormatTest, PayloadBitFlipIsDetected) {
  auto bytes = SerializedSample();
  bytes[kSerializedHeaderBytes + 17] ^= 0x10;
  EXPECT_NE(Message(bytes).find("payload checksum mismatch"), std::string::npos);
}

TEST(FormatTest, InconsistentFieldsNameTheField) {
  const auto good = SerializedSample();
  struct Case {
    std::size_t offset;
    std::uint8_t value;
    const char* expect;
  };
  const Case cases[] = {
      {0, 'X', "bad magic"},
      {8, 9, "unknown method 9"},
      {9, 5, "bits 5 not in {2,3,4,8}"},
      {10, 7, "unknown scale type 7"},
      {11, 0, "unknown layout 0"},
      {24, 99, "row bytes 99 disagree"},
      {32, 1, "payload bytes"},
      {55, 1, "reserved byte 55"},
  };
  for (const Case& c : cases) {
    auto bytes = good;
    bytes[c.offset] = c.value;
    if (c.offset != 0) Reseal(bytes);
    EXPECT_NE(Message(bytes).find(c.expect), std::string::npos)
        << c.expect << " vs " << Message(bytes);
  }
  auto zero_dim = good;
  std::memset(zero_dim.data() + 12, 0, 4);
  Reseal(zero_dim);
  EXPECT_NE(Message(zero_dim).find("dim is 0"), std::string::npos);
  auto newer = good;
  newer[4] = 2;
  Reseal(newer);
  EXPECT_EQ(Parse(newer).status().code(), StatusCode::kUnsupportedVersion);
  // A huge row count must not wrap rows * row_bytes into a small number.
  auto huge = good;
  const std::uint64_t rows = (1ULL << 62) + 1;
  std::memcpy(huge.data() + 16, &rows, 8);
  Reseal(huge);
  EXPECT_EQ(Parse(huge).status().code(), StatusCode::kCorruption);
}

TEST(FormatTest, NonFiniteStoredScaleFailsDequantizeWithRow) {
  const auto table = workloads::MakeTable(workloads::RowShape::kNormal, 4, 8, 1);
  QuantOptions options;
  options.scale_type = ScaleType::kFp32;
  auto q = Quantize(table.view(), options);
  ASSERT_TRUE(q.ok());
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(q->payload.data() + 2 * q->spec.row_bytes() + q->spec.code_bytes(), &nan, 4);
  // Serialized with a matching checksum, the damage is only visible to the decoder.
  const auto bytes = Serialize(q->view());
  auto parsed = Parse(bytes);
  ASSERT_TRUE(parsed.ok());
  std::vector<float> out(32);
  const Status s = Dequantize(*parsed, out.data());
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("row 2"), std::string::npos) << s.message();
}

TEST(FormatTest, Crc32cKnownAnswer) {
  const char* text = "123456789";
  EXPECT_EQ(Crc32c({reinterpret_cast<const std::uint8_t*>(text), 9}), 0xe3069283u);
}

}  // namespace
}  // namespace pmsnap::quant
