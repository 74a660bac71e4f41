// Score and P.V policies of the AVX2 build: 8-lane register tiles (AVX2 has 16 registers) and
// the 16-dim row readers they take.
// Part of the CPU attention kernel (see attention/attention_cpu_kernel.h), compiled once per instruction set.
#pragma once

#ifndef KVC_ISA
#error "define KVC_ISA (the namespace of this instruction-set build) before including this header"
#endif

#include "attention/cpu_kernel/task_state.h"

namespace kvcache::cpu::KVC_ISA {

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
  static void load16(const float* row, const uint16_t*, int64_t g, __m256& a, __m256& b) {
    a = _mm256_loadu_ps(row + 16 * g);
    b = _mm256_loadu_ps(row + 16 * g + 8);
  }
};
template <>
struct Row8<ReadF16> {
  static void load16(const uint16_t* row, const uint16_t*, int64_t g, __m256& a, __m256& b) {
    a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * g)));
    b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * g + 8)));
  }
};
template <>
struct Row8<ReadBF16> {
  static void load16(const uint16_t* row, const uint16_t*, int64_t g, __m256& a, __m256& b) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * g));
    a = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    b = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(int(0xffff0000u))));
  }
};
template <>
struct Row8<ReadI8> {
  static void load16(const int8_t* row, const uint16_t*, int64_t g, __m256& a, __m256& b) {
    a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 16 * g))));
    b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 16 * g + 8))));
  }
};
template <bool kE4M3>
struct Row8<ReadFp8<kE4M3>> {
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
/// The codes of 16 dims [16 g, 16 g + 16) of a grouped row (int4, KIVI) as fp32 (a, b) in Row8's order,
/// without their (scale, zero).
template <class Read>
struct Codes8;
template <>
struct Codes8<ReadI4> {  // low nibbles = even dims
  static void load16(const uint8_t* row, int64_t g, __m256& a, __m256& b) {
    const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * g)));
    a = _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(15)));
    b = _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4));
  }
};
/// KIVI codes, natural order. Codes are planar per 32-dim chunk c: at 4 bits, byte j holds dim j (low
/// nibble) and dim j + 16 (high); at 2 bits, byte j (< 8) holds dims j, j + 8, j + 16, j + 24 in bit
/// pairs 0-1, 2-3, 4-5, 6-7.
template <int kBits, bool kKey>
struct Codes8<ReadKivi<kBits, kKey>> {
  static void load16(const uint8_t* row, int64_t g, __m256& a, __m256& b) {
    const int64_t c = g / 2, half = g % 2;  // dims [16 g, 16 g + 16) = half `half` of chunk c
    const __m256i mask = _mm256_set1_epi32((1 << kBits) - 1);
    if constexpr (kBits == 4) {
      const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 16 * c)));
      const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 16 * c + 8)));
      const __m128i shift = _mm_cvtsi32_si128(int(4 * half));
      a = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(lo, shift), mask));  // dims 16 half + 0..7
      b = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(hi, shift), mask));  // dims 16 half + 8..15
    } else {
      const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * c)));
      a = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(w, _mm_cvtsi32_si128(int(4 * half))), mask));
      b = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(w, _mm_cvtsi32_si128(int(4 * half + 2))), mask));
    }
  }
};

/// The (scale, zero) fp16 pair at `pair` as two broadcast fp32 vectors (one F16C widening, not two scalar
/// conversions).
inline void scale_zero8(const uint16_t* pair, __m256& scale, __m256& zero) {
  int32_t bits;
  std::memcpy(&bits, pair, 4);
  const __m128 sz = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
  scale = _mm256_broadcastss_ps(sz);
  zero = _mm256_broadcastss_ps(_mm_movehdup_ps(sz));
}

template <>
struct Row8<ReadI4> {
  static void load16(const uint8_t* row, const uint16_t* meta, int64_t g, __m256& a, __m256& b) {
    __m256 scale, zero;
    scale_zero8(meta + g / 2 * 2, scale, zero);  // the group's pair
    Codes8<ReadI4>::load16(row, g, a, b);
    a = _mm256_fmadd_ps(a, scale, zero);
    b = _mm256_fmadd_ps(b, scale, zero);
  }
};

