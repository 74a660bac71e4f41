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
    load_query_scattered(a, base, q_row, [](int64_t d) { return storage_index<Read>(d); });
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
/// bf16 bits of fp8 magnitude codes 0-127 times ReadFp8's 1 / kFactor (e4m3fn: value / 256, so the caller's
/// scale is the same as on the fp32 path; e5m2: the value). Every fp8 value, subnormals included, is a
/// normal bf16 number: the table is exact. e4m3fn's 0x7f is NaN, e5m2's exponent 31 inf / NaN.
template <bool kE4M3>
struct Fp8Bf16Table {
  static constexpr uint16_t bits(int c) {
    const int mbits = kE4M3 ? 3 : 2, e = c >> mbits, m = c & ((1 << mbits) - 1);
    if (kE4M3 && c == 0x7f) return 0x7fc0;
    if (!kE4M3 && e == 31) return m == 0 ? 0x7f80 : 0x7fc0;
    // normal: value 2^(e - bias) (1 + m / 2^mbits), over kFactor: bf16 exponent field e + 112 in both formats
    if (e > 0) return static_cast<uint16_t>(((e + 112) << 7) | (m << (7 - mbits)));
    if (m == 0) return 0;
    // subnormal: m 2^(1 - bias - mbits) / kFactor = m 2^-17 (e4m3fn) or 2^-16 (e5m2), normalized at m's top bit p
    const int p = m >= 4 ? 2 : (m >= 2 ? 1 : 0);
    return static_cast<uint16_t>(((p + (kE4M3 ? 110 : 111)) << 7) | ((m << (7 - p)) & 0x7f));
  }
  struct Words { alignas(64) uint16_t w[128]; };
  static constexpr Words make() {
    Words t{};
    for (int c = 0; c < 128; ++c) t.w[c] = bits(c);
    return t;
  }
  static constexpr Words kWords = make();
};

/// 32 values of a row as bf16, in natural order, for the bf16 dot products: bf16 pools load as they are,
/// fp8 codes go through a table (below). (int8, int4 and KIVI take byte or 16-bit dot products instead.)
template <class Read>
struct Bf16Chunks;
template <>
struct Bf16Chunks<ReadBF16> {
  static __m512i load(const uint16_t* row, int64_t c) { return _mm512_loadu_si512(row + 32 * c); }
};

/// fp8 codes to bf16 bits by table (Fp8Bf16Table), two vpermt2w lookups of 64 words each: bits 0-5 of a
/// code pick a word of both halves of the table, bit 6 picks the half, bit 7 is the sign. 7 instructions
/// per 32 codes, where widening through fp16 and fp32 took 15 and a store-to-load round trip. The full
/// 64-dim blocks take byte lookups instead (ScoreFp8Bytes, PvFp8Bytes); this serves a last 32 dims.
template <bool kE4M3>
struct Bf16Chunks<ReadFp8<kE4M3>> {
  static __m512i load(const uint8_t* row, int64_t c) {
    const uint16_t* t = Fp8Bf16Table<kE4M3>::kWords.w;
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c)));
    const __m512i lo = _mm512_permutex2var_epi16(_mm512_load_si512(t), w, _mm512_load_si512(t + 32));
    const __m512i hi = _mm512_permutex2var_epi16(_mm512_load_si512(t + 64), w, _mm512_load_si512(t + 96));
    const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40)), lo, hi);
    return _mm512_or_si512(mag, _mm512_and_si512(_mm512_slli_epi16(w, 8), _mm512_set1_epi16(int16_t(0x8000))));
  }
};

/// Scores of a register block of R rows with bf16 dot products: for each group g of kKeys keys, `body(g, acc)`
/// fills 16 fp32 accumulators (row r, key j at r kKeys + j), which are reduced, scaled and handed out as rows.
template <int R, class Body>
__attribute__((always_inline)) inline void dp_scores(float scale, vf rows[R], Body&& body) {
  vf part[R];
#pragma GCC unroll 4
  for (int g = 0; g < R; ++g) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    body(g, acc);
    vf accv[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) accv[i] = (vf)acc[i];
    part[g] = reduce16(accv) * scale;
  }
  parts_to_rows<R>(part, rows);
}

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
    dp_scores<R>(scale, rows, [&](int g, __m512* acc) __attribute__((always_inline)) {
      for (int64_t c = 0; c < D / 32; ++c) chunk(qb, D, krow, g, c, acc);
    });
  }
  /// Dims 32 c .. 32 c + 31 of the products of the R rows with keys g kKeys .. (g + 1) kKeys - 1.
  __attribute__((always_inline)) static void chunk(const uint16_t* qb, int64_t D, const typename KRead::Elem* const* krow,
                                                   int g, int64_t c, __m512* acc) {
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
};
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
/// Query row `base` as load_query_f32 makes it (scaled, rotated like the keys), quantized in two int8
/// levels: q ~ (128 coarse + fine) * qs / 128, coarse = round(q / qs) with qs = max|q| / 127, fine the
/// rounded remainder in steps of qs / 128 (|fine| <= 64). Returns qs. head_dim % 16 == 0.
/// Why two levels: one level (llama.cpp's q8 activations) rounds each dim by up to max|q| / 254, ~6x
/// bf16's rounding of a Gaussian query; at head_dim 128 that put a quarter of random attention calls
/// over the FlashAttention rule (2x PyTorch's bf16 error). Two levels cost a second pass of byte dot
/// products over keys already in L1 and round by max|q| / 32512, far below bf16.
/// NOTE: vectorized: the scalar loop called libm's fmaxf and lrintf per element (8% of an int4 step
/// from cache).
inline float load_query_q8x2(const AttentionArgs& a, int64_t base, int8_t* coarse, int8_t* fine) {
  const int64_t D = a.layout.head_dim;
  float q[kMaxRotatedDim];
  load_query_f32(a, base, q);
  __m512 amax = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(q + d)));
  const float m = hmax((vf)(amax));
  const float qs = m > 0.f ? m / 127.f : 1.f;
  const __m512 inv = _mm512_set1_ps(1.f / qs), inv_fine = _mm512_set1_ps(128.f / qs), step = _mm512_set1_ps(qs);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 x = _mm512_loadu_ps(q + d);
    const __m512i c = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x, inv)), lo), hi);
    const __m512 rest = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(c), step, x);  // x - c qs, exact-ish in fp32
    const __m512i f = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(rest, inv_fine)), lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(coarse + d), _mm512_cvtepi32_epi8(c));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(fine + d), _mm512_cvtepi32_epi8(f));
  }
  return qs;
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
/// The (scale, zero) pairs of chunk c (4 groups of 32 dims) of 16 keys' int4 rows, as columns: S[g] and
/// Z[g] hold the scales and zeros of group 4 c + g, lane j for key j. Two 8 x 8 transposes side by side
/// (keys 0-7 in the low halves, 8-15 in the high), 24 shuffles. kTwoGroups: rows of 2 groups (head_dim
/// 64), read no further; S and Z of groups 2-3 are 0.
template <bool kTwoGroups = false>
inline void int4_meta_columns(const uint16_t* const* meta, int64_t c, __m512 S[4], __m512 Z[4]) {
  const auto pairs = [&](int i) {
    const uint16_t* m = meta[i] + 8 * c;
    const __m128i x = kTwoGroups ? _mm_maskz_loadu_epi16(0x0f, m) : _mm_loadu_si128(reinterpret_cast<const __m128i*>(m));
    return _mm256_cvtph_ps(x);
  };
  __m512 b[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) b[i] = _mm512_insertf32x8(_mm512_castps256_ps512(pairs(i)), pairs(i + 8), 1);
  __m512 t[8], u[8];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    // vunpck{l,h}ps (as shuffles: GCC 12 warns about the intrinsics' undefined pass-through operand)
    const vf x = (vf)b[2 * i], y = (vf)b[2 * i + 1];
    t[2 * i] = (__m512)__builtin_shufflevector(x, y, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29);
    t[2 * i + 1] = (__m512)__builtin_shufflevector(x, y, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  // 128-bit lanes (a0, b0, a2, b2) and (a1, b1, a3, b3): each 256-bit half's two lanes, as vperm2f128
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
  const __m512i hi_idx = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  __m512 col[8];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    col[i] = _mm512_permutex2var_ps(u[i], lo_idx, u[i + 4]);
    col[i + 4] = _mm512_permutex2var_ps(u[i], hi_idx, u[i + 4]);
  }
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {
    S[g] = col[2 * g];
    Z[g] = col[2 * g + 1];
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
/// col[i] = dword i of the 16 rows x[0..15] (lane j: row j): a 16 x 16 transpose of dwords, 64 shuffles.
/// kHalf: only columns 0-7 (rows of 8 dwords) are made.
template <bool kHalf = false>
__attribute__((always_inline)) inline void transpose16x16_epi32(const __m512i x[16], __m512i col[16]) {
  __m512i t[16], u[16];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(x[2 * k], x[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(x[2 * k], x[2 * k + 1]);
  }
  // u[4 k + m], 128-bit lane L: dword 4 L + m of rows 4 k .. 4 k + 3
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    u[4 * k + 0] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m) {
    const __m512i a = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88);
    const __m512i b = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xdd);
    const __m512i c = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88);
    const __m512i d = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xdd);
    col[m] = _mm512_shuffle_i32x4(a, c, 0x88);      // lane 0 of every u: columns 0-3
    col[4 + m] = _mm512_shuffle_i32x4(b, d, 0x88);  // lane 1: columns 4-7
    if constexpr (!kHalf) {
      col[8 + m] = _mm512_shuffle_i32x4(a, c, 0xdd);   // lane 2
      col[12 + m] = _mm512_shuffle_i32x4(b, d, 0xdd);  // lane 3
    }
  }
}

