// The CPU paged-attention kernel: one AttentionTask at a time, online softmax, fp32 accumulation.
//
// Written once with GCC vector extensions (16-lane float vectors) and compiled three times, by
// attention_cpu_{avx512,avx2,generic}.cpp, each with its own instruction-set flags and namespace
// (KVC_ISA); attention_cpu.cpp picks the best one the machine supports at run time.
//
// How a task runs: its rows are (query token, head of the GQA group) pairs; they are processed four
// at a time against tiles of 16 keys. Each K/V tile is read from the pages once per task (and once
// per KV head: every query head of the group shares it), converted to fp32 in registers, never
// written anywhere. Scores use the dot-product form (q.k along head_dim, then a 16-way reduction
// tree), so K is consumed in its stored layout; P.V accumulates straight into the output rows.
//
// NOTE: bfloat16 rows are widened without shuffles: a 64-byte load of 32 bf16 values, shifted left
// 16 bits, gives the even dims as fp32; masked, the odd dims. Queries and outputs are kept in the same
// even/odd order ("storage order"), so dot products need no reordering; outputs are put back in
// natural order once, at the end of the task.
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
// Tiles ahead that the P.V loop prefetches (pages are scattered, so the hardware prefetcher cannot
// help). On Zen 1, decode from DRAM: 1 tile ahead 126 ns per (key, KV head), 2 tiles 112, 4 tiles 109
// (in cache: 95). Every line is prefetched: every other line, relying on adjacent-line fetches, was 126.
constexpr int64_t kPrefetchTiles = 4;

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
inline __m256 vexp8(__m256 x) {
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

/// cap * tanh(s / cap), via tanh(y) = 1 - 2 / (exp(2y) + 1); -inf stays -inf.
inline vf vsoftcap(vf s, float cap) {
  const vf y = s * (2.f / cap);
  const vf t = 1.f - 2.f / (vexp(y > 80.f ? splat(80.f) : y) + 1.f);
  return s == -INFINITY ? s : t * cap;
}

/// Sums of 16 vectors: lane k of the result is the sum of all lanes of acc[k]. 30 shuffles, 15 adds.
/// NOTE: every loop unrolled, so the arrays are registers (GCC left them on the stack otherwise).
inline vf reduce16(const vf acc[16]) {
  vf u[8], w[4], z[2];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    const vf a = acc[2 * k], b = acc[2 * k + 1];
    u[k] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const vf a = u[2 * k], b = u[2 * k + 1];
    w[k] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
#pragma GCC unroll 2
  for (int k = 0; k < 2; ++k) {
    const vf a = w[2 * k], b = w[2 * k + 1];
    z[k] = __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// ---- KV row readers: 32 values of a row -> two fp32 vectors (a, b), in the reader's storage order ----
struct ReadF32 {
  using Elem = float;
  static constexpr bool kEvenOdd = false;
  static void chunk(const Elem* row, const uint16_t* /*meta*/, int64_t c, vf& a, vf& b) {
    a = loadv(row + 32 * c);
    b = loadv(row + 32 * c + 16);
  }
};
struct ReadF16 {
  using Elem = uint16_t;
  static constexpr bool kEvenOdd = false;
  // NOTE: the conversion goes through the F16C/AVX-512 intrinsics: without AVX512-FP16, GCC converts
  // a vector of _Float16 one element at a time (measured 4x slower decode).
  static vf widen16(const Elem* p) {
#if defined(__AVX512F__)
    // (maskz form: GCC 12 warns about the undefined pass-through operand of the unmasked one)
    return (vf)_mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
    vf v;
    std::memcpy(&v, &lo, 32);
    std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
    return v;
#else
    vh x;
    std::memcpy(&x, p, sizeof x);
    return __builtin_convertvector(x, vf);
#endif
  }
  static void chunk(const Elem* row, const uint16_t* /*meta*/, int64_t c, vf& a, vf& b) {
    a = widen16(row + 32 * c);
    b = widen16(row + 32 * c + 16);
  }
};
struct ReadBF16 {
  using Elem = uint16_t;
  static constexpr bool kEvenOdd = true;  // a = even dims, b = odd dims of the 32
  static void chunk(const Elem* row, const uint16_t* /*meta*/, int64_t c, vf& a, vf& b) {
    vu x;
    std::memcpy(&x, row + 32 * c, sizeof x);
    a = (vf)(x << 16);
    b = (vf)(x & 0xffff0000u);
  }
};

struct ReadI8 {
  using Elem = int8_t;
  static constexpr bool kEvenOdd = false;
  // Codes only: the per-token scale multiplies the scores (K) or the probabilities (V), not each value.
  // NOTE: intrinsics, as for fp16: GCC scalarizes a vector conversion of int8 (measured 2x slower).
  static vf widen16(const Elem* p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(x, 8)));
    vf v;
    std::memcpy(&v, &lo, 32);
    std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
    return v;
#else
    vf v;
    for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
    return v;
#endif
  }
  static void chunk(const Elem* row, const uint16_t* /*meta*/, int64_t c, vf& a, vf& b) {
    a = widen16(row + 32 * c);
    b = widen16(row + 32 * c + 16);
  }
};

/// fp8 codes widened through fp16: e5m2 is the top byte of an fp16; e4m3fn, shifted into an fp16's
/// bit positions, reads as its value times 2^-8 (normals and subnormals alike; the factor 256 is
/// folded into the scale by the caller). No lookup table, no branches.
template <bool kE4M3>
struct ReadFp8 {
  using Elem = uint8_t;
  static constexpr bool kEvenOdd = false;
  static constexpr float kFactor = kE4M3 ? 256.f : 1.f;
  static vf widen16(const Elem* p) {
#if defined(__AVX2__)
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    // e4m3: byte s.eeee.mmm to the top of the lane, an arithmetic shift by one copies s into bit 14,
    // which the mask clears: s.0eeee.mmm0000000 (3 operations, where masking each field took 5)
    const __m256i h = kE4M3 ? _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(w, 8), 1), _mm256_set1_epi16(int16_t(0xbfff)))
                            : _mm256_slli_epi16(w, 8);
    alignas(32) uint16_t bits[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(bits), h);
#else
    uint16_t bits[16];
    for (int i = 0; i < 16; ++i) {
      const uint16_t w = p[i];
      bits[i] = kE4M3 ? static_cast<uint16_t>(((w & 0x7f) << 7) | ((w & 0x80) << 8)) : static_cast<uint16_t>(w << 8);
    }
#endif
    return ReadF16::widen16(bits);
  }
  static void chunk(const Elem* row, const uint16_t* /*meta*/, int64_t c, vf& a, vf& b) {
    a = widen16(row + 32 * c);
    b = widen16(row + 32 * c + 16);
  }
};

/// int4 (asymmetric, groups of 32 along head_dim): two codes per byte, the even dim in the low nibble;
/// `meta` points at the row's (scale, zero) fp16 pairs, one pair per group = per 32-dim chunk.
struct ReadI4 {
  using Elem = uint8_t;
  static constexpr bool kEvenOdd = true;  // a = even dims (low nibbles), b = odd dims (high nibbles)
  static constexpr int kDimsPerElem = 2;
  static void chunk(const Elem* row, const uint16_t* meta, int64_t c, vf& a, vf& b) {
    vi l, h;
#if defined(__AVX512F__)
    // intrinsics: GCC scalarizes vector conversions from 8-bit lanes
    const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c)));
    l = (vi)_mm512_and_si512(w, _mm512_set1_epi32(15));
    h = (vi)_mm512_srli_epi32(w, 4);
#else
    for (int i = 0; i < 16; ++i) {
      const uint8_t byte = row[16 * c + i];
      l[i] = byte & 15;
      h[i] = byte >> 4;
    }
#endif
    const float scale = fp16_to_float(meta[2 * c]), zero = fp16_to_float(meta[2 * c + 1]);
    a = __builtin_convertvector(l, vf) * scale + zero;
    b = __builtin_convertvector(h, vf) * scale + zero;
  }
};

