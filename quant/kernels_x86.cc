// AVX2 and AVX-512 kernel sets, selected at run time (cpu.cc).
//
// Every function carries a target attribute instead of the file being built
// with -mavx*: out-of-line copies of inline library functions then stay
// baseline x86-64, so nothing here can leak AVX code into callers on a CPU
// without it. Results equal the portable set bit for bit (detail/kernels.h):
// same IEEE operations per element, round-to-nearest-even conversions, and the
// loss summed in 16 fixed lanes.
// Thread-safety: pure functions.
#include <cmath>
#include <cstring>

#include "detail/half.h"
#include "detail/kernels.h"

#if defined(__x86_64__)
// GCC 12's AVX-512 headers seed results with _mm512_undefined_ps(), which
// trips -Wmaybe-uninitialized once inlined; the lanes are always overwritten.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#define PMSNAP_AVX2 __attribute__((target("avx2,f16c,popcnt")))
#define PMSNAP_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")))

namespace pmsnap::quant::detail {
namespace {

// ---------------------------------------------------------------- AVX2 ----

PMSNAP_AVX2 float HMin256(__m256 v) {
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  m = _mm_min_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
PMSNAP_AVX2 float HMax256(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// ReduceLanes16 in registers: lanes 0-7 in lo, 8-15 in hi; same tree.
PMSNAP_AVX2 inline float ReduceLanes16Avx2(__m256 lo, __m256 hi) {
  const __m256 r8 = _mm256_add_ps(lo, hi);
  const __m128 r4 = _mm_add_ps(_mm256_castps256_ps128(r8), _mm256_extractf128_ps(r8, 1));
  const __m128 r2 = _mm_add_ps(r4, _mm_movehl_ps(r4, r4));
  return _mm_cvtss_f32(_mm_add_ss(r2, _mm_shuffle_ps(r2, r2, 1)));
}

PMSNAP_AVX2 bool MinMaxAvx2(const float* x, std::uint32_t n, float* min_out, float* max_out) {
  std::uint32_t i = 0;
  float lo = x[0], hi = x[0];
  float poison = 0.0f;
  if (n >= 8) {
    __m256 vlo = _mm256_loadu_ps(x), vhi = vlo;
    __m256 vpoison = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      vlo = _mm256_min_ps(vlo, v);
      vhi = _mm256_max_ps(vhi, v);
      vpoison = _mm256_add_ps(vpoison, _mm256_sub_ps(v, v));
    }
    lo = HMin256(vlo);
    hi = HMax256(vhi);
    const __m256 bad = _mm256_cmp_ps(vpoison, _mm256_setzero_ps(), _CMP_NEQ_UQ);
    if (_mm256_movemask_ps(bad) != 0) poison = 1.0f;
  }
  for (; i < n; ++i) {
    const float v = x[i];
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
    poison += v - v;
  }
  *min_out = lo + 0.0f;
  *max_out = hi + 0.0f;
  return poison == 0.0f;
}

PMSNAP_AVX2 inline __m256 EncodeVec256(__m256 v, __m256 bias, __m256 inv, __m256 qmax) {
  __m256 t = _mm256_mul_ps(_mm256_sub_ps(v, bias), inv);
  t = _mm256_min_ps(_mm256_max_ps(t, _mm256_setzero_ps()), qmax);
  return _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

PMSNAP_AVX2 void EncodeAvx2(const float* x, std::uint32_t n, EncodeParams p, float qmax,
                            std::uint8_t* codes) {
  const __m256 bias = _mm256_set1_ps(p.bias), inv = _mm256_set1_ps(p.inv_scale);
  const __m256 vqmax = _mm256_set1_ps(qmax);
  std::uint32_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i q0 = _mm256_cvtps_epi32(EncodeVec256(_mm256_loadu_ps(x + i), bias, inv, vqmax));
    const __m256i q1 =
        _mm256_cvtps_epi32(EncodeVec256(_mm256_loadu_ps(x + i + 8), bias, inv, vqmax));
    const __m256i q2 =
        _mm256_cvtps_epi32(EncodeVec256(_mm256_loadu_ps(x + i + 16), bias, inv, vqmax));
    const __m256i q3 =
        _mm256_cvtps_epi32(EncodeVec256(_mm256_loadu_ps(x + i + 24), bias, inv, vqmax));
    // packs interleave 128-bit halves; the permute restores element order.
    const __m256i w01 = _mm256_packus_epi32(q0, q1);
    const __m256i w23 = _mm256_packus_epi32(q2, q3);
    __m256i b = _mm256_packus_epi16(w01, w23);
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), b);
  }
  for (; i < n; ++i) {
    codes[i] = static_cast<std::uint8_t>(static_cast<int>(EncodeOne(x[i], p, qmax)));
  }
}

PMSNAP_AVX2 void Loss2Avx2(const float* x, std::uint32_t n, EncodeParams a, EncodeParams b,
                           float qmax, float* loss_a, float* loss_b) {
  const __m256 bias_a = _mm256_set1_ps(a.bias), inv_a = _mm256_set1_ps(a.inv_scale);
  const __m256 scale_a = _mm256_set1_ps(a.scale);
  const __m256 bias_b = _mm256_set1_ps(b.bias), inv_b = _mm256_set1_ps(b.inv_scale);
  const __m256 scale_b = _mm256_set1_ps(b.scale);
  const __m256 vqmax = _mm256_set1_ps(qmax);
  // Lanes 0-7 and 8-15 of the 16-lane accumulation order.
  __m256 acc_a_lo = _mm256_setzero_ps(), acc_a_hi = _mm256_setzero_ps();
  __m256 acc_b_lo = _mm256_setzero_ps(), acc_b_hi = _mm256_setzero_ps();
  std::uint32_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    __m256 d;
    d = _mm256_sub_ps(
        v0, _mm256_add_ps(_mm256_mul_ps(EncodeVec256(v0, bias_a, inv_a, vqmax), scale_a), bias_a));
    acc_a_lo = _mm256_add_ps(acc_a_lo, _mm256_mul_ps(d, d));
    d = _mm256_sub_ps(
        v1, _mm256_add_ps(_mm256_mul_ps(EncodeVec256(v1, bias_a, inv_a, vqmax), scale_a), bias_a));
    acc_a_hi = _mm256_add_ps(acc_a_hi, _mm256_mul_ps(d, d));
    d = _mm256_sub_ps(
        v0, _mm256_add_ps(_mm256_mul_ps(EncodeVec256(v0, bias_b, inv_b, vqmax), scale_b), bias_b));
    acc_b_lo = _mm256_add_ps(acc_b_lo, _mm256_mul_ps(d, d));
    d = _mm256_sub_ps(
        v1, _mm256_add_ps(_mm256_mul_ps(EncodeVec256(v1, bias_b, inv_b, vqmax), scale_b), bias_b));
    acc_b_hi = _mm256_add_ps(acc_b_hi, _mm256_mul_ps(d, d));
  }
  if (i == n) {
    *loss_a = ReduceLanes16Avx2(acc_a_lo, acc_a_hi);
    *loss_b = ReduceLanes16Avx2(acc_b_lo, acc_b_hi);
    return;
  }
  alignas(32) float lanes_a[16], lanes_b[16];
  _mm256_store_ps(lanes_a, acc_a_lo);
  _mm256_store_ps(lanes_a + 8, acc_a_hi);
  _mm256_store_ps(lanes_b, acc_b_lo);
  _mm256_store_ps(lanes_b + 8, acc_b_hi);
  FinishLoss2(x, i, n, a, b, qmax, lanes_a, lanes_b, loss_a, loss_b);
}