/// int4 keys (groups of 32 dims, fp16 (scale, zero) each) against the query quantized once per row in two
/// int8 levels (load_query_q8x2), with the tile's 16 keys in the vector lanes: the codes of 16 keys are
/// transposed a dword (8 dims) at a time, and vpdpbusd multiplies a column's low nibbles (even dims) and
/// high nibbles (odd dims) by the query's even and odd bytes of those dims, broadcast. A group's sums then
/// sit one key per lane, where its scale and zero are one vector each (score_j = qs sum_g (s_jg I_jg +
/// z_jg Q_g), Q_g the sum of the rounded query over group g): no horizontal reduction, and the per-key
/// metadata is a 16 x 8 transpose per tile instead of shuffles per key. (With keys in rows, a reduction
/// per 16 sums and the scales spread per key, q.k took 12.3 of an int4 step's 30.8 ns per key and KV head
/// from DRAM; in lanes the whole step takes 0.86-0.92x as long, Zen 5.) The coarse level's sums shift
/// left by 7 before the fine level adds into them, as in ScoreB8. Needs head_dim % 64 == 0.
/// Row r's buffer: D / 2 even then D / 2 odd coarse query bytes, the fine ones likewise from byte D; Q_g
/// (of 128 coarse + fine) in float D / 2 + g; qs / 128 in float D - 1.
template <int R = 4>
struct ScoreB4 {
  static constexpr int kRows = R;
  static void load_query(const AttentionArgs& a, int64_t base, float* q_row) {
    const int64_t D = a.layout.head_dim;
    int8_t coarse[kMaxRotatedDim], fine[kMaxRotatedDim];
    const float qs = load_query_q8x2(a, base, coarse, fine);
    int8_t* q8 = reinterpret_cast<int8_t*>(q_row);
    for (int64_t d = 0; d < D; ++d) {
      q8[(d & 1) * (D / 2) + d / 2] = coarse[d];
      q8[D + (d & 1) * (D / 2) + d / 2] = fine[d];
    }
    // Q_g sums the rounded query: the zero and the codes then meet the same query, and the error is that
    // of q8 . k (with the exact query here it was q8 . (k - zero), ~3x larger).
    for (int64_t g = 0; g < D / 32; ++g) {
      int32_t sum = 0;
      for (int64_t i = 0; i < 32; ++i) sum += 128 * coarse[32 * g + i] + fine[32 * g + i];
      q_row[D / 2 + g] = static_cast<float>(sum);  // |sum| <= 32 * 16320 < 2^24: exact
    }
    q_row[D - 1] = qs / 128.f;
  }
  static void scores(const float* q, int64_t D, const uint8_t* const* krow, const uint16_t* const* kmeta, float scale,
                     vf rows[R]) {
    // (head_dim 128 and 64 get their own unrolled loops: see ScoreB8)
    if (D == 128) return scores_n<1>(q, D, krow, kmeta, scale, rows);
    if (D == 64) return scores_n<-1>(q, D, krow, kmeta, scale, rows);
    scores_n<0>(q, D, krow, kmeta, scale, rows);
  }
  template <int kBlocks>  // 128-dim blocks; -1: one half block (head_dim 64); 0: read from D
  static void scores_n(const float* q, int64_t D, const uint8_t* const* krow, const uint16_t* const* kmeta,
                       float /*scale*/, vf rows[R]) {
    if constexpr (kBlocks != 0) D = kBlocks > 0 ? 128 * kBlocks : 64;  // (a constant: addresses fold)
    const int8_t* qb = reinterpret_cast<const int8_t*>(q);  // rows D fp32 = 4 D bytes apart
    const __m512i nib = _mm512_set1_epi8(0x0f);
    __m512 sc[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) sc[r] = _mm512_setzero_ps();
    const auto block = [&]<bool kHalf>(int64_t b, std::bool_constant<kHalf>) {
      __m512i x[16], col[16];
#pragma GCC unroll 16
      for (int j = 0; j < kTile; ++j) {
        x[j] = kHalf ? _mm512_maskz_loadu_epi32(0x00ff, krow[j] + 64 * b) : _mm512_loadu_si512(krow[j] + 64 * b);
      }
      transpose16x16_epi32<kHalf>(x, col);
      __m512 S[4], Z[4];
      int4_meta_columns<kHalf>(kmeta, b, S, Z);
#pragma GCC unroll 4
      for (int g = 0; g < (kHalf ? 2 : 4); ++g) {
        __m512i lo[4], hi[4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          lo[i] = _mm512_and_si512(col[4 * g + i], nib);
          hi[i] = _mm512_and_si512(_mm512_srli_epi32(col[4 * g + i], 4), nib);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const int8_t* qr = qb + r * 4 * D + 64 * b + 16 * g;  // the group's even query bytes, coarse level
          // even and odd dims in two accumulators: two dependency chains of 8 vpdpbusd, not one of 16
          // (the int4 step 0.94-0.96x as long, Zen 5)
          __m512i even_acc = _mm512_setzero_si512(), odd_acc = _mm512_setzero_si512();
#pragma GCC unroll 2
          for (int level = 0; level < 2; ++level) {  // coarse query bytes at 0, fine ones at D
            if (level == 1) {
              even_acc = _mm512_slli_epi32(even_acc, 7);
              odd_acc = _mm512_slli_epi32(odd_acc, 7);
            }
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) {
              int32_t even, odd;
              std::memcpy(&even, qr + level * D + 4 * i, 4);
              std::memcpy(&odd, qr + level * D + D / 2 + 4 * i, 4);
              even_acc = _mm512_dpbusd_epi32(even_acc, lo[i], _mm512_set1_epi32(even));
              odd_acc = _mm512_dpbusd_epi32(odd_acc, hi[i], _mm512_set1_epi32(odd));
            }
          }
          const __m512i acc = _mm512_add_epi32(even_acc, odd_acc);
          const __m512 qsum = _mm512_set1_ps(q[r * D + D / 2 + 4 * b + g]);
          sc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), S[g], _mm512_fmadd_ps(Z[g], qsum, sc[r]));
        }
      }
    };
    if constexpr (kBlocks < 0) {
      block(0, std::true_type{});
    } else {
      const int64_t full = kBlocks > 0 ? kBlocks : D / 128;
#pragma GCC unroll 1
      for (int64_t b = 0; b < full; ++b) block(b, std::false_type{});
      if (kBlocks == 0 && D % 128 != 0) block(full, std::true_type{});
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) rows[r] = (vf)_mm512_mul_ps(sc[r], _mm512_set1_ps(q[r * D + D - 1]));
  }
};
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
/// int8 keys against a query quantized once per row in two int8 levels (load_query_q8x2), with the tile's
/// 16 keys in the vector lanes: 64 bytes of 16 keys' codes are transposed a dword (4 dims) per vector, and
/// vpdpbusd multiplies a column's codes, offset by 128 to unsigned (one xor), by the query's 4 signed bytes
/// of those dims, broadcast; 128 * sum(q) comes off after. A score is then one lane: no horizontal
/// reduction (keys in rows, with one reduce16 per 16 sums, made an int8 step 1.14x as long from DRAM and
/// 1.23x from cache, Zen 5). The coarse sums shift left by 7 and the fine ones add into them: a lane sums
/// D products of at most 255 * 127 a level, so the result fits int32 for every head_dim (<= kMaxRotatedDim).
/// Needs head_dim % 64 == 0. Row r's buffer: D coarse bytes, D fine bytes, then sum(128 coarse + fine) in
/// float D - 2 and qs / 128 in float D - 1.
template <int R = 4>
struct ScoreB8 {
  static constexpr int kRows = R;
  static void load_query(const AttentionArgs& a, int64_t base, float* q_row) {
    const int64_t D = a.layout.head_dim;
    int8_t* coarse = reinterpret_cast<int8_t*>(q_row);
    const float qs = load_query_q8x2(a, base, coarse, coarse + D);
    int32_t sum = 0;
    for (int64_t d = 0; d < D; ++d) sum += 128 * coarse[d] + coarse[D + d];
    q_row[D - 2] = static_cast<float>(sum);  // |sum| <= 16320 D < 2^24: exact
    q_row[D - 1] = qs / 128.f;
  }
  static void scores(const float* q, int64_t D, const int8_t* const* krow, const uint16_t* const* kmeta, float scale,
                     vf rows[R]) {
    // (head_dim 128 and 64 get loops of a constant count, which GCC unrolls, the addresses folded)
    if (D == 128) return scores_n<2>(q, D, krow, kmeta, scale, rows);
    if (D == 64) return scores_n<1>(q, D, krow, kmeta, scale, rows);
    scores_n<0>(q, D, krow, kmeta, scale, rows);
  }
  template <int kBlocks>  // D / 64, or 0: read from D
  static void scores_n(const float* q, int64_t D, const int8_t* const* krow, const uint16_t* const* /*kmeta*/,
                       float /*scale*/, vf rows[R]) {
    if constexpr (kBlocks > 0) D = 64 * kBlocks;  // (a constant: addresses fold)
    const int8_t* qb = reinterpret_cast<const int8_t*>(q);  // rows D fp32 = 4 D bytes apart
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512i coarse[R], fine[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) coarse[r] = fine[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int64_t b = 0; b < D / 64; ++b) {
      __m512i x[16], col[16];
#pragma GCC unroll 16
      for (int j = 0; j < kTile; ++j) x[j] = _mm512_xor_si512(_mm512_loadu_si512(krow[j] + 64 * b), flip);  // k + 128
      transpose16x16_epi32(x, col);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          int32_t c4, f4;
          std::memcpy(&c4, qb + r * 4 * D + 64 * b + 4 * i, 4);
          std::memcpy(&f4, qb + r * 4 * D + D + 64 * b + 4 * i, 4);
          coarse[r] = _mm512_dpbusd_epi32(coarse[r], col[i], _mm512_set1_epi32(c4));
          fine[r] = _mm512_dpbusd_epi32(fine[r], col[i], _mm512_set1_epi32(f4));
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(coarse[r], 7), fine[r]);
      const float* qr = q + r * D;
      rows[r] = (vf)_mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(128.f * qr[D - 2])),
                                  _mm512_set1_ps(qr[D - 1]));
    }
  }
};
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
/// A KIVI row's codes (4 or 2 bits, planar per 32-dim chunk, core/quant.h: planar_byte) as 16-bit lanes, one
/// vector per 32 dims (kivi4: 32 bytes zero-extended, then low and high nibbles; kivi2: its four fields).
/// Word p of a row's vectors laid end to end is code position p; `dim(p, D)` is its dim. Every aligned run
/// of 8 positions is 8 consecutive dims. (maskz forms of the broadcasts and shuffles: GCC 12 warns about
/// the plain intrinsics' undefined pass-through operand.)
template <int kBits>
struct KiviKeyWords {
  static __m512i widen(const uint8_t* p) {  // 32 bytes -> 32 words
    return _mm512_maskz_cvtepu8_epi16(~__mmask32{0}, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  /// 128 dims at p (16 kBits bytes) -> v[0..3].
  static void unpack128(const uint8_t* p, __m512i v[4]) {
    const __m512i mask = _mm512_set1_epi16(kBits == 4 ? 0x0f : 0x03);
    if constexpr (kBits == 4) {  // per 32 bytes: low nibbles (dims 0-15 of each chunk), high nibbles (16-31)
      const __m512i x0 = widen(p), x1 = widen(p + 32);
      v[0] = _mm512_and_si512(x0, mask);
      v[1] = _mm512_srli_epi16(x0, 4);
      v[2] = _mm512_and_si512(x1, mask);
      v[3] = _mm512_srli_epi16(x1, 4);
    } else {  // field f: dims 8 f .. 8 f + 7 of each chunk
      const __m512i x = widen(p);
      v[0] = _mm512_and_si512(x, mask);
      v[1] = _mm512_and_si512(_mm512_srli_epi16(x, 2), mask);
      v[2] = _mm512_and_si512(_mm512_srli_epi16(x, 4), mask);
      v[3] = _mm512_srli_epi16(x, 6);
    }
  }
  /// head_dim 64 (8 kBits bytes at p) -> v[0..1].
  static void unpack64(const uint8_t* p, __m512i v[2]) {
    if constexpr (kBits == 4) {
      const __m512i x = widen(p);
      v[0] = _mm512_and_si512(x, _mm512_set1_epi16(0x0f));
      v[1] = _mm512_srli_epi16(x, 4);
    } else {  // 16 bytes in both halves, shifted per half: fields 0 | 1, then 2 | 3
      const __m512i x = _mm512_maskz_broadcast_i64x4(
          0xff, _mm256_maskz_cvtepu8_epi16(0xffff, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      constexpr int64_t k2 = 0x0002000200020002, k4 = 2 * k2, k6 = 3 * k2;  // shifts in each 16-bit lane
      const __m512i mask = _mm512_set1_epi16(0x03);
      v[0] = _mm512_and_si512(_mm512_srlv_epi16(x, _mm512_setr_epi64(0, 0, 0, 0, k2, k2, k2, k2)), mask);
      v[1] = _mm512_and_si512(_mm512_srlv_epi16(x, _mm512_setr_epi64(k4, k4, k4, k4, k6, k6, k6, k6)), mask);
    }
  }
  static int64_t dim(int64_t p, int64_t D) {
    if (kBits == 2 && D == 64) return 32 * (p % 16 / 8) + 8 * (p / 16) + p % 8;
    const int64_t base = p / 128 * 128, e = p % 128, k = e / 32, n = e % 32;
    return kBits == 4 ? base + 64 * (k / 2) + 32 * (n / 16) + 16 * (k % 2) + n % 16  // vector k: nibble k % 2
                      : base + 32 * (n / 8) + 8 * k + n % 8;                             // vector k: field k
  }
};

/// KIVI keys (per channel over a page: k_d = s_d c_d + z_d, s and z shared by the page's tokens) against a
/// bf16 query: score = sum_d (q_d s_d) c_d + q.z. Once per page and row, w = q * s is quantized to 16 bits
/// (w ~ a w16, a = max|w| / 32767), so each key is its codes widened to 16-bit lanes and vpdpwssd'd against
/// w16: no dequantization, no fp32 per key, and the query's rounding (2^-15 of its largest) far below
/// bf16's. (Bytes (vpdpbusd, w8) halved the dot products but not the time: their error needed a multiplier
/// per int32 lane, applied per key, and still reached 2-3x PyTorch's lse error on long decodes.)
/// The constant takes the codes' midpoint m off the rounded w16: score = a (c . w16) + q.(z + m s) -
/// m a sum(w16), whose error sum_d (a w16_d - w_d)(c_d - m) is that of the centred codes.
/// The page is known by its metadata pointer (kmeta of any key of the tile: tiles lie in one page, as the
/// dispatch asks); each row block keeps the page it prepared, so a page is prepared once per block, when
/// its first tile arrives. Needs head_dim 64 or a multiple of 128.
/// Row r's buffer (row_floats(D) floats): the exact scaled query (fp32) in code order (KiviKeyWords::dim),
/// then its w16 (D words, code order); row 0 then holds the block's multipliers and constants (lane k: row
/// k / kKeys) and the prepared page's pointer.
template <int kBits, int R = 4>
struct ScoreKivi {
  static constexpr int kRows = R;
  static constexpr int kKeys = kTile / R;
  static constexpr float kMid = ((1 << kBits) - 1) / 2.f;
  using Words = KiviKeyWords<kBits>;
  static int64_t row_floats(int64_t D) { return D + D / 2 + 48; }
  static void load_query(const AttentionArgs& a, int64_t base, float* q_row) {
    const int64_t D = a.layout.head_dim;
    float q[kMaxRotatedDim];
    load_query_f32(a, base, q);
    for (int64_t p = 0; p < D; ++p) q_row[p] = q[Words::dim(p, D)];
  }

  static void scores(float* q, int64_t D, const uint8_t* const* krow, const uint16_t* const* kmeta, float /*scale*/,
                     vf rows[R]) {
    // (head_dim 128 and 64 get their own unrolled loops: see ScoreB8)
    if (D == 128) return scores_n<1>(q, D, krow, kmeta[0], rows);
    if (D == 64) return scores_n<-1>(q, D, krow, kmeta[0], rows);
    scores_n<0>(q, D, krow, kmeta[0], rows);
  }

  /// Code positions 16 i .. 16 i + 15 of the page's scales (or, at meta + 32, zeros) as fp32: two runs of 8
  /// dims.
  static __m512 meta16(const uint16_t* meta, int64_t i, int64_t D) {
    const auto at = [&](int64_t p) { const int64_t d = Words::dim(p, D); return meta + 64 * (d / 32) + d % 32; };
    if constexpr (kBits == 4) {  // (runs of 16)
      return _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at(16 * i))));
    } else {
      const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at(16 * i)));
      const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at(16 * i + 8)));
      return _mm512_maskz_cvtph_ps(0xffff, _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
    }
  }

  /// w16, multipliers and constants of the block's rows for the page whose metadata is `meta` (per 32-dim
  /// chunk, 32 fp16 scales then 32 zeros).
  template <int kChunks>  // as scores_n
  static void prepare(float* q, int64_t D, const uint16_t* meta) {
    if constexpr (kChunks != 0) D = kChunks > 0 ? 128 * kChunks : 64;  // (a constant: addresses fold)
    const int64_t stride = row_floats(D);
    __m512 amax[R], qzm[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) amax[r] = qzm[r] = _mm512_setzero_ps();
    const __m512 mid = _mm512_set1_ps(kMid);
#pragma GCC unroll 8
    for (int64_t i = 0; i < D / 16; ++i) {
      const __m512 s = meta16(meta, i, D), zm = _mm512_fmadd_ps(s, mid, meta16(meta + 32, i, D));  // z + m s
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512 qv = _mm512_loadu_ps(q + r * stride + 16 * i);
        amax[r] = _mm512_range_ps(amax[r], _mm512_mul_ps(qv, s), 0x0b);  // max |.|
        qzm[r] = _mm512_fmadd_ps(qv, zm, qzm[r]);
      }
    }
    __m512 inv[R];
    float alpha[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float m = hmax((vf)amax[r]);
      alpha[r] = m / 32767.f;
      inv[r] = _mm512_set1_ps(m > 0.f ? 32767.f / m : 0.f);
    }
    // 32 values at a time: two int32 vectors packed with saturation (|w| <= 32767 already: it only guards
    // the largest's rounding), which interleaves their runs of 4; one vpermq restores the order.
    const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
    const __m512i ones = _mm512_set1_epi16(1);
    __m512i wsum[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) wsum[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int64_t i = 0; i < D / 32; ++i) {
      const __m512 s0 = meta16(meta, 2 * i, D), s1 = meta16(meta, 2 * i + 1, D);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const float* qr = q + r * stride + 32 * i;
        const __m512 x0 = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(qr), s0), inv[r]);
        const __m512 x1 = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(qr + 16), s1), inv[r]);
        const __m512i w0 = _mm512_maskz_cvtps_epi32(0xffff, x0), w1 = _mm512_maskz_cvtps_epi32(0xffff, x1);
        const __m512i w16 = _mm512_maskz_permutexvar_epi64(0xff, order, _mm512_packs_epi32(w0, w1));
        _mm512_storeu_si512(reinterpret_cast<int16_t*>(q + r * stride + D) + 32 * i, w16);
        wsum[r] = _mm512_dpwssd_epi32(wsum[r], ones, w16);
      }
    }
    float* block = q + D + D / 2;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float cst = hsum((vf)qzm[r]) - kMid * alpha[r] * hsum(__builtin_convertvector((vi)wsum[r], vf));
      for (int k = r * kKeys; k < (r + 1) * kKeys; ++k) {
        block[k] = alpha[r];
        block[16 + k] = cst;
      }
    }
    const uintptr_t page = reinterpret_cast<uintptr_t>(meta);
    std::memcpy(block + 32, &page, sizeof page);
  }

  template <int kChunks>  // 128-dim chunks; -1: head_dim 64; 0: read from D
  static void scores_n(float* q, int64_t D, const uint8_t* const* krow, const uint16_t* meta, vf rows[R]) {
    if constexpr (kChunks != 0) D = kChunks > 0 ? 128 * kChunks : 64;
    const float* block = q + D + D / 2;
    uintptr_t page;  // the page this block last prepared
    std::memcpy(&page, block + 32, sizeof page);
    if (page != reinterpret_cast<uintptr_t>(meta)) prepare<kChunks>(q, D, meta);
    const int64_t stride = row_floats(D), chunks = kChunks > 0 ? kChunks : D / 128;
    const vf alpha = loadv(block), cst = loadv(block + 16);
    const auto w16 = [&](int r, int64_t v) {  // the row's words v * 32 .. v * 32 + 31
      return _mm512_loadu_si512(reinterpret_cast<const int16_t*>(q + r * stride + D) + 32 * v);
    };
    vf part[R];
#pragma GCC unroll 4
    for (int g = 0; g < R; ++g) {
      __m512i acc[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_si512();
      if constexpr (kChunks < 0) {
#pragma GCC unroll 16
        for (int j = 0; j < kKeys; ++j) {
          __m512i x[2];
          Words::unpack64(krow[g * kKeys + j], x);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            acc[r * kKeys + j] = _mm512_dpwssd_epi32(acc[r * kKeys + j], x[0], w16(r, 0));
            acc[r * kKeys + j] = _mm512_dpwssd_epi32(acc[r * kKeys + j], x[1], w16(r, 1));
          }
        }
      } else {
#pragma GCC unroll 4
        for (int64_t c = 0; c < chunks; ++c) {
#pragma GCC unroll 16
          for (int j = 0; j < kKeys; ++j) {
            __m512i x[4];
            Words::unpack128(krow[g * kKeys + j] + 16 * kBits * c, x);
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
              for (int v = 0; v < 4; ++v) {
                acc[r * kKeys + j] = _mm512_dpwssd_epi32(acc[r * kKeys + j], x[v], w16(r, 4 * c + v));
              }
            }
          }
        }
      }
      vi acci[16];  // (integer sums, exact: reduced before the one conversion)
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) acci[i] = (vi)acc[i];
      part[g] = __builtin_convertvector(reduce16(acci), vf) * alpha + cst;
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
  using Pairs = uint32_t[R][kTile / 2];  // (p_2i, p_2i+1) as bf16 pairs
  __attribute__((always_inline)) static void make_pairs(const float (*p)[kTile], Pairs& pairs) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256bh pb = _mm512_cvtneps_pbh(_mm512_loadu_ps(p[r]));
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[r]), (__m256i)pb);
    }
  }
  static void accumulate(float* o, int64_t D, const float (*p)[kTile], const typename VRead::Elem* const* vrow,
                         const uint16_t* const* /*vmeta*/, int64_t /*n = kTile*/, Prefetcher& pf_state) {
    LocalPrefetcher pf(pf_state);
    alignas(64) Pairs pairs;
    make_pairs(p, pairs);
    for (int64_t c = 0; c < D / 32; ++c) chunk(o, D, pairs, vrow, c, pf);
  }
  /// Dims 32 c .. 32 c + 31 of the R output rows.
  __attribute__((always_inline)) static void chunk(float* o, int64_t D, const Pairs& pairs,
                                                   const typename VRead::Elem* const* vrow, int64_t c, Prefetcher& pf) {
    // NOTE: even and odd key pairs in two accumulator sets, 16 chains of 4 vdpbf16ps: 8 chains of 8 were
    // bound by the instruction's latency (from DRAM: bf16 step 0.91-0.97x as long this way, fp8 0.90x, Zen 5)
    __m512 oa[R], ob[R], oa2[R], ob2[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      oa[r] = _mm512_loadu_ps(o + r * D + 32 * c);
      ob[r] = _mm512_loadu_ps(o + r * D + 32 * c + 16);
      oa2[r] = ob2[r] = _mm512_setzero_ps();
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
        if (jp % 2 == 0) {
          oa[r] = _mm512_dpbf16_ps(oa[r], lo, pp);
          ob[r] = _mm512_dpbf16_ps(ob[r], hi, pp);
        } else {
          oa2[r] = _mm512_dpbf16_ps(oa2[r], lo, pp);
          ob2[r] = _mm512_dpbf16_ps(ob2[r], hi, pp);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(o + r * D + 32 * c, _mm512_add_ps(oa[r], oa2[r]));
      _mm512_storeu_ps(o + r * D + 32 * c + 16, _mm512_add_ps(ob[r], ob2[r]));
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
      const float pmax = hmax((vf)(pr));
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

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
/// fp8 codes to bf16, 64 at a time: vpermi2b looks up each code's bf16 low and high byte in two 128-entry byte
/// tables (Fp8Bf16Table split; code bits 0-6 index, the sign copied into the high byte). Two shuffles per 32
/// codes where the word table (Bf16Chunks<ReadFp8>) takes three: on Zen 4, which runs a 512-bit shuffle as two
/// halves, q.k of a GQA group of 4 over 128 dims from L1 took 13.5 ns per key by the word table, 10.5 this way
/// (bf16 pages: 10.1).
template <bool kE4M3>
struct Fp8ByteTables {
  struct Bytes { alignas(64) uint8_t lo[128], hi[128]; };
  static constexpr Bytes make() {
    Bytes t{};
    for (int c = 0; c < 128; ++c) {
      t.lo[c] = static_cast<uint8_t>(Fp8Bf16Table<kE4M3>::bits(c) & 0xff);
      t.hi[c] = static_cast<uint8_t>(Fp8Bf16Table<kE4M3>::bits(c) >> 8);
    }
    return t;
  }
  static constexpr Bytes kBytes = make();
  __m512i lo0, lo1, hi0, hi1;
  Fp8ByteTables()
      : lo0(_mm512_load_si512(kBytes.lo)), lo1(_mm512_load_si512(kBytes.lo + 64)),
        hi0(_mm512_load_si512(kBytes.hi)), hi1(_mm512_load_si512(kBytes.hi + 64)) {}
  /// The low and high bytes of the bf16 values of the 64 codes in x (byte i of each: code i's).
  __attribute__((always_inline)) void lookup(__m512i x, __m512i& lo, __m512i& hi) const {
    lo = _mm512_permutex2var_epi8(lo0, x, lo1);
    // hi | (x & 0x80): the code's sign into the bf16's
    hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, x, hi1), x, _mm512_set1_epi8(int8_t(0x80)), 0xf8);
  }
};

/// fp8 keys with bf16 dot products, 64 dims per step (Fp8ByteTables): vpunpck{l,h}bw join the low and high
/// bytes into two vectors of 32 bf16 values, per 128-bit lane L codes 16 L .. 16 L + 7 in the first and
/// 16 L + 8 .. 16 L + 15 in the second; the query is stored in that order once per task (load_query). A last
/// 32-dim chunk (head_dim % 64 == 32) goes through the word table in natural order.
template <bool kE4M3, int R = 4>
struct ScoreFp8Bytes {
  static constexpr int kRows = R;
  static constexpr int kKeys = kTile / R;
  /// Where dim j (0-63) of a 64-dim block sits in the stored query.
  static constexpr int64_t slot(int64_t j) { return (j % 16 < 8 ? 0 : 32) + 8 * (j / 16) + j % 8; }
  static void load_query(const AttentionArgs& a, int64_t base, float* q_row) {
    uint16_t* qb = reinterpret_cast<uint16_t*>(q_row);  // bf16 bits in the fp32 buffer, as ScoreDp
    const int64_t D = a.layout.head_dim, full = D / 64 * 64;
    const uint16_t* q = static_cast<const uint16_t*>(a.query);
    for (int64_t d = 0; d < D; ++d) qb[d < full ? d - d % 64 + slot(d % 64) : d] = q[base + d * a.q_strides[2]];
  }
  static void scores(const float* q, int64_t D, const uint8_t* const* krow, const uint16_t* const* /*kmeta*/,
                     float scale, vf rows[R]) {
    const uint16_t* qb = reinterpret_cast<const uint16_t*>(q);  // rows D fp32 = 2 D bf16 apart
    const Fp8ByteTables<kE4M3> t;
    dp_scores<R>(scale, rows, [&](int g, __m512* acc) __attribute__((always_inline)) {
      for (int64_t b = 0; b < D / 64; ++b) {
        __m512bh qa[R], qz[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          qa[r] = (__m512bh)_mm512_loadu_si512(qb + r * 2 * D + 64 * b);
          qz[r] = (__m512bh)_mm512_loadu_si512(qb + r * 2 * D + 64 * b + 32);
        }
#pragma GCC unroll 16
        for (int j = 0; j < kKeys; ++j) {
          __m512i lo, hi;
          t.lookup(_mm512_loadu_si512(krow[g * kKeys + j] + 64 * b), lo, hi);
          const __m512bh ka = (__m512bh)_mm512_unpacklo_epi8(lo, hi), kz = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            acc[r * kKeys + j] = _mm512_dpbf16_ps(acc[r * kKeys + j], qa[r], ka);
            acc[r * kKeys + j] = _mm512_dpbf16_ps(acc[r * kKeys + j], qz[r], kz);
          }
        }
      }
      // the last 32 dims (head_dim % 64 == 32), natural order
      if (D % 64 != 0) ScoreDp<ReadFp8<kE4M3>, R>::chunk(qb, D, krow, g, D / 32 - 1, acc);
    });
  }
};

