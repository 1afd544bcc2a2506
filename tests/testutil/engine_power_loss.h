// Power loss under the Engine (runtime::Engine), simulated at the
// persistence seam (testutil/power_loss.h): a model trains through the
// Engine's hooks for real epochs (workers copy and persist parts, the last
// one commits, an encoder writes chunks), the engine closes, reopens,
// restores and trains on; meanwhile the simulator captures the pool file a
// power loss would leave at every seam call that writes a commit record
// header and the call after it (its drain), and at sampled drains and other
// seam calls (CaptureDensity: every one at stride 1). Each distinct image is
// then opened through Engine::Open and checked:
//  - the pool: it opens without a warning, every slot and chunk verifies in
//    full, and it recovers to the newest epoch whose Commit returned or, if
//    the next one was in flight, to that one; the recovered epoch's
//    iteration is the one that epoch captured (the model's own pool checks
//    follow, e.g. every retained embedding checkpoint);
//  - the Engine's restore path: Restore into a fresh model, which must
//    equal, bit for bit, what that epoch captured (the model compares),
//    with the extra state of that iteration.
//
// What the workload has done when an image is taken comes from two test
// wrappers the Engine calls itself, so no image depends on timing: an
// IntervalPolicy (OnEpochStarted, training thread, after BeginEpoch) marks
// an epoch in flight, an Encoder (OnCommitted / OnAbandoned, the committing
// thread, right after Pool::Commit returned) marks it committed. Both
// forward to the real policy and encoder.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string_view>
#include <string>
#include <vector>

#include "pmsnap/pmem_layout/pool.h"
#include "pmsnap/runtime/encoder.h"
#include "pmsnap/runtime/engine.h"
#include "pmsnap/runtime/interval_policy.h"
#include "testutil/power_loss.h"
#include "testutil/temp_pool.h"

namespace pmsnap::testing {

// The engine's progress as the capture plan reads it, in one word:
// committed epoch * 4 + epochs started and not yet over (0-2: a staged
// epoch can start while another is in flight, EngineOptions::
// dram_staging_buffers). Written by the wrappers below, read under the
// simulator's lock.
class EngineProgress {
 public:
  std::uint64_t note() const { return word_.load(std::memory_order_acquire); }
  static std::uint64_t CommittedOf(std::uint64_t note) { return note / 4; }
  static bool InFlightOf(std::uint64_t note) { return note % 4 != 0; }

  void Resumed(std::uint64_t last_committed) { word_.store(last_committed * 4); }
  // Training thread, after the engine started an epoch: the pool numbers it
  // after the committed one and every one still open before it.
  void Started(std::uint64_t iteration) {
    const std::uint64_t before = word_.fetch_add(1);
    const std::uint64_t epoch = CommittedOf(before) + before % 4 + 1;
    iteration_of_epoch_[epoch] = iteration;  // a number reused after an abandon is overwritten
  }
  void Committed(std::uint64_t epoch) {
    Update([epoch](std::uint64_t w) { return epoch * 4 + (w % 4 == 0 ? 0 : w % 4 - 1); });
  }
  void Abandoned() {
    Update([](std::uint64_t w) { return w % 4 == 0 ? w : w - 1; });
  }
  // After the run: which iteration each epoch captured.
  std::optional<std::uint64_t> IterationOf(std::uint64_t epoch) const {
    auto it = iteration_of_epoch_.find(epoch);
    if (it == iteration_of_epoch_.end()) return std::nullopt;
    return it->second;
  }

 private:
  template <typename Next>
  void Update(Next next) {
    std::uint64_t w = word_.load();
    while (!word_.compare_exchange_weak(w, next(w))) {
    }
  }

