// Chunk payload decoding (diff/detail/chunk_format.h) on damaged and unusual
// chunks: regressions for what the chunk-payload fuzz target found
// (tests/fuzz/chunk_payload_fuzz.cc).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "detail/chunk_format.h"

namespace pmsnap::diff::detail {
namespace {

using ::testing::HasSubstr;

// Offset of DataHeader::tensor_count in a data chunk (chunk_format.cc).
constexpr std::size_t kTensorCountOffset = 6;

// Found by the fuzzer (heap-buffer-overflow under ASan): a chunk that ends
// right after an unpadded 4-byte block and announces one more block. The
// padding moved the read position past the end, the "16 bytes left?" check
// wrapped around, and the next block header was read beyond the chunk.
TEST(ChunkFormatTest, BlockPaddingPastTheEndIsTruncationNotARead) {
  const std::vector<std::uint64_t> keys = {7};
  const std::vector<float> row = {1.5f};
  const std::vector<TensorInput> tensors = {{1, row}};
  auto chunk = BuildDataChunk(3, keys, tensors, {}, "t");
  ASSERT_TRUE(chunk.ok()) << chunk.status().ToString();
  // header 64 + key 8 + block header 16 + 4 bytes + 4 bytes of padding.
  ASSERT_EQ(chunk->size(), 96u);
  std::vector<std::byte> damaged(chunk->begin(), chunk->end() - 4);
  const std::uint16_t two_tensors = 2;
  std::memcpy(damaged.data() + kTensorCountOffset, &two_tensors, sizeof(two_tensors));

  auto parsed = ParseDataChunk(damaged, "table 't' checkpoint 3");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), StatusCode::kCorruption);
  EXPECT_THAT(parsed.status().message(), HasSubstr("tensor block truncated"));
}

// A data chunk built in an earlier image's memory (the embedding
// checkpointer's reused buffer) is the same chunk, whatever that memory held,
// and is built where the buffer was when it had room: no new allocation.
TEST(ChunkFormatTest, ChunkBuiltInAReusedBufferIsTheSameChunkInTheSameMemory) {
  const std::vector<std::uint64_t> keys = {3, 4, 9};
  const std::vector<float> weights = {1, 2, 3, 4, 5, 6};
  const std::vector<float> sums = {0.5f, 0.25f, 0.125f};
  const std::vector<TensorInput> tensors = {{2, weights}, {1, sums}};
  EncodeOptions options;
  options.bloom_bits_per_key = 10;
  auto fresh = BuildDataChunk(5, keys, tensors, options, "t");
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();

  std::vector<std::byte> earlier(4096, std::byte{0xab});  // another image's bytes
  const std::byte* memory = earlier.data();
  auto reused = BuildDataChunk(5, keys, tensors, options, "t", std::move(earlier));
  ASSERT_TRUE(reused.ok()) << reused.status().ToString();
  EXPECT_EQ(*reused, *fresh);
  EXPECT_EQ(reused->data(), memory);
  auto view = ParseDataChunk(*reused, "t");
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  EXPECT_EQ(view->keys.size(), keys.size());
}

// Found by the fuzzer (undefined behaviour under UBSan: memcpy into the null
// data() of an empty vector): slicing a chunk whose tensor has zero floats
// per row. Only the undefined-behaviour sanitizer build
// (PMSNAP_SANITIZE=undefined) or the fuzz build sees the old failure; here
// the slice must keep its keys and its zero-width block.
TEST(ChunkFormatTest, SliceOfZeroWidthTensorKeepsItsRows) {
  const std::vector<std::uint64_t> keys = {1, 2, 5};
  const std::vector<TensorInput> tensors = {{0, {}}};
  auto chunk = BuildDataChunk(4, keys, tensors, {}, "t");
  ASSERT_TRUE(chunk.ok()) << chunk.status().ToString();
  auto view = ParseDataChunk(*chunk, "t");
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  ASSERT_EQ(view->tensors.size(), 1u);
  EXPECT_EQ(view->tensors[0].elems_per_row, 0u);

  const std::vector<std::uint64_t> positions = {0, 2};
  auto slice = SliceDataChunk(*view, positions, 10);
  ASSERT_TRUE(slice.ok()) << slice.status().ToString();
  auto sliced = ParseDataChunk(*slice, "t");
  ASSERT_TRUE(sliced.ok()) << sliced.status().ToString();
  ASSERT_EQ(sliced->keys.size(), 2u);
  EXPECT_EQ(sliced->keys[0], 1u);
  EXPECT_EQ(sliced->keys[1], 5u);
  EXPECT_EQ(sliced->tensors.at(0).elems_per_row, 0u);
}

}  // namespace
}  // namespace pmsnap::diff::detail
