// Real pools for the fuzz targets: what the pool-open target mutates and what
// the seed generator (seed_corpus.cc) takes its decoder inputs from. Each
// recipe trains a small model through the Engine (a dense unit and one
// embedding table checkpointed by diff::EmbeddingCheckpointer) for a few
// committed steps, each with packed extra state (hooks/extra_state.h), so the
// pool holds both slots, part checksums, extra state and data and index
// chunks of one embedding policy.
//
// Thread-safety: BuildSeedPool may run for different paths at once.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pmsnap/common/status.h"
#include "pmsnap/diff/embedding_checkpointer.h"

namespace pmsnap::fuzz {

struct SeedPoolRecipe {
  std::string name;  // file-name friendly
  diff::Policy policy = diff::Policy::kFull;
  int quant_bits = 0;  // 0: raw float rows
};

// Where fuzz pools live: $PMSNAP_POOL_DIR, default /dev/shm (as the tests').
std::string PoolDirectory();

// Every embedding policy, raw and quantized (2, 4 and 8 bits between them).
const std::vector<SeedPoolRecipe>& SeedPoolRecipes();

// The encoded table's unit name in every seed pool.
inline constexpr char kSeedTable[] = "emb.users";

// Creates the pool at `path` (which must not exist) and commits
// `steps` epochs. Errors carry the recipe's name and the failing call.
Status BuildSeedPool(const std::string& path, const SeedPoolRecipe& recipe, int steps = 6);

}  // namespace pmsnap::fuzz
