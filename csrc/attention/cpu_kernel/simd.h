// Vector types and helpers of the 16-lane code (GCC vector extensions; 8-lane intrinsics where an
// AVX2 build would spill), exp, soft-cap, the 16-way reduction of dot products.
// Part of the CPU attention kernel (see attention/attention_cpu_kernel.h), compiled once per instruction set.
#pragma once

#ifndef KVC_ISA
#error "define KVC_ISA (the namespace of this instruction-set build) before including this header"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "attention/attention_args.h"
#include "attention/attention_cpu_gemm.h"
#include "core/dtype.h"
#include "core/kv_format.h"
#include "core/softmax_state.h"
#include "cache/quant_rows.h"

namespace kvcache::cpu::KVC_ISA {

using vf = float __attribute__((vector_size(64)));
using vu = uint32_t __attribute__((vector_size(64)));
using vi = int32_t __attribute__((vector_size(64)));
using vh = _Float16 __attribute__((vector_size(32)));
constexpr int kLanes = 16;
constexpr int kTile = 16;  // keys per tile: one vector of scores per row
constexpr int kRows = 4;   // query rows processed together
// How far ahead the P.V loop prefetches (pages are scattered, so the hardware prefetcher cannot help):
// kPrefetchBytes of K and V rows of the task's heads, at least one tile and at most kPrefetchTiles.
// On Zen 1, one head per task, bf16 from DRAM: 1 tile ahead (8 KiB) 126 ns per (key, KV head), 2 tiles
// 112, 4 tiles 109 (in cache: 95). Every line is prefetched: every other line, relying on adjacent-line
// fetches, was 126. NOTE: in bytes, not tiles: with 8 heads per task (decode_heads_per_page) 4 bf16 tiles
// are 256 KiB ahead, and 1 tile (64 KiB) took bf16 decode from DRAM to 0.91-0.96x of that (Xeon with
// AVX-512 BF16, 8 x 32k); int8 (2 tiles) moved within noise (0.97-1.06x), int4 keeps its 4 tiles.
constexpr int64_t kPrefetchTiles = 4;
constexpr int64_t kPrefetchBytes = 64 << 10;

inline vf loadv(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{} + x; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }

#if defined(__AVX2__) && !defined(__AVX512F__)
// NOTE: AVX2 builds spell the 16-lane helpers in 8-lane intrinsics: GCC lowers the generic versions'
// 16-lane shuffles, compares and conversions to ~300 instructions per exp (measured with callgrind).
inline __m256 lo8(vf v) { __m256 x; std::memcpy(&x, &v, 32); return x; }
inline __m256 hi8(vf v) { __m256 x; std::memcpy(&x, reinterpret_cast<const char*>(&v) + 32, 32); return x; }
inline vf join8(__m256 lo, __m256 hi) {
  vf v;
  std::memcpy(&v, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
  return v;
}
inline float hmax8(__m256 m) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
inline float hsum8(__m256 m) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
inline float hmax(vf v) { return hmax8(_mm256_max_ps(lo8(v), hi8(v))); }
inline float hsum(vf v) { return hsum8(_mm256_add_ps(lo8(v), hi8(v))); }
/// The same polynomial and rounding as the generic vexp below, 8 lanes at a time.
// NOTE: always_inline: left to GCC it stayed an out-of-line call in the AVX2 softmax (every ymm register
// is caller-saved, so the live tile values went to the stack around each call).
__attribute__((always_inline)) inline __m256 vexp8(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3365447505531f), _CMP_LT_OQ);
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365447505531f));
  const __m256 half = _mm256_or_ps(_mm256_set1_ps(0.5f), _mm256_and_ps(x, _mm256_set1_ps(-0.f)));  // x >= 0 ? 0.5 : -0.5
  const __m256i ni = _mm256_cvttps_epi32(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), half));
  const __m256 n = _mm256_cvtepi32_ps(ni);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23));
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, e));
}
inline vf vexp(vf x) { return join8(vexp8(lo8(x)), vexp8(hi8(x))); }
#else
// Horizontal reductions as shuffle trees (a scalar loop would be a 16-long dependency chain).
template <bool kMax>
inline float fold(vf v) {
  auto op = [](vf x, vf y) { return kMax ? vmax(x, y) : x + y; };
  v = op(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}
inline float hsum(vf v) { return fold<false>(v); }
inline float hmax(vf v) { return fold<true>(v); }

/// exp(x) for a vector, ~2 ulp on [-87, 88]; exactly 0 below -87.3 (masked scores are -inf).
inline vf vexp(vf x) {
  const vf hi = splat(88.3762626647949f), lo = splat(-87.3365447505531f);
  const vi underflow = x < lo;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  // x = n ln2 + r, |r| <= ln2/2
  const vf n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f + (x >= 0.f ? splat(0.5f) : splat(-0.5f)), vi), vf);
  vf r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scaled = p * (vf)e;
  return underflow ? splat(0.f) : scaled;
}

