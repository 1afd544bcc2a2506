// Golden bytes of what a pool stores: the manifest encoding and the model
// signature, the slot layout recomputed from them at open, the pool header,
// a commit record and a chunk header with the checksums that protect them.
// Round-trip tests pass when an encoder and its decoder change together;
// these fail, because every expected value here is written out by hand from
// pmem_layout/FORMAT.md (the checksums are XXH3-64 values computed outside
// this code base, with the xxhash library's own XXH3_64bits). A pool written
// by an earlier build must keep opening: a change that breaks one of these
// needs a new format version, not new golden values.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "detail/format.h"
#include "pmsnap/pmem_layout/manifest.h"

namespace pmsnap::layout {
namespace {

// Two units: a dense one with a float32 [2, 3] and an int64 scalar, and an
// encoded (embedding) one with a float32 [4].
Manifest GoldenManifest() {
  Manifest manifest;
  manifest.units.push_back(
      {"fc", {{"param", DType::kFloat32, {2, 3}}, {"step", DType::kInt64, {}}}, kUnitFlagNone});
  manifest.units.push_back({"emb", {{"w", DType::kFloat32, {4}}}, kUnitFlagEncoded});
  return manifest;
}

std::vector<std::byte> Bytes(std::initializer_list<unsigned> values) {
  std::vector<std::byte> out;
  for (unsigned v : values) out.push_back(static_cast<std::byte>(v));
  return out;
}

// The encoding FORMAT.md ("Manifest") describes, field by field.
const std::vector<std::byte> kGoldenManifest = Bytes({
    0x50, 0x4d, 0x41, 0x4e,  // magic "PMAN"
    0x01, 0x00, 0x00, 0x00,  // encoding version 1
    0x02, 0x00, 0x00, 0x00,  // 2 units
    // unit 0
    0x02, 0x00, 0x00, 0x00, 'f', 'c',  // name
    0x00, 0x00, 0x00, 0x00,            // flags: none
    0x02, 0x00, 0x00, 0x00,            // 2 tensors
    0x05, 0x00, 0x00, 0x00, 'p', 'a', 'r', 'a', 'm',  // name
    0x01,                                             // dtype float32
    0x02,                                             // rank 2
    0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,   // dim 2 (i64)
    0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,   // dim 3
    0x04, 0x00, 0x00, 0x00, 's', 't', 'e', 'p',       // name
    0x05,                                             // dtype int64
    0x00,                                             // rank 0
    // unit 1
    0x03, 0x00, 0x00, 0x00, 'e', 'm', 'b',           // name
    0x01, 0x00, 0x00, 0x00,                          // flags: encoded
    0x01, 0x00, 0x00, 0x00,                          // 1 tensor
    0x01, 0x00, 0x00, 0x00, 'w',                     // name
    0x01,                                            // dtype float32
    0x01,                                            // rank 1
    0x04, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // dim 4
});
// XXH3-64, seed 0x706d736e6170, of the bytes after magic and version.
constexpr std::uint64_t kGoldenSignature = 0x209c5b9366361638ull;

template <typename T>
std::vector<std::byte> ImageOf(const T& value) {
  const auto* p = reinterpret_cast<const std::byte*>(&value);
  return {p, p + sizeof(T)};
}

void PutU64(std::vector<std::byte>& image, std::size_t offset, std::uint64_t value) {
  for (int i = 0; i < 8; ++i) image[offset + i] = static_cast<std::byte>(value >> (8 * i));
}

TEST(ManifestGoldenTest, SerializeWritesTheDocumentedBytes) {
  EXPECT_EQ(GoldenManifest().Serialize(), kGoldenManifest);
}

TEST(ManifestGoldenTest, ParseReadsTheDocumentedBytes) {
  auto parsed = Manifest::Parse(kGoldenManifest, "golden");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  const Manifest expected = GoldenManifest();
  ASSERT_EQ(parsed->units.size(), 2u);
  EXPECT_EQ(parsed->units[0].name, "fc");
  EXPECT_EQ(parsed->units[0].flags, kUnitFlagNone);
  ASSERT_EQ(parsed->units[0].tensors.size(), 2u);
  EXPECT_EQ(parsed->units[0].tensors[0].name, "param");
  EXPECT_EQ(parsed->units[0].tensors[0].dtype, DType::kFloat32);
  EXPECT_EQ(parsed->units[0].tensors[0].shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(parsed->units[0].tensors[1].name, "step");
  EXPECT_EQ(parsed->units[0].tensors[1].dtype, DType::kInt64);
  EXPECT_TRUE(parsed->units[0].tensors[1].shape.empty());
  EXPECT_EQ(parsed->units[1].name, "emb");
  EXPECT_EQ(parsed->units[1].flags, kUnitFlagEncoded);
  EXPECT_EQ(parsed->units[1].tensors[0].shape, (std::vector<std::int64_t>{4}));
  EXPECT_EQ(parsed->units, expected.units);
}

TEST(ManifestGoldenTest, SignatureIsTheDocumentedHash) {
  EXPECT_EQ(GoldenManifest().Signature(), kGoldenSignature);
  auto parsed = Manifest::Parse(kGoldenManifest, "golden");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->Signature(), kGoldenSignature);
}

// Open recomputes the layout from the stored manifest, so it is as much a
// part of the format as the bytes: tensors in manifest order at 256-byte
// boundaries, cut into parts of at most part_bytes, encoded units left out.
TEST(ManifestGoldenTest, LayoutIsTheDocumentedPlacement) {
  const SlotLayout layout = ComputeLayout(GoldenManifest(), /*part_bytes=*/16);
  ASSERT_EQ(layout.parts.size(), 3u);
  const PartLayout expected[3] = {
      {0, 0, 0, 16, 0},   // fc.param bytes [0, 16)
      {0, 0, 16, 8, 16},  // fc.param bytes [16, 24)
      {0, 1, 0, 8, 256},  // fc.step at the next 256-byte boundary
  };
  for (int p = 0; p < 3; ++p) {
    EXPECT_EQ(layout.parts[p].unit, expected[p].unit) << p;
    EXPECT_EQ(layout.parts[p].tensor, expected[p].tensor) << p;
    EXPECT_EQ(layout.parts[p].offset_in_tensor, expected[p].offset_in_tensor) << p;
    EXPECT_EQ(layout.parts[p].bytes, expected[p].bytes) << p;
    EXPECT_EQ(layout.parts[p].slot_offset, expected[p].slot_offset) << p;
  }
  EXPECT_EQ(layout.units[1].part_count, 0u);  // encoded: no slot bytes
  EXPECT_EQ(layout.slot_bytes, 512u);
}

TEST(ManifestGoldenTest, PoolHeaderBytesAndChecksum) {
  detail::PoolHeader header{};
  std::memcpy(header.magic, detail::kPoolMagic, 8);
  header.format_version = 1;
  header.header_bytes = 256;
  header.model_signature = 0x0123456789abcdefull;
  header.created_unix_ns = 1700000000000000000ull;
  header.part_bytes = 4096;
  header.extra_state_capacity = 65536;
  header.chunk_heap_bytes = 1u << 20;
  header.unit_count = 2;
  header.part_count = 3;
  header.slot_bytes = 512;
  header.record_bytes = 4224;
  header.manifest_offset = 1048576;
  header.manifest_bytes = 100;
  header.manifest_checksum = 0xdead;
  header.slot_alloc_offset[0] = 2097152;
  header.slot_alloc_offset[1] = 4194304;
  header.slot_data_offset[0] = 2101248;
  header.slot_data_offset[1] = 4198400;
  header.slot_record_offset[0] = 6291456;
  header.slot_record_offset[1] = 6295552;

  std::vector<std::byte> expected(256, std::byte{0});
  std::memcpy(expected.data(), "PMSNAPPL", 8);
  expected[8] = std::byte{1};                   // format_version u32
  expected[13] = std::byte{1};                  // header_bytes u32 = 256
  PutU64(expected, 24, 0x0123456789abcdefull);  // model_signature
  PutU64(expected, 32, 1700000000000000000ull);
  PutU64(expected, 40, 4096);
  PutU64(expected, 48, 65536);
  PutU64(expected, 56, 1u << 20);
  PutU64(expected, 64, 2);
  PutU64(expected, 72, 3);
  PutU64(expected, 80, 512);
  PutU64(expected, 88, 4224);
  PutU64(expected, 96, 1048576);
  PutU64(expected, 104, 100);
  PutU64(expected, 112, 0xdead);
  PutU64(expected, 120, 2097152);
  PutU64(expected, 128, 4194304);
  PutU64(expected, 136, 2101248);
  PutU64(expected, 144, 4198400);
  PutU64(expected, 152, 6291456);
  PutU64(expected, 160, 6295552);
  EXPECT_EQ(ImageOf(header), expected);
  // Over all 256 bytes with header_checksum (offset 16) zero.
  EXPECT_EQ(detail::HeaderChecksum(header), 0x5c149d148d165c63ull);
  header.header_checksum = 42;  // the stored checksum does not enter its own hash
  EXPECT_EQ(detail::HeaderChecksum(header), 0x5c149d148d165c63ull);
}

TEST(ManifestGoldenTest, CommitWordPacksEpochAndState) {
  EXPECT_EQ(detail::MakeCommitWord(5, /*COMPLETE=*/2), 0x16u);
  EXPECT_EQ(detail::MakeCommitWord(6, /*WRITING=*/1), 0x19u);
  EXPECT_EQ(detail::CommitWordEpoch(0x16), 5u);
  EXPECT_EQ(detail::CommitWordState(0x16), 2u);
  EXPECT_EQ(detail::CommitWordState(0x19), 1u);
}

TEST(ManifestGoldenTest, CommitRecordBytesAndChecksum) {
  detail::SlotRecordHeader record{};
  record.commit_word.store(detail::MakeCommitWord(5, 2));
  record.iteration = 41;
  record.commit_time_unix_ns = 1700000000000000000ull;
  record.extra_bytes = 3;
  record.extra_checksum = 0x1111;
  record.parts_checksum = 0x2222;
  record.record_checksum = 0x3333;

  std::vector<std::byte> expected(64, std::byte{0});
  PutU64(expected, 0, 0x16);  // commit_word {5, COMPLETE}
  PutU64(expected, 8, 41);
  PutU64(expected, 16, 1700000000000000000ull);
  PutU64(expected, 24, 3);
  PutU64(expected, 32, 0x1111);
  PutU64(expected, 40, 0x2222);
  PutU64(expected, 48, 0x3333);
  EXPECT_EQ(ImageOf(record), expected);

  // RecordChecksumInput {epoch, iteration, time, extra_bytes, extra_checksum,
  // parts_checksum}: 48 raw bytes.
  const detail::RecordChecksumInput input{5, 41, 1700000000000000000ull, 3, 0x1111, 0x2222};
  std::vector<std::byte> input_expected(48, std::byte{0});
  const std::uint64_t fields[6] = {5, 41, 1700000000000000000ull, 3, 0x1111, 0x2222};
  for (int i = 0; i < 6; ++i) PutU64(input_expected, 8 * i, fields[i]);
  EXPECT_EQ(ImageOf(input), input_expected);
  EXPECT_EQ(detail::RecordChecksum(5, record), 0xa12ad4af667f1964ull);
  // The epoch comes from the commit word: the same record under another
  // epoch does not verify.
  EXPECT_NE(detail::RecordChecksum(7, record), 0xa12ad4af667f1964ull);
}

TEST(ManifestGoldenTest, ChunkHeaderBytesAndChecksum) {
  detail::ChunkHeader chunk{};
  chunk.magic = detail::kChunkMagic;
  chunk.prev_offset = 0x1000;
  chunk.next_offset = 0x2000;
  chunk.epoch = 7;
  chunk.tag = 0x0301;
  chunk.bytes = 100;
  chunk.header_checksum = 0x90001aa7e78d13a9ull;
  chunk.sealed = 1;
  chunk.payload_checksum = 0x004e4f921a64bd1cull;

  std::vector<std::byte> expected(128, std::byte{0});
  std::memcpy(expected.data(), "PMSCHNK", 7);  // magic, the 8th byte 0
  PutU64(expected, 8, 0x1000);
  PutU64(expected, 16, 0x2000);
  PutU64(expected, 24, 7);
  PutU64(expected, 32, 0x0301);
  PutU64(expected, 40, 100);
  PutU64(expected, 48, 0x90001aa7e78d13a9ull);
  PutU64(expected, 56, 1);
  PutU64(expected, 64, 0x004e4f921a64bd1cull);
  EXPECT_EQ(ImageOf(chunk), expected);
  // Over {magic, epoch, tag, bytes}; the links are not covered.
  EXPECT_EQ(detail::ChunkHeaderChecksum(chunk), 0x90001aa7e78d13a9ull);
  chunk.prev_offset = 0;
  chunk.next_offset = 0;
  EXPECT_EQ(detail::ChunkHeaderChecksum(chunk), 0x90001aa7e78d13a9ull);
  // The payload checksum is XXH3-64 of the payload bytes (here 0, 1, .., 99).
  std::vector<std::uint8_t> payload(100);
  for (int i = 0; i < 100; ++i) payload[i] = static_cast<std::uint8_t>(i);
  EXPECT_EQ(Checksum64(payload.data(), payload.size()), 0x004e4f921a64bd1cull);
}

}  // namespace
}  // namespace pmsnap::layout
