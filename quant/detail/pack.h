// Tight LSB-first bit packing of per-element codes (internal).
//
// Eight codes of b bits fill exactly b bytes, so a row packs group by group:
// the eight code bytes are loaded as one little-endian word and squeezed with
// three shift/or/mask steps (SWAR), no per-bit loop. The same code runs after
// every kernel set, which keeps packed bytes identical across instruction sets.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <cstring>

namespace pmsnap::quant::detail {

inline std::uint64_t CodeBytesFor(std::uint64_t dim, int bits) {
  return (dim * static_cast<std::uint64_t>(bits) + 7) / 8;
}

// Squeezes 8 one-byte codes (each < 2^bits) into the low 8 * bits bits.
inline std::uint64_t Squeeze8(std::uint64_t x, int bits) {
  const unsigned b = static_cast<unsigned>(bits);
  const std::uint64_t m1 = 0x0001000100010001ULL * ((1ULL << (2 * b)) - 1);
  const std::uint64_t m2 = 0x0000000100000001ULL * ((1ULL << (4 * b)) - 1);
  x = (x | (x >> (8 - b))) & m1;
  x = (x | (x >> (16 - 2 * b))) & m2;
  return (x | (x >> (32 - 4 * b))) & ((1ULL << (8 * b)) - 1);
}

// Inverse of Squeeze8.
inline std::uint64_t Spread8(std::uint64_t x, int bits) {
  const unsigned b = static_cast<unsigned>(bits);
  const std::uint64_t m2 = 0x0000000100000001ULL * ((1ULL << (4 * b)) - 1);
  const std::uint64_t m1 = 0x0001000100010001ULL * ((1ULL << (2 * b)) - 1);
  const std::uint64_t m0 = 0x0101010101010101ULL * ((1ULL << b) - 1);
  x = (x | (x << (32 - 4 * b))) & m2;
  x = (x | (x << (16 - 2 * b))) & m1;
  return (x | (x << (8 - b))) & m0;
}

// Packs n codes (one byte each) for bits in {2,3,4}; writes CodeBytesFor(n)
// bytes, padding bits zero.
inline void PackCodes(const std::uint8_t* codes, std::uint64_t n, int bits, std::uint8_t* out) {
  const std::uint64_t full = n / 8;
  for (std::uint64_t g = 0; g < full; ++g) {
    std::uint64_t word;
    std::memcpy(&word, codes + 8 * g, 8);
    const std::uint64_t packed = Squeeze8(word, bits);
    std::memcpy(out + static_cast<std::uint64_t>(bits) * g, &packed,
                static_cast<std::size_t>(bits));
  }
  const std::uint64_t rest = n - 8 * full;
  if (rest != 0) {
    std::uint64_t word = 0;
    std::memcpy(&word, codes + 8 * full, rest);
    const std::uint64_t packed = Squeeze8(word, bits);
    std::memcpy(out + static_cast<std::uint64_t>(bits) * full, &packed,
                static_cast<std::size_t>((rest * static_cast<std::uint64_t>(bits) + 7) / 8));
  }
}

// Unpacks n codes of `bits` (1..8) into one byte each.
inline void UnpackCodes(const std::uint8_t* packed, std::uint64_t n, int bits,
                        std::uint8_t* codes) {
  if (bits == 8) {
    std::memcpy(codes, packed, n);
    return;
  }
  const std::uint64_t full = n / 8;
  for (std::uint64_t g = 0; g < full; ++g) {
    std::uint64_t word = 0;
    std::memcpy(&word, packed + static_cast<std::uint64_t>(bits) * g,
                static_cast<std::size_t>(bits));
    const std::uint64_t spread = Spread8(word, bits);
    std::memcpy(codes + 8 * g, &spread, 8);
  }
  const std::uint64_t rest = n - 8 * full;
  if (rest != 0) {
    std::uint64_t word = 0;
    std::memcpy(&word, packed + static_cast<std::uint64_t>(bits) * full,
                static_cast<std::size_t>((rest * static_cast<std::uint64_t>(bits) + 7) / 8));
    const std::uint64_t spread = Spread8(word, bits);
    std::memcpy(codes + 8 * full, &spread, rest);
  }
}

}  // namespace pmsnap::quant::detail
