// Shared fixtures for pool tests: small manifests and seed-derived contents,
// so a reader can check every byte without remembering what was written.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "pmsnap/pmem_layout/pool.h"

namespace pmsnap::testing {

// `unit_count` units "layer<i>.weight", each a float32 param of `floats_per_unit`
// elements and an Adam-like exp_avg of the same shape plus a scalar int64 step.
inline layout::Manifest MakeManifest(int unit_count, std::int64_t floats_per_unit) {
  layout::Manifest manifest;
  for (int u = 0; u < unit_count; ++u) {
    layout::UnitSpec unit;
    unit.name = "layer" + std::to_string(u) + ".weight";
    const std::int64_t rows = floats_per_unit >= 16 ? 16 : 1;
    unit.tensors.push_back({"param", layout::DType::kFloat32, {rows, floats_per_unit / rows}});
    unit.tensors.push_back({"exp_avg", layout::DType::kFloat32, {rows, floats_per_unit / rows}});
    unit.tensors.push_back({"step", layout::DType::kInt64, {}});
    manifest.units.push_back(std::move(unit));
  }
  return manifest;
}

// Deterministic bytes for (epoch, unit, tensor): splitmix64 stream.
inline void FillSeeded(std::vector<std::byte>& out, std::uint64_t epoch, std::uint32_t unit,
                       std::uint32_t tensor) {
  std::uint64_t state = (epoch * 0x9E3779B97F4A7C15ull) ^ (std::uint64_t{unit} << 20) ^ tensor;
  for (std::size_t i = 0; i < out.size(); i += 8) {
    state += 0x9E3779B97F4A7C15ull;
    std::uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    std::memcpy(out.data() + i, &z, std::min<std::size_t>(8, out.size() - i));
  }
}

inline std::vector<std::byte> SeededTensor(const layout::Manifest& manifest, std::uint64_t epoch,
                                           std::uint32_t unit, std::uint32_t tensor) {
  std::vector<std::byte> bytes(manifest.units[unit].tensors[tensor].bytes());
  FillSeeded(bytes, epoch, unit, tensor);
  return bytes;
}

// Writes every tensor of every unit with seed-derived content for `epoch`'s
// seed and commits with `extra`. Returns the first failure.
inline Status WriteSeededEpoch(layout::Pool& pool, std::uint64_t seed, std::uint64_t iteration,
                               const std::string& extra = "") {
  auto epoch = pool.BeginEpoch(iteration);
  if (!epoch.ok()) return epoch.status();
  const layout::Manifest& manifest = pool.manifest();
  for (std::uint32_t u = 0; u < manifest.units.size(); ++u) {
    for (std::uint32_t t = 0; t < manifest.units[u].tensors.size(); ++t) {
      std::vector<std::byte> bytes = SeededTensor(manifest, seed, u, t);
      Status s = pool.WriteTensor(u, t, bytes.data());
      if (!s.ok()) return s;
    }
  }
  return pool.Commit({reinterpret_cast<const std::byte*>(extra.data()), extra.size()});
}

// True when every tensor in `view` equals the seed-derived content of `seed`.
inline std::string CheckSeededView(const layout::Manifest& manifest,
                                   const layout::SnapshotView& view, std::uint64_t seed) {
  for (std::uint32_t u = 0; u < manifest.units.size(); ++u) {
    for (std::uint32_t t = 0; t < manifest.units[u].tensors.size(); ++t) {
      std::vector<std::byte> expected = SeededTensor(manifest, seed, u, t);
      auto actual = view.tensor(u, t);
      if (actual.size() != expected.size() ||
          std::memcmp(actual.data(), expected.data(), expected.size()) != 0) {
        return "unit " + std::to_string(u) + " tensor " + std::to_string(t) +
               " differs from seed " + std::to_string(seed);
      }
    }
  }
  return "";
}

}  // namespace pmsnap::testing