#endif

/// Whether some lane of v is above m (NaN lanes are not): the online softmax's test for a new maximum,
/// a compare and a mask test where the tile's horizontal max would be a chain of four shuffles.
inline bool any_above(vf v, float m) {
#if defined(__AVX512F__)
  __m512 x;
  std::memcpy(&x, &v, sizeof x);
  return _mm512_cmp_ps_mask(x, _mm512_set1_ps(m), _CMP_GT_OQ) != 0;
#elif defined(__AVX2__)
  const __m256 mv = _mm256_set1_ps(m);
  return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(lo8(v), mv, _CMP_GT_OQ), _mm256_cmp_ps(hi8(v), mv, _CMP_GT_OQ))) != 0;
#else
  for (int i = 0; i < kLanes; ++i) {
    if (v[i] > m) return true;
  }
  return false;
#endif
}

/// tanh(y) by its odd Taylor series to y^13, within 1 ulp for |y| < kTanhSeriesBound, where
/// 1 - 2 / (exp(2y) + 1) cancels (relative error ~2^-24 / |y|: 30 ulp for a score of 1 under a cap of 30,
/// over the attention rule in fp32, as a fuzzer found). V: vf or __m256 (both GCC vector types).
constexpr float kTanhSeriesBound = 0.4f;
template <class V>
inline V tanh_series(V y) {
  const V y2 = y * y;
  V p = y2 * (21844.f / 6081075.f) + (-1382.f / 155925.f);
  p = p * y2 + (62.f / 2835.f);
  p = p * y2 + (-17.f / 315.f);
  p = p * y2 + (2.f / 15.f);
  p = p * y2 + (-1.f / 3.f);
  return y + y * y2 * p;
}

/// cap * tanh(s / cap): the series near 0, else tanh(y) = 1 - 2 / (exp(2y) + 1); -inf stays -inf.
inline vf vsoftcap(vf s, float cap) {
  const vf y = s * (2.f / cap);
  const vf t = 1.f - 2.f / (vexp(y > 80.f ? splat(80.f) : y) + 1.f);
  const vf h = s * (1.f / cap);
  const vf r = (h < kTanhSeriesBound && h > -kTanhSeriesBound) ? tanh_series(h) : t;
  return s == -INFINITY ? s : r * cap;
}

/// Sums of 16 vectors: lane k of the result is the sum of all lanes of acc[k]. 30 shuffles, 15 adds.
/// V: vf, or vi for integer sums (exact, so converted once after). NOTE: every loop unrolled, so the
/// arrays are registers (GCC left them on the stack otherwise).
template <class V>
__attribute__((always_inline)) inline V reduce16(const V acc[16]) {
  V u[8], w[4], z[2];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    const V a = acc[2 * k], b = acc[2 * k + 1];
    u[k] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const V a = u[2 * k], b = u[2 * k + 1];
    w[k] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
#pragma GCC unroll 2
  for (int k = 0; k < 2; ++k) {
    const V a = w[2 * k], b = w[2 * k + 1];
    z[k] = __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/// Score vectors of a register block of R rows (1, 2 or 4) from its R reduce16 results: lane k of part[g]
/// holds (row k / (16 / R), key g * 16 / R + k % (16 / R)); rows[r] gets the 16 keys of row r.
template <int R>
inline void parts_to_rows(const vf part[R], vf rows[R]) {
  if constexpr (R == 1) {
    rows[0] = part[0];
  } else if constexpr (R == 2) {
    rows[0] = __builtin_shufflevector(part[0], part[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    rows[1] = __builtin_shufflevector(part[0], part[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  } else {
    static_assert(R == 4, "register blocks of 1, 2 or 4 rows");
    const vf* quad = part;
    const vf t01l = __builtin_shufflevector(quad[0], quad[1], 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const vf t01h = __builtin_shufflevector(quad[0], quad[1], 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const vf t23l = __builtin_shufflevector(quad[2], quad[3], 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const vf t23h = __builtin_shufflevector(quad[2], quad[3], 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    rows[0] = __builtin_shufflevector(t01l, t23l, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    rows[1] = __builtin_shufflevector(t01l, t23l, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    rows[2] = __builtin_shufflevector(t01h, t23h, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    rows[3] = __builtin_shufflevector(t01h, t23h, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
}

}  // namespace kvcache::cpu::KVC_ISA