/// fp8 values with bf16 dot products, 64 dims per step: two keys' codes interleaved byte-wise first
/// (vpunpck{l,h}bw), then one lookup (Fp8ByteTables) and vpunpck{l,h}bw of the low and high bytes give the
/// (key 2i, key 2i + 1) bf16 pairs vdpbf16ps takes: 10 shuffles per pair of keys and 64 dims where the word
/// table and the pairing took 16. Outputs per 64-dim chunk as PvB8's: accumulator k lane 4 L + m is dim
/// 16 L + 4 k + m; a last 32-dim chunk as PvDp's.
template <bool kE4M3, int R = 4>
struct PvFp8Bytes {
  static constexpr int kRows = R;
  static int64_t storage(int64_t d, int64_t D) {
    return d >= D / 64 * 64 ? PvDp<ReadFp8<kE4M3>, R>::storage(d) : PvB8<R>::storage(d);
  }
  static void accumulate(float* o, int64_t D, const float (*p)[kTile], const uint8_t* const* vrow,
                         const uint16_t* const* /*vmeta*/, int64_t /*n = kTile*/, Prefetcher& pf_state) {
    using Tail = PvDp<ReadFp8<kE4M3>, R>;
    alignas(64) typename Tail::Pairs pairs;
    Tail::make_pairs(p, pairs);
    const Fp8ByteTables<kE4M3> t;
    LocalPrefetcher pf(pf_state);
    for (int64_t c = 0; c < D / 64; ++c) {
      __m512 acc[R][4];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_loadu_ps(o + r * D + 64 * c + 16 * k);
      }
#pragma GCC unroll 8
      for (int jp = 0; jp < kTile / 2; ++jp) {
        pf.step(4);  // as PvDp: D / 2 steps per tile
        const __m512i x0 = _mm512_loadu_si512(vrow[2 * jp] + 64 * c), x1 = _mm512_loadu_si512(vrow[2 * jp + 1] + 64 * c);
        __m512i u[4];
        __m512i lo, hi;
        t.lookup(_mm512_unpacklo_epi8(x0, x1), lo, hi);  // dims 16 L + 0..7 of both keys
        u[0] = _mm512_unpacklo_epi8(lo, hi);
        u[1] = _mm512_unpackhi_epi8(lo, hi);
        t.lookup(_mm512_unpackhi_epi8(x0, x1), lo, hi);  // dims 16 L + 8..15
        u[2] = _mm512_unpacklo_epi8(lo, hi);
        u[3] = _mm512_unpackhi_epi8(lo, hi);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r][jp]));
