#include "seed_pools.h"

#include <cstdlib>
#include <memory>

#include "pmsnap/hooks/extra_state.h"
#include "pmsnap/runtime/engine.h"
#include "testutil/embedding_toy.h"

namespace pmsnap::fuzz {
namespace {

// Small enough that a pool-open execution stays cheap, large enough for
// several parts per tensor and for chunks of every kind.
constexpr std::uint64_t kTableRows = 512;
constexpr std::uint32_t kTableDim = 8;

Status WithRecipe(const SeedPoolRecipe& recipe, const Status& status) {
  if (status.ok()) return status;
  return Status(status.code(), "seed pool '" + recipe.name + "': " + status.message());
}

}  // namespace

std::string PoolDirectory() {
  const char* dir = std::getenv("PMSNAP_POOL_DIR");
  return dir != nullptr && *dir != '\0' ? dir : "/dev/shm";
}

const std::vector<SeedPoolRecipe>& SeedPoolRecipes() {
  static const std::vector<SeedPoolRecipe> recipes = {
      {"full-raw", diff::Policy::kFull, 0},
      {"oneshot-q8", diff::Policy::kOneShotDifferential, 8},
      {"incremental-raw", diff::Policy::kConsecutiveIncremental, 0},
      {"intermittent-q4", diff::Policy::kIntermittentDifferential, 4},
      {"incrcp-q2", diff::Policy::kIncrCP, 2},
  };
  return recipes;
}

Status BuildSeedPool(const std::string& path, const SeedPoolRecipe& recipe, int steps) {
  diff::EmbeddingOptions embedding;
  embedding.policy = recipe.policy;
  embedding.retain = 3;
  embedding.quantize.enabled = recipe.quant_bits != 0;
  embedding.quantize.bits = recipe.quant_bits;
  embedding.incrcp.duplicate_ratio_threshold = 0.0;  // extract whenever rows repeat
  auto checkpointer = std::make_shared<diff::EmbeddingCheckpointer>(embedding);

  runtime::EngineOptions options;
  options.pool_path = path;
  options.pool_options.part_bytes = 4096;
  options.pool_options.extra_state_capacity = 4096;
  options.pool_options.chunk_heap_bytes = 1ull << 20;
  options.pool_options.prefault_mapping = false;
  options.policy = std::make_shared<runtime::EveryKPolicy>(1);
  options.encoder = checkpointer;
  options.workers = 1;
  options.print_summary = false;

  testing::EmbeddingToy toy(kTableRows, kTableDim);
  auto engine = runtime::Engine::Open(options, toy.Registrations());
  if (!engine.ok()) return WithRecipe(recipe, engine.status());
  diff::RowTracker* tracker = checkpointer->tracker(kSeedTable);
  if (tracker == nullptr) {
    return WithRecipe(recipe, Status(StatusCode::kInternal, "no row tracker for the table"));
  }
  for (int k = 1; k <= steps; ++k) {
    const auto step = static_cast<std::uint64_t>(k);
    Status status = toy.Step(**engine, *tracker, step);
    if (status.ok()) status = (*engine)->Flush();
    if (!status.ok()) return WithRecipe(recipe, status);
  }
  // One more step with extra state, so the newest slot carries a packed one
  // (EmbeddingToy::Step ends its steps without).
  hooks::ExtraState extra;
  extra.data_position = 4242;
  extra.rng_state.assign(40, std::byte{0x5a});
  extra.user.assign(12, std::byte{0x17});
  const std::vector<std::byte> packed = hooks::PackExtraState(extra);
  const auto last = static_cast<std::uint64_t>(steps + 1);
  Status status = tracker->Mark(toy.RowsOf(last));
  if (status.ok()) status = (*engine)->BeginStep(last);
  if (status.ok()) status = (*engine)->EndStep(packed);
  if (status.ok()) status = (*engine)->Flush();
  if (status.ok()) status = (*engine)->Close();
  return WithRecipe(recipe, status);
}

}  // namespace pmsnap::fuzz