/// KIVI rows, natural order (Codes8). Keys dequantize with their page's per-channel (scale, zero), values
/// with their row's pair per chunk (as int4).
template <int kBits, bool kKey>
struct Row8<ReadKivi<kBits, kKey>> {
  static void load16(const uint8_t* row, const uint16_t* meta, int64_t g, __m256& a, __m256& b) {
    const int64_t c = g / 2, half = g % 2;
    Codes8<ReadKivi<kBits, kKey>>::load16(row, g, a, b);
    if constexpr (kKey) {  // per chunk: 32 fp16 scales, then 32 zeros
      const uint16_t* m = meta + 64 * c + 16 * half;
      const __m256 sa = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m)));
      const __m256 sb = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + 8)));
      const __m256 za = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + 32)));
      const __m256 zb = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + 40)));
      a = _mm256_fmadd_ps(a, sa, za);
      b = _mm256_fmadd_ps(b, sb, zb);
    } else {
      __m256 scale, zero;
      scale_zero8(meta + 2 * c, scale, zero);
      a = _mm256_fmadd_ps(a, scale, zero);
      b = _mm256_fmadd_ps(b, scale, zero);
    }
  }
};

/// Position of dim d in an 8-lane reader's storage order: even/odd within each 16 dims where the reader's
/// order is even/odd (bf16, int4).
template <class Read>
inline int64_t storage_index8(int64_t d) {
  if constexpr (Read::kEvenOdd) {
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

/// The scores of R rows x 16 keys from pairs[k] (64-bit lane r: row r, keys 2 k and 2 k + 1): a 4 x 4
/// transpose of 64-bit pairs for keys 0-7, then 8-15.
template <int R>
inline void pairs_to_rows(const __m256d pairs[kTile / 2], vf rows[R]) {
  for (int half = 0; half < 2; ++half) {
    const __m256d* x = pairs + 4 * half;
    const __m256d t0 = _mm256_unpacklo_pd(x[0], x[1]), t1 = _mm256_unpackhi_pd(x[0], x[1]);
    const __m256d t2 = _mm256_unpacklo_pd(x[2], x[3]), t3 = _mm256_unpackhi_pd(x[2], x[3]);
    const __m256d r0 = _mm256_permute2f128_pd(t0, t2, 0x20), r1 = _mm256_permute2f128_pd(t1, t3, 0x20);
    const __m256d r2 = _mm256_permute2f128_pd(t0, t2, 0x31), r3 = _mm256_permute2f128_pd(t1, t3, 0x31);
    const __m256d out[4] = {r0, r1, r2, r3};
    for (int r = 0; r < R; ++r) std::memcpy(reinterpret_cast<char*>(&rows[r]) + 32 * half, &out[r], 32);
  }
}

/// q.k with fp32 FMAs: R (1-4) rows' queries stay in registers while two keys stream past them.
/// R < 4 serves GQA groups of 1-3 (a decode step of MHA, or of 3 query heads per KV head, would
/// otherwise spend 25-75% of its FMAs on padding rows).
template <class Read, int R = 4>
struct ScoreAvx2 {
  static constexpr int kRows = R;
  static void load_query(const AttentionArgs& a, int64_t base, float* q_row) {
    load_query_scattered(a, base, q_row, [](int64_t d) { return storage_index8<Read>(d); });
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
    pairs_to_rows<R>(pairs, rows);
  }
};

/// o += p.V with fp32 FMAs: R rows x 16 dims of output in registers while the keys stream past. int4 and
/// KIVI values dequantize each code here (scale * code + zero, Row8). NOTE: with the group scale on the
/// probabilities instead and the zeros added once per tile, the loop only widened codes but was slower
/// on Zen 3 (L1, 4 rows, head_dim 128, ns per key: int4 22.8 vs 21.2, KIVI 26-27 vs 24-25; int4's whole
/// step in cache 2-3%).
template <class Read, int R = 4>
struct PvAvx2 {
  static constexpr int kRows = R;
  static int64_t storage(int64_t d) { return storage_index8<Read>(d); }
  static void accumulate(float* o, int64_t D, const float (*p)[kTile], const typename Read::Elem* const* vrow,
                         const uint16_t* const* vmeta, int64_t n, Prefetcher& pf_state) {
    LocalPrefetcher pf(pf_state);
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
/// hsum8x8 in int32 lanes (wrapping: callers bound their sums).
inline __m256i hsum8x8_epi32(const __m256i v[8]) {
  const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i h0123 = _mm256_hadd_epi32(h01, h23), h4567 = _mm256_hadd_epi32(h45, h67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0123, h4567, 0x20), _mm256_permute2x128_si256(h0123, h4567, 0x31));
}

/// D fp32 values q rounded to integers c = round(q / qs) with qs = max|q| / top. Returns qs (1 for a zero row).
inline float quantize_i16(const float* q, int64_t D, float top, int32_t* c) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(q + d), abs_mask));
  const float m = hmax8(amax);
  const __m256 inv = _mm256_set1_ps(m > 0.f ? top / m : 0.f);
  for (int64_t d = 0; d < D; d += 8) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + d), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(q + d), inv)));
  }
  return m > 0.f ? m / top : 1.f;
}