#pragma GCC unroll 4
          for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_dpbf16_ps(acc[r][k], (__m512bh)u[k], pp);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) _mm512_storeu_ps(o + r * D + 64 * c + 16 * k, acc[r][k]);
      }
    }
    if (D % 64 != 0) Tail::chunk(o, D, pairs, vrow, D / 32 - 1, pf);  // the last 32 dims
  }
};
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
/// Lane 4 g + m (m = 0-3): the largest lane of v[g]. 8 shuffles and maxes.
inline __m512 group_max4(const __m512 v[4]) {
  const __m512 a = _mm512_max_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x44), _mm512_shuffle_f32x4(v[0], v[1], 0xee));
  const __m512 b = _mm512_max_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x44), _mm512_shuffle_f32x4(v[2], v[3], 0xee));
  __m512 m = _mm512_max_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xdd));
  m = _mm512_max_ps(m, _mm512_permute_ps(m, 0xb1));
  return _mm512_max_ps(m, _mm512_permute_ps(m, 0x4e));
}

/// Where PvB4 finds a 128-dim chunk's codes: int4 rows, 64 bytes, a byte's low nibble the even dim and
/// its high nibble the odd one, group g in bytes 16 g .. 16 g + 15.
struct Int4Codes {
  static constexpr bool kHalfChunks = false;
  /// Chunk c of a row, pass h: 128-bit lane g holds 16 codes of group g as bytes.
  template <bool kHalf>
  static __m512i codes(const uint8_t* row, int64_t c, int h) {
    const __m512i x = _mm512_loadu_si512(row + 64 * c);
    return _mm512_and_si512(h == 0 ? x : _mm512_srli_epi16(x, 4), _mm512_set1_epi8(0x0f));
  }
  static int64_t storage(int64_t d, int64_t /*D*/) {
    const int64_t c = d / 128, e = d % 128, i = e / 2, h = e % 2;
    return 128 * c + 64 * h + 16 * (i % 16 / 4) + 4 * (i / 16) + i % 4;
  }
  /// Keys v[0..3], chunk c, pass h, as vpdpbusd takes them: u[k] dword m of 128-bit lane L holds the 4 keys'
  /// codes of byte 4 k + m of lane L of `codes` (one dim of group L).
  template <bool kHalf, class Codes = Int4Codes>
  static void quad(const uint8_t* const* v, int64_t c, int h, __m512i u[4]) {
    __m512i n[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) n[i] = Codes::template codes<kHalf>(v[i], c, h);
    const __m512i t0 = _mm512_unpacklo_epi8(n[0], n[1]), t1 = _mm512_unpackhi_epi8(n[0], n[1]);
    const __m512i t2 = _mm512_unpacklo_epi8(n[2], n[3]), t3 = _mm512_unpackhi_epi8(n[2], n[3]);
    u[0] = _mm512_unpacklo_epi16(t0, t2);
    u[1] = _mm512_unpackhi_epi16(t0, t2);
    u[2] = _mm512_unpacklo_epi16(t1, t3);
    u[3] = _mm512_unpackhi_epi16(t1, t3);
  }
};