/// KIVI rows (4 or 2 bits, planar codes: dims 0-15 and 16-31 of a chunk unpack in natural order).
/// Keys (kKey): `meta` is the page's per-channel metadata, per chunk 32 fp16 scales then 32 zeros;
/// values: `meta` is the row's (scale, zero) fp16 pair per chunk, as int4. AVX2 builds read these rows
/// through Row8 below; this serves the generic and AVX-512 builds.
template <int kBits, bool kKey>
struct ReadKivi {
  using Elem = uint8_t;
  static constexpr bool kEvenOdd = false;
  static constexpr bool kBf16Exact = false;  // dequantized values are not bf16 numbers
  static constexpr int kDimsPerElem = 8 / kBits;
  static void chunk(const Elem* row, const uint16_t* meta, int64_t c, vf& a, vf& b) {
    constexpr int kBytes = 4 * kBits, kMask = (1 << kBits) - 1;
    const uint8_t* p = row + kBytes * c;
    vi lo, hi;
#if defined(__AVX512F__)
    // NOTE: intrinsics (the plain loop below ran lane by lane: kivi2 decode ~9x slower than bf16).
    // Lane j of `w` is byte j % kBytes; its bit field (j / kBytes) is shifted down per lane.
    __m128i bytes;
    if constexpr (kBits == 4) {
      bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    } else {
      const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
      bytes = _mm_unpacklo_epi64(x, x);
    }
    const __m512i w = _mm512_cvtepu8_epi32(bytes), mask = _mm512_set1_epi32(kMask);
    if constexpr (kBits == 4) {
      lo = (vi)_mm512_and_si512(w, mask);
      hi = (vi)_mm512_srli_epi32(w, 4);
    } else {
      const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
      lo = (vi)_mm512_and_si512(_mm512_srlv_epi32(w, shift), mask);
      hi = (vi)_mm512_and_si512(_mm512_srlv_epi32(w, _mm512_add_epi32(shift, _mm512_set1_epi32(4))), mask);
    }
#else
    for (int j = 0; j < 16; ++j) {
      lo[j] = (p[j % kBytes] >> (kBits * (j / kBytes))) & kMask;
      hi[j] = (p[(j + 16) % kBytes] >> (kBits * ((j + 16) / kBytes))) & kMask;
    }
#endif
    if constexpr (kKey) {
      const uint16_t* m = meta + 64 * c;
      a = __builtin_convertvector(lo, vf) * ReadF16::widen16(m) + ReadF16::widen16(m + 32);
      b = __builtin_convertvector(hi, vf) * ReadF16::widen16(m + 16) + ReadF16::widen16(m + 48);
    } else {
      const float scale = fp16_to_float(meta[2 * c]), zero = fp16_to_float(meta[2 * c + 1]);
      a = __builtin_convertvector(lo, vf) * scale + zero;
      b = __builtin_convertvector(hi, vf) * scale + zero;
    }
  }
};

template <class Read>
constexpr bool bf16_exact() {
  if constexpr (requires { Read::kBf16Exact; }) {
    return Read::kBf16Exact;
  } else {
    return true;
  }
}

/// Dims per stored element (2 for packed int4), and a row's first element from a dim offset.
template <class Read>
constexpr int64_t dims_per_elem() {
  if constexpr (requires { Read::kDimsPerElem; }) {
    return Read::kDimsPerElem;
  } else {
    return 1;
  }
}

/// Position of dim d in storage order.
template <class Read>
inline int64_t storage_index(int64_t d) {
  if constexpr (Read::kEvenOdd) {
    const int64_t c = d / 32, j = d % 32;
    return 32 * c + (j & 1) * 16 + j / 2;
  } else {
    return d;
  }
}

/// Query row `base` of a.query as fp32 in natural order, times a.scale; with Hadamard-rotated keys,
/// rotated like them (quant::rotate, then 1 / (c^2 D)) so that its dot products with the codes are q.k.
inline void load_query_f32(const AttentionArgs& a, int64_t base, float* q) {
  const int64_t D = a.layout.head_dim;
  for (int64_t d = 0; d < D; ++d) q[d] = load_as_float(a.query, base + d * a.q_strides[2], a.q_dtype);
  if (a.k_rot) {
    quant::rotate(q, D);
    const float s = quant::rot_query_scale(D);
    for (int64_t d = 0; d < D; ++d) q[d] *= s;
  }
  for (int64_t d = 0; d < D; ++d) q[d] *= a.scale;
}

/// The query row as load_query_f32 makes it, stored at q_row[index(d)] (a score policy's K order).
inline void load_query_scattered(const AttentionArgs& a, int64_t base, float* q_row, int64_t (*index)(int64_t)) {
  const int64_t D = a.layout.head_dim;
  if (a.k_rot) {  // Hadamard-rotated keys: rotated (and scaled) like them
    float q[kMaxRotatedDim];
    load_query_f32(a, base, q);
    for (int64_t d = 0; d < D; ++d) q_row[index(d)] = q[d];
    return;
  }
  for (int64_t d = 0; d < D; ++d) {
    q_row[index(d)] = a.scale * load_as_float(a.query, base + d * a.q_strides[2], a.q_dtype);
  }
}

/// Per-row bookkeeping of a task.
struct RowState {
  int64_t pos;   // position of the query (-1: padding row, sees nothing)
  int64_t lo;    // first key of the window
  float m, l;    // running max and sum of the online softmax
};

/// Prefetches the next tile's K and V rows a few lines at a time, from inside the P.V loop: spread
/// out, the prefetches overlap with the arithmetic; issued as one burst per tile they stall it (measured
/// ~10% slower on a Zen 4 core). Lines go to L2 (locality 2); closer hints evict the current tile.
struct Prefetcher {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t lines = 0;  // left to prefetch in each of k and v
  void step(int count) {
    for (int i = 0; i < count && lines > 0; ++i, --lines, k += 64, v += 64) {
      __builtin_prefetch(k, 0, 2);
      __builtin_prefetch(v, 0, 2);
    }
  }
};

/// A cache-line-aligned allocator. NOTE: BLAS may pick its code path by the alignment of its
/// operands, so the buffers the GEMM path hands it are always 64-byte aligned: the same call gives
/// the same bits whatever addresses the heap returns.
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <class U>
  bool operator==(const Aligned64<U>&) const { return true; }
};
using FloatBuffer = std::vector<float, Aligned64<float>>;

/// Scratch memory of one thread, reused across its tasks.
struct Scratch {
  FloatBuffer q, o;
  std::vector<RowState> rows;
};

/// Rows of a task: `per_head` real rows (query tokens x group) for each of `heads` KV heads, each
/// head's block padded to a multiple of kRows in the scratch buffers.
struct TaskRows {
  int64_t heads, per_head, padded;
  TaskRows(const AttentionTask& t, int64_t group, int64_t align)
      : heads(t.head_end - t.head_begin), per_head(int64_t(t.tok_end - t.tok_begin) * group),
        padded((per_head + align - 1) / align * align) {}
};

/// Normalizes the rows of a finished task and writes them: the final output, or its partial state.
template <class Index>
void finish_task(const AttentionArgs& a, const AttentionTask& t, const PartialStates& partial, const Scratch& s,
                 const TaskRows& tr, int64_t q_start, Index storage) {
  const int64_t D = a.layout.head_dim, G = a.group;
  thread_local std::vector<float> obuf;
  obuf.resize(D);
  float* o = obuf.data();
  for (int64_t hb = 0; hb < tr.heads; ++hb) {
    for (int64_t local = 0; local < tr.per_head; ++local) {
      const int64_t r = hb * tr.padded + local;
      const RowState& st = s.rows[r];
      const float inv = st.l > 0.f ? 1.f / st.l : 0.f;
      const float lse = st.l > 0.f ? st.m + std::log(st.l) : -INFINITY;
      const float* so = &s.o[r * D];
      for (int64_t d = 0; d < D; ++d) o[d] = so[storage(d)] * inv;
      // Rotated V: the state is linear in V, so unrotating here (partial states too) is exact.
      if (a.v_rot) quant::unrotate(o, D);
      if (t.partial < 0) {
        const int64_t i = t.tok_begin + local / G, hq = (t.head_begin + hb) * G + local % G;
        const int64_t row = (q_start + i) * a.q_heads + hq;
        for (int64_t d = 0; d < D; ++d) store_from_float(a.out, row * D + d, a.q_dtype, o[d]);
        if (a.lse) a.lse[row] = lse;
      } else {
        const int64_t slot_row = t.partial * partial.rows_per_slot + hb * tr.per_head + local;
        float* po = partial.o + slot_row * D;
        for (int64_t d = 0; d < D; ++d) po[d] = o[d];
        partial.lse[slot_row] = lse;
      }
    }
  }
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

// ---- score policies: q.k for 4 rows x 16 keys ----------------------------------------------------
/// fp32 FMAs on K widened by `Read`; queries pre-scaled, in Read's storage order. R rows (1, 2, 4) x
/// 16 / R keys per pass: 16 accumulators, one reduce16. NOTE: the r and j loops are unrolled so the
/// accumulators stay in registers (left to itself GCC kept them on the stack: a store and a reload
/// per FMA, measured ~3x slower).
template <class Read, int R = 4>
struct ScoreFma {
  static constexpr int kRows = R;
  static constexpr int kKeys = kTile / R;
  static void load_query(const AttentionArgs& a, int64_t base, float* q_row) {
    load_query_scattered(a, base, q_row, storage_index<Read>);
  }
  static void scores(const float* q, int64_t D, const typename Read::Elem* const* krow,
                     const uint16_t* const* kmeta, float /*scale*/, vf rows[R]) {
    vf part[R];
#pragma GCC unroll 4
    for (int g = 0; g < R; ++g) {
      vf acc[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) acc[i] = vf{};
      for (int64_t c = 0; c < D / 32; ++c) {
#pragma GCC unroll 16
        for (int j = 0; j < kKeys; ++j) {
          vf ka, kb;
          Read::chunk(krow[g * kKeys + j], kmeta[g * kKeys + j], c, ka, kb);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            acc[r * kKeys + j] += loadv(q + r * D + 32 * c) * ka + loadv(q + r * D + 32 * c + 16) * kb;
          }
        }
      }
      part[g] = reduce16(acc);
    }
    parts_to_rows<R>(part, rows);
  }
};

#ifdef __AVX512BF16__
/// 32 values of a row as bf16, in natural order: bf16 pools load as they are; int8 and fp8 codes widen
/// to fp32 and pack to bf16, which is exact (int8 codes and fp8 values have at most 8 significant bits).
template <class Read>
struct Bf16Chunks {
  using Elem = typename Read::Elem;
  static __m512i load(const Elem* row, int64_t c) {
    if constexpr (std::is_same_v<Read, ReadBF16>) {
      return _mm512_loadu_si512(row + 32 * c);
    } else {
      static_assert(!Read::kEvenOdd, "packing assumes natural order");
      vf a, b;
      Read::chunk(row, nullptr, c, a, b);
      return (__m512i)_mm512_cvtne2ps_pbh((__m512)b, (__m512)a);  // a -> dims 0..15, b -> 16..31
    }
  }
};