// ------------------------------------------------------------- AVX-512 ----

PMSNAP_AVX512 bool MinMaxAvx512(const float* x, std::uint32_t n, float* min_out, float* max_out) {
  __m512 vlo = _mm512_set1_ps(x[0]), vhi = vlo;
  __m512 vpoison = _mm512_setzero_ps();
  std::uint32_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    vlo = _mm512_min_ps(vlo, v);
    vhi = _mm512_max_ps(vhi, v);
    vpoison = _mm512_add_ps(vpoison, _mm512_sub_ps(v, v));
  }
  if (i < n) {
    // Masked-off lanes load x[0], which is already part of the min and max.
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(x[0]), m, x + i);
    vlo = _mm512_min_ps(vlo, v);
    vhi = _mm512_max_ps(vhi, v);
    vpoison = _mm512_add_ps(vpoison, _mm512_sub_ps(v, v));
  }
  const __mmask16 bad = _mm512_cmp_ps_mask(vpoison, _mm512_setzero_ps(), _CMP_NEQ_UQ);
  // x[0] NaN would hide in the min/max but not in the poison sum; checked above.
  *min_out = _mm512_reduce_min_ps(vlo) + 0.0f;
  *max_out = _mm512_reduce_max_ps(vhi) + 0.0f;
  return bad == 0;
}