/// KIVI value rows (4 or 2 bits, planar per 32-dim chunk = group). kivi4: pass h takes dims 16 h .. 16 h + 15
/// of each group (the low or high nibbles of its 16 bytes, as int4's). kivi2: pass h takes bytes 4 h .. 4 h + 3
/// of each group's 8, whose four fields are dims 8 f + 4 h + (0..3): the four keys' packed bytes are
/// interleaved first (one vpermt2b) and the fields taken from the interleaved bytes, so that no code is
/// widened or shuffled one at a time (the step's shuffles per 4 keys and pass: 24 -> 12). Head_dim 64 (two
/// groups) runs as one pass: 128-bit lanes 0-1 hold pass 0 of groups 0-1 and lanes 2-3 pass 1. (maskz
/// forms of the broadcast and shuffles: GCC 12 warns about the plain intrinsics' undefined pass-through.)
template <int kBits>
struct KiviCodes {
  static constexpr bool kHalfChunks = true;
  template <bool kHalf>
  static __m512i codes(const uint8_t* row, int64_t c, int h) {
    static_assert(kBits == 4, "kivi2 codes come a quad of keys at a time (quad)");
    if constexpr (kHalf) {  // 32 bytes: lanes [g0, g1, g0, g1], the upper two to their high nibbles
      const __m512i x = _mm512_maskz_broadcast_i64x4(0xff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
      const __m512i counts = _mm512_setr_epi64(0, 0, 0, 0, kWords4, kWords4, kWords4, kWords4);
      return _mm512_and_si512(_mm512_srlv_epi16(x, counts), _mm512_set1_epi8(0x0f));
    } else {
      return Int4Codes::codes<false>(row, c, h);
    }
  }
  template <bool kHalf>
  static void quad(const uint8_t* const* v, int64_t c, int h, __m512i u[4]) {
    if constexpr (kBits == 4) {
      Int4Codes::quad<kHalf, KiviCodes>(v, c, h, u);
    } else {
#ifndef __AVX512VBMI__
      static_assert(kBits != 2, "kivi2 values take AVX512_VBMI byte permutes, which the dot-product build has");
#else
      // Byte 16 L + 4 m + j of x: key j's packed byte 4 h + m of group L (head_dim 64: of group L % 2, with
      // h = L / 2), so that field f of dword m of lane L is the four keys' code of dim 8 f + 4 h + m.
      __m512i x;
      if constexpr (kHalf) {  // 16 bytes a key: the four keys in one register, byte 16 j + 8 g + b
        x = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v[0])));
        x = _mm512_inserti32x4(x, _mm_loadu_si128(reinterpret_cast<const __m128i*>(v[1])), 1);
        x = _mm512_inserti32x4(x, _mm_loadu_si128(reinterpret_cast<const __m128i*>(v[2])), 2);
        x = _mm512_inserti32x4(x, _mm_loadu_si128(reinterpret_cast<const __m128i*>(v[3])), 3);
        x = _mm512_permutexvar_epi8(half_order(), x);
      } else {  // 32 bytes a key (chunk c): keys 0-1 in a, 2-3 in b, byte 32 j + 8 g + b of (a, b)
        const auto load = [&](int j) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v[j] + 32 * c)); };
        const __m512i a = _mm512_inserti64x4(_mm512_castsi256_si512(load(0)), load(1), 1);
        const __m512i b = _mm512_inserti64x4(_mm512_castsi256_si512(load(2)), load(3), 1);
        x = _mm512_permutex2var_epi8(a, h == 0 ? full_order(0) : full_order(1), b);
      }
      const __m512i mask = _mm512_set1_epi8(0x03);
      u[0] = _mm512_and_si512(x, mask);
      u[1] = _mm512_and_si512(_mm512_srli_epi16(x, 2), mask);
      u[2] = _mm512_and_si512(_mm512_srli_epi16(x, 4), mask);
      u[3] = _mm512_and_si512(_mm512_srli_epi16(x, 6), mask);
