// Score (q.k) and P.V policies of the 16-lane builds (AVX-512 and generic): fp32 FMAs on widened
// rows, bf16 dot products (AVX-512 BF16) and int16 dot products for int8 codes (AVX-512 VNNI).
// Part of the CPU attention kernel (see attention/attention_cpu_kernel.h), compiled once per instruction set.
#pragma once

#ifndef KVC_ISA
#error "define KVC_ISA (the namespace of this instruction-set build) before including this header"
#endif

#include "attention/cpu_kernel/task_state.h"

namespace kvcache::cpu::KVC_ISA {

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

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
/// int8 keys against a query quantized to 15 bits per row (q ~ q16 * qs, |q16| <= 32767): codes
/// sign-extend to int16 in one instruction and vpdpwssd multiplies int16 pairs exactly into int32, so a
/// key costs one widening per 32 dims instead of four conversions and a bf16 pack. The query's rounding
/// (at most max|q| / 65534 per dim) is far below the rounding a bf16 query already carries; fp32 and
/// fp16 queries keep the exact fp32 path. Row r's buffer: D int16 values, its scale qs in float D - 1.
template <int R = 4>
struct ScoreWd {
  static constexpr int kRows = R;
  static constexpr int kKeys = kTile / R;
  static void load_query(const AttentionArgs& a, int64_t base, float* q_row) {
    const int64_t D = a.layout.head_dim;
    float q[kMaxRotatedDim];
    load_query_f32(a, base, q);  // scaled by a.scale (and rotated like the keys)
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::fmax(amax, std::fabs(q[d]));
    const float qs = amax > 0.f ? amax / 32767.f : 1.f, inv = 1.f / qs;
    int16_t* q16 = reinterpret_cast<int16_t*>(q_row);
    for (int64_t d = 0; d < D; ++d) {  // |q[d] * inv| <= 32767 (+ rounding): clamped, then rounded to nearest
      const float x = q[d] * inv;
      q16[d] = static_cast<int16_t>(std::lrint(x > 32767.f ? 32767.f : (x < -32767.f ? -32767.f : x)));
    }
    q_row[D - 1] = qs;
  }
  static void scores(const float* q, int64_t D, const int8_t* const* krow, const uint16_t* const* /*kmeta*/,
                     float /*scale*/, vf rows[R]) {
    const int16_t* qw = reinterpret_cast<const int16_t*>(q);  // rows D fp32 = 2 D int16 apart
    vf row_scale;  // lane k of a reduce16 result belongs to row k / kKeys
    for (int k = 0; k < kLanes; ++k) row_scale[k] = q[(k / kKeys) * D + D - 1];
    vf part[R];
#pragma GCC unroll 4
    for (int g = 0; g < R; ++g) {
      __m512i acc[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_si512();
      for (int64_t c = 0; c < D / 32; ++c) {
        __m512i qv[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) qv[r] = _mm512_loadu_si512(qw + r * 2 * D + 32 * c);
#pragma GCC unroll 16
        for (int j = 0; j < kKeys; ++j) {
          const __m512i k = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(krow[g * kKeys + j] + 32 * c)));
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) acc[r * kKeys + j] = _mm512_dpwssd_epi32(acc[r * kKeys + j], qv[r], k);
        }
      }
      vf accv[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) accv[i] = (vf)_mm512_cvtepi32_ps(acc[i]);
      part[g] = reduce16(accv) * row_scale;
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
                         const uint16_t* const* vmeta, int64_t /*n = kTile*/, Prefetcher& pf_state) {
    LocalPrefetcher pf(pf_state);
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
                         const uint16_t* const* /*vmeta*/, int64_t /*n = kTile*/, Prefetcher& pf_state) {
    LocalPrefetcher pf(pf_state);
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

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
/// int8 values: each row's probabilities (the values' per-token scales already on them) quantized to 15
/// bits against the tile's largest, paired as PvDp pairs bf16, and vpdpwssd against two keys' codes
/// sign-extended to int16 and interleaved; the int32 sums go to the fp32 outputs once per tile. The
/// probabilities keep 15 bits, where PvDp's bf16 pairs keep 8. Outputs in PvDp's order.
template <int R = 4>
struct PvWd {
  static constexpr int kRows = R;
  static int64_t storage(int64_t d) { return PvDp<ReadBF16, R>::storage(d); }
  static void accumulate(float* o, int64_t D, const float (*p)[kTile], const int8_t* const* vrow,
                         const uint16_t* const* /*vmeta*/, int64_t /*n = kTile*/, Prefetcher& pf_state) {
    LocalPrefetcher pf(pf_state);
    alignas(64) uint32_t pairs[R][kTile / 2];  // (p16_2i, p16_2i+1)
    __m512 ps[R];                               // p = p16 * ps
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 pr = _mm512_loadu_ps(p[r]);
      const float pmax = _mm512_reduce_max_ps(pr);
      const float scale = pmax > 0.f ? pmax / 32767.f : 0.f;
      ps[r] = _mm512_set1_ps(scale);
      const __m512i p16 = _mm512_cvtps_epi32(_mm512_mul_ps(pr, _mm512_set1_ps(pmax > 0.f ? 1.f / scale : 0.f)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[r]), _mm512_cvtsepi32_epi16(p16));  // saturating
    }
    for (int64_t c = 0; c < D / 32; ++c) {
      __m512i oa[R], ob[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) oa[r] = ob[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int jp = 0; jp < kTile / 2; ++jp) {
        pf.step(2);
        const __m512i v0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[2 * jp] + 32 * c)));
        const __m512i v1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[2 * jp + 1] + 32 * c)));
        const __m512i lo = _mm512_unpacklo_epi16(v0, v1), hi = _mm512_unpackhi_epi16(v0, v1);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m512i pp = _mm512_set1_epi32(static_cast<int>(pairs[r][jp]));
          oa[r] = _mm512_dpwssd_epi32(oa[r], lo, pp);
          ob[r] = _mm512_dpwssd_epi32(ob[r], hi, pp);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        float* out = o + r * D + 32 * c;
        _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(oa[r]), ps[r], _mm512_loadu_ps(out)));
        _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(ob[r]), ps[r], _mm512_loadu_ps(out + 16)));
      }
    }
  }
};
#endif

}  // namespace kvcache::cpu::KVC_ISA
