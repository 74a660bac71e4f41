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
/// o += p.V for int4 values. A group's V is scale * code + zero, so p.V = (p scale).code + sum(p zero):
/// the scale rides on the probabilities and the zeros are added once per tile, so the loop over the
/// keys only widens codes (no per-key (scale, zero) loads and no dequantizing multiply-add).
template <int R>
struct PvAvx2<ReadI4, R> {
  static constexpr int kRows = R;
  static int64_t storage(int64_t d) { return storage_index8<ReadI4>(d); }
  static void accumulate(float* o, int64_t D, const float (*p)[kTile], const uint8_t* const* vrow,
                         const uint16_t* const* vmeta, int64_t n, Prefetcher& pf_state) {
    LocalPrefetcher pf(pf_state);
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

}  // namespace kvcache::cpu::KVC_ISA