  std::atomic<std::uint64_t> word_{0};
  std::map<std::uint64_t, std::uint64_t> iteration_of_epoch_;  // training thread
};

// Forwards to `inner` (may be null: no encoded units) and tells `progress`
// when an epoch committed or was abandoned.
class ProgressEncoder final : public runtime::Encoder {
 public:
  ProgressEncoder(EngineProgress* progress, std::shared_ptr<runtime::Encoder> inner)
      : progress_(progress), inner_(std::move(inner)) {}
  Status Attach(layout::ChunkHeap& chunks, const layout::Manifest& manifest,
                std::uint64_t last_committed_epoch,
                const std::vector<runtime::UnitRegistration>& units,
                const std::vector<std::uint32_t>& encoded_units, runtime::Device& device) override {
    progress_->Resumed(last_committed_epoch);
    return inner_ ? inner_->Attach(chunks, manifest, last_committed_epoch, units, encoded_units,
                                   device)
                  : Status::Ok();
  }
  Status OnCaptured(std::uint32_t unit, std::uint64_t epoch, std::uint64_t iteration) override {
    return inner_->OnCaptured(unit, epoch, iteration);
  }
  Status Encode(std::uint32_t unit, std::uint64_t epoch) override {
    return inner_->Encode(unit, epoch);
  }
  Status OnCommitted(std::uint64_t epoch) override {
    progress_->Committed(epoch);  // Pool::Commit returned: durable
    return inner_ ? inner_->OnCommitted(epoch) : Status::Ok();
  }
  void OnAbandoned(std::uint64_t epoch) override {
    progress_->Abandoned();
    if (inner_) inner_->OnAbandoned(epoch);
  }
  Status Restore(std::uint32_t unit, std::uint64_t epoch) override {
    return inner_->Restore(unit, epoch);
  }
  std::uint64_t bytes_written() const override { return inner_ ? inner_->bytes_written() : 0; }

 private:
  EngineProgress* progress_;
  std::shared_ptr<runtime::Encoder> inner_;
};

// Forwards to `inner` and tells `progress` when an epoch started.
class ProgressPolicy final : public runtime::IntervalPolicy {
 public:
  ProgressPolicy(EngineProgress* progress, std::shared_ptr<runtime::IntervalPolicy> inner)
      : progress_(progress), inner_(std::move(inner)) {}
  std::string name() const override { return inner_->name(); }
  bool ShouldCheckpoint(std::uint64_t step, const runtime::PolicyInputs& inputs) override {
    return inner_->ShouldCheckpoint(step, inputs);
  }
  bool wait_if_busy() const override { return inner_->wait_if_busy(); }
  void OnEpochStarted(std::uint64_t step) override {
    progress_->Started(step);
    inner_->OnEpochStarted(step);
  }

