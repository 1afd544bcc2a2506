// IEEE binary16 <-> binary32 conversions in plain C++ (internal).
//
// Round-to-nearest-even matches F16C's vcvtps2ph and PyTorch's at::Half, so
// the portable and SIMD kernels agree bit for bit. RoundDown / RoundUp give
// the nearest half at or below / at or above a float, for outward-rounded
// parameters. Thread-safety: pure functions.
#pragma once

#include <bit>
#include <cstdint>

namespace pmsnap::quant::detail {

inline float HalfToFloat(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24, exact in float.
    const float magnitude = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return std::bit_cast<float>(std::bit_cast<std::uint32_t>(magnitude) | sign);
  }
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline std::uint16_t FloatToHalfRne(float f) {
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (x >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to infinity
  if (x < 0x38800000u) {
    // Below 2^-14: adding 0.5f leaves the value rounded (to nearest even) to a
    // multiple of 2^-24, the half subnormal step, in the low mantissa bits.
    const float shifted = std::bit_cast<float>(x) + 0.5f;
    return sign | static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(shifted) - 0x3f000000u);
  }
  const std::uint32_t odd = (x >> 13) & 1u;
  x += 0xc8000fffu + odd;  // rebias exponent by -112 and round the 13 dropped bits
  return sign | static_cast<std::uint16_t>(x >> 13);
}

// The next half toward +infinity / -infinity (finite, non-NaN input).
inline std::uint16_t HalfNextUp(std::uint16_t h) {
  if (h == 0x8000u) return 0x0001u;
  return (h & 0x8000u) ? static_cast<std::uint16_t>(h - 1) : static_cast<std::uint16_t>(h + 1);
}
inline std::uint16_t HalfNextDown(std::uint16_t h) {
  if (h == 0x0000u) return 0x8001u;
  return (h & 0x8000u) ? static_cast<std::uint16_t>(h + 1) : static_cast<std::uint16_t>(h - 1);
}

inline std::uint16_t FloatToHalfRoundDown(float f) {
  std::uint16_t h = FloatToHalfRne(f);
  if ((h & 0x7fffu) < 0x7c00u && HalfToFloat(h) > f)
    h = HalfNextDown(h);
  else if (h == 0x7c00u)
    h = 0x7bffu;  // +inf rounded down is the largest finite half
  return h;
}
inline std::uint16_t FloatToHalfRoundUp(float f) {
  std::uint16_t h = FloatToHalfRne(f);
  if ((h & 0x7fffu) < 0x7c00u && HalfToFloat(h) < f)
    h = HalfNextUp(h);
  else if (h == 0xfc00u)
    h = 0xfbffu;
  return h;
}

inline bool HalfIsFinite(std::uint16_t h) { return (h & 0x7c00u) != 0x7c00u; }

}  // namespace pmsnap::quant::detail