/// bfloat16 queries and keys: vdpbf16ps multiplies bf16 pairs exactly and accumulates in fp32, so K
/// needs no widening at all. The query stays unscaled (its bf16 values exact); scores are scaled after.
/// R rows (1, 2, 4) x 16 / R keys per pass, every loop over them unrolled (registers, as ScoreFma).
template <class KRead = ReadBF16, int R = 4>
struct ScoreDp {
  static constexpr int kRows = R;
  static constexpr int kKeys = kTile / R;
  static void load_query(const AttentionArgs& a, int64_t base, float* q_row) {
    uint16_t* qb = reinterpret_cast<uint16_t*>(q_row);  // bf16 bits, natural order, in the fp32 buffer
    for (int64_t d = 0; d < a.layout.head_dim; ++d) qb[d] = static_cast<const uint16_t*>(a.query)[base + d * a.q_strides[2]];
  }
  static void scores(const float* q, int64_t D, const typename KRead::Elem* const* krow,
                     const uint16_t* const* /*kmeta*/, float scale, vf rows[R]) {
    const uint16_t* qb = reinterpret_cast<const uint16_t*>(q);  // rows D fp32 = 2 D bf16 apart
    vf part[R];
#pragma GCC unroll 4
    for (int g = 0; g < R; ++g) {
      __m512 acc[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t c = 0; c < D / 32; ++c) {
        __m512bh qv[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) qv[r] = (__m512bh)_mm512_loadu_si512(qb + r * 2 * D + 32 * c);
#pragma GCC unroll 16
        for (int j = 0; j < kKeys; ++j) {
          const __m512bh k = (__m512bh)Bf16Chunks<KRead>::load(krow[g * kKeys + j], c);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) acc[r * kKeys + j] = _mm512_dpbf16_ps(acc[r * kKeys + j], qv[r], k);
        }
      }
      vf accv[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) accv[i] = (vf)acc[i];
      part[g] = reduce16(accv) * scale;
    }
    parts_to_rows<R>(part, rows);
  }
};
#endif

// ---- P.V policies: o[4 rows] += p[4 rows][n keys] . V[n keys] --------------------------------------
/// fp32 FMAs on V widened by `Read`; outputs in Read's storage order. Two accumulator sets keep the
/// FMA dependency chains short; the loops over rows and keys are unrolled (registers, as ScoreFma).
/// A tile is always kTile keys (masked ones have p = 0 and read a visible key's row).
template <class Read, int R = 4>
struct PvFma {
  static constexpr int kRows = R;
  static int64_t storage(int64_t d) { return storage_index<Read>(d); }
  static void accumulate(float* o, int64_t D, const float (*p)[kTile], const typename Read::Elem* const* vrow,
                         const uint16_t* const* vmeta, int64_t /*n = kTile*/, Prefetcher& pf) {
    for (int64_t c = 0; c < D / 32; ++c) {
      vf oa[R], ob[R], oa2[R], ob2[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        oa[r] = loadv(o + r * D + 32 * c);
        ob[r] = loadv(o + r * D + 32 * c + 16);
        oa2[r] = ob2[r] = vf{};
      }
#pragma GCC unroll 8
      for (int j = 0; j < kTile; j += 2) {
        pf.step(2);
        vf va, vb, va2, vb2;
        Read::chunk(vrow[j], vmeta[j], c, va, vb);
        Read::chunk(vrow[j + 1], vmeta[j + 1], c, va2, vb2);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          oa[r] += p[r][j] * va;
          ob[r] += p[r][j] * vb;
          oa2[r] += p[r][j + 1] * va2;
          ob2[r] += p[r][j + 1] * vb2;
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        storev(o + r * D + 32 * c, oa[r] + oa2[r]);
        storev(o + r * D + 32 * c + 16, ob[r] + ob2[r]);
      }
    }
  }
};

#ifdef __AVX512BF16__
/// bfloat16 V: interleave two keys' rows into bf16 pairs and accumulate with vdpbf16ps, the
/// probabilities rounded to bf16 as PyTorch's bf16 attention does. Outputs come out in the order of
/// vpunpck{l,h}wd: in each 32-dim chunk, lane 4L + i of the first vector is dim 8L + i and of the
/// second dim 8L + 4 + i.
template <class VRead = ReadBF16, int R = 4>
struct PvDp {
  static constexpr int kRows = R;
  static int64_t storage(int64_t d) {
    const int64_t c = d / 32, j = d % 32, lane = j / 8, w = j % 8;
    return 32 * c + (w < 4 ? 4 * lane + w : 16 + 4 * lane + w - 4);
  }
  static void accumulate(float* o, int64_t D, const float (*p)[kTile], const typename VRead::Elem* const* vrow,
                         const uint16_t* const* /*vmeta*/, int64_t /*n = kTile*/, Prefetcher& pf) {
    alignas(64) uint32_t pairs[R][kTile / 2];  // (p_2i, p_2i+1) as bf16 pairs
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256bh pb = _mm512_cvtneps_pbh(_mm512_loadu_ps(p[r]));
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[r]), (__m256i)pb);
    }
    for (int64_t c = 0; c < D / 32; ++c) {
      __m512 oa[R], ob[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        oa[r] = _mm512_loadu_ps(o + r * D + 32 * c);
        ob[r] = _mm512_loadu_ps(o + r * D + 32 * c + 16);
      }
#pragma GCC unroll 8
      for (int jp = 0; jp < kTile / 2; ++jp) {
        pf.step(2);
        const __m512i v0 = Bf16Chunks<VRead>::load(vrow[2 * jp], c);
        const __m512i v1 = Bf16Chunks<VRead>::load(vrow[2 * jp + 1], c);
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(v0, v1);
        const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r][jp]));
          oa[r] = _mm512_dpbf16_ps(oa[r], lo, pp);
          ob[r] = _mm512_dpbf16_ps(ob[r], hi, pp);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        _mm512_storeu_ps(o + r * D + 32 * c, oa[r]);
        _mm512_storeu_ps(o + r * D + 32 * c + 16, ob[r]);
      }
    }
  }
};
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// ---- AVX2 (8-lane) policies ----------------------------------------------------------------------
// NOTE: AVX2 has 16 ymm registers; the 16-lane policies above keep 16-32 live 16-lane accumulators
// and spill on every FMA (measured ~16x slower than AVX-512). These work on 8-lane vectors with
// register tiles that fit: scores as 2 rows x 4 keys, P.V as 4 rows x 16 dims. Rows are read 16 dims
// at a time, as two 8-lane fp32 vectors in the reader's storage order.

/// 16 dims [16 g, 16 g + 16) of a stored row -> (a, b). Even/odd readers give even dims in a, odd in b.
template <class Read>
struct Row8;
template <>
struct Row8<ReadF32> {
  static constexpr bool kEvenOdd = false;
  static void load16(const float* row, const uint16_t*, int64_t g, __m256& a, __m256& b) {
    a = _mm256_loadu_ps(row + 16 * g);
    b = _mm256_loadu_ps(row + 16 * g + 8);
  }
};
template <>
struct Row8<ReadF16> {
  static constexpr bool kEvenOdd = false;
  static void load16(const uint16_t* row, const uint16_t*, int64_t g, __m256& a, __m256& b) {
    a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * g)));
    b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * g + 8)));
  }
};
template <>
struct Row8<ReadBF16> {
  static constexpr bool kEvenOdd = true;
  static void load16(const uint16_t* row, const uint16_t*, int64_t g, __m256& a, __m256& b) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * g));
    a = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    b = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(int(0xffff0000u))));
  }
};
template <>
struct Row8<ReadI8> {
  static constexpr bool kEvenOdd = false;
  static void load16(const int8_t* row, const uint16_t*, int64_t g, __m256& a, __m256& b) {
    a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 16 * g))));
    b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 16 * g + 8))));
  }
};
template <bool kE4M3>
struct Row8<ReadFp8<kE4M3>> {
  static constexpr bool kEvenOdd = false;
  static void load16(const uint8_t* row, const uint16_t*, int64_t g, __m256& a, __m256& b) {
    // fp16 bit patterns, as in ReadFp8 (the e4m3 factor 256 is in the head scale)
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * g)));
    // e4m3: byte s.eeee.mmm to the top of the lane, an arithmetic shift by one copies s into bit 14,
    // which the mask clears: s.0eeee.mmm0000000 (3 operations, where masking each field took 5)
    const __m256i h = kE4M3 ? _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(w, 8), 1), _mm256_set1_epi16(int16_t(0xbfff)))
                            : _mm256_slli_epi16(w, 8);
    a = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    b = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }
};
template <>
struct Row8<ReadI4> {
  static constexpr bool kEvenOdd = true;  // low nibbles = even dims
  static void load16(const uint8_t* row, const uint16_t* meta, int64_t g, __m256& a, __m256& b) {
    const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * g)));
    // (scale, zero) of the group: one fp16 pair, widened by F16C rather than two scalar conversions
    int32_t pair;
    std::memcpy(&pair, meta + g / 2 * 2, 4);
    const __m128 sz = _mm_cvtph_ps(_mm_cvtsi32_si128(pair));
    const __m256 scale = _mm256_broadcastss_ps(sz), zero = _mm256_broadcastss_ps(_mm_movehdup_ps(sz));
    a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(15))), scale, zero);
    b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4)), scale, zero);
  }
};