/// Query row `base` as load_query_f32 makes it (scaled, rotated like the keys), quantized by quantize_i16, in
/// natural order. Returns qs.
inline float load_query_i16(const AttentionArgs& a, int64_t base, float top, int32_t* c) {
  float q[kMaxRotatedDim];
  load_query_f32(a, base, q);
  return quantize_i16(q, a.layout.head_dim, top, c);
}

/// 16 int32 values (|c| <= 32767), c0 then c1, as 16-bit lanes in that order: packs interleaves the two
/// vectors' 128-bit lanes; vpermq puts them back in order.
inline __m256i pack_i16(__m256i c0, __m256i c1) {
  return _mm256_permute4x64_epi64(_mm256_packs_epi32(c0, c1), 0xd8);
}

/// Lanes 2 r and 2 r + 1: row r's value x[r * stride] (a float of its query buffer), as the lanes of
/// hsum8x8's result for two keys; rows >= R: 0.
template <int R>
inline __m256 row_lanes_x2(const float* x, int64_t stride) {
  float v[4] = {};
  for (int r = 0; r < R; ++r) v[r] = x[r * stride];
  return _mm256_setr_ps(v[0], v[0], v[1], v[1], v[2], v[2], v[3], v[3]);
}

/// int8 keys against a query quantized once per row to 16 bits (AVX2 has no byte dot product that keeps
/// an 8-bit query's accuracy: vpmaddubsw saturates at 2 x 255 x 127, and one 8-bit level breaks the
/// FlashAttention rule, see load_query_q8x2): each 16 codes of a key widen to 16-bit lanes (one
/// vpmovsxbw) and one vpmaddwd per row multiplies them by the query's codes, summing pairs in int32. Where
/// the fp32 path widens every code to fp32 (two conversions per 8) and issues one FMA per 8 products,
/// this issues one multiply per 16. Query codes are bounded so that a whole row's sum fits int32
/// (|q16| <= 32767 and D 128 |q16| < 2^31), rounding by at most max|q| / 65534: far below bf16.
/// Row r's buffer: D int16 codes (D / 2 floats), then qs (q ~ q16 qs) in float D - 1.
template <int R = 4>
struct ScoreI8Avx2 {
  static constexpr int kRows = R;
  static void load_query(const AttentionArgs& a, int64_t base, float* q_row) {
    const int64_t D = a.layout.head_dim;
    alignas(32) int32_t c[kMaxRotatedDim];
    const float top = static_cast<float>(std::min<int64_t>(32767, ((int64_t(1) << 31) - 1) / (128 * D)));
    const float qs = load_query_i16(a, base, top, c);
    int16_t* codes = reinterpret_cast<int16_t*>(q_row);
    for (int64_t d = 0; d < D; d += 16) {
      const __m256i c0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(c + d));
      const __m256i c1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(c + d + 8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + d), pack_i16(c0, c1));
    }
    q_row[D - 1] = qs;
  }
  static void scores(const float* q, int64_t D, const int8_t* const* krow, const uint16_t* const* /*kmeta*/,
                     float /*scale*/, vf rows[R]) {
    const int16_t* qw = reinterpret_cast<const int16_t*>(q);  // row r at qw + 2 r D
    const __m256 qs_lanes = row_lanes_x2<R>(q + D - 1, D);
    __m256d pairs[kTile / 2];  // 64-bit lane r of pairs[k]: row r, keys 2k and 2k + 1
    for (int k = 0; k < kTile / 2; ++k) {
      __m256i acc[8];  // acc[2 r + t]: row r, key 2 k + t (rows >= R stay 0)
      for (auto& v : acc) v = _mm256_setzero_si256();
      const int8_t* k0 = krow[2 * k];
      const int8_t* k1 = krow[2 * k + 1];
      for (int64_t g = 0; g < D / 16; ++g) {
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k0 + 16 * g)));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k1 + 16 * g)));
        for (int r = 0; r < R; ++r) {
          const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + 2 * r * D + 16 * g));
          acc[2 * r] = _mm256_add_epi32(acc[2 * r], _mm256_madd_epi16(qv, w0));
          acc[2 * r + 1] = _mm256_add_epi32(acc[2 * r + 1], _mm256_madd_epi16(qv, w1));
        }
      }
      pairs[k] = _mm256_castps_pd(_mm256_mul_ps(_mm256_cvtepi32_ps(hsum8x8_epi32(acc)), qs_lanes));
    }
    pairs_to_rows<R>(pairs, rows);
  }
};