#endif
    }
  }
  /// kivi4: accumulator k lane 4 L + m holds byte 4 k + m of 128-bit lane L, dim 16 h + 4 k + m of its group;
  /// kivi2: field k of byte 4 h + m of group L, dim 8 k + 4 h + m.
  static int64_t storage(int64_t d, int64_t D) {
    const int64_t g = d % 128 / 32, e = d % 32, m = d % 4;
    const int64_t h = kBits == 4 ? e / 16 : e % 8 / 4, k = kBits == 4 ? e % 16 / 4 : e / 8;
    if (D == 64) return 16 * k + 4 * (g + 2 * h) + m;
    return d / 128 * 128 + 64 * h + 16 * k + 4 * g + m;
  }

 private:
  static constexpr int64_t kWords4 = 0x0004000400040004;  // a shift by 4 in each 16-bit lane of a qword
  /// kivi2's byte orders (quad): output byte 16 L + 4 m + j takes key j's byte 4 h + m of group L.
  static __m512i full_order(int h) {  // from (a, b): key j's byte 8 L + 4 h + m at 32 j + 8 L + 4 h + m
    alignas(64) uint8_t idx[64];
    for (int i = 0; i < 64; ++i) idx[i] = uint8_t(32 * (i % 4) + 8 * (i / 16) + 4 * h + i % 16 / 4);
    return _mm512_load_si512(idx);
  }
  static __m512i half_order() {  // head_dim 64: lane L takes group L % 2, h = L / 2, from byte 16 j + 8 g + 4 h + m
    alignas(64) uint8_t idx[64];
    for (int i = 0; i < 64; ++i) idx[i] = uint8_t(16 * (i % 4) + 8 * (i / 16 % 2) + 4 * (i / 32) + i % 16 / 4);
    return _mm512_load_si512(idx);
  }
};