PMSNAP_AVX512 inline __m512 EncodeVec512(__m512 v, __m512 bias, __m512 inv, __m512 qmax) {
  __m512 t = _mm512_mul_ps(_mm512_sub_ps(v, bias), inv);
  t = _mm512_min_ps(_mm512_max_ps(t, _mm512_setzero_ps()), qmax);
  return _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

PMSNAP_AVX512 void EncodeAvx512(const float* x, std::uint32_t n, EncodeParams p, float qmax,
                                std::uint8_t* codes) {
  const __m512 bias = _mm512_set1_ps(p.bias), inv = _mm512_set1_ps(p.inv_scale);
  const __m512 vqmax = _mm512_set1_ps(qmax);
  std::uint32_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i q = _mm512_cvtps_epi32(EncodeVec512(_mm512_loadu_ps(x + i), bias, inv, vqmax));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(q));
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    const __m512i q = _mm512_cvtps_epi32(EncodeVec512(v, bias, inv, vqmax));
    _mm512_mask_cvtepi32_storeu_epi8(codes + i, m, q);
  }
}

PMSNAP_AVX512 void Loss2Avx512(const float* x, std::uint32_t n, EncodeParams a, EncodeParams b,
                               float qmax, float* loss_a, float* loss_b) {
  const __m512 bias_a = _mm512_set1_ps(a.bias), inv_a = _mm512_set1_ps(a.inv_scale);
  const __m512 scale_a = _mm512_set1_ps(a.scale);
  const __m512 bias_b = _mm512_set1_ps(b.bias), inv_b = _mm512_set1_ps(b.inv_scale);
  const __m512 scale_b = _mm512_set1_ps(b.scale);
  const __m512 vqmax = _mm512_set1_ps(qmax);
  __m512 acc_a = _mm512_setzero_ps(), acc_b = _mm512_setzero_ps();
  std::uint32_t i = 0;
  for (; i < n; i += 16) {
    const __mmask16 m =
        n - i >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    const __m512 deq_a =
        _mm512_add_ps(_mm512_mul_ps(EncodeVec512(v, bias_a, inv_a, vqmax), scale_a), bias_a);
    const __m512 deq_b =
        _mm512_add_ps(_mm512_mul_ps(EncodeVec512(v, bias_b, inv_b, vqmax), scale_b), bias_b);
    // Lanes past the end contribute +0.0, which leaves every partial sum unchanged.
    const __m512 da = _mm512_maskz_sub_ps(m, v, deq_a);
    const __m512 db = _mm512_maskz_sub_ps(m, v, deq_b);
    acc_a = _mm512_add_ps(acc_a, _mm512_mul_ps(da, da));
    acc_b = _mm512_add_ps(acc_b, _mm512_mul_ps(db, db));
  }
  *loss_a = ReduceLanes16Avx2(_mm512_castps512_ps256(acc_a), _mm512_extractf32x8_ps(acc_a, 1));
  *loss_b = ReduceLanes16Avx2(_mm512_castps512_ps256(acc_b), _mm512_extractf32x8_ps(acc_b, 1));
}

// Adaptive search fast path (quantize.cc AdaptiveSearch, fp16 asymmetric
// pmsnap rows), kSearchRows rows in lock step so their independent chains of
// parameter -> loss -> choice overlap. Lanes of a __m256: 2r holds row r's
// raise-lo candidate, 2r+1 its lower-hi candidate; per-row state is kept in
// both lanes of its pair. Parameters come from F16C's directed conversions
// (round toward -inf / +inf), which equal FloatToHalfRoundDown / RoundUp for
// every finite float (tests/quant_simd_equivalence_test.cc checks them over
// the float range); losses come from Loss2Avx512 itself.

struct ParamsVec {
  __m256 bias, inv, scale;
  __mmask8 bad;  // the generic path reports kHalfOverflow for these lanes
};

// MakeUniformParams' fp16 asymmetric branch, lane by lane.
PMSNAP_AVX512 inline ParamsVec Fp16ParamsVec(__m256 lo, __m256 hi, __m256 qmax) {
  hi = _mm256_mask_blend_ps(_mm256_cmp_ps_mask(hi, lo, _CMP_LT_OQ), hi, lo);
  __mmask8 bad =
      static_cast<__mmask8>(_mm256_cmp_ps_mask(hi, _mm256_set1_ps(65504.0f), _CMP_GT_OQ) |
                            _mm256_cmp_ps_mask(lo, _mm256_set1_ps(-65504.0f), _CMP_LT_OQ));
  const __m128i bias_h = _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEG_INF);
  const __m256 bias = _mm256_cvtph_ps(bias_h);
  const __m256 range = _mm256_sub_ps(hi, bias);
  const __mmask8 live = _mm256_cmp_ps_mask(range, _mm256_setzero_ps(), _CMP_GT_OQ);
  const __m128i scale_h = _mm256_cvtps_ph(_mm256_div_ps(range, qmax), _MM_FROUND_TO_POS_INF);
  const __m128i inf = _mm_set1_epi16(0x7c00);
  bad =
      static_cast<__mmask8>(bad | (live & _mm_cmpeq_epi16_mask(_mm_and_si128(scale_h, inf), inf)));
  const __m256 scale = _mm256_maskz_mov_ps(live, _mm256_cvtph_ps(scale_h));
  const __m256 inv = _mm256_maskz_div_ps(live, _mm256_set1_ps(1.0f), scale);
  return {bias, inv, scale, bad};
}