/// int4 keys (groups of 32 dims, an fp16 (scale, zero) each) against a query quantized once per row to 16
/// bits, as ScoreI8Avx2: a group's 16 bytes widen to 16-bit lanes, whose low nibbles (even dims) and high
/// nibbles (odd dims) one vpmaddwd each multiplies by the query's codes of those dims; the group's int32
/// sums then take the key's group scale in one FMA. score = qs sum_g (s_g I_g + z_g Q_g), Q_g the sum of
/// the query's codes over group g: the zeros of four groups (one fp16 load, s and z interleaved) multiply a
/// vector (0, Q_g, ...) per row and add into the same accumulator, whose lanes are summed at the end.
/// Where the fp32 path dequantizes every code (two conversions and an FMA per 8) before two FMAs per 16
/// products, this issues one multiply per 16 products and one FMA per 32. Needs head_dim % 64 == 0.
/// Row r's buffer: D int16 codes (per 32 dims: the 16 even dims, then the 16 odd), then (0, Q_g) per
/// group from float D / 2, and qs in float D - 1.
template <int R = 4>
struct ScoreI4Avx2 {
  static constexpr int kRows = R;
  static int64_t index(int64_t d) { return 32 * (d / 32) + (d % 2) * 16 + d % 32 / 2; }
  static void load_query(const AttentionArgs& a, int64_t base, float* q_row) {
    const int64_t D = a.layout.head_dim;
    alignas(32) int32_t c[kMaxRotatedDim];
    const float qs = load_query_i16(a, base, 32767.f, c);  // (codes <= 15: no bound on the sum needed)
    int16_t* codes = reinterpret_cast<int16_t*>(q_row);
    for (int64_t g = 0; g < D / 32; ++g) {
      int32_t sum = 0;
      for (int64_t d = 32 * g; d < 32 * g + 32; ++d) {
        codes[index(d)] = static_cast<int16_t>(c[d]);
        sum += c[d];
      }
      q_row[D / 2 + 2 * g] = 0.f;
      q_row[D / 2 + 2 * g + 1] = static_cast<float>(sum);  // |sum| <= 32 x 32767 < 2^24: exact
    }
    q_row[D - 1] = qs;
  }
  static void scores(const float* q, int64_t D, const uint8_t* const* krow, const uint16_t* const* kmeta,
                     float /*scale*/, vf rows[R]) {
    // NOTE: by 4 groups only where they tile the row: at head_dim 192, 320, ... the last load of 4 read two
    // groups past the key and the query (another row's codes, or scratch never written).
    if (D % 128 != 0) return scores_n<2>(q, D, krow, kmeta, rows);
    scores_n<4>(q, D, krow, kmeta, rows);
  }
  /// kGroups: groups per metadata load, 4 (head_dim % 128 == 0) or 2 (the other multiples of 64).
  template <int kGroups>
  static void scores_n(const float* q, int64_t D, const uint8_t* const* krow, const uint16_t* const* kmeta,
                       vf rows[R]) {
    const int16_t* qw = reinterpret_cast<const int16_t*>(q);  // row r at qw + 2 r D
    const __m256 qs_lanes = row_lanes_x2<R>(q + D - 1, D);
    const __m256i nibble = _mm256_set1_epi16(15);
    // (s, z) pairs of kGroups groups as fp32 lanes, and the rows' (0, Q_g) of them
    const auto meta = [](const uint16_t* m) {
      if constexpr (kGroups == 4) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m)));
      else return _mm256_zextps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m))));
    };
    const auto qzero = [](const float* p) {
      if constexpr (kGroups == 4) return _mm256_loadu_ps(p);
      else return _mm256_zextps128_ps256(_mm_loadu_ps(p));
    };
    __m256d pairs[kTile / 2];  // 64-bit lane r of pairs[k]: row r, keys 2k and 2k + 1
    for (int k = 0; k < kTile / 2; ++k) {
      __m256 acc[8];  // acc[2 r + t]: row r, key 2 k + t (rows >= R stay 0)
      for (auto& v : acc) v = _mm256_setzero_ps();
      const uint8_t* k0 = krow[2 * k];
      const uint8_t* k1 = krow[2 * k + 1];
      for (int64_t g0 = 0; g0 < D / 32; g0 += kGroups) {
        const __m256 sz0 = meta(kmeta[2 * k] + 2 * g0), sz1 = meta(kmeta[2 * k + 1] + 2 * g0);
        for (int r = 0; r < R; ++r) {
          const __m256 qz = qzero(q + r * D + D / 2 + 2 * g0);
          acc[2 * r] = _mm256_fmadd_ps(sz0, qz, acc[2 * r]);
          acc[2 * r + 1] = _mm256_fmadd_ps(sz1, qz, acc[2 * r + 1]);
        }
        for (int gi = 0; gi < kGroups; ++gi) {
          const int64_t g = g0 + gi;
          const __m256i x0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k0 + 16 * g)));
          const __m256i x1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k1 + 16 * g)));
          const __m256i e0 = _mm256_and_si256(x0, nibble), o0 = _mm256_srli_epi16(x0, 4);
          const __m256i e1 = _mm256_and_si256(x1, nibble), o1 = _mm256_srli_epi16(x1, 4);
          const __m256i lane = _mm256_set1_epi32(2 * gi);
          const __m256 s0 = _mm256_permutevar8x32_ps(sz0, lane), s1 = _mm256_permutevar8x32_ps(sz1, lane);
          for (int r = 0; r < R; ++r) {
            const __m256i* qg = reinterpret_cast<const __m256i*>(qw + 2 * r * D + 32 * g);
            const __m256i qe = _mm256_loadu_si256(qg), qo = _mm256_loadu_si256(qg + 1);
            const __m256i d0 = _mm256_add_epi32(_mm256_madd_epi16(qe, e0), _mm256_madd_epi16(qo, o0));
            const __m256i d1 = _mm256_add_epi32(_mm256_madd_epi16(qe, e1), _mm256_madd_epi16(qo, o1));
            acc[2 * r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), s0, acc[2 * r]);
            acc[2 * r + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), s1, acc[2 * r + 1]);
          }
        }
      }
      pairs[k] = _mm256_castps_pd(_mm256_mul_ps(hsum8x8(acc), qs_lanes));
    }
    pairs_to_rows<R>(pairs, rows);
  }
};

