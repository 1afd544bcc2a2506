// AVX2 and AVX-512 kernel sets, selected at run time (cpu.cc).
//
// Every function carries a target attribute instead of the file being built
// with -mavx*: out-of-line copies of inline library functions then stay
// baseline x86-64, so nothing here can leak AVX code into callers on a CPU
// without it. Results equal the portable set bit for bit (detail/kernels.h):
// same IEEE operations per element, round-to-nearest-even conversions, and the
// loss summed in 16 fixed lanes.
// Thread-safety: pure functions.
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
    const __m256i q1 = _mm256_cvtps_epi32(EncodeVec256(_mm256_loadu_ps(x + i + 8), bias, inv, vqmax));
    const __m256i q2 = _mm256_cvtps_epi32(EncodeVec256(_mm256_loadu_ps(x + i + 16), bias, inv, vqmax));
    const __m256i q3 = _mm256_cvtps_epi32(EncodeVec256(_mm256_loadu_ps(x + i + 24), bias, inv, vqmax));
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
    d = _mm256_sub_ps(v0, _mm256_add_ps(_mm256_mul_ps(EncodeVec256(v0, bias_a, inv_a, vqmax), scale_a), bias_a));
    acc_a_lo = _mm256_add_ps(acc_a_lo, _mm256_mul_ps(d, d));
    d = _mm256_sub_ps(v1, _mm256_add_ps(_mm256_mul_ps(EncodeVec256(v1, bias_a, inv_a, vqmax), scale_a), bias_a));
    acc_a_hi = _mm256_add_ps(acc_a_hi, _mm256_mul_ps(d, d));
    d = _mm256_sub_ps(v0, _mm256_add_ps(_mm256_mul_ps(EncodeVec256(v0, bias_b, inv_b, vqmax), scale_b), bias_b));
    acc_b_lo = _mm256_add_ps(acc_b_lo, _mm256_mul_ps(d, d));
    d = _mm256_sub_ps(v1, _mm256_add_ps(_mm256_mul_ps(EncodeVec256(v1, bias_b, inv_b, vqmax), scale_b), bias_b));
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
  for (; i < n; ++i) {
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

// ------------------------------------------------------------- AVX-512 ----

PMSNAP_AVX512 bool MinMaxAvx512(const float* x, std::uint32_t n, float* min_out,
                                float* max_out) {
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

constexpr Kernels kAvx2 = {Isa::kAvx2, MinMaxAvx2, EncodeAvx2, Loss2Avx2};
constexpr Kernels kAvx512 = {Isa::kAvx512, MinMaxAvx512, EncodeAvx512, Loss2Avx512};

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
