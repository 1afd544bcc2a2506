// Engine::Open and Engine::Close: checking the registrations, opening or
// creating the pool (with the ranks' agreement), the device registrations,
// the worker arenas and their pinning; and the fork guard.
#include <pthread.h>
#include <unistd.h>

#include <filesystem>
#include <iostream>

#include "detail/engine_impl.h"
#include "pmsnap/common/cpu_affinity.h"
#include "pmsnap/pmem_layout/checksum.h"

namespace pmsnap::runtime {
namespace {

// fork() copies only the calling thread. The oneTBB worker threads an
// engine starts, and the scheduler state they belong to, reach the child as
// memory without threads, and an engine opened or used there waits forever
// for workers that do not exist. oneTBB keeps those workers after the
// engines close (a child forked then hung too, 1 run in 3), so a child
// forked from a process that ever opened an engine refuses engines with an
// error instead (runtime_engine_fork_test).
std::atomic<int> g_engines_opened{0};
std::atomic<int> g_open_engines{0};
std::atomic<bool> g_forked_after_engines{false};
std::atomic<int> g_forked_from{0};
std::atomic<int> g_opened_at_fork{0};
std::atomic<int> g_open_at_fork{0};

void NoteForkInChild() {
  const int opened = g_engines_opened.load(std::memory_order_relaxed);
  if (opened > 0) {
    g_opened_at_fork.store(opened, std::memory_order_relaxed);
    g_open_at_fork.store(g_open_engines.load(std::memory_order_relaxed),
                         std::memory_order_relaxed);
    g_forked_from.store(static_cast<int>(getppid()), std::memory_order_relaxed);
    g_forked_after_engines.store(true, std::memory_order_relaxed);
  }
}

void WatchForks() {
  static const int registered = pthread_atfork(nullptr, nullptr, &NoteForkInChild);
  (void)registered;
}

}  // namespace

// Declared in detail/engine_impl.h.
Status RefuseInForkedChild(const std::string& pool) {
  if (!g_forked_after_engines.load(std::memory_order_relaxed)) return Status::Ok();
  return Status(StatusCode::kFailedPrecondition,
                "pmsnap engine for " + pool + ": this process was forked from process " +
                    std::to_string(g_forked_from.load()) + " after it had opened " +
                    std::to_string(g_opened_at_fork.load()) + " pmsnap engine(s) (" +
                    std::to_string(g_open_at_fork.load()) +
                    " still open); the oneTBB worker threads they started do not exist after "
                    "fork(), and an engine here would wait for them forever. Start processes "
                    "with the 'spawn' or 'forkserver' method, or fork before opening engines.");
}

Result<CopyStart> ParseCopyStart(std::string_view name) {
  if (name == "auto") return CopyStart::kAuto;
  if (name == "after-update") return CopyStart::kAfterUpdate;
  if (name == "after-step") return CopyStart::kAfterStep;
  return Status(StatusCode::kInvalidArgument, "unknown copy start '" + std::string(name) +
                                                  "' (expected auto, after-update or after-step)");
}

void WorkerPinning::on_scheduler_entry(bool is_worker) {
  if (!is_worker) return;
  Status pinned = PinCurrentThread(cpus_, "EngineOptions::worker_cpus");
  if (!pinned.ok() && !reported_.exchange(true)) on_error_(pinned);
}

layout::Manifest ManifestFor(const std::vector<UnitRegistration>& units) {
  layout::Manifest manifest;
  for (const UnitRegistration& unit : units) {
    layout::UnitSpec spec;
    spec.name = unit.name;
    spec.flags = unit.encoded ? layout::kUnitFlagEncoded : layout::kUnitFlagNone;
    for (const TensorView& t : unit.tensors) spec.tensors.push_back({t.name, t.dtype, t.shape});
    manifest.units.push_back(std::move(spec));
  }
  return manifest;
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  g_engines_opened.fetch_add(1, std::memory_order_relaxed);
  g_open_engines.fetch_add(1, std::memory_order_relaxed);
}

Engine::~Engine() {
  if (impl_ && !impl_->closed && !RefuseInForkedChild(impl_->options.pool_path).ok()) {
    // The parent's engine in a forked child: tearing down its arena would
    // wait for threads that are not here. The process keeps the memory.
    (void)impl_.release();
    return;
  }
  if (impl_ && !impl_->closed) {
    Status status = Close(CloseMode::kFinish);
    if (!status.ok()) std::cerr << "pmsnap: error while closing: " << status.ToString() << "\n";
  }
}

namespace {

// Opens the pool at options.pool_path if it exists, else creates it. With an
// agreement (several ranks) every rank takes part in the same collectives
// whatever happens locally, so that a failure on one rank fails all of them
// instead of leaving the others waiting: first whether every existing pool
// opened, then the run identity (AgreeOnGroup), then whether every new pool
// was created with it.
Result<std::unique_ptr<layout::Pool>> OpenOrCreatePool(const EngineOptions& options,
                                                       const layout::Manifest& manifest,
                                                       const layout::OpenOptions& open_options,
                                                       EpochAgreement* agreement) {
  std::error_code ec;
  const bool exists = std::filesystem::exists(options.pool_path, ec);
  if (agreement == nullptr) {
    return exists ? layout::Pool::Open(options.pool_path, manifest, open_options)
                  : layout::Pool::Create(options.pool_path, manifest, options.pool_options);
  }
  Result<std::unique_ptr<layout::Pool>> pool =
      Status(StatusCode::kInternal, "pool '" + options.pool_path + "' not opened");
  std::optional<layout::RankGroup> existing;
  bool holds_checkpoint = false;
  if (exists) {
    pool = layout::Pool::Open(options.pool_path, manifest, open_options);
    if (pool.ok()) {
      existing = (*pool)->group();
      holds_checkpoint = (*pool)->committed_slots() > 0;
    }
  }
  PMSNAP_RETURN_IF_ERROR(agreement->AgreeOnStatus(exists ? pool.status() : Status::Ok()));
  const std::uint64_t fingerprint =
      options.model_fingerprint != 0 ? options.model_fingerprint : manifest.Signature();
  PMSNAP_ASSIGN_OR_RETURN(const layout::RankGroup group,
                          agreement->AgreeOnGroup(existing, holds_checkpoint, fingerprint,
                                                  options.pool_path));
  if (!exists) {
    layout::PoolOptions pool_options = options.pool_options;
    pool_options.group = group;
    pool = layout::Pool::Create(options.pool_path, manifest, pool_options);
  }
  // Every rank, also those that opened: a rank whose pool was lost creates
  // it beside ranks that did not.
  PMSNAP_RETURN_IF_ERROR(agreement->AgreeOnStatus(pool.status()));
  return pool;
}

}  // namespace

Result<std::unique_ptr<Engine>> Engine::Open(EngineOptions options,
                                             std::vector<UnitRegistration> units) {
  if (options.pool_path.empty()) {
    return Status(StatusCode::kInvalidArgument, "EngineOptions::pool_path is empty");
  }
  WatchForks();
  PMSNAP_RETURN_IF_ERROR(RefuseInForkedChild(options.pool_path));
  if (units.empty()) {
    return Status(StatusCode::kInvalidArgument, "no units registered for " + options.pool_path);
  }
  if (options.workers < 1) {
    return Status(StatusCode::kInvalidArgument,
                  "EngineOptions::workers must be >= 1, got " + std::to_string(options.workers));
  }
  if (!options.worker_cpus.empty()) {
    PMSNAP_RETURN_IF_ERROR(CheckCpus(options.worker_cpus, "EngineOptions::worker_cpus"));
  }
  // Every registration's manifest; with sharding, the pool's holds this
  // rank's units only (below).
  layout::Manifest manifest = ManifestFor(units);
  PMSNAP_RETURN_IF_ERROR(manifest.Validate());
  for (const UnitRegistration& unit : units) {
    if (unit.on_host && unit.encoded) {
      return Status(StatusCode::kInvalidArgument,
                    "unit '" + unit.name + "' is both encoded and on_host (" + options.pool_path +
                        "): an encoder reads the engine's device");
    }
    for (const TensorView& t : unit.tensors) {
      if (t.data == nullptr && layout::TensorSpec{t.name, t.dtype, t.shape}.bytes() > 0) {
        return Status(StatusCode::kInvalidArgument,
                      "unit '" + unit.name + "' tensor '" + t.name + "' has no data pointer");
      }
      if (t.on_host != unit.on_host) {
        return Status(StatusCode::kInvalidArgument,
                      "unit '" + unit.name + "' tensor '" + t.name + "' is in " +
                          (t.on_host ? "host" : "device") + " memory but the unit is registered " +
                          (unit.on_host ? "on_host" : "on the device") + " (" +
                          options.pool_path + "): frontend::ParameterUnits splits such units");
      }
    }
  }
  const int world_size = options.coordinator ? options.coordinator->world_size() : 1;
  if (options.replicas != 1 && !options.shard_replicated_state) {
    return Status(StatusCode::kInvalidArgument,
                  "EngineOptions::replicas=" + std::to_string(options.replicas) +
                      " needs shard_replicated_state (" + options.pool_path + ")");
  }
  std::optional<ShardedUnits> shards;
  if (options.shard_replicated_state && world_size > 1) {
    // The whole model's identity, with the replica count: a pool holds the
    // units one placement assigned it.
    const std::uint64_t identity[2] = {
        options.model_fingerprint != 0 ? options.model_fingerprint : manifest.Signature(),
        static_cast<std::uint64_t>(options.replicas)};
    options.model_fingerprint = layout::Checksum64(identity, sizeof(identity));
    PMSNAP_ASSIGN_OR_RETURN(shards,
                            ShardUnits(std::move(units), manifest, options.coordinator->rank(),
                                       world_size, options.replicas, options.pool_path));
    units = HeldRegistrations(*shards);
    manifest = ManifestFor(units);
  }

  std::vector<std::uint32_t> encoded_units;
  for (std::uint32_t u = 0; u < units.size(); ++u) {
    if (units[u].encoded) encoded_units.push_back(u);
  }
  if (!encoded_units.empty() && !options.encoder) {
    return Status(StatusCode::kInvalidArgument,
                  "unit '" + units[encoded_units[0]].name +
                      "' is registered as encoded but EngineOptions::encoder is not set");
  }
  if (!encoded_units.empty() && options.pool_options.chunk_heap_bytes == 0) {
    // Room for a baseline plus differential history of every encoded unit.
    std::uint64_t encoded_bytes = 0;
    for (std::uint32_t u : encoded_units) encoded_bytes += manifest.units[u].bytes();
    options.pool_options.chunk_heap_bytes = 4 * encoded_bytes + (16ull << 20);
  }

  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->encoder = options.encoder;
  impl->units = std::move(units);
  impl->shards = std::move(shards);
  if (options.device == nullptr) {
    impl->owned_device = std::make_unique<HostDevice>();
    impl->device = impl->owned_device.get();
  } else {
    impl->device = options.device;
  }
  impl->devices = std::make_unique<UnitDevices>(*impl->device);
  impl->policy = options.policy ? options.policy : std::make_shared<ContinuousPolicy>();
  if (options.coordinator && options.coordinator->world_size() > 1) {
    if (impl->policy->adapts_to_measurements()) {
      return Status(StatusCode::kInvalidArgument,
                    "policy '" + impl->policy->name() + "' decides from this rank's own " +
                        "measurements, so ranks would capture different iterations; with " +
                        std::to_string(options.coordinator->world_size()) +
                        " ranks use continuous or every-k (" + options.pool_path + ")");
    }
    PMSNAP_ASSIGN_OR_RETURN(impl->agreement, EpochAgreement::Create(options.coordinator));
  }
  impl->strategy =
      options.strategy ? options.strategy : std::make_shared<WaitForSnapshotStrategy>();
  if (options.dram_staging_buffers != 0) {
    const std::string why =
        options.dram_staging_buffers < 0 || options.dram_staging_buffers > 2
            ? "must be 0, 1 or 2"
        : !encoded_units.empty()
            ? "stages slot units only, and unit '" + impl->units[encoded_units[0]].name +
                  "' is encoded"
        : world_size > 1 ? "is for a single process, and this engine has " +
                               std::to_string(world_size) + " ranks"
        : impl->policy->wait_if_busy()
            ? "stages boundaries a policy would skip, and policy '" + impl->policy->name() +
                  "' waits for the epoch in flight instead (use continuous)"
            : "";
    if (!why.empty()) {
      return Status(StatusCode::kInvalidArgument,
                    "EngineOptions::dram_staging_buffers=" +
                        std::to_string(options.dram_staging_buffers) + " " + why + " (" +
                        options.pool_path + ")");
    }
  }

  layout::OpenOptions open_options;
  open_options.verify_data = options.verify_on_open;
  // An encoder reads its own state at Attach, from the slot chosen at open.
  // Ranks agree on what to restore from what each verified at open.
  open_options.defer_data_verification = encoded_units.empty() && !impl->agreement;
  open_options.prefault_mapping = options.pool_options.prefault_mapping;
  open_options.prefault_method = options.pool_options.prefault_method;
  open_options.pm_bandwidth = options.pool_options.pm_bandwidth;
  PMSNAP_ASSIGN_OR_RETURN(
      impl->pool, OpenOrCreatePool(options, manifest, open_options, impl->agreement.get()));
  for (const auto& unit : impl->pool->layout().units) impl->model_bytes += unit.bytes;
  if (options.dram_staging_buffers > 0) {
    std::uint64_t slot_bytes = 0;
    for (const layout::PartLayout& part : impl->pool->layout().parts) {
      slot_bytes = std::max(slot_bytes, part.slot_offset + part.bytes);
    }
    PMSNAP_RETURN_IF_ERROR(
        impl->staging.Allocate(options.dram_staging_buffers, slot_bytes, options.pool_path));
  }
  impl->hold_budget.emplace(options.copy_start, impl->device->cpu_addressable(), impl->model_bytes,
                            options.workers);
  if (!impl->device->cpu_addressable()) {
    // DMA straight into the PM slots and the staging buffers; where the
    // device cannot register them it stages through its bounded pinned ring
    // (slower, still correct). A range registered already by someone else
    // is an error: the copies could land in pages that are not this pool.
    std::vector<std::pair<std::string, std::span<std::byte>>> destinations;
    for (int slot = 0; slot < 2; ++slot) {
      const std::vector<std::span<std::byte>> extents = impl->pool->slot_extents(slot);
      for (std::size_t i = 0; i < extents.size(); ++i) {
        destinations.emplace_back(
            "slot " + std::to_string(slot) +
                (extents.size() > 1 ? " extent " + std::to_string(i) : std::string()),
            extents[i]);
      }
    }
    for (std::size_t i = 0; i < impl->staging.count(); ++i) {
      destinations.emplace_back("staging buffer " + std::to_string(i), impl->staging.buffer(i));
    }
    for (const auto& [what, range] : destinations) {
      std::string not_registered;
      Result<HostRegistration> registered =
          HostRegistration::Register(*impl->device, range.data(), range.size(), &not_registered);
      if (!registered.ok()) {
        return Status(registered.status().code(), "pool '" + options.pool_path + "' " + what +
                                                      ": " + registered.status().message());
      }
      if (!not_registered.empty()) {
        std::cerr << "pmsnap: warning: pool '" << options.pool_path << "' " << what << ": "
                  << not_registered << "\n";
      }
      if (registered->registered()) impl->registrations.push_back(std::move(*registered));
    }
  }

  // No slot reserved for the training thread: it never joins the arena.
  if (impl->encoder) {
    PMSNAP_RETURN_IF_ERROR(impl->encoder->Attach(
        impl->pool->chunk_heap(), impl->pool->manifest(),
        impl->pool->last_committed_epoch().value_or(0), impl->units, encoded_units,
        *impl->device));
  }
  const std::size_t wanted_threads = static_cast<std::size_t>(options.workers) + 2;
  if (tbb::global_control::active_value(tbb::global_control::max_allowed_parallelism) <
      wanted_threads) {
    impl->thread_limit = std::make_unique<tbb::global_control>(
        tbb::global_control::max_allowed_parallelism, wanted_threads);
  }
  impl->arena = std::make_unique<tbb::task_arena>(options.workers, /*reserved_for_masters=*/0);
  impl->device_stream = std::make_unique<tbb::task_arena>(1, /*reserved_for_masters=*/0);
  if (!impl->options.worker_cpus.empty()) {
    for (tbb::task_arena* arena : {impl->arena.get(), impl->device_stream.get()}) {
      arena->initialize();
      Impl* raw = impl.get();
      impl->pinning.push_back(std::make_unique<WorkerPinning>(
          *arena, impl->options.worker_cpus,
          [raw](const Status& status) { raw->RecordError(status); }));
    }
  }
  {
    // Nothing else sees the engine yet; the lock is for the analysis.
    MutexLock lock(impl->stats_mutex);
    impl->stats.device = impl->device->name();
    impl->stats.pm = impl->pool->pm_bandwidth().Label();
    impl->stats.strategy = impl->strategy->name();
    impl->stats.policy = impl->policy->name();
    for (std::size_t u = 0; u < impl->units.size(); ++u) {
      UnitStats us;
      us.name = impl->units[u].name;
      us.bytes = impl->pool->layout().units[u].bytes;
      impl->stats.units.push_back(us);
    }
  }
  impl->policy_inputs.model_bytes = impl->model_bytes;
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Status Engine::Close(CloseMode mode) {
  Impl& impl = *impl_;
  if (impl.closed) return impl.TakeError();
  // In a forked child the parent's engine stays as it is: the parent owns
  // its pool and epoch.
  PMSNAP_RETURN_IF_ERROR(RefuseInForkedChild(impl.options.pool_path));
  // The staged epoch first: abandoning the epoch in flight would begin it.
  if (impl.staged && (mode == CloseMode::kAbandon || !impl.staged->step_ended)) {
    impl.AbandonEpoch(*impl.staged);
  }
  if (impl.current && (mode == CloseMode::kAbandon || !impl.current->step_ended)) {
    impl.AbandonEpoch(*impl.current);
  }
  impl.WaitEpochIdle();
  impl.ReapIfDone();
  if (impl.agreement) {
    // Every rank finishes the exchange it started, whatever it then reports.
    if (Status finished = impl.agreement->Finish(); !finished.ok()) impl.RecordError(finished);
  }
  impl.closed = true;
  impl.pinning.clear();
  impl.arena->terminate();
  impl.device_stream->terminate();
  {
    MutexLock lock(impl.stats_mutex);
    impl.stats.memory = impl.MemoryNow();
    impl.memory_taken_at_close = true;
  }
  // Before the memory they cover goes (Device::RegisterHostDestination).
  for (HostRegistration& registration : impl.registrations) {
    if (Status released = registration.Release(); !released.ok()) impl.RecordError(released);
  }
  impl.registrations.clear();
  impl.staging.Release();
  g_open_engines.fetch_sub(1, std::memory_order_relaxed);
  if (impl.options.print_summary) std::cerr << stats().Summary() << "\n";
  impl.pool.reset();
  return impl.TakeError();
}

}  // namespace pmsnap::runtime