/// KIVI rows, natural order. Codes are planar per 32-dim chunk c: at 4 bits, byte j holds dim j (low
/// nibble) and dim j + 16 (high); at 2 bits, byte j (< 8) holds dims j, j + 8, j + 16, j + 24 in bit
/// pairs 0-1, 2-3, 4-5, 6-7. Keys dequantize with their page's per-channel (scale, zero), values
/// with their row's pair per chunk (as int4).
template <int kBits, bool kKey>
struct Row8<ReadKivi<kBits, kKey>> {
  static constexpr bool kEvenOdd = false;
  static void load16(const uint8_t* row, const uint16_t* meta, int64_t g, __m256& a, __m256& b) {
    const int64_t c = g / 2, half = g % 2;  // dims [16 g, 16 g + 16) = half `half` of chunk c
    const __m256i mask = _mm256_set1_epi32((1 << kBits) - 1);
    __m256i ca, cb;
    if constexpr (kBits == 4) {
      const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 16 * c)));
      const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 16 * c + 8)));
      const __m128i shift = _mm_cvtsi32_si128(int(4 * half));
      ca = _mm256_and_si256(_mm256_srl_epi32(lo, shift), mask);  // dims 16 half + 0..7
      cb = _mm256_and_si256(_mm256_srl_epi32(hi, shift), mask);  // dims 16 half + 8..15
    } else {
      const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * c)));
      ca = _mm256_and_si256(_mm256_srl_epi32(w, _mm_cvtsi32_si128(int(4 * half))), mask);
      cb = _mm256_and_si256(_mm256_srl_epi32(w, _mm_cvtsi32_si128(int(4 * half + 2))), mask);
    }
    if constexpr (kKey) {  // per chunk: 32 fp16 scales, then 32 zeros
      const uint16_t* m = meta + 64 * c + 16 * half;
      const __m256 sa = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m)));
      const __m256 sb = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + 8)));
      const __m256 za = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + 32)));
      const __m256 zb = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + 40)));
      a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ca), sa, za);
      b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(cb), sb, zb);
    } else {
      int32_t pair;
      std::memcpy(&pair, meta + 2 * c, 4);
      const __m128 sz = _mm_cvtph_ps(_mm_cvtsi32_si128(pair));
      const __m256 scale = _mm256_broadcastss_ps(sz), zero = _mm256_broadcastss_ps(_mm_movehdup_ps(sz));
      a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ca), scale, zero);
      b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(cb), scale, zero);
    }
  }
};

/// Position of dim d in an 8-lane reader's storage order (even/odd within each 16 dims).
template <class Read>
inline int64_t storage_index8(int64_t d) {
  if constexpr (Row8<Read>::kEvenOdd) {
    const int64_t g = d / 16, j = d % 16;
    return 16 * g + (j & 1) * 8 + j / 2;
  } else {
    return d;
  }
}

/// Lane i of the result is the sum of the lanes of v[i].
inline __m256 hsum8x8(const __m256 v[8]) {
  const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

/// q.k with fp32 FMAs: R (1-4) rows' queries stay in registers while two keys stream past them.
/// R < 4 serves GQA groups of 1-3 (a decode step of MHA, or of 3 query heads per KV head, would
/// otherwise spend 25-75% of its FMAs on padding rows).
template <class Read, int R = 4>
struct ScoreAvx2 {
  static constexpr int kRows = R;
  static void load_query(const AttentionArgs& a, int64_t base, float* q_row) {
    load_query_scattered(a, base, q_row, storage_index8<Read>);
  }
  static void scores(const float* q, int64_t D, const typename Read::Elem* const* krow,
                     const uint16_t* const* kmeta, float /*scale*/, vf rows[R]) {
    // R rows x 2 keys per pass: each key chunk is widened once and feeds all the rows
    __m256d pairs[kTile / 2];  // 64-bit lane r of pairs[k]: row r, keys 2k and 2k + 1
    for (int k = 0; k < kTile / 2; ++k) {
      __m256 acc[8];  // acc[2 r + t]: row r, key 2 k + t (rows >= R stay 0)
      for (auto& v : acc) v = _mm256_setzero_ps();
      const typename Read::Elem* k0 = krow[2 * k];
      const typename Read::Elem* k1 = krow[2 * k + 1];
      for (int64_t g = 0; g < D / 16; ++g) {
        __m256 k0a, k0b, k1a, k1b;
        Row8<Read>::load16(k0, kmeta[2 * k], g, k0a, k0b);
        Row8<Read>::load16(k1, kmeta[2 * k + 1], g, k1a, k1b);
        for (int r = 0; r < R; ++r) {
          __m256 qa = _mm256_loadu_ps(q + r * D + 16 * g), qb = _mm256_loadu_ps(q + r * D + 16 * g + 8);
          // NOTE: in registers, each feeding two FMAs: left to itself GCC folds the load into both
          // FMAs, and the loop then issues more loads than FMAs (the limit on Zen 1: one 256-bit load
          // per cycle).
          __asm__("" : "+x"(qa), "+x"(qb));
          acc[2 * r] = _mm256_fmadd_ps(qa, k0a, acc[2 * r]);
          acc[2 * r + 1] = _mm256_fmadd_ps(qa, k1a, acc[2 * r + 1]);
          acc[2 * r] = _mm256_fmadd_ps(qb, k0b, acc[2 * r]);
          acc[2 * r + 1] = _mm256_fmadd_ps(qb, k1b, acc[2 * r + 1]);
        }
      }
      pairs[k] = _mm256_castps_pd(hsum8x8(acc));
    }
    for (int half = 0; half < 2; ++half) {  // 4x4 transpose of 64-bit pairs: keys 0..7, then 8..15
      const __m256d* x = pairs + 4 * half;
      const __m256d t0 = _mm256_unpacklo_pd(x[0], x[1]), t1 = _mm256_unpackhi_pd(x[0], x[1]);
      const __m256d t2 = _mm256_unpacklo_pd(x[2], x[3]), t3 = _mm256_unpackhi_pd(x[2], x[3]);
      const __m256d r0 = _mm256_permute2f128_pd(t0, t2, 0x20), r1 = _mm256_permute2f128_pd(t1, t3, 0x20);
      const __m256d r2 = _mm256_permute2f128_pd(t0, t2, 0x31), r3 = _mm256_permute2f128_pd(t1, t3, 0x31);
      const __m256d out[4] = {r0, r1, r2, r3};
      for (int r = 0; r < R; ++r) std::memcpy(reinterpret_cast<char*>(&rows[r]) + 32 * half, &out[r], 32);
    }
  }
};

/// o += p.V with fp32 FMAs: R rows x 16 dims of output in registers while the keys stream past.
template <class Read, int R = 4>
struct PvAvx2 {
  static constexpr int kRows = R;
  static int64_t storage(int64_t d) { return storage_index8<Read>(d); }
  static void accumulate(float* o, int64_t D, const float (*p)[kTile], const typename Read::Elem* const* vrow,
                         const uint16_t* const* vmeta, int64_t n, Prefetcher& pf) {
    // NOTE: the next tile's lines go out a few at a time, every kPrefetchKeys keys of every dim group.
    // One burst per dim group stalled Zen 1 (SmolLM2's fp32 pages, 16 K + 16 V lines per burst):
    // decode from DRAM, 2 threads, 93 -> 86 ns per key and KV head; Llama's bf16 layer 107 -> 94.
    constexpr int64_t kPrefetchKeys = 4;
    const int64_t points = D / 16 * ((n + kPrefetchKeys - 1) / kPrefetchKeys);
    const int per_point = int((pf.lines + points - 1) / points);
    for (int64_t g = 0; g < D / 16; ++g) {
      __m256 oa[kRows], ob[kRows];
      for (int r = 0; r < kRows; ++r) {
        oa[r] = _mm256_loadu_ps(o + r * D + 16 * g);
        ob[r] = _mm256_loadu_ps(o + r * D + 16 * g + 8);
      }
      for (int64_t j0 = 0; j0 < n; j0 += kPrefetchKeys) {
        pf.step(per_point);
        for (int64_t j = j0; j < std::min(n, j0 + kPrefetchKeys); ++j) {
          __m256 va, vb;
          Row8<Read>::load16(vrow[j], vmeta[j], g, va, vb);
          for (int r = 0; r < kRows; ++r) {
            const __m256 pj = _mm256_broadcast_ss(&p[r][j]);
            oa[r] = _mm256_fmadd_ps(pj, va, oa[r]);
            ob[r] = _mm256_fmadd_ps(pj, vb, ob[r]);
          }
        }
      }
      for (int r = 0; r < kRows; ++r) {
        _mm256_storeu_ps(o + r * D + 16 * g, oa[r]);
        _mm256_storeu_ps(o + r * D + 16 * g + 8, ob[r]);
      }
    }
  }
};
/// o += p.V for int4 values. A group's V is scale * code + zero, so p.V = (p scale).code + sum(p zero):
/// the scale rides on the probabilities and the zeros are added once per tile, so the loop over the
/// keys only widens codes (no per-key (scale, zero) loads and no dequantizing multiply-add).
template <int R>
struct PvAvx2<ReadI4, R> {
  static constexpr int kRows = R;
  static int64_t storage(int64_t d) { return storage_index8<ReadI4>(d); }
  static void accumulate(float* o, int64_t D, const float (*p)[kTile], const uint8_t* const* vrow,
                         const uint16_t* const* vmeta, int64_t n, Prefetcher& pf) {
    constexpr int64_t kPrefetchKeys = 4;
    const int64_t points = D / 16 * ((n + kPrefetchKeys - 1) / kPrefetchKeys);
    const int per_point = int((pf.lines + points - 1) / points);
    for (int64_t c = 0; c < D / 32; ++c) {
      alignas(32) float scale[kTile] = {}, zero[kTile] = {};
      for (int64_t j = 0; j < n; ++j) {
        int32_t pair;
        std::memcpy(&pair, vmeta[j] + 2 * c, 4);
        const __m128 sz = _mm_cvtph_ps(_mm_cvtsi32_si128(pair));
        scale[j] = _mm_cvtss_f32(sz);
        zero[j] = _mm_cvtss_f32(_mm_movehdup_ps(sz));
      }
      alignas(32) float ps[R][kTile];
      __m256 zsum[R];
      for (int r = 0; r < R; ++r) {
        const __m256 p0 = _mm256_load_ps(p[r]), p1 = _mm256_load_ps(p[r] + 8);
        _mm256_store_ps(ps[r], _mm256_mul_ps(p0, _mm256_load_ps(scale)));
        _mm256_store_ps(ps[r] + 8, _mm256_mul_ps(p1, _mm256_load_ps(scale + 8)));
        zsum[r] = _mm256_set1_ps(hsum8(_mm256_fmadd_ps(p0, _mm256_load_ps(zero), _mm256_mul_ps(p1, _mm256_load_ps(zero + 8)))));
      }
      for (int64_t g = 2 * c; g < 2 * c + 2; ++g) {
        __m256 oa[R], ob[R];
        for (int r = 0; r < R; ++r) {
          oa[r] = _mm256_add_ps(_mm256_loadu_ps(o + r * D + 16 * g), zsum[r]);
          ob[r] = _mm256_add_ps(_mm256_loadu_ps(o + r * D + 16 * g + 8), zsum[r]);
        }
        for (int64_t j0 = 0; j0 < n; j0 += kPrefetchKeys) {
          pf.step(per_point);
          for (int64_t j = j0; j < std::min(n, j0 + kPrefetchKeys); ++j) {
            const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(vrow[j] + 8 * g)));
            const __m256 va = _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(15)));
            const __m256 vb = _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4));
            for (int r = 0; r < R; ++r) {
              const __m256 pj = _mm256_broadcast_ss(&ps[r][j]);
              oa[r] = _mm256_fmadd_ps(pj, va, oa[r]);
              ob[r] = _mm256_fmadd_ps(pj, vb, ob[r]);
            }
          }
        }
        for (int r = 0; r < R; ++r) {
          _mm256_storeu_ps(o + r * D + 16 * g, oa[r]);
          _mm256_storeu_ps(o + r * D + 16 * g + 8, ob[r]);
        }
      }
    }
  }
};
#define KVC_AVX2_POLICIES 1
#endif