 private:
  EngineProgress* progress_;
  std::shared_ptr<runtime::IntervalPolicy> inner_;
};

// What a model under test provides. Training runs on one instance (the live
// model); each image is restored into a Fresh() one.
class PowerLossModel {
 public:
  virtual ~PowerLossModel() = default;
  // Engine options without pool_path, policy wrapper or encoder wrapper:
  // the harness sets those (policy: the inner one, nullptr = continuous).
  virtual runtime::EngineOptions Options() const = 0;
  virtual std::vector<runtime::UnitRegistration> Registrations() = 0;
  // A new encoder for one engine open (nullptr: none).
  virtual std::shared_ptr<runtime::Encoder> MakeEncoder() { return nullptr; }
  // One training step k through the engine's hooks; EndStep's extra state
  // must be ExtraStateOf(k).
  virtual Status Step(runtime::Engine& engine, std::uint64_t k) = 0;
  // After step k's hooks returned, on the training thread.
  virtual void AfterStep(runtime::Engine& engine, std::uint64_t k) {
    (void)engine;
    (void)k;
  }
  virtual std::unique_ptr<PowerLossModel> Fresh() const = 0;
  // "" when `restored`'s live tensors equal what this (live) model's epoch
  // of iteration k captured, bit for bit.
  virtual std::string CompareRestored(const PowerLossModel& restored, std::uint64_t k) const = 0;
  // Extra checks of an image's pool recovered to `epoch` (iteration k).
  virtual std::string CheckPool(const layout::Pool& pool, std::uint64_t epoch,
                                std::uint64_t k) const {
    (void)pool;
    (void)epoch;
    (void)k;
    return "";
  }
  static std::string ExtraStateOf(std::uint64_t k) {
    return "iteration=" + std::to_string(k) + std::string(k * 29 % 150, 'x');
  }
};

// Where the plan captures (see CapturePlan).
struct CaptureDensity {
  int record_random_images = 3;
  int drain_stride = 1;
  int other_stride = 4;
};

struct EnginePowerLossOutcome {
  std::uint64_t persist_points = 0;
  std::uint64_t events = 0;
  std::uint64_t epochs_committed = 0;
  std::uint64_t epochs_abandoned = 0;
  std::size_t images = 0;           // captured
  std::size_t distinct_images = 0;  // of which different (each checked once)
  std::vector<std::string> problems;
  std::string Summary() const {
    return "seam events " + std::to_string(events) + ", persist points " +
           std::to_string(persist_points) + ", epochs committed " +
           std::to_string(epochs_committed) + ", abandoned " + std::to_string(epochs_abandoned) +
           ", images " + std::to_string(images) + " (" +
           std::to_string(distinct_images) + " distinct, each checked), bad " + std::to_string(problems.size());
  }
};

// $PMSNAP_POWER_LOSS_SCALE (default 1): more steps and a denser sample for a
// longer run.
inline int PowerLossScale() {
  const char* scale = std::getenv("PMSNAP_POWER_LOSS_SCALE");
  const int value = scale == nullptr ? 1 : std::atoi(scale);
  return value < 1 ? 1 : value;
}

namespace engine_power_loss_detail {

inline runtime::EngineOptions WrappedOptions(const PowerLossModel& model, const std::string& path,
                                             EngineProgress* progress,
                                             std::shared_ptr<runtime::Encoder> inner_encoder) {
  runtime::EngineOptions options = model.Options();
  options.pool_path = path;
  options.print_summary = false;
  std::shared_ptr<runtime::IntervalPolicy> inner =
      options.policy ? options.policy : std::make_shared<runtime::ContinuousPolicy>();
  options.policy = std::make_shared<ProgressPolicy>(progress, std::move(inner));
  options.encoder = std::make_shared<ProgressEncoder>(progress, std::move(inner_encoder));
  return options;
}

// Once `armed`: at a seam call that writes a commit record's header (the
// record itself, the commit word; BeginEpoch's WRITING word too) and at the
// call right after it (its drain), `record_random_images` random images; at
// every `drain_stride`th drain, one; at every `other_stride`th other call,
// none besides "drained only" and "everything".
inline PowerLossSimulator::Plan CapturePlan(const std::atomic<bool>* armed,
                                            const EngineProgress* progress,
                                            const layout::FileRegions* regions,
                                            const CaptureDensity& density) {
  auto after_record = std::make_shared<bool>(false);
  auto drains = std::make_shared<std::uint64_t>(0);
  return [=](const SeamEvent& event) -> std::optional<CaptureRequest> {
    if (!armed->load()) return std::nullopt;
    const std::uint64_t note = progress->note();
    bool record = false;
    for (const layout::FileRegion& r : regions->record) {
      record = record || event.Touches(r.offset, 64);  // SlotRecordHeader: 64 bytes (FORMAT.md)
    }
    const bool follows_record = *after_record;
    *after_record = record;
    if (record || follows_record) return CaptureRequest{density.record_random_images, note};
    if (event.persist_point()) {
      if ((*drains)++ % density.drain_stride == 0) return CaptureRequest{1, note};
      return std::nullopt;
    }
    if (event.index % density.other_stride == 0) return CaptureRequest{0, note};
    return std::nullopt;
  };
}

inline std::string CheckImage(const PowerLossSimulator& simulator, const PowerLossImage& image,
                              const PowerLossModel& live, const EngineProgress& progress,
                              const std::string& path) {
  const std::string where = image.Describe() + ": ";
  if (std::string failed = simulator.WriteImage(image, path); !failed.empty()) return failed;
  std::vector<std::string> warnings;
  layout::SetWarningSink([&](const std::string& w) { warnings.push_back(w); });
  struct SinkReset {
    ~SinkReset() { layout::SetWarningSink(nullptr); }
  } sink_reset;
  const std::uint64_t committed = EngineProgress::CommittedOf(image.note);
  const bool in_flight = EngineProgress::InFlightOf(image.note);
  // Opened the way a restarted trainer opens it, into a fresh model; the
  // pool is checked through the engine before anything is restored.
  std::unique_ptr<PowerLossModel> fresh = live.Fresh();
  EngineProgress scratch;
  auto engine = runtime::Engine::Open(WrappedOptions(*fresh, path, &scratch, fresh->MakeEncoder()),
                                      fresh->Registrations());
  if (!engine.ok()) return where + "does not open: " + engine.status().ToString();
  struct Closer {
    runtime::Engine* engine;
    ~Closer() { (void)engine->Close(runtime::CloseMode::kAbandon); }
  } closer{engine->get()};
  const layout::Pool& pool = (*engine)->pool();
  if (!warnings.empty()) return where + "opens with a warning: " + warnings.front();
  const layout::VerifyReport report = pool.Verify(/*deep=*/true);
  if (!report.ok()) {
    for (const auto& slot : report.slots) {
      if (!slot.problems.empty()) return where + "a slot fails verification: " + slot.problems[0];
    }
    return where + "a chunk fails verification: " + report.chunk_problems.front();
  }
  auto latest = pool.Latest();
  const std::uint64_t recovered = latest.ok() ? latest->epoch() : 0;
  if (recovered != committed && !(in_flight && recovered == committed + 1)) {
    return where + "recovers epoch " + std::to_string(recovered) + ", expected " +
           std::to_string(committed) + (in_flight ? " or " + std::to_string(committed + 1) : "");
  }
  auto restored = (*engine)->Restore();
  if (recovered == 0) {
    if (restored.status().code() != StatusCode::kNotFound) {
      return where + "no epoch committed, yet Restore says " + restored.status().ToString();
    }
    return "";
  }
  const std::optional<std::uint64_t> captured = progress.IterationOf(recovered);
  if (!captured) return where + "recovers epoch " + std::to_string(recovered) + ", never begun";
  const std::uint64_t iteration = *captured;
  if (latest->iteration() != iteration) {
    return where + "epoch " + std::to_string(recovered) + " has iteration " +
           std::to_string(latest->iteration()) + ", it captured " + std::to_string(iteration);
  }
  if (std::string problem = live.CheckPool(pool, recovered, iteration); !problem.empty()) {
    return where + "epoch " + std::to_string(recovered) + ": " + problem;
  }
  if (!restored.ok()) return where + "Engine::Restore fails: " + restored.status().ToString();
  if (!warnings.empty()) return where + "restores with a warning: " + warnings.front();
  if (restored->epoch != recovered || restored->iteration != iteration) {
    return where + "Engine::Restore restores epoch " + std::to_string(restored->epoch) +
           " (iteration " + std::to_string(restored->iteration) + "), the pool recovers " +
           std::to_string(recovered);
  }
  const std::string extra = PowerLossModel::ExtraStateOf(iteration);
  if (restored->extra_state.size() != extra.size() ||
      std::memcmp(restored->extra_state.data(), extra.data(), extra.size()) != 0) {
    return where + "epoch " + std::to_string(recovered) + ": restored extra state differs";
  }
  if (std::string differs = live.CompareRestored(*fresh, iteration); !differs.empty()) {
    return where + "epoch " + std::to_string(recovered) + " (iteration " +
           std::to_string(iteration) + ") restored: " + differs;
  }
  return "";
}

// A key for an image's bytes and note: many captures leave the same file
// (e.g. "drained only" between two drains), which needs checking once.
inline std::string ImageKey(const PowerLossImage& image) {
  std::string key(reinterpret_cast<const char*>(&image.note), sizeof(image.note));
  key.append(reinterpret_cast<const char*>(image.line_offsets.data()),
             image.line_offsets.size() * sizeof(std::uint64_t));
  const std::size_t bytes_hash = std::hash<std::string_view>{}(std::string_view(
      reinterpret_cast<const char*>(image.line_bytes.data()), image.line_bytes.size()));
  key.append(reinterpret_cast<const char*>(&bytes_hash), sizeof(bytes_hash));
  return key;
}

}  // namespace engine_power_loss_detail

// Creates a pool through Engine::Open, trains steps 1..first_steps, closes;
// reopens, restores, trains `more_steps` more, begins one more epoch and
// closes abandoning it; all under the simulator (armed once the first open
// returned). Then checks every distinct image.
inline EnginePowerLossOutcome RunEnginePowerLoss(PowerLossModel& live, std::uint64_t first_steps,
                                                 std::uint64_t more_steps, std::uint64_t seed,
                                                 const CaptureDensity& density = {}) {
  using namespace engine_power_loss_detail;
  EnginePowerLossOutcome outcome;
  TempPoolPath path("engine-power-loss");
  TempPoolPath image_path("engine-power-loss-image");
  EngineProgress progress;
  std::atomic<bool> armed{false};
  layout::FileRegions regions;
  PowerLossSimulator simulator(pmsnap::testing::TestSeed(seed));
  simulator.SetPlan(CapturePlan(&armed, &progress, &regions, density));
  std::uint64_t restored_iteration = 0;
  {
    auto engine = runtime::Engine::Open(
        WrappedOptions(live, path.path(), &progress, live.MakeEncoder()), live.Registrations());
    EXPECT_TRUE(engine.ok()) << engine.status().ToString();
    if (!engine.ok()) return outcome;
    regions = (*engine)->pool().regions();
    armed = true;
    for (std::uint64_t k = 1; k <= first_steps; ++k) {
      Status stepped = live.Step(**engine, k);
      EXPECT_TRUE(stepped.ok()) << "step " << k << ": " << stepped.ToString();
      if (!stepped.ok()) return outcome;
      live.AfterStep(**engine, k);
    }
    EXPECT_TRUE((*engine)->Close().ok());
    outcome.epochs_committed += (*engine)->stats().epochs_committed;
  }
  {
    // A new process: reopen, restore, train on.
    auto engine = runtime::Engine::Open(
        WrappedOptions(live, path.path(), &progress, live.MakeEncoder()), live.Registrations());
    EXPECT_TRUE(engine.ok()) << engine.status().ToString();
    if (!engine.ok()) return outcome;
    auto restored = (*engine)->Restore();
    EXPECT_TRUE(restored.ok()) << restored.status().ToString();
    if (!restored.ok()) return outcome;
    restored_iteration = restored->iteration;
    for (std::uint64_t k = restored_iteration + 1; k <= restored_iteration + more_steps; ++k) {
      Status stepped = live.Step(**engine, k);
      EXPECT_TRUE(stepped.ok()) << "step " << k << ": " << stepped.ToString();
      if (!stepped.ok()) return outcome;
      live.AfterStep(**engine, k);
    }
    // One more epoch begins (its commit word says WRITING) and the trainer
    // stops before the step ends: Close abandons it.
    EXPECT_TRUE((*engine)->Flush().ok());
    EXPECT_TRUE((*engine)->BeginStep(restored_iteration + more_steps + 1).ok());
    EXPECT_TRUE((*engine)->Close(runtime::CloseMode::kAbandon).ok());
    outcome.epochs_committed += (*engine)->stats().epochs_committed;
    outcome.epochs_abandoned += (*engine)->stats().epochs_abandoned;
  }
  simulator.Stop();
  outcome.persist_points = simulator.persist_points();
  outcome.events = simulator.events();
  outcome.images = simulator.images().size();
  std::set<std::string> checked;
  for (const PowerLossImage& image : simulator.images()) {
    if (!checked.insert(ImageKey(image)).second) continue;
    std::string problem = CheckImage(simulator, image, live, progress, image_path.path());
    if (!problem.empty()) outcome.problems.push_back(problem);
  }
  outcome.distinct_images = checked.size();
  return outcome;
}

// gtest failures for the first few problems, and the summary line.
inline void ReportOutcome(const EnginePowerLossOutcome& outcome) {
  std::cout << outcome.Summary() << "\n";
  for (std::size_t i = 0; i < outcome.problems.size() && i < 5; ++i) {
    ADD_FAILURE() << outcome.problems[i];
  }
}

// The planted bug: runs `live` with the drain before each commit word
// dropped (images only around commit records, several random ones each)
// and expects the simulator to find bad images.
inline void ExpectDroppedCommitDrainCaught(PowerLossModel& live, std::uint64_t first_steps,
                                           std::uint64_t more_steps, std::uint64_t seed) {
  layout::detail::DropCommitRecordDrainForTesting(true);
  const EnginePowerLossOutcome outcome = RunEnginePowerLoss(
      live, first_steps, more_steps, seed,
      {.record_random_images = 4, .drain_stride = 1 << 30, .other_stride = 1 << 30});
  layout::detail::DropCommitRecordDrainForTesting(false);
  std::cout << "planted bug: " << outcome.Summary()
            << (outcome.problems.empty() ? "" : "; first: " + outcome.problems.front()) << "\n";
  EXPECT_FALSE(outcome.problems.empty());
}

}  // namespace pmsnap::testing