PMSNAP_AVX512 inline __m256 Losses8(const float* const* x, std::uint32_t n, const ParamsVec& p,
                                    float qmax) {
  alignas(32) float b[8], iv[8], sc[8], loss[8];
  _mm256_store_ps(b, p.bias);
  _mm256_store_ps(iv, p.inv);
  _mm256_store_ps(sc, p.scale);
  for (int r = 0; r < kSearchRows; ++r) {
    Loss2Avx512(x[r], n, EncodeParams{b[2 * r], iv[2 * r], sc[2 * r]},
                EncodeParams{b[2 * r + 1], iv[2 * r + 1], sc[2 * r + 1]}, qmax, &loss[2 * r],
                &loss[2 * r + 1]);
  }
  return _mm256_load_ps(loss);
}

PMSNAP_AVX512 bool AdaptiveFp16Avx512(const float* const* rows, int count, std::uint32_t n,
                                      const SearchPlan& plan, const float* lo0, const float* hi0,
                                      SearchResult* out) {
  static_assert(kSearchRows == 4, "lane layout assumes 4 rows x 2 candidates");
  const float* x[kSearchRows];
  alignas(32) float l0[8], h0[8];
  for (int r = 0; r < kSearchRows; ++r) {
    const int src = r < count ? r : 0;  // padding rows repeat row 0, results unused
    x[r] = rows[src];
    l0[2 * r] = l0[2 * r + 1] = lo0[src];
    h0[2 * r] = h0[2 * r + 1] = hi0[src];
  }
  const __mmask8 real = static_cast<__mmask8>((1u << (2 * count)) - 1);
  const __m256 vlo0 = _mm256_load_ps(l0), vhi0 = _mm256_load_ps(h0);
  const __m256 qmax = _mm256_set1_ps(plan.qmax);
  ParamsVec p = Fp16ParamsVec(vlo0, vhi0, qmax);
  if (p.bad & real) return false;
  __m256 best_loss = Losses8(x, n, p, plan.qmax);
  __m256 best_bias = p.bias, best_inv = p.inv, best_scale = p.scale;
  const __m256 range = _mm256_sub_ps(vhi0, vlo0);
  const __mmask8 searching =
      static_cast<__mmask8>(real & _mm256_cmp_ps_mask(range, _mm256_setzero_ps(), _CMP_GT_OQ));
  if (searching != 0) {
    const __m256 step = _mm256_div_ps(range, _mm256_set1_ps(static_cast<float>(plan.num_bins)));
    __m256 best_lo = vlo0, best_hi = vhi0;
    constexpr __mmask8 kRaiseLanes = 0x55;
    auto walk = [&](__m256 cl, __m256 ch, __m256 wstep, __m256 thr, std::uint32_t iter,
                    std::uint32_t end) PMSNAP_AVX512 {
      for (; iter < end; ++iter) {
        const __mmask8 active = static_cast<__mmask8>(
            searching & _mm256_cmp_ps_mask(_mm256_add_ps(cl, thr), ch, _CMP_LT_OQ));
        if (active == 0) break;
        const __m256 raised = _mm256_add_ps(cl, wstep), lowered = _mm256_sub_ps(ch, wstep);
        const ParamsVec c = Fp16ParamsVec(_mm256_mask_blend_ps(kRaiseLanes, cl, raised),
                                          _mm256_mask_blend_ps(kRaiseLanes, lowered, ch), qmax);
        if (c.bad & active) return false;
        const __m256 loss = Losses8(x, n, c, plan.qmax);
        const __m256 la = _mm256_moveldup_ps(loss), lb = _mm256_movehdup_ps(loss);
        const __mmask8 raise = _mm256_cmp_ps_mask(la, lb, _CMP_LT_OQ);
        const __m256 cur_loss = _mm256_mask_blend_ps(raise, lb, la);
        cl = _mm256_mask_blend_ps(static_cast<__mmask8>(active & raise), cl, raised);
        ch = _mm256_mask_blend_ps(static_cast<__mmask8>(active & ~raise), ch, lowered);
        const __mmask8 better =
            static_cast<__mmask8>(active & _mm256_cmp_ps_mask(cur_loss, best_loss, _CMP_LT_OQ));
        auto pick = [&](__m256 v) PMSNAP_AVX512 {
          return _mm256_mask_blend_ps(raise, _mm256_movehdup_ps(v), _mm256_moveldup_ps(v));
        };
        best_loss = _mm256_mask_blend_ps(better, best_loss, cur_loss);
        best_bias = _mm256_mask_blend_ps(better, best_bias, pick(c.bias));
        best_inv = _mm256_mask_blend_ps(better, best_inv, pick(c.inv));
        best_scale = _mm256_mask_blend_ps(better, best_scale, pick(c.scale));
        best_lo = _mm256_mask_blend_ps(better, best_lo, cl);
        best_hi = _mm256_mask_blend_ps(better, best_hi, ch);
      }
      return true;
    };
    const __m256 thr = _mm256_mul_ps(_mm256_set1_ps(static_cast<float>(plan.min_bins)), step);
    if (!walk(vlo0, vhi0, step, thr, plan.min_bins, plan.num_bins)) return false;
    __m256 refine_lo = _mm256_sub_ps(best_lo, step);
    refine_lo =
        _mm256_mask_blend_ps(_mm256_cmp_ps_mask(refine_lo, vlo0, _CMP_LT_OQ), refine_lo, vlo0);
    __m256 refine_hi = _mm256_add_ps(best_hi, step);
    refine_hi =
        _mm256_mask_blend_ps(_mm256_cmp_ps_mask(refine_hi, vhi0, _CMP_GT_OQ), refine_hi, vhi0);
    if (!walk(refine_lo, refine_hi, _mm256_mul_ps(step, _mm256_set1_ps(0.25f)), _mm256_setzero_ps(),
              0, plan.refine_iterations)) {
      return false;
    }
  }
  alignas(32) float b[8], iv[8], sc[8];
  _mm256_store_ps(b, best_bias);
  _mm256_store_ps(iv, best_inv);
  _mm256_store_ps(sc, best_scale);
  for (int r = 0; r < count; ++r) {
    out[r].enc = EncodeParams{b[2 * r], iv[2 * r], sc[2 * r]};
    out[r].bias_h = FloatToHalfRne(b[2 * r]);  // exact: these are half values
    out[r].scale_h = FloatToHalfRne(sc[2 * r]);
  }
  return true;
}