/// Per-token multipliers of a tile's scores (K) or probabilities (V): the quantization scales.
inline void tile_scales(KVKind kind, const float* scales, float factor, const PagedLayout& L, const int32_t* table,
                        int64_t h, int64_t t0, const int64_t* tok, float out[kTile]) {
  if (kind == KVKind::kInt8) {
    for (int j = 0; j < kTile; ++j) out[j] = scales[L.row_index(table[tok[j] >> L.page_shift], h, tok[j] & (L.page_size - 1))];
  } else {
    for (int j = 0; j < kTile; ++j) out[j] = scales[h] * factor;
  }
  (void)t0;
}

template <class Read>
constexpr float read_factor() {
  if constexpr (requires { Read::kFactor; }) {
    return Read::kFactor;
  } else {
    return 1.f;
  }
}

template <class ReadK, class ReadV, class Score, class Pv>
void run_task_vec(const AttentionArgs& a, const AttentionTask& t, const PartialStates& partial, Scratch& s) {
  static_assert(Score::kRows == Pv::kRows, "the score and P.V policies must agree on rows per block");
  constexpr int kRows = Score::kRows;  // query rows per block (1-4)
  using KElem = typename ReadK::Elem;
  using VElem = typename ReadV::Elem;
  const PagedLayout& L = a.layout;
  const int64_t D = L.head_dim, G = a.group;
  const int64_t kv_len = a.kv_lens[t.seq];
  const int64_t q_start = a.cu_q_lens[t.seq], q_len = a.cu_q_lens[t.seq + 1] - q_start;
  const TaskRows tr(t, G, kRows);
  const int64_t padded = tr.heads * tr.padded;

  s.q.assign(padded * D, 0.f);
  s.o.assign(padded * D, 0.f);
  s.rows.resize(padded);
  int64_t max_pos = -1, min_lo = INT64_MAX;
  for (int64_t r = 0; r < padded; ++r) {
    RowState& st = s.rows[r];
    const int64_t hb = r / tr.padded, local = r % tr.padded;
    st.m = -INFINITY;
    st.l = 0.f;
    if (local >= tr.per_head) {  // padding rows see nothing
      st.pos = -1;
      st.lo = 0;
      continue;
    }
    const int64_t i = t.tok_begin + local / G, hq = (t.head_begin + hb) * G + local % G;
    st.pos = kv_len - q_len + i;
    st.lo = a.window_left >= 0 ? std::max<int64_t>(0, st.pos - a.window_left) : 0;
    max_pos = std::max(max_pos, st.pos);
    min_lo = std::min(min_lo, st.lo);
    Score::load_query(a, (q_start + i) * a.q_strides[0] + hq * a.q_strides[1], &s.q[r * D]);
  }

  const KElem* kc = static_cast<const KElem*>(a.k_cache);
  const VElem* vc = static_cast<const VElem*>(a.v_cache);
  // per-key multipliers (int8 rows, fp8 heads); int4 dequantizes per chunk instead
  const bool k_scaled = has_token_scales(a.k_kind) || has_head_scales(a.k_kind);
  const bool v_scaled = has_token_scales(a.v_kind) || has_head_scales(a.v_kind);
  const int32_t* table = a.block_tables + t.seq * a.table_stride;
  // Keys any row of the task can see: the sinks, then the windows; nothing past the last query.
  const int64_t end = std::min<int64_t>(t.kv_end, max_pos + 1);
  const int64_t sink_end = std::min<int64_t>(end, a.sink_tokens);
  const int64_t ranges[2][2] = {{t.kv_begin, sink_end},
                                {std::max<int64_t>(t.kv_begin, std::max<int64_t>(min_lo, sink_end)), end}};
  constexpr int64_t kdiv = dims_per_elem<ReadK>(), vdiv = dims_per_elem<ReadV>();
  const int64_t k_row_bytes = D / kdiv * int64_t(sizeof(KElem)), v_row_bytes = D / vdiv * int64_t(sizeof(VElem));
  const int64_t row_bytes = std::max(k_row_bytes, v_row_bytes);  // prefetch: the wider of the two
  // int4 and kivi value rows carry (scale, zero) fp16 pairs, one per 32 dims: [rows, D / 32, 2]; kivi
  // keys carry 2 D fp16 per (block, head) page: row r of the pool reads the metadata of page r / P.
  const bool grouped_k = a.k_kind == KVKind::kInt4 || is_kivi(a.k_kind);
  const uint16_t* k_meta = grouped_k ? reinterpret_cast<const uint16_t*>(a.k_scale) : nullptr;
  const uint16_t* v_meta = a.v_kind == KVKind::kInt4 || is_kivi(a.v_kind) ? reinterpret_cast<const uint16_t*>(a.v_scale) : nullptr;
  const bool kivi_k = is_kivi(a.k_kind);
  auto k_meta_of = [&](int64_t off) { return kivi_k ? k_meta + off / (L.page_size * D) * 2 * D : k_meta + off / 32 * 2; };
  const uint16_t* kmeta[kTile] = {};
  const uint16_t* vmeta[kTile] = {};
  alignas(64) float p[kRows][kTile];
  alignas(64) float kscale[kTile], vscale[kTile];
  int64_t tok_of[kTile];
  const KElem* krow[kTile];
  const VElem* vrow[kTile];
  vf iota;
  for (int i = 0; i < kLanes; ++i) iota[i] = float(i);

  // Tiles are aligned to multiples of kTile, so with pages of >= kTile tokens a tile lies in one page
  // and its rows are consecutive: one block-table lookup per tile and head.
  const bool tile_in_page = L.page_size >= kTile;

  for (const auto& range : ranges) {
    for (int64_t t0 = range[0] & ~int64_t(kTile - 1); t0 < range[1]; t0 += kTile) {
      // Keys [k_lo, k_hi) of this tile belong to the range; the other lanes are masked and point at
      // key k_lo, so they never read a slot that holds no token.
      const int64_t k_lo = std::max(t0, range[0]), k_hi = std::min(t0 + kTile, range[1]);
      if (!tile_in_page && t0 + kTile < range[1]) {
        // NOTE: prefetch the next tile into L2: one (sequence, head) stream reads short runs and jumps,
        // which the hardware prefetcher does not follow. (Inline: GCC deletes calls to a function
        // that only prefetches.) Pages of >= kTile tokens prefetch from inside the P.V loop instead.
        for (int64_t h = t.head_begin; h < t.head_end; ++h) {
          for (int64_t tok = t0 + kTile; tok < std::min(range[1], t0 + 2 * kTile); ++tok) {
            const int64_t off = L.token_offset(table[tok >> L.page_shift], h, tok);
            for (int64_t b = 0; b < row_bytes; b += 64) {
              __builtin_prefetch(reinterpret_cast<const char*>(kc + off / kdiv) + b, 0, 2);
              __builtin_prefetch(reinterpret_cast<const char*>(vc + off / vdiv) + b, 0, 2);
            }
          }
        }
      }
      for (int64_t hb = 0; hb < tr.heads; ++hb) {
        const int64_t h = t.head_begin + hb;
        Prefetcher pf;
        if (tile_in_page && t0 + kPrefetchTiles * kTile < range[1]) {
          const int64_t ahead = t0 + kPrefetchTiles * kTile;
          const int64_t next = L.token_offset(table[ahead >> L.page_shift], h, ahead);
          // (K and V rows have the same width, so one line count serves both)
          pf = {reinterpret_cast<const char*>(kc + next / kdiv), reinterpret_cast<const char*>(vc + next / vdiv),
                kTile * row_bytes / 64};
          // The tile's scales and metadata are a stream of their own: int8 rows' scales (64 bytes a tile),
          // int4 / KIVI values' (scale, zero) pairs, KIVI keys' per-channel page metadata. Unfetched, each
          // was a DRAM miss per tile (int8 decode from DRAM took 1.6x its time from cache).
          const int64_t row = next / D;  // the tile's first row of the pool
          const auto prefetch = [](const void* p, int64_t bytes) {
            for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, 2);
          };
          if (a.k_kind == KVKind::kInt8) prefetch(a.k_scale + row, kTile * 4);
          if (a.v_kind == KVKind::kInt8) prefetch(a.v_scale + row, kTile * 4);
          if (k_meta) prefetch(k_meta_of(next), kivi_k ? 4 * D : kTile * (D / 32) * 4);
          if (v_meta) prefetch(v_meta + next / 32 * 2, kTile * (D / 32) * 4);
        }
        if (tile_in_page) {
          const int64_t base = L.token_offset(table[t0 >> L.page_shift], h, t0);
          for (int64_t j = 0; j < kTile; ++j) {
            tok_of[j] = t0 + j >= k_lo && t0 + j < k_hi ? t0 + j : k_lo;
            const int64_t off = base + (tok_of[j] - t0) * D;
            krow[j] = kc + off / kdiv;
            vrow[j] = vc + off / vdiv;
            if (k_meta) kmeta[j] = k_meta_of(off);  // off / D rows, D / 32 groups each
            if (v_meta) vmeta[j] = v_meta + off / 32 * 2;
          }
        } else {
          for (int64_t j = 0; j < kTile; ++j) {
            const int64_t tok = t0 + j >= k_lo && t0 + j < k_hi ? t0 + j : k_lo;
            tok_of[j] = tok;
            const int64_t off = L.token_offset(table[tok >> L.page_shift], h, tok);
            krow[j] = kc + off / kdiv;
            vrow[j] = vc + off / vdiv;
            if (k_meta) kmeta[j] = k_meta_of(off);
            if (v_meta) vmeta[j] = v_meta + off / 32 * 2;
          }
        }
        if (k_scaled) tile_scales(a.k_kind, a.k_scale, read_factor<ReadK>(), L, table, h, t0, tok_of, kscale);
        if (v_scaled) tile_scales(a.v_kind, a.v_scale, read_factor<ReadV>(), L, table, h, t0, tok_of, vscale);
        for (int64_t rc = hb * tr.padded; rc < (hb + 1) * tr.padded; rc += kRows) {
          RowState* st = &s.rows[rc];
          bool any = false;
          for (int r = 0; r < kRows; ++r) {
            any |= st[r].pos >= k_lo && (k_hi - 1 >= st[r].lo || k_lo < a.sink_tokens);
          }
          if (!any) continue;
          vf sc_rows[kRows];
          Score::scores(&s.q[rc * D], D, krow, kmeta, a.scale, sc_rows);
          if (k_scaled) {
            const vf ks = loadv(kscale);
            for (int r = 0; r < kRows; ++r) sc_rows[r] *= ks;
          }
          // ---- mask, soft-cap, online softmax ----
          const vf key = iota + float(t0);
          for (int r = 0; r < kRows; ++r) {
#if defined(__AVX2__) && !defined(__AVX512F__)
            // NOTE: the common case (every key of the tile visible, no soft-cap) in 8-lane halves: GCC
            // keeps the 16-lane vectors of the general form below on the stack in AVX2 builds (SmolLM2's
            // layer, fp32 pages, in cache: 47.5 -> 43.9 ns per key and KV head).
            if (a.softcap <= 0.f && k_lo == t0 && k_hi == t0 + kTile && k_hi - 1 <= st[r].pos &&
                (t0 >= st[r].lo || k_hi <= a.sink_tokens)) {
              const __m256 s0 = lo8(sc_rows[r]), s1 = hi8(sc_rows[r]);
              const float mx = hmax8(_mm256_max_ps(s0, s1));
              if (mx > st[r].m) {
                const float alpha = std::exp(st[r].m - mx);  // 0 on the first visible tile
                st[r].l *= alpha;
                float* o = &s.o[(rc + r) * D];
                const __m256 scale_o = _mm256_set1_ps(alpha);
                for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), scale_o));
                st[r].m = mx;
              }
              const __m256 m = _mm256_set1_ps(st[r].m);
              __m256 p0 = vexp8(_mm256_sub_ps(s0, m)), p1 = vexp8(_mm256_sub_ps(s1, m));
              st[r].l += hsum8(_mm256_add_ps(p0, p1));
              if (v_scaled) {  // V's per-token scale rides on p
                p0 = _mm256_mul_ps(p0, _mm256_load_ps(vscale));
                p1 = _mm256_mul_ps(p1, _mm256_load_ps(vscale + 8));
              }
              _mm256_store_ps(p[r], p0);
              _mm256_store_ps(p[r] + 8, p1);
              continue;
            }
#endif
            vf sc = sc_rows[r];
            if (a.softcap > 0.f) sc = vsoftcap(sc, a.softcap);
            const bool all_visible = k_lo == t0 && k_hi == t0 + kTile && k_hi - 1 <= st[r].pos &&
                                     (t0 >= st[r].lo || k_hi <= a.sink_tokens);
            if (!all_visible) {
              const vi visible = (key >= float(k_lo)) & (key < float(k_hi)) & (key <= float(st[r].pos)) &
                                 ((key >= float(st[r].lo)) | (key < float(a.sink_tokens)));
              sc = visible ? sc : splat(-INFINITY);
            }
            const float mx = hmax(sc);
            if (mx == -INFINITY) {
              storev(p[r], vf{});
              continue;
            }
            if (mx > st[r].m) {
              const float alpha = std::exp(st[r].m - mx);  // 0 on the first visible tile
              st[r].l *= alpha;
              float* o = &s.o[(rc + r) * D];
              for (int64_t d = 0; d < D; d += kLanes) storev(o + d, loadv(o + d) * alpha);
              st[r].m = mx;
            }
            const vf pr = vexp(sc - st[r].m);
            st[r].l += hsum(pr);
            storev(p[r], v_scaled ? pr * loadv(vscale) : pr);  // V's per-token scale rides on p
          }
          Pv::accumulate(&s.o[rc * D], D, p, vrow, vmeta, kTile, pf);
        }
      }
    }
  }
  finish_task(a, t, partial, s, tr, q_start, [](int64_t d) { return Pv::storage(d); });
}

