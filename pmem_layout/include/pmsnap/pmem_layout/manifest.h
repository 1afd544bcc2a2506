// Manifest: what a pool stores, and where.
//
// A manifest lists the units (one parameter plus its optimizer-state tensors)
// with their tensors' names, dtypes and shapes. From a manifest and the pool
// options, `ComputeLayout` derives deterministically where every tensor and
// every part (a piece of at most `part_bytes` of one tensor) lives inside a
// slot, so the pool stores only the manifest and recomputes the layout at
// open. The model signature is a hash of names, dtypes and shapes: two
// manifests with the same signature describe the same model.
//
// Thread-safety: plain values; const methods may be called concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pmsnap/common/status.h"

namespace pmsnap::layout {

enum class DType : std::uint8_t {
  kFloat32 = 1,
  kFloat64 = 2,
  kFloat16 = 3,
  kBFloat16 = 4,
  kInt64 = 5,
  kInt32 = 6,
  kInt16 = 7,
  kInt8 = 8,
  kUInt8 = 9,
  kBool = 10,
};

// Bytes per element; 0 for a value that is not a known DType.
std::size_t DTypeSize(DType dtype);
const char* DTypeName(DType dtype);

struct TensorSpec {
  std::string name;  // role inside the unit: "param", "exp_avg", "step", ...
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;

  std::uint64_t numel() const;
  std::uint64_t bytes() const { return numel() * DTypeSize(dtype); }
  bool operator==(const TensorSpec&) const = default;
};

// Unit flags. kEncoded units keep no bytes in the fixed slots: their payload
// goes through an Encoder into the chunk heap (differential / quantized).
enum UnitFlags : std::uint32_t {
  kUnitFlagNone = 0,
  kUnitFlagEncoded = 1u << 0,
};

struct UnitSpec {
  std::string name;
  std::vector<TensorSpec> tensors;
  std::uint32_t flags = kUnitFlagNone;

  std::uint64_t bytes() const;
  bool operator==(const UnitSpec&) const = default;
};

// Limits that keep a corrupt manifest from asking for absurd allocations.
inline constexpr std::size_t kMaxNameBytes = 4096;
inline constexpr std::size_t kMaxRank = 16;
inline constexpr std::size_t kMaxTensorsPerUnit = 64;

struct Manifest {
  std::vector<UnitSpec> units;

  // Checks names are unique and non-empty, dtypes known, dims >= 0, limits.
  Status Validate() const;
  // Hash of every unit's name, flags and tensors (names, dtypes, shapes).
  std::uint64_t Signature() const;
  // Stable little-endian encoding stored in the pool.
  std::vector<std::byte> Serialize() const;
  // Parses `Serialize` output; every length is bounds-checked. `what` names
  // the source in errors (e.g. the pool path).
  static Result<Manifest> Parse(std::span<const std::byte> bytes, std::string_view what);
  // Explains the first difference from `other` ("unit 3 'fc1.weight':
  // tensor 'param' shape [4, 8] vs [4, 16]"), or "" if equal.
  std::string FirstDifference(const Manifest& other) const;
};

std::string ShapeToString(std::span<const std::int64_t> shape);

// Where one part of one tensor lives inside a slot.
struct PartLayout {
  std::uint32_t unit = 0;
  std::uint32_t tensor = 0;
  std::uint64_t offset_in_tensor = 0;
  std::uint64_t bytes = 0;
  std::uint64_t slot_offset = 0;  // from the start of the slot's data
};

struct TensorLayout {
  std::uint64_t slot_offset = 0;
  std::uint64_t bytes = 0;
  std::uint32_t first_part = 0;
  std::uint32_t part_count = 0;
};

struct UnitLayout {
  std::vector<TensorLayout> tensors;
  std::uint32_t first_part = 0;  // parts of a unit are consecutive
  std::uint32_t part_count = 0;
  std::uint64_t bytes = 0;
};

struct SlotLayout {
  std::vector<UnitLayout> units;
  std::vector<PartLayout> parts;
  std::uint64_t slot_bytes = 0;  // every tensor starts on a kTensorAlignment boundary
  // A slot too large for one allocation is stored in extents: extent i holds
  // slot offsets [i * extent_bytes, (i + 1) * extent_bytes), of which only
  // the first extent_used[i] bytes are stored (no tensor crosses an extent;
  // the rest is padding that takes no space). extent_bytes 0: one extent of
  // slot_bytes.
  std::uint64_t extent_bytes = 0;
  std::vector<std::uint64_t> extent_used;
};

inline constexpr std::uint64_t kTensorAlignment = 256;

// Places every tensor of every non-encoded unit and cuts it into parts of at
// most `part_bytes` (> 0). Deterministic: same input, same layout. With
// `extent_bytes` > 0 (a multiple of kTensorAlignment), a tensor that would
// cross a multiple of it starts at that multiple instead; a tensor larger
// than `extent_bytes` cannot be placed so and crosses (Pool::Create
// refuses such a manifest).
SlotLayout ComputeLayout(const Manifest& manifest, std::uint64_t part_bytes,
                         std::uint64_t extent_bytes = 0);

}  // namespace pmsnap::layout