// Asymmetric 8-bit, fp32 parameters: MinMaxAvx512, MakeUniformParams' fp32
// branch and EncodeAvx512 inlined per row, no indirect calls, so the
// out-of-order core overlaps one row's reductions and divisions with the
// neighbours' loads and stores.
PMSNAP_AVX512 std::uint64_t Asym8Fp32RowsAvx512(const float* x, std::uint64_t stride,
                                                std::uint64_t count, std::uint32_t n,
                                                std::uint8_t* out) {
  for (std::uint64_t r = 0; r < count; ++r, x += stride, out += n + 8) {
    float lo, hi;
    if (!MinMaxAvx512(x, n, &lo, &hi)) return r;
    const float range = hi - lo;
    if (!std::isfinite(range)) return r;
    float scale = range / 255.0f;
    float inv = scale == 0.0f ? 0.0f : 1.0f / scale;
    if (range <= 0.0f || scale == 0.0f || !std::isfinite(inv)) {
      scale = 0.0f;
      inv = 0.0f;
    }
    EncodeAvx512(x, n, EncodeParams{lo, inv, scale}, 255.0f, out);
    std::memcpy(out + n, &scale, 4);
    std::memcpy(out + n + 4, &lo, 4);
  }
  return count;
}

constexpr Kernels kAvx2 = {Isa::kAvx2, MinMaxAvx2, EncodeAvx2, Loss2Avx2, nullptr, nullptr};
constexpr Kernels kAvx512 = {Isa::kAvx512, MinMaxAvx512,       EncodeAvx512,
                             Loss2Avx512,  AdaptiveFp16Avx512, Asym8Fp32RowsAvx512};

}  // namespace

const Kernels* Avx2Kernels() { return &kAvx2; }
const Kernels* Avx512Kernels() { return &kAvx512; }

}  // namespace pmsnap::quant::detail

#else  // not x86-64: portable kernels only

namespace pmsnap::quant::detail {
const Kernels* Avx2Kernels() { return nullptr; }
const Kernels* Avx512Kernels() { return nullptr; }
}  // namespace pmsnap::quant::detail

#endif