/// Any head_dim, any dtype: the plain loop, for head dims that are not a multiple of 32.
inline void run_task_scalar(const AttentionArgs& a, const AttentionTask& t, const PartialStates& partial, Scratch& s) {
  const PagedLayout& L = a.layout;
  const int64_t D = L.head_dim, G = a.group;
  const int64_t kv_len = a.kv_lens[t.seq];
  const int64_t q_start = a.cu_q_lens[t.seq], q_len = a.cu_q_lens[t.seq + 1] - q_start;
  const TaskRows tr(t, G, 1);
  const int32_t* table = a.block_tables + t.seq * a.table_stride;
  s.q.assign(tr.heads * tr.padded * D, 0.f);
  s.o.assign(tr.heads * tr.padded * D, 0.f);
  s.rows.resize(tr.heads * tr.padded);
  for (int64_t r = 0; r < tr.heads * tr.padded; ++r) {
    RowState& st = s.rows[r];
    const int64_t hb = r / tr.padded, local = r % tr.padded, h = t.head_begin + hb;
    const int64_t i = t.tok_begin + local / G, hq = h * G + local % G;
    st.pos = kv_len - q_len + i;
    st.lo = a.window_left >= 0 ? std::max<int64_t>(0, st.pos - a.window_left) : 0;
    st.m = -INFINITY;
    st.l = 0.f;
    const int64_t base = (q_start + i) * a.q_strides[0] + hq * a.q_strides[1];
    float* q = &s.q[r * D];
    if (a.k_rot) {
      load_query_f32(a, base, q);
    } else {
      for (int64_t d = 0; d < D; ++d) q[d] = a.scale * load_as_float(a.query, base + d * a.q_strides[2], a.q_dtype);
    }
    float* o = &s.o[r * D];
    const int64_t end = std::min<int64_t>(t.kv_end, st.pos + 1);
    for (int64_t j = t.kv_begin; j < end; ++j) {
      if (j < st.lo && j >= a.sink_tokens) continue;
      const int64_t block = table[j >> L.page_shift], pos = j & (L.page_size - 1);
      const int64_t off = L.offset(block, h, pos);
      auto value = [&](KVKind kind, const void* pool, const float* scales, int64_t d) {
        if (kind == KVKind::kFull) return load_as_float(pool, off + d, a.kv_dtype);
        const RowRef r = row_ref(const_cast<void*>(pool), const_cast<float*>(scales), kind, L, block, h, pos);
        return kind == KVKind::kInt4 ? dequantize_int4(r.codes, r.scale, d) : dequantize(r.codes, d, kind, *r.scale);
      };
      float sc = 0.f;
      for (int64_t d = 0; d < D; ++d) sc += q[d] * value(a.k_kind, a.k_cache, a.k_scale, d);
      if (a.softcap > 0.f) sc = a.softcap * std::tanh(sc / a.softcap);
      if (sc > st.m) {
        const float alpha = std::exp(st.m - sc);
        st.l *= alpha;
        for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
        st.m = sc;
      }
      const float pj = std::exp(sc - st.m);
      st.l += pj;
      for (int64_t d = 0; d < D; ++d) o[d] += pj * value(a.v_kind, a.v_cache, a.v_scale, d);
    }
  }
  finish_task(a, t, partial, s, tr, q_start, [](int64_t d) { return d; });
}

