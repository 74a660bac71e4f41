// KV row readers: 32 values of a stored row (any format) as two fp32 vectors, and what each
// reader tells the task loop (storage order, dims per stored element).
// Part of the CPU attention kernel (see attention/attention_cpu_kernel.h), compiled once per instruction set.
#pragma once

#ifndef KVC_ISA
#error "define KVC_ISA (the namespace of this instruction-set build) before including this header"
#endif

#include "attention/cpu_kernel/simd.h"

namespace kvcache::cpu::KVC_ISA {

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
#if defined(__AVX512BW__)
    // 32 codes to fp16 bits in one register and two conversions, no round trip through memory (the fp32 FMA
    // path of Intel cores: q.k of a GQA group of 4 from L1 15.4 ns per key, against 17.0 through widen16)
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c)));
    const __m512i h = kE4M3 ? _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(w, 8), 1), _mm512_set1_epi16(int16_t(0xbfff)))
                            : _mm512_slli_epi16(w, 8);
    a = (vf)_mm512_maskz_cvtph_ps(0xffff, _mm512_castsi512_si256(h));
    b = (vf)_mm512_maskz_cvtph_ps(0xffff, _mm512_extracti64x4_epi64(h, 1));
#else
    a = widen16(row + 32 * c);
    b = widen16(row + 32 * c + 16);
#endif
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

}  // namespace kvcache::cpu::KVC_ISA
