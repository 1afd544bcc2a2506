// The per-ISA XXH3 kernels (and the fused copy+hash bulk path) give exactly
// the checksums of Debian's libxxhash, so pools stay readable everywhere.
#include "pmsnap/pmem_layout/checksum.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstring>
#include <random>
#include <vector>

#include "detail/xxh3_kernels.h"

namespace pmsnap::layout {
namespace {

struct KernelCase {
  const detail::Xxh3Kernels* kernels;
  const char* cpu_feature;  // nullptr: always available
};

class Xxh3KernelTest : public ::testing::TestWithParam<KernelCase> {
 protected:
  void SetUp() override {
    __builtin_cpu_init();
    const char* feature = GetParam().cpu_feature;
    if (feature != nullptr && std::string(feature) == "avx2" && !__builtin_cpu_supports("avx2")) {
      GTEST_SKIP() << "CPU lacks avx2";
    }
    if (feature != nullptr && std::string(feature) == "avx512" &&
        !(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))) {
      GTEST_SKIP() << "CPU lacks avx512f/bw";
    }
  }
};

std::vector<unsigned char> RandomBytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> out(n);
  for (auto& b : out) b = static_cast<unsigned char>(rng());
  return out;
}

std::vector<std::size_t> InterestingLengths() {
  std::vector<std::size_t> lengths = {0,    1,    63,   64,   65,        128,    239,
                                      240,  241,  255,  256,  257,       1023,   1024,
                                      1025, 1087, 1088, 4096, 65536 + 7, 1 << 20};
  std::mt19937_64 rng(7);
  for (int i = 0; i < 60; ++i) lengths.push_back(rng() % 20000);
  return lengths;
}

TEST_P(Xxh3KernelTest, OneShotAndStreamingMatchTheLibrary) {
  const detail::Xxh3Kernels& k = *GetParam().kernels;
  for (std::size_t len : InterestingLengths()) {
    auto data = RandomBytes(len, len);
    const std::uint64_t expected = XXH3_64bits_withSeed(data.data(), len, 0);
    ASSERT_EQ(k.hash(data.data(), len, 0), expected) << k.name << " len " << len;
    ASSERT_EQ(k.hash(data.data(), len, 99), XXH3_64bits_withSeed(data.data(), len, 99));
    detail::Xxh3State state;
    k.reset(&state, 0);
    for (std::size_t off = 0; off < len; off += 1000) {
      k.update(&state, data.data() + off, std::min<std::size_t>(1000, len - off));
    }
    ASSERT_EQ(k.digest(&state), expected) << k.name << " streaming len " << len;
  }
}

TEST_P(Xxh3KernelTest, FusedCopyAndHashCopiesAndHashesLikeTheLibrary) {
  const detail::Xxh3Kernels& k = *GetParam().kernels;
  for (std::size_t len : InterestingLengths()) {
    for (std::size_t src_misalign : {0, 3}) {
      auto data = RandomBytes(len + src_misalign, len);
      const unsigned char* src = data.data() + src_misalign;
      std::vector<unsigned char> dst_storage(len + 64, 0xee);
      auto* dst = reinterpret_cast<unsigned char*>(
          (reinterpret_cast<std::uintptr_t>(dst_storage.data()) + 63) / 64 * 64);
      std::uint64_t hash = 0;
      const std::size_t covered = k.copy_and_hash(dst, src, len, &hash);
      if (len <= 240) {
        ASSERT_EQ(covered, 0u);
        continue;
      }
      ASSERT_EQ(hash, XXH3_64bits(src, len)) << k.name << " len " << len;
      ASSERT_EQ(covered % 64, 0u);
      ASSERT_LE(covered, len);
      ASSERT_GE(covered + 64, len);  // the caller copies at most one stripe
      ASSERT_EQ(std::memcmp(dst, src, covered), 0) << k.name << " len " << len;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, Xxh3KernelTest,
                         ::testing::Values(KernelCase{&detail::kXxh3Scalar, nullptr},
                                           KernelCase{&detail::kXxh3Avx2, "avx2"},
                                           KernelCase{&detail::kXxh3Avx512, "avx512"}),
                         [](const auto& info) { return std::string(info.param.kernels->name); });

TEST(ChecksumTest, PublicFunctionsUseTheBestKernelAndMatchTheLibrary) {
  auto data = RandomBytes(100000, 1);
  EXPECT_EQ(Checksum64(data.data(), data.size()), XXH3_64bits(data.data(), data.size()));
  StreamingChecksum streaming;
  streaming.Update(data.data(), 5);
  streaming.Update(data.data() + 5, data.size() - 5);
  EXPECT_EQ(streaming.Digest(), XXH3_64bits(data.data(), data.size()));
}

}  // namespace
}  // namespace pmsnap::layout