/// Calls fn(Reader{}) with the reader of a quantized kind (not kivi).
template <class Fn>
void with_quantized_reader(KVKind kind, Fn&& fn) {
  switch (kind) {
    case KVKind::kInt8: fn(ReadI8{}); break;
    case KVKind::kFp8E4M3: fn(ReadFp8<true>{}); break;
    case KVKind::kFp8E5M2: fn(ReadFp8<false>{}); break;
    default: fn(ReadI4{}); break;
  }
}

/// Calls fn(KeyReader{}, ValueReader{}) for kivi keys and values (validated: both kivi).
template <class Fn>
void with_kivi_readers(KVKind k, KVKind v, Fn&& fn) {
  if (k == KVKind::kKivi4) {
    if (v == KVKind::kKivi4) return fn(ReadKivi<4, true>{}, ReadKivi<4, false>{});
    return fn(ReadKivi<4, true>{}, ReadKivi<2, false>{});
  }
  if (v == KVKind::kKivi4) return fn(ReadKivi<2, true>{}, ReadKivi<4, false>{});
  fn(ReadKivi<2, true>{}, ReadKivi<2, false>{});
}

/// Query rows per register block of the 16-lane policies (1, 2 or 4) for a task with `rows` rows per KV head.
inline int rows_per_block16(int64_t rows) { return rows <= 1 ? 1 : (rows == 2 ? 2 : 4); }

/// Calls fn(std::integral_constant<int, R>{}) for R in {1, 2, 4}.
template <class Fn>
void with_rows16(int rows, Fn&& fn) {
  switch (rows) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    default: return fn(std::integral_constant<int, 4>{});
  }
}

#ifdef KVC_AVX2_POLICIES
/// Query rows per register block for a task with `rows` rows per KV head: the least padding (ties
/// to the larger block). A decode step has rows = the GQA group, often 1-3; prefill rows are many.
inline int rows_per_block(int64_t rows) {
  if (rows <= 4) return static_cast<int>(std::max<int64_t>(rows, 1));
  const int64_t pad4 = (4 - rows % 4) % 4, pad3 = (3 - rows % 3) % 3;
  return pad3 < pad4 ? 3 : 4;
}

/// Calls fn(std::integral_constant<int, R>{}) for rows per block R in 1-4.
template <class Fn>
void with_rows(int rows, Fn&& fn) {
  switch (rows) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    default: return fn(std::integral_constant<int, 4>{});
  }
}
#endif

#if !defined(__AVX512F__)
// ---- chunked prefill through BLAS ----------------------------------------------------------------
// NOTE: a prefill task has many query rows per KV head, so its two products (Q.K^T over a block of
// keys, then P.V) are matrix products: BLAS's register-blocked sgemm runs them at ~100% of the FMA
// peak here (Zen 1, AVX2), the per-row-block register kernel above at ~60%. Each block of keys is
// widened to fp32 once per task and the online softmax runs between the two products. Full-precision
// pools only; quantized ones keep the register kernel. (AVX-512 builds keep theirs: not measured.)
constexpr int64_t kGemmKeys = 128;    // keys per block: Q, O (128 rows), S, K and V blocks fit a 512 KiB L2
constexpr int64_t kGemmMinRows = 16;  // rows per KV head from which the products pay off

/// A full-precision row as fp32, natural order.
template <class Read>
inline void widen_row(const typename Read::Elem* row, int64_t D, float* out) {
  if constexpr (std::is_same_v<Read, ReadF32>) {
    std::memcpy(out, row, static_cast<size_t>(D) * sizeof(float));
  } else if constexpr (std::is_same_v<Read, ReadBF16>) {
    int64_t d = 0;
#if defined(__AVX2__)
    for (; d + 8 <= D; d += 8) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), _mm256_slli_epi32(w, 16));
    }
#endif
    for (; d < D; ++d) {
      const uint32_t bits = uint32_t(row[d]) << 16;
      std::memcpy(&out[d], &bits, 4);
    }
  } else {
    int64_t d = 0;
#if defined(__F16C__)
    for (; d + 8 <= D; d += 8) {
      _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d))));
    }
#endif
    for (; d < D; ++d) out[d] = fp16_to_float(row[d]);
  }
}

// Row passes of the online softmax over a block of scores (`n` of them; the row's storage runs on to
// a multiple of 16, and those lanes are masked). NOTE: 8-lane intrinsics on AVX2: GCC spills the
// 16-lane generic vectors there.
#if defined(__AVX2__)
/// Keys outside [lo, hi) -> -inf, soft-cap the rest; returns the row's max.
inline float mask_and_max(float* row, int64_t n, float lo, float hi, float softcap) {
  if (lo == 0.f && hi == float(n) && n % 8 == 0 && softcap <= 0.f) {  // every key visible: only the max
    __m256 mx = _mm256_loadu_ps(row);
    for (int64_t c = 8; c < n; c += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(row + c));
    return hmax8(mx);
  }
  const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), lo8 = _mm256_set1_ps(lo), hi8 = _mm256_set1_ps(hi);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  __m256 mx = ninf;
  for (int64_t c = 0; c < n; c += 8) {
    __m256 sc = _mm256_loadu_ps(row + c);
    if (softcap > 0.f) {  // cap * tanh(s / cap) = cap * (1 - 2 / (exp(2 s / cap) + 1))
      const __m256 y = _mm256_min_ps(_mm256_mul_ps(sc, _mm256_set1_ps(2.f / softcap)), _mm256_set1_ps(80.f));
      const __m256 t = _mm256_sub_ps(_mm256_set1_ps(1.f),
                                     _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(vexp8(y), _mm256_set1_ps(1.f))));
      sc = _mm256_mul_ps(t, _mm256_set1_ps(softcap));
    }
    const __m256 key = _mm256_add_ps(iota, _mm256_set1_ps(float(c)));
    const __m256 in = _mm256_and_ps(_mm256_cmp_ps(key, lo8, _CMP_GE_OQ), _mm256_cmp_ps(key, hi8, _CMP_LT_OQ));
    sc = _mm256_blendv_ps(ninf, sc, in);
    _mm256_storeu_ps(row + c, sc);
    mx = _mm256_max_ps(mx, sc);
  }
  return hmax8(mx);
}
/// row = exp(row - m) (masked lanes: 0); returns the sum.
inline float exp_and_sum(float* row, int64_t n, float m) {
  const __m256 m8 = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t c = 0; c < n; c += 8) {
    const __m256 p = vexp8(_mm256_sub_ps(_mm256_loadu_ps(row + c), m8));
    _mm256_storeu_ps(row + c, p);
    sum = _mm256_add_ps(sum, p);
  }
  return hsum8(sum);
}
#else
inline float mask_and_max(float* row, int64_t n, float lo, float hi, float softcap) {
  vf iota, mx = splat(-INFINITY);
  for (int i = 0; i < kLanes; ++i) iota[i] = float(i);
  for (int64_t c = 0; c < n; c += kLanes) {
    const vf key = iota + float(c);
    vf sc = loadv(row + c);
    if (softcap > 0.f) sc = vsoftcap(sc, softcap);
    sc = (key >= lo) & (key < hi) ? sc : splat(-INFINITY);
    storev(row + c, sc);
    mx = vmax(mx, sc);
  }
  return hmax(mx);
}
inline float exp_and_sum(float* row, int64_t n, float m) {
  vf sum = vf{};
  for (int64_t c = 0; c < n; c += kLanes) {
    const vf p = vexp(loadv(row + c) - m);
    storev(row + c, p);
    sum += p;
  }
  return hsum(sum);
}
#endif

