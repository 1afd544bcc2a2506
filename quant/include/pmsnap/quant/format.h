// Self-describing serialized form of a quantized table.
//
// A 64-byte little-endian header followed by the payload (the rows exactly as
// quant.h lays them out):
//
//   off size field
//     0    4 magic "PSQT"
//     4    2 format version (1)
//     6    2 header bytes (64)
//     8    1 method            9  1 bits
//    10    1 scale type       11  1 layout
//    12    4 dim (floats per row)
//    16    8 rows
//    24    8 row bytes (must equal what method/bits/dim/scale type imply)
//    32    8 payload bytes (rows * row bytes)
//    40    4 adaptive num_bins  44  4 adaptive ratio (fp32)
//    48    4 payload CRC-32C   52  8 reserved (zero)
//    60    4 header CRC-32C over bytes [0, 60)
//
// A reader needs nothing else to dequantize. Parse() checks every field and
// both checksums and names what is wrong on failure.
//
// Thread-safety: pure functions over caller buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "pmsnap/common/status.h"
#include "pmsnap/quant/quant.h"

namespace pmsnap::quant {

inline constexpr std::size_t kSerializedHeaderBytes = 64;
inline constexpr std::uint16_t kSerializedFormatVersion = 1;

// Bytes Serialize() produces for `spec`.
std::uint64_t SerializedSize(const QuantSpec& spec);

// Writes header + payload into `out` (exactly SerializedSize(view.spec)
// bytes). Fails with kInvalidArgument if the sizes disagree.
Status SerializeInto(const QuantizedView& view, std::span<std::uint8_t> out);

// Header + payload as a new buffer.
std::vector<std::uint8_t> Serialize(const QuantizedView& view);

// Validates `bytes` and returns a view into them (no copy; `bytes` must
// outlive the view). Errors: kCorruption for a bad magic, checksum, enum,
// size relation or truncation (the message says which field and the values);
// kUnsupportedVersion for a newer format version.
Result<QuantizedView> Parse(std::span<const std::uint8_t> bytes);

// CRC-32C (Castagnoli) of `bytes`, continuing from `crc` (0 to start).
std::uint32_t Crc32c(std::span<const std::uint8_t> bytes, std::uint32_t crc = 0);

}  // namespace pmsnap::quant