/// KIVI keys (per channel over a page: k_d = s_d c_d + z_d, s and z shared by the page's tokens) against a
/// bf16 query: score = sum_d (q_d s_d) c_d + q.z. The query is quantized once per row to 16 bits (q ~ qs q16)
/// and, once per page, the page's scales (s ~ sigma s16); w16 = q16 s16 / 2^15, rounded (one vpmulhrsw per
/// 16 dims and row), then stands for q * s, and each key's codes, widened to 16-bit lanes, go through one
/// vpmaddwd per row and 16 dims against it: no dequantization and no fp32 per key. (ScoreKivi on AVX-512
/// quantizes the product q * s itself, per page and row: on AVX2 that took 8 ns per key of a 23 ns q.k with
/// pages of 16; the rounding here is at most ~1.5 max|q| max|s| / 65534 per dim, far below bf16's.) The
/// constant takes the codes' midpoint m off the rounded w16 (score = a (c . w16) + q.(z + m s) -
/// m a sum(w16), a = qs sigma 2^15), so the rounding error is that of the centred codes. Sums fit int32:
/// 15 x 32767 x 1024 < 2^31.
/// Code order (w16's order), 16 lanes as two runs of 8 dims: 4 bits, per 32-dim chunk its low nibbles (dims
/// 0-15) then its high ones (16-31), the natural order; 2 bits, per 64 dims (two chunks, 16 bytes) bit field
/// f of the 16 bytes: dims 8f..8f+7 of the first chunk, then of the second. The page is known by its
/// metadata pointer (tiles lie in one page: the dispatch asks for pages of >= kTile tokens). Needs head_dim %
/// 64 == 0. Row r's buffer (row_floats(D)): the scaled query (fp32, natural order), q16 and w16 (D words each,
/// code order), then (a, constant, qs); row 0 then holds the prepared page's pointer from float 2 D + 4.
template <int kBits, int R = 4>
struct ScoreKiviAvx2 {
  static constexpr int kRows = R;
  static constexpr float kMid = ((1 << kBits) - 1) / 2.f;
  static int64_t row_floats(int64_t D) { return 2 * D + 8; }
  /// First dim of code vector v's lanes 0-7; lanes 8-15 are the kRun1 dims after it.
  static int64_t run0(int64_t v) { return kBits == 4 ? 16 * v : 64 * (v / 4) + 8 * (v % 4); }
  static constexpr int64_t kRun1 = kBits == 4 ? 8 : 32;
  static int16_t* q16(float* q_row, int64_t D) { return reinterpret_cast<int16_t*>(q_row + D); }
  static int16_t* w16(float* q_row, int64_t D) { return reinterpret_cast<int16_t*>(q_row + D + D / 2); }