template <class Read>
void run_task_gemm(const AttentionArgs& a, const AttentionTask& t, const PartialStates& partial, Scratch& s,
                   GemmF32 gemm) {
  using Elem = typename Read::Elem;
  const PagedLayout& L = a.layout;
  const int64_t D = L.head_dim, G = a.group;
  const int64_t kv_len = a.kv_lens[t.seq];
  const int64_t q_start = a.cu_q_lens[t.seq], q_len = a.cu_q_lens[t.seq + 1] - q_start;
  const TaskRows tr(t, G, 1);
  const int64_t n = tr.per_head;
  s.q.assign(tr.heads * n * D, 0.f);
  s.o.assign(tr.heads * n * D, 0.f);
  s.rows.resize(tr.heads * n);
  thread_local FloatBuffer kbuf, vbuf, sbuf;
  kbuf.resize(kGemmKeys * D);
  vbuf.resize(kGemmKeys * D);
  sbuf.resize(n * kGemmKeys);
  const Elem* kc = static_cast<const Elem*>(a.k_cache);
  const Elem* vc = static_cast<const Elem*>(a.v_cache);
  const int32_t* table = a.block_tables + t.seq * a.table_stride;

  for (int64_t hb = 0; hb < tr.heads; ++hb) {
    const int64_t h = t.head_begin + hb;
    RowState* st = &s.rows[hb * n];
    float* q = &s.q[hb * n * D];
    float* o = &s.o[hb * n * D];
    int64_t max_pos = -1, min_lo = INT64_MAX;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t i = t.tok_begin + r / G, hq = h * G + r % G;
      st[r].pos = kv_len - q_len + i;
      st[r].lo = a.window_left >= 0 ? std::max<int64_t>(0, st[r].pos - a.window_left) : 0;
      st[r].m = -INFINITY;
      st[r].l = 0.f;
      max_pos = std::max(max_pos, st[r].pos);
      min_lo = std::min(min_lo, st[r].lo);
      load_query_f32(a, (q_start + i) * a.q_strides[0] + hq * a.q_strides[1], q + r * D);  // scaled
    }
    // the same two key ranges as run_task_vec: the sinks, then the windows
    const int64_t end = std::min<int64_t>(t.kv_end, max_pos + 1);
    const int64_t sink_end = std::min<int64_t>(end, a.sink_tokens);
    const int64_t ranges[2][2] = {{t.kv_begin, sink_end},
                                  {std::max<int64_t>(t.kv_begin, std::max<int64_t>(min_lo, sink_end)), end}};
    for (int range = 0; range < 2; ++range) {
      for (int64_t k0 = ranges[range][0]; k0 < ranges[range][1]; k0 += kGemmKeys) {
        const int64_t k1 = std::min(ranges[range][1], k0 + kGemmKeys), nk = k1 - k0;
        for (int64_t j = k0; j < k1; ++j) {
          const int64_t off = L.token_offset(table[j >> L.page_shift], h, j);
          widen_row<Read>(kc + off, D, &kbuf[(j - k0) * D]);
          widen_row<Read>(vc + off, D, &vbuf[(j - k0) * D]);
        }
        gemm(true, n, nk, D, q, D, kbuf.data(), D, 0.f, sbuf.data(), kGemmKeys);  // S = Q . K^T
        for (int64_t r = 0; r < n; ++r) {
          float* srow = &sbuf[r * kGemmKeys];
          // visible keys of this row in the block: causal, and inside the window unless sinks
          const int64_t vis_lo = range == 0 ? k0 : std::max(k0, st[r].lo);
          const int64_t vis_hi = std::min(k1, st[r].pos + 1);
          if (vis_lo >= vis_hi) {
            std::fill(srow, srow + nk, 0.f);
            continue;
          }
          const float mx = mask_and_max(srow, nk, float(vis_lo - k0), float(vis_hi - k0), a.softcap);
          if (mx > st[r].m) {
            const float alpha = std::exp(st[r].m - mx);  // 0 on the first visible block
            st[r].l *= alpha;
            for (int64_t d = 0; d < D; ++d) o[r * D + d] *= alpha;
            st[r].m = mx;
          }
          st[r].l += exp_and_sum(srow, nk, st[r].m);
        }
        gemm(false, n, D, nk, sbuf.data(), kGemmKeys, vbuf.data(), D, 1.f, o, D);  // O += P . V
      }
    }
  }
  finish_task(a, t, partial, s, tr, q_start, [](int64_t d) { return d; });
}
#endif

/// Runs one task with the kernel that fits its KV dtype and head_dim.
inline void run_task(const AttentionArgs& a, const AttentionTask& t, const PartialStates& partial, GemmF32 gemm) {
  thread_local Scratch scratch;
#if !defined(__AVX512F__)
  if (gemm && a.k_kind == KVKind::kFull && int64_t(t.tok_end - t.tok_begin) * a.group >= kGemmMinRows) {
    switch (a.kv_dtype) {
      case DType::kFloat32: return run_task_gemm<ReadF32>(a, t, partial, scratch, gemm);
      case DType::kFloat16: return run_task_gemm<ReadF16>(a, t, partial, scratch, gemm);
      default: return run_task_gemm<ReadBF16>(a, t, partial, scratch, gemm);
    }
  }
#else
  (void)gemm;
#endif
  if (a.layout.head_dim % 32 != 0) return run_task_scalar(a, t, partial, scratch);
#ifdef KVC_AVX2_POLICIES
  return with_rows(rows_per_block(int64_t(t.tok_end - t.tok_begin) * a.group), [&]<int R>(std::integral_constant<int, R>) {
    if (is_kivi(a.k_kind)) {
      return with_kivi_readers(a.k_kind, a.v_kind, [&]<class RK, class RV>(RK, RV) {
        run_task_vec<RK, RV, ScoreAvx2<RK, R>, PvAvx2<RV, R>>(a, t, partial, scratch);
      });
    }
    if (a.k_kind != KVKind::kFull) {
      return with_quantized_reader(a.k_kind, [&]<class RK>(RK) {
        with_quantized_reader(a.v_kind, [&]<class RV>(RV) {
          run_task_vec<RK, RV, ScoreAvx2<RK, R>, PvAvx2<RV, R>>(a, t, partial, scratch);
        });
      });
    }
    switch (a.kv_dtype) {
      case DType::kFloat32: return run_task_vec<ReadF32, ReadF32, ScoreAvx2<ReadF32, R>, PvAvx2<ReadF32, R>>(a, t, partial, scratch);
      case DType::kFloat16: return run_task_vec<ReadF16, ReadF16, ScoreAvx2<ReadF16, R>, PvAvx2<ReadF16, R>>(a, t, partial, scratch);
      default: return run_task_vec<ReadBF16, ReadBF16, ScoreAvx2<ReadBF16, R>, PvAvx2<ReadBF16, R>>(a, t, partial, scratch);
    }
  });
#endif
  // 16-lane builds: register blocks of 1, 2 or 4 query rows (a GQA group of 1 or 2 pads nothing).
  return with_rows16(rows_per_block16(int64_t(t.tok_end - t.tok_begin) * a.group), [&]<int R>(std::integral_constant<int, R>) {
    if (is_kivi(a.k_kind)) {
      return with_kivi_readers(a.k_kind, a.v_kind, [&]<class RK, class RV>(RK, RV) {
        run_task_vec<RK, RV, ScoreFma<RK, R>, PvFma<RV, R>>(a, t, partial, scratch);
      });
    }
    if (a.k_kind != KVKind::kFull) {  // quantized K and V (validated: both quantized)
      return with_quantized_reader(a.k_kind, [&]<class RK>(RK) {
        with_quantized_reader(a.v_kind, [&]<class RV>(RV) {
#ifdef __AVX512BF16__
          // Codes widen to bf16 exactly, so a bf16 query takes the bf16 dot-product path.
          if constexpr (!RK::kEvenOdd && !RV::kEvenOdd) {  // int4 rows are not exact in bf16: FMA path
            // (a rotated query is not a bf16 value any more: FMA path too)
            if (a.q_dtype == DType::kBFloat16 && !a.k_rot) {
              return run_task_vec<RK, RV, ScoreDp<RK, R>, PvDp<RV, R>>(a, t, partial, scratch);
            }
          }
#endif
          run_task_vec<RK, RV, ScoreFma<RK, R>, PvFma<RV, R>>(a, t, partial, scratch);
        });
      });
    }
    switch (a.kv_dtype) {
      case DType::kFloat32: return run_task_vec<ReadF32, ReadF32, ScoreFma<ReadF32, R>, PvFma<ReadF32, R>>(a, t, partial, scratch);
      case DType::kFloat16: return run_task_vec<ReadF16, ReadF16, ScoreFma<ReadF16, R>, PvFma<ReadF16, R>>(a, t, partial, scratch);
      default:
#ifdef __AVX512BF16__
        // bf16 dot products only when the query is bf16 too: rounding an fp32 query would lose precision.
        if (a.q_dtype == DType::kBFloat16) {
          return run_task_vec<ReadBF16, ReadBF16, ScoreDp<ReadBF16, R>, PvDp<ReadBF16, R>>(a, t, partial, scratch);
        }
#endif
        return run_task_vec<ReadBF16, ReadBF16, ScoreFma<ReadBF16, R>, PvFma<ReadBF16, R>>(a, t, partial, scratch);
    }
  });
}

}  // namespace kvcache::cpu::KVC_ISA
