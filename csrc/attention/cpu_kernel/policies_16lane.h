// Score (q.k) and P.V policies of the 16-lane builds (AVX-512 and generic): fp32 FMAs on widened
// rows, bf16 dot products (AVX-512 BF16) and byte dot products for int8 codes (AVX-512 VNNI).
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
/// int8 keys against a query quantized once per row to int8 (q ~ q8 * qs, as llama.cpp's q8 activations),
/// 64 dims per vpdpbusd: the codes, offset by 128 to unsigned (one xor), multiply the signed query bytes
/// into int32, and 128 * sum(q8) comes off after: 64 products per instruction, no widening of the
/// codes (int8 cache, Zen 4: q.k 10.7 -> 8.4 ns per key and KV head against int16 products). The
/// query's rounding (at most max|q| / 254 per dim) is of the order of the keys' own and of PyTorch's
/// bf16 attention (log-sum-exp error 1-2x PyTorch's in bf16, tests/test_quantized.py). Needs
/// head_dim % 64 == 0. Row r's buffer: D int8 values, then sum(q8) in float D - 2 and qs in float D - 1.
template <int R = 4>
struct ScoreB8 {
  static constexpr int kRows = R;
  static constexpr int kKeys = kTile / R;
  static void load_query(const AttentionArgs& a, int64_t base, float* q_row) {
    const int64_t D = a.layout.head_dim;
    float q[kMaxRotatedDim];
    load_query_f32(a, base, q);  // scaled by a.scale (and rotated like the keys)
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::fmax(amax, std::fabs(q[d]));
    const float qs = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / qs;
    int8_t* q8 = reinterpret_cast<int8_t*>(q_row);
    int32_t sum = 0;
    for (int64_t d = 0; d < D; ++d) {  // |q[d] * inv| <= 127 (+ rounding): clamped, then rounded to nearest
      const float x = q[d] * inv;
      q8[d] = static_cast<int8_t>(std::lrint(x > 127.f ? 127.f : (x < -127.f ? -127.f : x)));
      sum += q8[d];
    }
    q_row[D - 2] = static_cast<float>(sum);
    q_row[D - 1] = qs;
  }
  static void scores(const float* q, int64_t D, const int8_t* const* krow, const uint16_t* const* kmeta, float scale,
                     vf rows[R]) {
    // NOTE: with a run-time chunk count GCC neither unrolled the chunk loop nor kept the 16 accumulators
    // in place across it (16 register copies and 2 spills per chunk); head_dim 128 and 64 get their own.
    if (D == 128) return scores_n<2>(q, D, krow, kmeta, scale, rows);
    if (D == 64) return scores_n<1>(q, D, krow, kmeta, scale, rows);
    scores_n<0>(q, D, krow, kmeta, scale, rows);
  }
  template <int kChunks>  // D / 64, or 0: read from D
  static void scores_n(const float* q, int64_t D, const int8_t* const* krow, const uint16_t* const* /*kmeta*/,
                       float /*scale*/, vf rows[R]) {
    const int64_t chunks = kChunks > 0 ? kChunks : D / 64;
    const int8_t* qb = reinterpret_cast<const int8_t*>(q);  // rows D fp32 = 4 D bytes apart
    vf row_scale, row_offset;  // lane k of a reduce16 result belongs to row k / kKeys
    for (int k = 0; k < kLanes; ++k) {
      const float* qr = q + (k / kKeys) * D;
      row_scale[k] = qr[D - 1];
      row_offset[k] = 128.f * qr[D - 2];
    }
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    vf part[R];
#pragma GCC unroll 4
    for (int g = 0; g < R; ++g) {
      __m512i acc[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int64_t c = 0; c < chunks; ++c) {
#pragma GCC unroll 16
        for (int j = 0; j < kKeys; ++j) {
          const __m512i k = _mm512_xor_si512(_mm512_loadu_si512(krow[g * kKeys + j] + 64 * c), flip);  // k + 128
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            acc[r * kKeys + j] = _mm512_dpbusd_epi32(acc[r * kKeys + j], k, _mm512_loadu_si512(qb + r * 4 * D + 64 * c));
          }
        }
      }
      vf accv[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) accv[i] = (vf)_mm512_cvtepi32_ps(acc[i]);
      part[g] = (reduce16(accv) - row_offset) * row_scale;
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
/// int8 values: each row's probabilities (the values' per-token scales already on them, so >= 0)
/// quantized to unsigned 8 bits against the tile's largest, and vpdpbusd against four keys' codes
/// interleaved byte-wise: 4 keys x 16 dims per instruction, twice vdpbf16ps's. The int32 sums go to
/// the fp32 outputs once per tile. Needs head_dim % 64 == 0. Outputs, per 64-dim chunk: accumulator k
/// lane 4L + m is dim 16L + 4k + m (the order of vpunpck{l,h}bw then vpunpck{l,h}wd).
template <int R = 4>
struct PvB8 {
  static constexpr int kRows = R;
  static int64_t storage(int64_t d) {
    const int64_t c = d / 64, L = d % 64 / 16, k = d % 16 / 4, m = d % 4;
    return 64 * c + 16 * k + 4 * L + m;
  }
  static void accumulate(float* o, int64_t D, const float (*p)[kTile], const int8_t* const* vrow,
                         const uint16_t* const* /*vmeta*/, int64_t /*n = kTile*/, Prefetcher& pf_state) {
    LocalPrefetcher pf(pf_state);
    alignas(64) uint32_t quads[R][kTile / 4];  // (p8_4i .. p8_4i+3)
    __m512 ps[R];                               // p = p8 * ps
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 pr = _mm512_loadu_ps(p[r]);
      const float pmax = _mm512_reduce_max_ps(pr);
      const float scale = pmax > 0.f ? pmax / 255.f : 0.f;
      ps[r] = _mm512_set1_ps(scale);
      const __m512i p8 = _mm512_cvtps_epi32(_mm512_mul_ps(pr, _mm512_set1_ps(pmax > 0.f ? 1.f / scale : 0.f)));
      _mm_store_si128(reinterpret_cast<__m128i*>(quads[r]), _mm512_cvtusepi32_epi8(p8));  // saturating
    }
    for (int64_t c = 0; c < D / 64; ++c) {
      __m512i acc[R][4];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int jq = 0; jq < kTile / 4; ++jq) {
        pf.step(4);  // a tile is 16 x D / 64 lines of K and of V: 4 per (quad, chunk)
        const int8_t* const* v = vrow + 4 * jq;
        const __m512i v0 = _mm512_loadu_si512(v[0] + 64 * c), v1 = _mm512_loadu_si512(v[1] + 64 * c);
        const __m512i v2 = _mm512_loadu_si512(v[2] + 64 * c), v3 = _mm512_loadu_si512(v[3] + 64 * c);
        const __m512i t0 = _mm512_unpacklo_epi8(v0, v1), t1 = _mm512_unpackhi_epi8(v0, v1);
        const __m512i t2 = _mm512_unpacklo_epi8(v2, v3), t3 = _mm512_unpackhi_epi8(v2, v3);
        const __m512i u[4] = {_mm512_unpacklo_epi16(t0, t2), _mm512_unpackhi_epi16(t0, t2),
                              _mm512_unpacklo_epi16(t1, t3), _mm512_unpackhi_epi16(t1, t3)};
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m512i pq = _mm512_set1_epi32(static_cast<int>(quads[r][jq]));
#pragma GCC unroll 4
          for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_dpbusd_epi32(acc[r][k], pq, u[k]);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        float* out = o + r * D + 64 * c;
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          _mm512_storeu_ps(out + 16 * k, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][k]), ps[r], _mm512_loadu_ps(out + 16 * k)));
        }
      }
    }
  }
};
#endif

}  // namespace kvcache::cpu::KVC_ISA