/// int4 and KIVI values (groups of 32 dims, fp16 (scale, zero) each): o_d += sum_j p_j s_jg u_jd +
/// sum_j p_j z_jg. Per row, tile and group, the coefficients p_j s_jg are quantized to unsigned 8 bits
/// against their largest and multiply 4 keys' codes interleaved byte-wise (vpdpbusd: 4 keys x 16 dims); the
/// zero terms are 4 dot products of 16 per row, added in fp32. 128 dims at a time, in two passes of 16
/// dims per group; 128-bit lane L is group L, which is what lets one vpshufd spread a quad of coefficients
/// per group. `Codes` says where a pass finds its codes and so the output order (storage): Int4Codes (low
/// nibbles = even dims, then high = odd dims; accumulator k lane 4L + m is dim 2 (16L + 4k + m) + h) or
/// KiviCodes (KIVI's planar codes; head_dim 64 as one pass of 2 groups, whose lanes 2-3 take pass 1 with
/// groups 0-1's coefficients). `Codes::quad` gives a quad of keys' codes interleaved for vpdpbusd. Needs
/// head_dim % 128 == 0, or 64 with KiviCodes.
template <int R = 4, class Codes = Int4Codes>
struct PvB4 {
  static constexpr int kRows = R;
  static int64_t storage(int64_t d, int64_t D) { return Codes::storage(d, D); }
  static void accumulate(float* o, int64_t D, const float (*p)[kTile], const uint8_t* const* vrow,
                         const uint16_t* const* vmeta, int64_t n, Prefetcher& pf_state) {
    if constexpr (Codes::kHalfChunks) {
      if (D == 64) return accumulate_n<true>(o, D, p, vrow, vmeta, n, pf_state);
    }
    accumulate_n<false>(o, D, p, vrow, vmeta, n, pf_state);
  }
  template <bool kHalf>  // head_dim 64 as one pass (KiviCodes)
  static void accumulate_n(float* o, int64_t D, const float (*p)[kTile], const uint8_t* const* vrow,
                           const uint16_t* const* vmeta, int64_t /*n = kTile*/, Prefetcher& pf_state) {
    LocalPrefetcher pf(pf_state);
    for (int64_t c = 0; c < (kHalf ? 1 : D / 128); ++c) {
      __m512 S[4], Z[4];
      int4_meta_columns<kHalf>(vmeta, c, S, Z);
      if constexpr (kHalf) {  // lanes 2-3 (pass 1) take groups 0-1's coefficients; their Z stay 0
        S[2] = S[0];
        S[3] = S[1];
      }
      __m512i cb[R];        // row r: group g's 16 coefficient bytes in 128-bit lane g
      __m512 cs[R], zv[R];  // row r: lane 4 g + m, group g's coefficient scale and zero term
      __m512 rS[4];         // 1 / scale (0 for a scale of 0)
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        const __mmask16 pos = _mm512_cmp_ps_mask(S[g], _mm512_setzero_ps(), _CMP_GT_OQ);
        rS[g] = _mm512_maskz_div_ps(pos, _mm512_set1_ps(1.f), S[g]);
      }
      vf zprod[16];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512 pr = _mm512_loadu_ps(p[r]);
        __m512 C[4];
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) C[g] = _mm512_mul_ps(pr, S[g]);  // >= 0: probabilities and scales are
        const __m512 cmax = group_max4(C);  // lane 4 g + m: the largest of C[g]
        cs[r] = _mm512_mul_ps(cmax, _mm512_set1_ps(1.f / 255.f));
        const __mmask16 live = _mm512_cmp_ps_mask(cmax, _mm512_setzero_ps(), _CMP_GT_OQ);
        const __m512 inv = _mm512_maskz_div_ps(live, _mm512_set1_ps(255.f), cmax);
        __m512i c8[4];  // group g's coefficients as int32, lane j for key j
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) {
          const __m512i lane = _mm512_set1_epi32(4 * g);
          c8[g] = _mm512_cvtps_epi32(_mm512_mul_ps(C[g], _mm512_permutexvar_ps(lane, inv)));
          // The zero term takes the probabilities the codes meet, c8 * cs / s (p itself where s = 0): the
          // error is then that of p . v; with the exact p it was that of p . (v - zero), often far larger.
          const __m512 w = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(c8[g]), _mm512_permutexvar_ps(lane, cs[r])), rS[g]);
          const __mmask16 flat = _mm512_cmp_ps_mask(S[g], _mm512_setzero_ps(), _CMP_LE_OQ);
          zprod[4 * r + g] = (vf)_mm512_mul_ps(_mm512_mask_blend_ps(flat, w, pr), Z[g]);
        }
        // NOTE: packed in registers (with saturation, as vpmovusdb did): four 16-byte stores read back as one
        // 64-byte load could not be forwarded (the int4 step 0.94-0.96x as long this way, Zen 5). The packs
        // leave lane L holding keys 4 L .. 4 L + 3 of each group; one vpermd puts group g in lane g.
        const __m512i packed =
            _mm512_packus_epi16(_mm512_packus_epi32(c8[0], c8[1]), _mm512_packus_epi32(c8[2], c8[3]));
        const __m512i by_group = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        cb[r] = _mm512_permutexvar_epi32(by_group, packed);
      }