  /// Natural-order int32 values c (|c| <= 32767) as 16-bit code vectors at out.
  static void pack_codes(const int32_t* c, int64_t D, int16_t* out) {
    for (int64_t v = 0; v < D / 16; ++v) {
      const __m256i c0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(c + run0(v)));
      const __m256i c1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(c + run0(v) + kRun1));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * v), pack_i16(c0, c1));
    }
  }

  static void load_query(const AttentionArgs& a, int64_t base, float* q_row) {
    const int64_t D = a.layout.head_dim;
    load_query_f32(a, base, q_row);
    alignas(32) int32_t c[kMaxRotatedDim];
    q_row[2 * D + 2] = quantize_i16(q_row, D, 32767.f, c);
    pack_codes(c, D, q16(q_row, D));
  }

  /// s16, then the block's rows' w16, a and constant, for the page whose metadata is `meta` (per 32-dim
  /// chunk, 32 fp16 scales then 32 zeros).
  static void prepare(float* q, int64_t D, const uint16_t* meta) {
    const int64_t stride = row_floats(D);
    const auto meta8 = [&](int64_t d, int64_t at) {  // dims d..d+7 of the scales (at 0) or zeros (at 32)
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 64 * (d / 32) + d % 32 + at)));
    };
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), mid = _mm256_set1_ps(kMid);
    alignas(32) float s[kMaxRotatedDim];
    __m256 smax = _mm256_setzero_ps(), qzm[R];
    for (int r = 0; r < R; ++r) qzm[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 sd = meta8(d, 0), zm = _mm256_fmadd_ps(sd, mid, meta8(d, 32));  // z + m s
      _mm256_store_ps(s + d, sd);
      smax = _mm256_max_ps(smax, _mm256_and_ps(sd, abs_mask));
      for (int r = 0; r < R; ++r) qzm[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * stride + d), zm, qzm[r]);
    }
    const float sm = hmax8(smax), sigma = sm / 32767.f;
    const __m256 inv = _mm256_set1_ps(sm > 0.f ? 32767.f / sm : 0.f);
    alignas(32) int32_t c[kMaxRotatedDim];
    for (int64_t d = 0; d < D; d += 8) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(c + d), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(s + d), inv)));
    }
    alignas(32) int16_t s16[kMaxRotatedDim];
    pack_codes(c, D, s16);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; ++r) {
      float* row = q + r * stride;
      const int16_t* qc = q16(row, D);
      int16_t* w = w16(row, D);
      __m256i wsum = _mm256_setzero_si256();
      for (int64_t v = 0; v < D / 16; ++v) {
        const __m256i x = _mm256_mulhrs_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qc + 16 * v)),
                                              _mm256_load_si256(reinterpret_cast<const __m256i*>(s16 + 16 * v)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 16 * v), x);
        wsum = _mm256_add_epi32(wsum, _mm256_madd_epi16(x, ones));
      }
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), wsum);
      int64_t sum = 0;
      for (int32_t x : lanes) sum += x;
      const float alpha = row[2 * D + 2] * sigma * 32768.f;
      row[2 * D] = alpha;
      row[2 * D + 1] = hsum8(qzm[r]) - kMid * alpha * static_cast<float>(sum);
    }
    const uintptr_t page = reinterpret_cast<uintptr_t>(meta);
    std::memcpy(q + 2 * D + 4, &page, sizeof page);
  }

  static void scores(float* q, int64_t D, const uint8_t* const* krow, const uint16_t* const* kmeta, float /*scale*/,
                     vf rows[R]) {
    const int64_t stride = row_floats(D);
    uintptr_t page;  // the page this block last prepared (0 before the first)
    std::memcpy(&page, q + 2 * D + 4, sizeof page);
    if (page != reinterpret_cast<uintptr_t>(kmeta[0])) prepare(q, D, kmeta[0]);
    const __m256 alpha = row_lanes_x2<R>(q + 2 * D, stride), cst = row_lanes_x2<R>(q + 2 * D + 1, stride);
    const int16_t* wr[R];  // row r's w16
    for (int r = 0; r < R; ++r) wr[r] = w16(q + r * stride, D);
    const __m256i mask = _mm256_set1_epi16((1 << kBits) - 1);
    const auto widen = [](const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); };
    __m256d pairs[kTile / 2];  // 64-bit lane r of pairs[k]: row r, keys 2k and 2k + 1
    for (int k = 0; k < kTile / 2; ++k) {
      __m256i acc[8];  // acc[2 r + t]: row r, key 2 k + t (rows >= R stay 0)
      for (auto& v : acc) v = _mm256_setzero_si256();
      const uint8_t* k0 = krow[2 * k];
      const uint8_t* k1 = krow[2 * k + 1];
      // code vector v: 16 bytes at `at` (4 bits: chunk v / 2; 2 bits: chunks 2 (v / 4), 2 (v / 4) + 1), field f
      constexpr int kFields = 8 / kBits;  // code vectors per 16 bytes
      for (int64_t v = 0; v < D / 16; ++v) {
        const int64_t at = 16 * (v / kFields);
        const int f = int(v % kFields);
        // NOTE: widened again per field, from L1, rather than kept: kept, the widened bytes of both keys and
        // the 8 accumulators no longer fit the 16 registers (spilled on every step)
        const __m128i shift = _mm_cvtsi32_si128(kBits * f);
        const __m256i e0 = _mm256_and_si256(_mm256_srl_epi16(widen(k0 + at), shift), mask);
        const __m256i e1 = _mm256_and_si256(_mm256_srl_epi16(widen(k1 + at), shift), mask);
        for (int r = 0; r < R; ++r) {
          const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[r] + 16 * v));
          acc[2 * r] = _mm256_add_epi32(acc[2 * r], _mm256_madd_epi16(qv, e0));
          acc[2 * r + 1] = _mm256_add_epi32(acc[2 * r + 1], _mm256_madd_epi16(qv, e1));
        }
      }
      pairs[k] = _mm256_castps_pd(_mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum8x8_epi32(acc)), alpha, cst));
    }
    pairs_to_rows<R>(pairs, rows);
  }
};

