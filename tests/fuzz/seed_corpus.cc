// Writes the fuzz targets' seed corpora from real pools (seed_pools.h):
//
//   pmsnap-fuzz-seeds <corpus-root>
//
// fills <corpus-root>/{pool_open,chunk_payload,manifest,extra_state}/ with
// the inputs each target's format expects: patch lists over every recipe's
// pool; every data and index chunk of every pool, and the quantized tables
// inside the data chunks (plus one table per quantization method and bit
// width); the pools' manifests; the extra state of their commit records.
// Pools are built in $PMSNAP_POOL_DIR (default /dev/shm) and removed.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "detail/chunk_format.h"
#include "pmsnap/pmem_layout/pool.h"
#include "pmsnap/quant/format.h"
#include "pool_reseal.h"
#include "seed_pools.h"
#include "testutil/pool_fixtures.h"

namespace pmsnap::fuzz {
namespace {

namespace fs = std::filesystem;

class Corpus {
 public:
  explicit Corpus(fs::path dir) : dir_(std::move(dir)) { fs::create_directories(dir_); }
  // Writes one seed; `mode` (if >= 0) is prepended as the target's first byte.
  void Add(const std::string& name, std::span<const std::byte> bytes, int mode = -1) {
    std::ofstream out(dir_ / name, std::ios::binary | std::ios::trunc);
    if (mode >= 0) out.put(static_cast<char>(mode));
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    ++count_;
  }
  int count() const { return count_; }

