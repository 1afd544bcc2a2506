// Pool write/commit/read behaviour on well-formed pools.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <thread>

#include "pmsnap/pmem_layout/pool.h"
#include "testutil/pool_fixtures.h"
#include "testutil/temp_pool.h"

namespace pmsnap::layout {
namespace {

using pmsnap::testing::CheckSeededView;
using pmsnap::testing::MakeManifest;
using pmsnap::testing::SeededTensor;
using pmsnap::testing::TempPoolPath;
using pmsnap::testing::WriteSeededEpoch;

std::string AsString(std::span<const std::byte> bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

TEST(PoolTest, FreshPoolHasNoCommittedCheckpoint) {
  TempPoolPath path("fresh");
  auto pool = Pool::Create(path.path(), MakeManifest(3, 1000));
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  auto latest = (*pool)->Latest();
  EXPECT_EQ(latest.status().code(), StatusCode::kNotFound);
  EXPECT_FALSE((*pool)->last_committed_epoch().has_value());
}

TEST(PoolTest, CommittedEpochSurvivesReopenBitExact) {
  TempPoolPath path("roundtrip");
  const Manifest manifest = MakeManifest(4, 5000);
  {
    auto pool = Pool::Create(path.path(), manifest);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    ASSERT_TRUE(WriteSeededEpoch(**pool, 1, 100, "loader=100").ok());
  }
  auto pool = Pool::Open(path.path(), manifest);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  auto latest = (*pool)->Latest();
  ASSERT_TRUE(latest.ok()) << latest.status().ToString();
  EXPECT_EQ(latest->epoch(), 1u);
  EXPECT_EQ(latest->iteration(), 100u);
  EXPECT_EQ(AsString(latest->extra_state()), "loader=100");
  EXPECT_EQ(CheckSeededView(manifest, *latest, 1), "");
  EXPECT_TRUE((*pool)->warnings().empty());
}

TEST(PoolTest, EpochsAlternateSlotsAndOlderSlotKeepsPreviousEpoch) {
  TempPoolPath path("alternate");
  const Manifest manifest = MakeManifest(2, 777);
  auto pool = Pool::Create(path.path(), manifest);
  ASSERT_TRUE(pool.ok());
  for (std::uint64_t e = 1; e <= 5; ++e) {
    ASSERT_TRUE(WriteSeededEpoch(**pool, e, e * 10).ok());
    auto latest = (*pool)->Latest();
    ASSERT_TRUE(latest.ok());
    EXPECT_EQ(latest->epoch(), e);
    EXPECT_EQ(latest->slot(), static_cast<int>(e % 2));
    if (e > 1) {
      auto older = (*pool)->Slot(static_cast<int>((e - 1) % 2));
      ASSERT_TRUE(older.ok()) << older.status().ToString();
      EXPECT_EQ(older->epoch(), e - 1);
      EXPECT_EQ(CheckSeededView(manifest, *older, e - 1), "");
    }
  }
}

TEST(PoolTest, RankGroupIsStoredAndReadBack) {
  TempPoolPath path("group");
  const Manifest manifest = MakeManifest(2, 100);
  PoolOptions options;
  options.group = {.run_id = 0x1234'5678'9abcULL, .rank = 3, .world_size = 4,
                   .model_fingerprint = 0xfeedULL};
  ASSERT_TRUE(Pool::Create(path.path(), manifest, options).ok());
  auto pool = Pool::Open(path.path(), manifest);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_EQ((*pool)->group(), options.group);
  EXPECT_TRUE((*pool)->group().in_group());

  TempPoolPath single("single");
  auto alone = Pool::Create(single.path(), manifest);
  ASSERT_TRUE(alone.ok());
  EXPECT_FALSE((*alone)->group().in_group());
}

TEST(PoolTest, RollBackLatestRestoresTheOlderEpochAndTheNextEpochOverwritesTheNewer) {
  TempPoolPath path("rollback");
  const Manifest manifest = MakeManifest(2, 3000);
  {
    auto pool = Pool::Create(path.path(), manifest);
    ASSERT_TRUE(pool.ok());
    ASSERT_TRUE(WriteSeededEpoch(**pool, 1, 10).ok());
    ASSERT_TRUE(WriteSeededEpoch(**pool, 2, 20).ok());
  }
  auto pool = Pool::Open(path.path(), manifest);
  ASSERT_TRUE(pool.ok());
  ASSERT_EQ((*pool)->Latest()->iteration(), 20u);
  const int dropped_slot = (*pool)->Latest()->slot();
  ASSERT_TRUE((*pool)->RollBackLatest("iteration 20 is newer than the group's 10").ok());
  auto latest = (*pool)->Latest();
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(latest->iteration(), 10u);
  EXPECT_EQ(CheckSeededView(manifest, *latest, 1), "");
  EXPECT_THAT((*pool)->warnings(), ::testing::Contains(::testing::HasSubstr("newer than")));
  // A rollback is not damage: its warning must not send the user looking for one.
  EXPECT_THAT((*pool)->warnings(),
              ::testing::Contains(::testing::HasSubstr("rolling back the newest checkpoint")));
  EXPECT_THAT((*pool)->warnings(), ::testing::Each(::testing::Not(::testing::HasSubstr("damaged"))));
  // The next epoch goes to the dropped slot; iteration 10 stays intact.
  ASSERT_TRUE(WriteSeededEpoch(**pool, 3, 11).ok());
  EXPECT_EQ((*pool)->Latest()->slot(), dropped_slot);
  pool->reset();
  auto reopened = Pool::Open(path.path(), manifest);
  ASSERT_TRUE(reopened.ok());
  EXPECT_EQ((*reopened)->Latest()->iteration(), 11u);
  auto older = (*reopened)->Slot(1 - dropped_slot);
  ASSERT_TRUE(older.ok());
  EXPECT_EQ(older->iteration(), 10u);
  EXPECT_EQ(CheckSeededView(manifest, *older, 1), "");
}

TEST(PoolTest, RollBackLatestWithoutACheckpointIsAPreconditionError) {
  TempPoolPath path("rollback-empty");
  auto pool = Pool::Create(path.path(), MakeManifest(1, 100));
  ASSERT_TRUE(pool.ok());
  EXPECT_EQ((*pool)->RollBackLatest("x").code(), StatusCode::kFailedPrecondition);
}

TEST(PoolTest, UncommittedEpochIsInvisibleAfterReopen) {
  TempPoolPath path("uncommitted");
  const Manifest manifest = MakeManifest(2, 4096);
  {
    auto pool = Pool::Create(path.path(), manifest);
    ASSERT_TRUE(pool.ok());
    ASSERT_TRUE(WriteSeededEpoch(**pool, 1, 1).ok());
    ASSERT_TRUE(WriteSeededEpoch(**pool, 2, 2).ok());
    // Epoch 3 writes half its parts, then the process "dies" (pool closed).
    ASSERT_TRUE((*pool)->BeginEpoch(3).ok());
    auto bytes = SeededTensor(manifest, 3, 0, 0);
    ASSERT_TRUE((*pool)->WriteTensor(0, 0, bytes.data()).ok());
  }
  auto pool = Pool::Open(path.path());
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  auto latest = (*pool)->Latest();
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(latest->epoch(), 2u);
  EXPECT_EQ(CheckSeededView(manifest, *latest, 2), "");
  EXPECT_EQ((*pool)->slot_info(1).state, SlotState::kWriting);
  // The next epoch reuses the number of the one that never committed.
  auto next = (*pool)->BeginEpoch(3);
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(*next, 3u);
}

TEST(PoolTest, CommitRefusesWhileAPartIsMissingAndNamesIt) {
  TempPoolPath path("missing-part");
  const Manifest manifest = MakeManifest(2, 100);
  auto pool = Pool::Create(path.path(), manifest);
  ASSERT_TRUE(pool.ok());
  ASSERT_TRUE((*pool)->BeginEpoch(7).ok());
  for (std::uint32_t t = 0; t < 3; ++t) {
    auto bytes = SeededTensor(manifest, 1, 0, t);
    ASSERT_TRUE((*pool)->WriteTensor(0, t, bytes.data()).ok());
  }
  Status status = (*pool)->Commit();
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("layer1.weight"), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("param"), std::string::npos) << status.message();
}

TEST(PoolTest, SecondBeginEpochWhileOneIsOpenIsBusy) {
  TempPoolPath path("busy");
  auto pool = Pool::Create(path.path(), MakeManifest(1, 10));
  ASSERT_TRUE(pool.ok());
  ASSERT_TRUE((*pool)->BeginEpoch(1).ok());
  EXPECT_EQ((*pool)->BeginEpoch(2).status().code(), StatusCode::kBusy);
  (*pool)->Abandon();
  EXPECT_TRUE((*pool)->BeginEpoch(2).ok());
}

TEST(PoolTest, LargeTensorsAreCutIntoPartsWrittenFromSeveralThreads) {
  TempPoolPath path("parts");
  const Manifest manifest = MakeManifest(3, 300000);  // 1.2 MB per tensor
  PoolOptions options;
  options.part_bytes = 64 << 10;
  auto pool = Pool::Create(path.path(), manifest, options);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  const SlotLayout& layout = (*pool)->layout();
  ASSERT_GT(layout.parts.size(), 30u);
  ASSERT_TRUE((*pool)->BeginEpoch(5).ok());
  std::vector<std::vector<std::byte>> sources;
  for (std::uint32_t u = 0; u < 3; ++u)
    for (std::uint32_t t = 0; t < 3; ++t) sources.push_back(SeededTensor(manifest, 9, u, t));
  // Parts in reverse order, interleaved over two threads.
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int worker = 0; worker < 2; ++worker) {
    threads.emplace_back([&, worker] {
      for (std::size_t i = layout.parts.size(); i-- > 0;) {
        if (static_cast<int>(i % 2) != worker) continue;
        const PartLayout& part = layout.parts[i];
        const auto& src = sources[part.unit * 3 + part.tensor];
        if (!(*pool)
                 ->WritePart(static_cast<std::uint32_t>(i), src.data() + part.offset_in_tensor)
                 .ok())
          failures++;
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ(failures.load(), 0);
  ASSERT_TRUE((*pool)->Commit().ok());
  auto report = (*pool)->Verify(/*deep=*/true);
  EXPECT_TRUE(report.ok());
  auto latest = (*pool)->Latest();
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(CheckSeededView(manifest, *latest, 9), "");
}

TEST(PoolTest, PartDestinationAndSealPartPersistExternallyCopiedBytes) {
  TempPoolPath path("seal");
  const Manifest manifest = MakeManifest(1, 2048);
  auto pool = Pool::Create(path.path(), manifest);
  ASSERT_TRUE(pool.ok());
  ASSERT_TRUE((*pool)->BeginEpoch(1).ok());
  for (std::uint32_t p = 0; p < (*pool)->layout().parts.size(); ++p) {
    const PartLayout& part = (*pool)->layout().parts[p];
    auto dst = (*pool)->PartDestination(p);
    ASSERT_TRUE(dst.ok());
    auto src = SeededTensor(manifest, 4, part.unit, part.tensor);
    std::memcpy(dst->data(), src.data() + part.offset_in_tensor, part.bytes);
    ASSERT_TRUE((*pool)->SealPart(p).ok());
  }
  ASSERT_TRUE((*pool)->Commit().ok());
  EXPECT_TRUE((*pool)->Verify(true).ok());
  EXPECT_EQ(CheckSeededView(manifest, *(*pool)->Latest(), 4), "");
}

enum class PartRead { kVerified, kUnverified };  // ReadPart, CopyPart

// Reads every part of `view` into per-tensor buffers starting `misalign`
// bytes past a 64-byte boundary; "" if each equals its seeded content.
std::string ReadAllPartsAndCompare(const Pool& pool, const SnapshotView& view, std::uint64_t seed,
                                   std::size_t misalign, PartRead how = PartRead::kVerified) {
  const Manifest& manifest = pool.manifest();
  std::vector<std::vector<std::vector<std::byte>>> buffers(manifest.units.size());
  for (std::uint32_t u = 0; u < manifest.units.size(); ++u) {
    for (const TensorSpec& t : manifest.units[u].tensors) {
      buffers[u].emplace_back(t.bytes() + 64 + misalign);
    }
  }
  auto at = [&](std::uint32_t u, std::uint32_t t) {
    auto address = reinterpret_cast<std::uintptr_t>(buffers[u][t].data());
    return reinterpret_cast<std::byte*>((address + 63) / 64 * 64 + misalign);
  };
  for (std::uint32_t p = 0; p < pool.layout().parts.size(); ++p) {
    const PartLayout& part = pool.layout().parts[p];
    std::byte* dst = at(part.unit, part.tensor) + part.offset_in_tensor;
    Status read =
        how == PartRead::kVerified ? pool.ReadPart(view, p, dst) : pool.CopyPart(view, p, dst);
    if (!read.ok()) return read.ToString();
  }
  for (std::uint32_t u = 0; u < manifest.units.size(); ++u) {
    for (std::uint32_t t = 0; t < manifest.units[u].tensors.size(); ++t) {
      const std::vector<std::byte> expected = SeededTensor(manifest, seed, u, t);
      if (std::memcmp(at(u, t), expected.data(), expected.size()) != 0) {
        return "unit " + std::to_string(u) + " tensor " + std::to_string(t) + " differs";
      }
    }
  }
  return "";
}

// A pool of `units` units of 80 KB tensors in 16 KiB parts (5 each) holding
// one epoch seeded with `seed`, reopened with its data check deferred.
Result<std::unique_ptr<Pool>> OpenDeferredAfterOneEpoch(const TempPoolPath& path,
                                                        std::uint32_t units, std::uint64_t seed) {
  PoolOptions options;
  options.part_bytes = 16 << 10;
  {
    auto pool = Pool::Create(path.path(), MakeManifest(units, 20000), options);
    if (!pool.ok()) return pool.status();
    PMSNAP_RETURN_IF_ERROR(WriteSeededEpoch(**pool, seed, seed * 10));
  }
  OpenOptions deferred;
  deferred.defer_data_verification = true;
  return Pool::Open(path.path(), deferred);
}

TEST(PoolTest, ReadPartCopiesEveryPartBitwiseAndCompletesDeferredVerification) {
  TempPoolPath path("read-part");
  auto pool = OpenDeferredAfterOneEpoch(path, 3, 9);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  ASSERT_GT((*pool)->layout().parts.size(), 3 * 3u);
  EXPECT_TRUE((*pool)->data_verification_pending());
  auto latest = (*pool)->Latest();
  ASSERT_TRUE(latest.ok());
  // Unaligned destinations take the plain copy; aligned ones the fused one.
  EXPECT_EQ(ReadAllPartsAndCompare(**pool, *latest, 9, 4), "");
  EXPECT_FALSE((*pool)->data_verification_pending());
  EXPECT_EQ(ReadAllPartsAndCompare(**pool, *latest, 9, 0), "");
  EXPECT_EQ((*pool)->ReadPart(*latest, 100000, nullptr).code(), StatusCode::kInvalidArgument);

  OpenOptions deferred;
  deferred.defer_data_verification = true;
  auto missing = Pool::Open(path.path() + ".missing", deferred);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
}

TEST(PoolTest, CopyPartCopiesEveryPartBitwiseWithoutVerifying) {
  TempPoolPath path("copy-part");
  auto pool = OpenDeferredAfterOneEpoch(path, 3, 11);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  auto latest = (*pool)->Latest();
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(ReadAllPartsAndCompare(**pool, *latest, 11, 4, PartRead::kUnverified), "");
  EXPECT_EQ(ReadAllPartsAndCompare(**pool, *latest, 11, 0, PartRead::kUnverified), "");
  EXPECT_TRUE((*pool)->data_verification_pending()) << "CopyPart checks nothing";
  std::vector<std::byte> sink(1 << 20);
  EXPECT_EQ((*pool)->CopyPart(*latest, 100000, sink.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*pool)->CopyPart(*latest, 0, nullptr).code(), StatusCode::kInvalidArgument);
}

TEST(PoolTest, PrefaultPartChangesNothingObservableAndIgnoresBadParts) {
  TempPoolPath path("prefault");
  auto pool = OpenDeferredAfterOneEpoch(path, 2, 5);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  auto latest = (*pool)->Latest();
  ASSERT_TRUE(latest.ok());
  for (std::uint32_t p = 0; p < (*pool)->layout().parts.size(); ++p)
    (*pool)->PrefaultPart(*latest, p);
  (*pool)->PrefaultPart(*latest, 100000);  // out of range: a no-op, not a crash
  // A hint only: nothing was verified, and every byte still reads back.
  EXPECT_TRUE((*pool)->data_verification_pending());
  EXPECT_EQ(ReadAllPartsAndCompare(**pool, *latest, 5, 0), "");
  EXPECT_FALSE((*pool)->data_verification_pending());
}

TEST(PoolTest, FindUnitUsesTheManifestIndex) {
  TempPoolPath path("index");
  auto pool = Pool::Create(path.path(), MakeManifest(5, 10));
  ASSERT_TRUE(pool.ok());
  EXPECT_EQ((*pool)->FindUnit("layer3.weight"), std::optional<std::uint32_t>(3));
  EXPECT_FALSE((*pool)->FindUnit("nope").has_value());
}

TEST(PoolTest, RequiredBytesIsEnoughForManySizes) {
  for (std::int64_t floats : {1, 1000, 1 << 20}) {
    for (std::uint64_t heap : {0ull, 1ull << 20, 64ull << 20}) {
      TempPoolPath path("size");
      PoolOptions options;
      options.chunk_heap_bytes = heap;
      const Manifest manifest = MakeManifest(7, floats);
      auto pool = Pool::Create(path.path(), manifest, options);
      ASSERT_TRUE(pool.ok()) << floats << " " << heap << ": " << pool.status().ToString();
      ASSERT_TRUE(WriteSeededEpoch(**pool, 1, 1).ok());
      if (heap == 0) continue;
      // The whole budget can be allocated, in chunks of mixed sizes, until
      // the budget (not libpmemobj) says the heap is full.
      std::uint64_t i = 0;
      for (;; ++i) {
        const std::uint64_t bytes = (i % 3 == 0) ? 300000 + i * 77 : 1000 + (i * 5171) % 60000;
        auto chunk = (*pool)->chunk_heap().Alloc(bytes, 1, 0);
        if (!chunk.ok()) {
          EXPECT_EQ(chunk.status().code(), StatusCode::kNoSpace);
          EXPECT_THAT(chunk.status().message(), ::testing::HasSubstr("chunk heap full"));
          break;
        }
      }
      EXPECT_GT((*pool)->chunk_heap().used_bytes(), heap - (600u << 10)) << "stopped early";
      EXPECT_LE((*pool)->chunk_heap().used_bytes(), heap);
    }
  }
}

TEST(ChunkHeapTest, SealedChunkReadsBackAndSurvivesReopen) {
  TempPoolPath path("chunks");
  PoolOptions options;
  options.chunk_heap_bytes = 4 << 20;
  const Manifest manifest = MakeManifest(1, 16);
  std::uint64_t id = 0;
  {
    auto pool = Pool::Create(path.path(), manifest, options);
    ASSERT_TRUE(pool.ok());
    ASSERT_TRUE(WriteSeededEpoch(**pool, 1, 1).ok());
    auto chunk = (*pool)->chunk_heap().Alloc(10000, 1, 42);
    ASSERT_TRUE(chunk.ok()) << chunk.status().ToString();
    id = chunk->id;
    auto payload = (*pool)->chunk_heap().Payload(id);
    ASSERT_TRUE(payload.ok());
    for (std::size_t i = 0; i < payload->size(); ++i) (*payload)[i] = std::byte(i * 7);
    ASSERT_TRUE((*pool)->chunk_heap().Seal(id).ok());
    // Charged as the heap really holds it: header + payload + libpmemobj's
    // 16-byte header, in 4 KiB units.
    EXPECT_EQ((*pool)->chunk_heap().used_bytes(), 12288u);
  }
  auto pool = Pool::Open(path.path());
  ASSERT_TRUE(pool.ok());
  auto chunks = (*pool)->chunk_heap().List();
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0].tag, 42u);
  EXPECT_EQ(chunks[0].epoch, 1u);
  auto payload = (*pool)->chunk_heap().Read(id);
  ASSERT_TRUE(payload.ok());
  for (std::size_t i = 0; i < payload->size(); ++i) ASSERT_EQ((*payload)[i], std::byte(i * 7));
}

TEST(ChunkHeapTest, FreedChunksReturnTheirSpace) {
  TempPoolPath path("chunk-free");
  PoolOptions options;
  options.chunk_heap_bytes = 1 << 20;
  auto pool = Pool::Create(path.path(), MakeManifest(1, 16), options);
  ASSERT_TRUE(pool.ok());
  std::vector<std::uint64_t> ids;
  for (int i = 0; i < 5; ++i) {
    auto chunk = (*pool)->chunk_heap().Alloc(1000 * (i + 1), 1, i);
    ASSERT_TRUE(chunk.ok());
    ids.push_back(chunk->id);
  }
  // Free from the middle, the head and the tail of the list.
  for (int i : {2, 4, 0, 1, 3}) ASSERT_TRUE((*pool)->chunk_heap().Free(ids[i]).ok());
  EXPECT_EQ((*pool)->chunk_heap().used_bytes(), 0u);
  EXPECT_TRUE((*pool)->chunk_heap().List().empty());
  EXPECT_EQ((*pool)->chunk_heap().Free(ids[0]).code(), StatusCode::kNotFound);
}

TEST(ChunkHeapTest, ChunksOfAnEpochThatNeverCommittedAreFreed) {
  TempPoolPath path("chunk-orphan");
  PoolOptions options;
  options.chunk_heap_bytes = 1 << 20;
  const Manifest manifest = MakeManifest(1, 16);
  {
    auto pool = Pool::Create(path.path(), manifest, options);
    ASSERT_TRUE(pool.ok());
    ASSERT_TRUE(WriteSeededEpoch(**pool, 1, 1).ok());
    ASSERT_TRUE((*pool)->chunk_heap().Alloc(100, 1, 0).ok());
    ASSERT_TRUE((*pool)->BeginEpoch(2).ok());
    ASSERT_TRUE((*pool)->chunk_heap().Alloc(100, 2, 0).ok());  // epoch 2 never commits
  }
  auto pool = Pool::Open(path.path());
  ASSERT_TRUE(pool.ok());
  EXPECT_EQ((*pool)->chunk_heap().List().size(), 2u);
  ASSERT_TRUE((*pool)->BeginEpoch(2).ok());
  auto chunks = (*pool)->chunk_heap().List();
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0].epoch, 1u);
}

TEST(ChunkHeapTest, UnsealedChunkIsNotReadable) {
  TempPoolPath path("chunk-unsealed");
  PoolOptions options;
  options.chunk_heap_bytes = 1 << 20;
  auto pool = Pool::Create(path.path(), MakeManifest(1, 16), options);
  ASSERT_TRUE(pool.ok());
  auto chunk = (*pool)->chunk_heap().Alloc(100, 0, 0);
  ASSERT_TRUE(chunk.ok());
  EXPECT_EQ((*pool)->chunk_heap().Read(chunk->id).status().code(), StatusCode::kFailedPrecondition);
}


// `pmsnap prune --keep 1`: the older epoch is dropped for good, the newest
// stays bit-exact and the next epoch reuses the dropped slot.
TEST(PoolTest, DiscardOlderEpochDropsItForEveryLaterOpenAndKeepsTheNewest) {
  TempPoolPath path("discard");
  const Manifest manifest = MakeManifest(3, 900);
  {
    auto pool = Pool::Create(path.path(), manifest);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    ASSERT_TRUE(WriteSeededEpoch(**pool, 1, 10).ok());
    ASSERT_TRUE(WriteSeededEpoch(**pool, 2, 20).ok());
    auto dropped = (*pool)->DiscardOlderEpoch();
    ASSERT_TRUE(dropped.ok()) << dropped.status().ToString();
    EXPECT_EQ(*dropped, std::optional<std::uint64_t>(1));
    // Nothing older is left to drop.
    auto again = (*pool)->DiscardOlderEpoch();
    ASSERT_TRUE(again.ok());
    EXPECT_FALSE(again->has_value());
  }
  auto pool = Pool::Open(path.path(), manifest);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_EQ((*pool)->slot_info(1).state, SlotState::kEmpty);
  EXPECT_EQ((*pool)->Slot(1).status().code(), StatusCode::kNotFound);
  auto latest = (*pool)->Latest();
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(latest->epoch(), 2u);
  EXPECT_EQ(CheckSeededView(manifest, *latest, 2), "");
  EXPECT_TRUE((*pool)->Verify(/*deep=*/true).ok());
  ASSERT_TRUE(WriteSeededEpoch(**pool, 3, 30).ok());
  EXPECT_EQ((*pool)->Latest()->slot(), 1);
  EXPECT_EQ(CheckSeededView(manifest, *(*pool)->Slot(0), 2), "");
}

TEST(PoolTest, DiscardOlderEpochRefusesAnOpenEpochAndAPoolWithoutCheckpoint) {
  TempPoolPath path("discard-refuse");
  const Manifest manifest = MakeManifest(2, 300);
  auto pool = Pool::Create(path.path(), manifest);
  ASSERT_TRUE(pool.ok());
  EXPECT_EQ((*pool)->DiscardOlderEpoch().status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(WriteSeededEpoch(**pool, 1, 10).ok());
  ASSERT_TRUE((*pool)->BeginEpoch(20).ok());
  EXPECT_EQ((*pool)->DiscardOlderEpoch().status().code(), StatusCode::kBusy);
  (*pool)->Abandon();
  auto none = (*pool)->DiscardOlderEpoch();
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());  // one epoch only: the newest is never dropped
  EXPECT_EQ((*pool)->Latest()->epoch(), 1u);
}

// Multi-rank recovery after a kill inside the first epoch
// (EpochAgreement): the epochs some ranks committed alone are dropped for
// every later open, epochs number from 1 again, and the next epoch frees
// the forgotten epochs' chunks.
TEST(PoolTest, ForgetEpochsDropsEveryEpochForLaterOpensAndTheNextEpochFreesTheirChunks) {
  TempPoolPath path("forget");
  const Manifest manifest = MakeManifest(2, 300);
  PoolOptions options;
  options.chunk_heap_bytes = 1 << 20;
  {
    auto pool = Pool::Create(path.path(), manifest, options);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    ASSERT_TRUE(WriteSeededEpoch(**pool, 1, 10).ok());
    auto chunk = (*pool)->chunk_heap().Alloc(1024, 1, 7);
    ASSERT_TRUE(chunk.ok()) << chunk.status().ToString();
    ASSERT_TRUE((*pool)->chunk_heap().Seal(chunk->id).ok());
    ASSERT_TRUE(WriteSeededEpoch(**pool, 2, 20).ok());
    EXPECT_EQ((*pool)->committed_slots(), 2);
    auto forgot = (*pool)->ForgetEpochs("the ranks start afresh");
    ASSERT_TRUE(forgot.ok()) << forgot.status().ToString();
    EXPECT_EQ(*forgot, 2);
    EXPECT_EQ((*pool)->Latest().status().code(), StatusCode::kNotFound);
    EXPECT_THAT((*pool)->warnings(), ::testing::Contains(::testing::HasSubstr(
                                         "the ranks start afresh: forgot 2 committed epochs")));
  }
  auto pool = Pool::Open(path.path(), manifest);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_EQ((*pool)->committed_slots(), 0);
  EXPECT_EQ((*pool)->Latest().status().code(), StatusCode::kNotFound);
  EXPECT_EQ((*pool)->chunk_heap().List().size(), 1u);
  auto epoch = (*pool)->BeginEpoch(1);
  ASSERT_TRUE(epoch.ok()) << epoch.status().ToString();
  EXPECT_EQ(*epoch, 1u);
  EXPECT_TRUE((*pool)->chunk_heap().List().empty());
  EXPECT_EQ((*pool)->ForgetEpochs("test").status().code(), StatusCode::kBusy);
  (*pool)->Abandon();
  ASSERT_TRUE(WriteSeededEpoch(**pool, 3, 1).ok());
  auto latest = (*pool)->Latest();
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(latest->epoch(), 1u);
  EXPECT_EQ(CheckSeededView(manifest, *latest, 3), "");
  EXPECT_EQ((*pool)->committed_slots(), 1);
}

}  // namespace
}  // namespace pmsnap::layout