#pragma GCC unroll 16
      for (int i = 4 * R; i < 16; ++i) zprod[i] = vf{};
      const __m512 zsum = (__m512)reduce16(zprod);  // lane 4 r + g
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512i spread = kHalf ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1)
                                     : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        zv[r] = _mm512_permutexvar_ps(_mm512_add_epi32(spread, _mm512_set1_epi32(4 * r)), zsum);
      }
#pragma GCC unroll 2
      for (int h = 0; h < (kHalf ? 1 : 2); ++h) {  // int4: low nibbles (even dims), then high nibbles (odd dims)
        __m512i acc[R][4];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_si512();
        const auto quad = [&]<int JQ>(std::integral_constant<int, JQ>) {
          if (h == 0) pf.step(4);  // a tile is 16 x D / 128 lines of K and of V: 4 per (quad, chunk)
          __m512i u[4];
          Codes::template quad<kHalf>(vrow + 4 * JQ, c, h, u);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            // dword JQ of each 128-bit lane: keys 4 JQ .. 4 JQ + 3 of that lane's group
            const __m512i pq = _mm512_shuffle_epi32(cb[r], static_cast<_MM_PERM_ENUM>(JQ * 0x55));
#pragma GCC unroll 4
            for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_dpbusd_epi32(acc[r][k], pq, u[k]);
          }
        };
        quad(std::integral_constant<int, 0>{});
        quad(std::integral_constant<int, 1>{});
        quad(std::integral_constant<int, 2>{});
        quad(std::integral_constant<int, 3>{});
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          float* out = o + r * D + 128 * c + 64 * h;
#pragma GCC unroll 4
          for (int k = 0; k < 4; ++k) {
            const __m512 prev = _mm512_add_ps(_mm512_loadu_ps(out + 16 * k), zv[r]);
            _mm512_storeu_ps(out + 16 * k, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][k]), cs[r], prev));
          }
        }
      }
    }
  }
};
#endif

}  // namespace kvcache::cpu::KVC_ISA