 private:
  fs::path dir_;
  int count_ = 0;
};

std::span<const std::byte> AsBytes(std::span<const std::uint8_t> bytes) {
  return {reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()};
}

// pool_open_fuzz.cc's input: recipe, flags, then patches.
std::vector<std::byte> PatchInput(std::uint8_t recipe, std::uint8_t flags,
                                  std::vector<std::byte> patches = {}) {
  std::vector<std::byte> input{std::byte{recipe}, std::byte{flags}};
  input.insert(input.end(), patches.begin(), patches.end());
  return input;
}

std::vector<std::byte> Patch(std::uint8_t region, std::uint32_t offset,
                             std::vector<std::uint8_t> bytes) {
  std::vector<std::byte> patch{std::byte{region}};
  for (int i = 0; i < 4; ++i) patch.push_back(static_cast<std::byte>(offset >> (8 * i)));
  patch.push_back(static_cast<std::byte>(bytes.size()));
  for (std::uint8_t b : bytes) patch.push_back(std::byte{b});
  return patch;
}

void AddPoolOpenSeeds(Corpus& corpus, std::uint8_t recipe, const std::string& name) {
  constexpr std::uint8_t kResealAll = (kResealManifest | kResealLayout | kResealParts |
                                       kResealRecords | kResealChunks | kResealHeader)
                                      << 2;
  corpus.Add(name + "-verified", PatchInput(recipe, 0));
  corpus.Add(name + "-unverified", PatchInput(recipe, 1));
  corpus.Add(name + "-deferred", PatchInput(recipe, 2));
  // One changed byte in each region (header, manifest, records, slots,
  // chunk-heap root, the first chunks), checksums recomputed.
  for (std::uint8_t region = 0; region < 10; ++region) {
    corpus.Add(name + "-region" + std::to_string(region),
               PatchInput(recipe, kResealAll, Patch(region, 8, {0xff})));
  }
  // Header fields: part_bytes and extra_state_capacity.
  corpus.Add(name + "-part-bytes",
             PatchInput(recipe, kResealAll, Patch(0, 40, {0x00, 0x20, 0, 0, 0, 0, 0, 0})));
  corpus.Add(name + "-extra-capacity",
             PatchInput(recipe, kResealAll,
                        Patch(0, 48, {0xc0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})));
}

Status AddPoolSeeds(const fs::path& root, const std::string& pool_dir) {
  Corpus pool_open(root / "pool_open");
  Corpus chunk_payload(root / "chunk_payload");
  Corpus manifest(root / "manifest");
  Corpus extra_state(root / "extra_state");
  const std::vector<SeedPoolRecipe>& recipes = SeedPoolRecipes();
  for (std::uint8_t r = 0; r < recipes.size(); ++r) {
    const SeedPoolRecipe& recipe = recipes[r];
    const std::string path =
        pool_dir + "/pmsnap-fuzz-seeds-" + std::to_string(::getpid()) + "-" + recipe.name + ".pool";
    std::remove(path.c_str());
    PMSNAP_RETURN_IF_ERROR(BuildSeedPool(path, recipe));
    layout::OpenOptions options;
    options.prefault_mapping = false;
    auto pool = layout::Pool::Open(path, options);
    if (!pool.ok()) {
      std::remove(path.c_str());
      return pool.status();
    }
    AddPoolOpenSeeds(pool_open, r, recipe.name);
    manifest.Add(recipe.name, (*pool)->manifest().Serialize());
    for (int slot = 0; slot < 2; ++slot) {
      auto view = (*pool)->Slot(slot);
      if (view.ok())
        extra_state.Add(recipe.name + "-slot" + std::to_string(slot), view->extra_state());
    }
    for (const layout::ChunkInfo& chunk : (*pool)->chunk_heap().List()) {
      auto payload = (*pool)->chunk_heap().Read(chunk.id);
      if (!payload.ok()) continue;
      const std::string name = recipe.name + "-chunk" + std::to_string(chunk.id);
      if (diff::detail::ParseIndex(*payload, name).ok()) {
        chunk_payload.Add(name + "-index", *payload, 1);
        continue;
      }
      auto data = diff::detail::ParseDataChunk(*payload, name);
      if (!data.ok()) continue;
      chunk_payload.Add(name + "-data", *payload, 0);
      for (std::size_t t = 0; t < data->tensors.size(); ++t) {
        if (!data->tensors[t].quantized) continue;
        const std::vector<std::uint8_t> table = quant::Serialize(data->tensors[t].quantized_view);
        chunk_payload.Add(name + "-quant" + std::to_string(t), AsBytes(table), 2);
      }
    }
    pool->reset();
    std::remove(path.c_str());
  }
  // Quantized tables of every method and bit width, beyond those the
  // embedding policies pick (adaptive up to 4 bits, asymmetric at 8).
  std::vector<float> table(6 * 10);
  for (std::size_t i = 0; i < table.size(); ++i)
    table[i] = 0.37f * static_cast<float>(i % 13) - 2.0f;
  for (quant::Method method : {quant::Method::kSymmetric, quant::Method::kAsymmetric,
                               quant::Method::kAdaptive, quant::Method::kKMeans}) {
    for (int bits : {2, 3, 4, 8}) {
      quant::QuantOptions options;
      options.method = method;
      options.bits = bits;
      options.max_threads = 1;
      auto quantized = quant::Quantize({"seed", table.data(), 6, 10, 0}, options);
      if (!quantized.ok()) continue;
      const std::vector<std::uint8_t> bytes = quant::Serialize(quantized->view());
      chunk_payload.Add(
          std::string("table-") + quant::MethodName(method) + "-" + std::to_string(bits),
          AsBytes(bytes), 2);
    }
  }
  manifest.Add("three-units", testing::MakeManifest(3, 1000).Serialize());
  std::cout << "pmsnap-fuzz-seeds: pool_open " << pool_open.count() << ", chunk_payload "
            << chunk_payload.count() << ", manifest " << manifest.count() << ", extra_state "
            << extra_state.count() << " seeds in " << root.string() << "\n";
  return Status::Ok();
}

}  // namespace
}  // namespace pmsnap::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: pmsnap-fuzz-seeds <corpus-root>\n";
    return 2;
  }
  const pmsnap::Status status = pmsnap::fuzz::AddPoolSeeds(argv[1], pmsnap::fuzz::PoolDirectory());
  if (!status.ok()) {
    std::cerr << "pmsnap-fuzz-seeds: " << status.ToString() << "\n";
    return 1;
  }
  return 0;
}
