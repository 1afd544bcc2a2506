// Per-row inner loops of the quantizers, one table per instruction set
// (internal).
//
// Contract shared by every set, so their outputs are identical:
//  - MinMax: exact min and max (order-independent), -0.0 normalized to +0.0;
//    returns false if any element is NaN or +-Inf.
//  - Encode: code = nearbyint(clamp((x - bias) * inv_scale, 0, qmax)), one
//    byte per element, computed with separate IEEE float subtract, multiply,
//    clamp and round-to-nearest-even (no FMA).
//  - Loss2: for two parameter sets, sum over elements of (x - (q * scale +
//    bias))^2 with q as in Encode; element i accumulates into lane i % 16 and
//    the 16 lanes are summed by ReduceLanes16, so the float result is the same
//    whatever the vector width.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>

#include "pmsnap/quant/cpu.h"

namespace pmsnap::quant::detail {

struct EncodeParams {
  float bias;
  float inv_scale;
  float scale;  // Loss2 only: the dequantization step
};

// Plan of one adaptive search (quantize.cc AdaptiveSearch), for the fast path.
struct SearchPlan {
  float qmax;
  std::uint32_t num_bins, min_bins, refine_iterations;
};

// Chosen range of one row in the fast path's fp16 form.
struct SearchResult {
  EncodeParams enc;
  std::uint16_t scale_h, bias_h;
};

struct Kernels {
  Isa isa;
  bool (*min_max)(const float* x, std::uint32_t n, float* min_out, float* max_out);
  void (*encode)(const float* x, std::uint32_t n, EncodeParams p, float qmax, std::uint8_t* codes);
  void (*loss2)(const float* x, std::uint32_t n, EncodeParams a, EncodeParams b, float qmax,
                float* loss_a, float* loss_b);
  // Optional (nullptr: use the generic search): the adaptive search for up to
  // kSearchRows rows of n elements with fp16 asymmetric parameters in the
  // pmsnap layout, whose exact min / max are lo0 / hi0. Same result as the
  // generic AdaptiveSearch over MakeUniformParams and loss2; returns false,
  // leaving `out` unspecified, when any row needs the generic path (an fp16
  // overflow, which the generic path reports as an error).
  bool (*adaptive_fp16)(const float* const* rows, int count, std::uint32_t n,
                        const SearchPlan& plan, const float* lo0, const float* hi0,
                        SearchResult* out);
  // Optional (nullptr: per-row driver): asymmetric 8-bit rows with fp32
  // scale/bias in the pmsnap layout, min/max, parameters, codes and stored
  // parameters fused per row, exactly as QuantizeRow computes them. Rows are
  // `stride` floats apart, output rows n + 8 bytes. Returns how many leading
  // rows it wrote; a row it stops at (non-finite, range overflow) is left to
  // QuantizeRow, which reports it.
  std::uint64_t (*asym8_fp32_rows)(const float* x, std::uint64_t stride, std::uint64_t count,
                                   std::uint32_t n, std::uint8_t* out);
};

inline constexpr int kSearchRows = 4;

// Kernels for `isa` (kAuto resolves to DetectIsa()). The caller checks
// IsaSupported() first.
const Kernels& KernelsFor(Isa isa);

const Kernels& PortableKernels();
// nullptr when the build has no such set (non-x86 targets).
const Kernels* Avx2Kernels();
const Kernels* Avx512Kernels();

// Fixed summation tree over 16 lane partial sums: i + (i + 8), then + 4, + 2, + 1.
inline float ReduceLanes16(const float* lanes) {
  float r8[8], r4[4], r2[2];
  for (int i = 0; i < 8; ++i) r8[i] = lanes[i] + lanes[i + 8];
  for (int i = 0; i < 4; ++i) r4[i] = r8[i] + r8[i + 4];
  for (int i = 0; i < 2; ++i) r2[i] = r4[i] + r4[i + 2];
  return r2[0] + r2[1];
}

// Scalar element step shared by the portable set and the vector tails.
inline float EncodeOne(float x, const EncodeParams& p, float qmax) {
  float t = (x - p.bias) * p.inv_scale;
  t = t < 0.0f ? 0.0f : t;
  t = t > qmax ? qmax : t;
  return __builtin_nearbyintf(t);
}

// Squared errors of elements [from, n) under both candidates, added to the
// 16 lane partial sums (element i into lane i % 16, the order every kernel
// set shares), then each reduced: the portable set does all elements here,
// the AVX2 set its tail after the vector loop.
inline void FinishLoss2(const float* x, std::uint32_t from, std::uint32_t n, const EncodeParams& a,
                        const EncodeParams& b, float qmax, float* lanes_a, float* lanes_b,
                        float* loss_a, float* loss_b) {
  for (std::uint32_t i = from; i < n; ++i) {
    const float qa = EncodeOne(x[i], a, qmax);
    const float qb = EncodeOne(x[i], b, qmax);
    const float da = x[i] - (qa * a.scale + a.bias);
    const float db = x[i] - (qb * b.scale + b.bias);
    lanes_a[i % 16] += da * da;
    lanes_b[i % 16] += db * db;
  }
  *loss_a = ReduceLanes16(lanes_a);
  *loss_b = ReduceLanes16(lanes_b);
}

}  // namespace pmsnap::quant::detail