/// The score policy of a reader on AVX2 for a bf16 query: 16-bit integer dot products for int8 keys, int4
/// keys (head_dim % 64 == 0) and KIVI keys (head_dim % 64 == 0, pages of >= kTile tokens), fp32 FMAs for
/// the rest. P.V keeps fp32 FMAs for every format: on Zen 3 (8 x 32k, GQA 4, head_dim 128) vpmaddwd with
/// 16-bit probabilities, two keys' codes interleaved per multiply, took int8's P.V from 15-17 to 15-17 ns per
/// key and KV head and int4's from 24-25 to 27-28 (its probabilities re-quantized per 32-dim group), and
/// rounded the probabilities.
template <class Read, int R>
struct Avx2Score {
  using type = ScoreAvx2<Read, R>;
  static bool fits(const AttentionArgs&) { return false; }
};
template <int R>
struct Avx2Score<ReadI8, R> {
  using type = ScoreI8Avx2<R>;
  static bool fits(const AttentionArgs&) { return true; }
};
template <int R>
struct Avx2Score<ReadI4, R> {
  using type = ScoreI4Avx2<R>;
  static bool fits(const AttentionArgs& a) { return a.layout.head_dim % 64 == 0; }
};
template <int kBits, int R>
struct Avx2Score<ReadKivi<kBits, true>, R> {
  using type = ScoreKiviAvx2<kBits, R>;
  static bool fits(const AttentionArgs& a) { return a.layout.head_dim % 64 == 0 && a.layout.page_size >= kTile; }
};
#define KVC_AVX2_POLICIES 1
#endif

}  // namespace kvcache::cpu::KVC_ISA
