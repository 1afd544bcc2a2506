// The simulated PM bandwidth model (PmBandwidth): a throttled pool writes and
// reads at the configured rate, concurrent writers share it, the chunk heap
// and the restore copy are held to it too, and the environment variables
// configure it.
//
// The rate checks are rate tests by nature (issue [perf]: "a throttled pool's
// measured write rate is within 10% of the configured one"). They stay
// independent of this machine's speed by configuring a rate well below what
// the same test just measured without the model (an eighth of the lower of
// two measurements, at most 0.25 GB/s): the model can then only be met, never
// outrun by a slow machine. (A quarter was not enough margin: on this 2-vCPU
// VM at a load of ~20 from parallel builds the machine's own rate moved by
// 4x within seconds and the throttled rate came out 15-20% low.)
// The other checks are lower bounds the model guarantees whatever the
// machine's speed (the channel's reservations run back to back).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "pmsnap/pmem_layout/pool.h"
#include "testutil/pool_fixtures.h"
#include "testutil/temp_pool.h"

namespace pmsnap::layout {
namespace {

using Clock = std::chrono::steady_clock;
using pmsnap::testing::CheckSeededView;
using pmsnap::testing::MakeManifest;
using pmsnap::testing::SeededTensor;
using pmsnap::testing::TempPoolPath;

// Four writers (readers) on two vCPUs: a writer that sleeps past its
// reservation (at a load of ~20 a wake-up can be late by more than one 4 MiB
// part's channel time) leaves the channel to the three others queued behind
// it, so the measured rate is the model's, not the scheduler's. With two,
// the channel idled and a throttled pool measured 78-84% of its rate.
constexpr int kThreads = 4;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::uint64_t DataBytes(const Pool& pool) {
  std::uint64_t bytes = 0;
  for (const auto& part : pool.layout().parts) bytes += part.bytes;
  return bytes;
}

// Sets (or, with nullopt, unsets) an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) {
      ::setenv(name, value->c_str(), 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// The seed-derived content of every tensor, made once so that the timed
// loops only write.
std::vector<std::vector<std::vector<std::byte>>> SeededModel(const Manifest& manifest,
                                                              std::uint64_t seed) {
  std::vector<std::vector<std::vector<std::byte>>> model(manifest.units.size());
  for (std::uint32_t u = 0; u < manifest.units.size(); ++u) {
    for (std::uint32_t t = 0; t < manifest.units[u].tensors.size(); ++t) {
      model[u].push_back(SeededTensor(manifest, seed, u, t));
    }
  }
  return model;
}

// Runs `work(thread)` on kThreads threads and returns the span from the
// first thread's start of work to the last one's end: the time the pool was
// being written or read, without the threads' start and join (on a loaded
// machine a new thread can wait milliseconds for a CPU before it runs).
template <typename Work>
double TimedOnThreads(const Work& work) {
  std::vector<Clock::time_point> starts(kThreads), ends(kThreads);
  std::vector<std::thread> threads;
  for (int w = 0; w < kThreads; ++w) {
    threads.emplace_back([&, w] {
      starts[w] = Clock::now();
      work(w);
      ends[w] = Clock::now();
    });
  }
  for (auto& thread : threads) thread.join();
  return Seconds(*std::max_element(ends.begin(), ends.end()) -
                 *std::min_element(starts.begin(), starts.end()));
}

// Writes `epochs` epochs of `model` with kThreads writers (units dealt out
// round-robin, as the engine's workers would) and returns the seconds the
// writers took (TimedOnThreads), summed over the epochs.
double WriteEpochs(Pool& pool, const std::vector<std::vector<std::vector<std::byte>>>& model,
                   int epochs) {
  double seconds = 0;
  for (int e = 0; e < epochs; ++e) {
    EXPECT_TRUE(pool.BeginEpoch(static_cast<std::uint64_t>(e)).ok());
    seconds += TimedOnThreads([&](int w) {
      for (std::uint32_t u = w; u < model.size(); u += kThreads) {
        for (std::uint32_t t = 0; t < model[u].size(); ++t) {
          const Status s = pool.WriteTensor(u, t, model[u][t].data());
          EXPECT_TRUE(s.ok()) << s.ToString();
        }
      }
    });
    const Status commit = pool.Commit();
    EXPECT_TRUE(commit.ok()) << commit.ToString();
  }
  return seconds;
}

// Reads every part of the latest slot `passes` times with kThreads readers
// (ReadPart: the verified restore copy) and returns the readers' seconds.
double ReadAll(const Pool& pool, int passes, std::vector<std::byte>& into) {
  auto view = pool.Latest();
  EXPECT_TRUE(view.ok()) << view.status().ToString();
  const auto& parts = pool.layout().parts;
  double seconds = 0;
  for (int pass = 0; pass < passes; ++pass) {
    seconds += TimedOnThreads([&](int r) {
      for (std::uint32_t p = r; p < parts.size(); p += kThreads) {
        const Status s = pool.ReadPart(*view, p, into.data() + parts[p].slot_offset);
        EXPECT_TRUE(s.ok()) << s.ToString();
      }
    });
  }
  return seconds;
}

// An eighth of what the machine just did (the lower of two measurements), at
// most 0.25 GB/s: a 4 MiB part then holds the channel for 16 ms or more,
// well above a late wake-up on a loaded machine (at 1 GB/s, 4 ms, a pool
// measured 88% of its rate at a load of ~22).
double ModestRate(double first_gbps, double second_gbps) {
  return std::min(0.25, std::min(first_gbps, second_gbps) / 8);
}

TEST(PoolPmBandwidthTest, ThrottledPoolWritesAndReadsWithinTenPercentOfTheConfiguredRates) {
  ScopedEnv no_write_env("PMSNAP_PM_WRITE_GBPS", std::nullopt);
  ScopedEnv no_read_env("PMSNAP_PM_READ_GBPS", std::nullopt);
  TempPoolPath path("pm_rate");
  const Manifest manifest = MakeManifest(8, 1 << 20);  // 64 MiB of data per epoch
  const auto model = SeededModel(manifest, 7);
  double write_gbps = 0;
  double read_gbps = 0;
  {
    // The machine's own rates, on pages already faulted in (two warm-up
    // epochs, one per slot).
    auto pool = Pool::Create(path.path(), manifest);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    EXPECT_FALSE((*pool)->pm_bandwidth().simulated());
    EXPECT_EQ((*pool)->pm_bandwidth().Label(), "");
    const std::uint64_t bytes = DataBytes(**pool);
    WriteEpochs(**pool, model, 2);
    write_gbps = ModestRate(bytes / WriteEpochs(**pool, model, 1) / 1e9,
                            bytes / WriteEpochs(**pool, model, 1) / 1e9);
    std::vector<std::byte> into((*pool)->layout().slot_bytes);
    ReadAll(**pool, 1, into);
    read_gbps = ModestRate(bytes / ReadAll(**pool, 1, into) / 1e9,
                           bytes / ReadAll(**pool, 1, into) / 1e9);
  }
  OpenOptions options;
  options.pm_bandwidth = {.write_gbps = write_gbps, .read_gbps = read_gbps};
  auto pool = Pool::Open(path.path(), manifest, options);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_TRUE((*pool)->pm_bandwidth().simulated());
  EXPECT_NE((*pool)->pm_bandwidth().Label().find("simulated PM"), std::string::npos);
  const std::uint64_t bytes = DataBytes(**pool);

  constexpr int kEpochs = 4;
  const double written_gbps = kEpochs * bytes / WriteEpochs(**pool, model, kEpochs) / 1e9;
  std::printf("write: configured %.3f GB/s (an eighth of the machine's, at most 0.25), measured %.3f\n",
              write_gbps, written_gbps);
  EXPECT_NEAR(written_gbps, write_gbps, 0.1 * write_gbps)
      << "configured " << write_gbps << " GB/s write";

  std::vector<std::byte> into((*pool)->layout().slot_bytes);
  constexpr int kPasses = 3;
  const double read_back_gbps = kPasses * bytes / ReadAll(**pool, kPasses, into) / 1e9;
  std::printf("read: configured %.3f GB/s, measured %.3f\n", read_gbps, read_back_gbps);
  EXPECT_NEAR(read_back_gbps, read_gbps, 0.1 * read_gbps)
      << "configured " << read_gbps << " GB/s read";

  // The model only delays: what was written reads back bit-exact.
  auto latest = (*pool)->Latest();
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(CheckSeededView(manifest, *latest, 7), "");
}

// Lower bounds the model guarantees whatever the machine's speed: the
// channel's reservations run back to back, so N bytes take at least
// N / rate. The rates are far below any machine's, so the bounds bite.
TEST(PoolPmBandwidthTest, ChunkSealsAndRestoreCopiesAreHeldToTheModel) {
  TempPoolPath path("pm_chunks");
  const Manifest manifest = MakeManifest(2, 1 << 18);  // 4 MiB of data
  PoolOptions create;
  create.chunk_heap_bytes = 16ull << 20;
  constexpr double kGbps = 0.1;  // 100 MB/s
  create.pm_bandwidth = {.write_gbps = kGbps, .read_gbps = kGbps};
  auto pool = Pool::Create(path.path(), manifest, create);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_EQ((*pool)->pm_bandwidth().write_gbps, kGbps);

  // Chunk payloads: sealing 8 MB is charged 80 ms of writes, reading them
  // back (ChunkHeap::Read verifies each payload) 80 ms of reads.
  ChunkHeap& heap = (*pool)->chunk_heap();
  std::vector<std::uint64_t> chunks;
  constexpr std::uint64_t kChunkBytes = 1'000'000;
  auto start = Clock::now();
  for (int c = 0; c < 8; ++c) {
    auto chunk = heap.Alloc(kChunkBytes, /*epoch=*/1, /*tag=*/c);
    ASSERT_TRUE(chunk.ok()) << chunk.status().ToString();
    auto payload = heap.Payload(chunk->id);
    ASSERT_TRUE(payload.ok());
    std::fill(payload->begin(), payload->end(), std::byte{static_cast<unsigned char>(c)});
    ASSERT_TRUE(heap.Seal(chunk->id).ok());
    chunks.push_back(chunk->id);
  }
  EXPECT_GE(Seconds(Clock::now() - start), 8 * kChunkBytes / (kGbps * 1e9));
  start = Clock::now();
  for (std::uint64_t id : chunks) ASSERT_TRUE(heap.Read(id).ok());
  EXPECT_GE(Seconds(Clock::now() - start), 8 * kChunkBytes / (kGbps * 1e9));

  // Slot data: one epoch written, then copied out unverified (CopyPart) and
  // verified in place (VerifyPart), each charged bytes / rate.
  ASSERT_TRUE(pmsnap::testing::WriteSeededEpoch(**pool, 3, 30).ok());
  auto view = (*pool)->Latest();
  ASSERT_TRUE(view.ok());
  const std::uint64_t bytes = DataBytes(**pool);
  std::vector<std::byte> into((*pool)->layout().slot_bytes);
  start = Clock::now();
  for (std::uint32_t p = 0; p < (*pool)->layout().parts.size(); ++p) {
    ASSERT_TRUE((*pool)->CopyPart(*view, p, into.data() + (*pool)->layout().parts[p].slot_offset)
                    .ok());
  }
  EXPECT_GE(Seconds(Clock::now() - start), bytes / (kGbps * 1e9));
  start = Clock::now();
  for (std::uint32_t p = 0; p < (*pool)->layout().parts.size(); ++p) {
    ASSERT_TRUE((*pool)->VerifyPart(*view, p).ok());
  }
  EXPECT_GE(Seconds(Clock::now() - start), bytes / (kGbps * 1e9));
}

TEST(PoolPmBandwidthTest, EnvironmentVariablesSetTheModelWhereTheOptionIsLeftAtZero) {
  TempPoolPath path("pm_env");
  const Manifest manifest = MakeManifest(1, 1000);
  ASSERT_TRUE(Pool::Create(path.path(), manifest).ok());
  {
    ScopedEnv write_env("PMSNAP_PM_WRITE_GBPS", "2.3");
    ScopedEnv read_env("PMSNAP_PM_READ_GBPS", "6.6");
    auto pool = Pool::Open(path.path(), manifest);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    EXPECT_DOUBLE_EQ((*pool)->pm_bandwidth().write_gbps, 2.3);
    EXPECT_DOUBLE_EQ((*pool)->pm_bandwidth().read_gbps, 6.6);
    EXPECT_EQ((*pool)->pm_bandwidth().Label(), "simulated PM (2.3 GB/s write, 6.6 GB/s read)");
  }
  {
    // An explicit option wins; the other direction still comes from the
    // environment.
    ScopedEnv write_env("PMSNAP_PM_WRITE_GBPS", "2.3");
    ScopedEnv read_env("PMSNAP_PM_READ_GBPS", "6.6");
    OpenOptions options;
    options.pm_bandwidth.write_gbps = 13.9;
    auto pool = Pool::Open(path.path(), manifest, options);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    EXPECT_DOUBLE_EQ((*pool)->pm_bandwidth().write_gbps, 13.9);
    EXPECT_DOUBLE_EQ((*pool)->pm_bandwidth().read_gbps, 6.6);
  }
  {
    // Only writes modelled: reads say they run at the machine's speed.
    ScopedEnv write_env("PMSNAP_PM_WRITE_GBPS", "32");
    ScopedEnv read_env("PMSNAP_PM_READ_GBPS", std::nullopt);
    auto pool = Pool::Open(path.path(), manifest);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    EXPECT_EQ((*pool)->pm_bandwidth().Label(), "simulated PM (32 GB/s write, machine speed read)");
  }
}

TEST(PoolPmBandwidthTest, MalformedRatesAreRefusedNamingTheirSource) {
  TempPoolPath path("pm_bad");
  const Manifest manifest = MakeManifest(1, 1000);
  ASSERT_TRUE(Pool::Create(path.path(), manifest).ok());
  for (const char* bad : {"fast", "0", "-1", "2.3GB", "inf"}) {
    ScopedEnv write_env("PMSNAP_PM_WRITE_GBPS", std::string(bad));
    auto pool = Pool::Open(path.path(), manifest);
    ASSERT_FALSE(pool.ok()) << bad;
    EXPECT_EQ(pool.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(pool.status().message().find("PMSNAP_PM_WRITE_GBPS"), std::string::npos)
        << pool.status().ToString();
  }
  OpenOptions options;
  options.pm_bandwidth.read_gbps = -2;
  auto pool = Pool::Open(path.path(), manifest, options);
  ASSERT_FALSE(pool.ok());
  EXPECT_NE(pool.status().message().find("read_gbps"), std::string::npos)
      << pool.status().ToString();
  PoolOptions create;
  create.pm_bandwidth.write_gbps = -1;
  TempPoolPath other("pm_bad_create");
  EXPECT_EQ(Pool::Create(other.path(), manifest, create).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pmsnap::layout
