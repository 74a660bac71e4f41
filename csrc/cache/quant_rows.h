// Quantizing one (token, kv head) row on append and dequantizing it on gather, for every KVKind:
// the CPU side of csrc/core/quant.h (the CUDA kernels call the same scalar functions).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/dtype.h"
#include "core/kv_format.h"
#include "core/paged_layout.h"
#include "core/quant.h"

namespace kvcache::cpu {

/// Where one (block, head, pos) row of a quantized pool keeps its codes and its scales.
struct RowRef {
  void* codes;   // first code byte of the row
  float* scale;  // int8: the row's scale; fp8: the head's scale; int4: (scale, zero) fp16 pairs
};

inline RowRef row_ref(void* pool, float* scales, KVKind kind, const PagedLayout& L, int64_t block, int64_t h,
                      int64_t pos) {
  const int64_t row = L.row_index(block, h, pos);
  char* codes = static_cast<char*>(pool) + row * L.head_dim / dims_per_code(kind);
  switch (kind) {
    case KVKind::kInt8: return {codes, scales + row};
    case KVKind::kInt4:
    case KVKind::kKivi4:
    case KVKind::kKivi2:  // (kivi keys: use kivi_key_meta for the page's per-channel metadata)
      return {codes, reinterpret_cast<float*>(reinterpret_cast<uint16_t*>(scales) + row * (L.head_dim / kInt4Group) * 2)};
    default: return {codes, scales + h};
  }
}

/// Largest head_dim of a Hadamard-rotated format (a row is rotated in a stack buffer).
constexpr int64_t kMaxRotatedDim = 1024;

/// min / max over the finite values of an asymmetric group (core/quant.h: uint_low), and whether it held a NaN.
struct GroupStats {
  float mn, mx;
  bool nan;
};

/// Loads the n values src[base + i * stride] (of dtype in) into x and returns their GroupStats.
inline GroupStats group_stats(const void* src, int64_t base, int64_t stride, DType in, int64_t n, float* x) {
  GroupStats st{INFINITY, -INFINITY, false};
  for (int64_t i = 0; i < n; ++i) {
    x[i] = load_as_float(src, base + i * stride, in);
    st.mn = std::fmin(st.mn, quant::uint_low(x[i]));
    st.mx = std::fmax(st.mx, quant::uint_high(x[i]));
    st.nan |= quant::is_nan(x[i]);
  }
  quant::uint_finish(st.mn, st.mx);
  return st;
}

/// The row in float32: the dtype switch once per row, so the conversion loop vectorizes.
inline void load_row_as_float(const void* src, int64_t base, int64_t stride, DType in, int64_t n, float* x) {
  switch (in) {
    case DType::kFloat32:
      for (int64_t i = 0; i < n; ++i) x[i] = static_cast<const float*>(src)[base + i * stride];
      break;
    case DType::kFloat16:
      for (int64_t i = 0; i < n; ++i) x[i] = fp16_to_float(static_cast<const uint16_t*>(src)[base + i * stride]);
      break;
    default:
      for (int64_t i = 0; i < n; ++i) x[i] = bf16_to_float(static_cast<const uint16_t*>(src)[base + i * stride]);
  }
}

/// quant::int8_encode's codes and int8_scale's scale for a row of n <= kMaxRotatedDim values, in loops the
/// compiler vectorizes. NOTE: per element the generic path called libm twice (fmaxf for the maximum, nearbyint
/// for the rounding: the baseline x86-64 build has no roundps), ~1.4 us for one token's 8 x 128 K and V rows on
/// Zen 4, most of a short int8 decode's append. Here the rounding adds and subtracts 1.5 * 2^23 (round half to
/// even for |y| < 2^22, the default rounding mode) after the clamp, which gives the same codes: clamping to
/// [-127, 127] before or after rounding to an integer is the same.
inline void quantize_int8_row(const void* src, int64_t base, int64_t stride, DType in, int64_t n, void* codes,
                              float* scale) {
  alignas(64) float x[kMaxRotatedDim];
  load_row_as_float(src, base, stride, in, n, x);
  // The maximum of the finite magnitudes as bits: non-negative floats order as their bit patterns, and an
  // integer maximum vectorizes where a float one must honour NaN (quant::int8_abs and is_nan, in bits). The
  // encoding loop needs -fno-trapping-math (CMakeLists.txt) to vectorize.
  // (Two loops: GCC 12 vectorizes each reduction alone, not the pair.)
  int32_t amax_bits = 0, nan = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t u = static_cast<int32_t>(quant::float_bits(x[i]) & 0x7fffffffu);
    const int32_t a = u < 0x7f800000 ? u : 0;
    amax_bits = a > amax_bits ? a : amax_bits;
  }
  for (int64_t i = 0; i < n; ++i) nan |= static_cast<int32_t>(quant::float_bits(x[i]) & 0x7fffffffu) > 0x7f800000;
  const float amax = quant::bits_float(static_cast<uint32_t>(amax_bits));
  const float inv = quant::int8_inv_scale(amax);
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23
  int8_t* out = static_cast<int8_t*>(codes);
  for (int64_t i = 0; i < n; ++i) {
    float c = x[i] * inv;
    c = c == c ? c : 0.f;  // NaN (a NaN, or +-Inf in a row with no finite magnitude) reads 0
    c = c < -127.f ? -127.f : c;
    c = c > 127.f ? 127.f : c;
    out[i] = static_cast<int8_t>(static_cast<int32_t>((c + kRound) - kRound));
  }
  *scale = quant::int8_scale(amax, nan != 0);
}

/// Writes the D values src[d * stride] (of dtype in) as `kind` into codes; `scale` is the row's scale
/// slot (int8, written), the head's scale (fp8, read) or the row's fp16 (scale, zero) pairs (int4, written).
/// With `rot`, the row is Hadamard-rotated (quant::rotate) first.
inline void quantize_row(const void* src, int64_t base, int64_t stride, DType in, int64_t D, KVKind kind,
                         void* codes, float* scale, bool rot = false) {
  if (rot) {
    float buf[kMaxRotatedDim];
    for (int64_t d = 0; d < D; ++d) buf[d] = load_as_float(src, base + d * stride, in);
    quant::rotate(buf, D);
    return quantize_row(buf, 0, 1, DType::kFloat32, D, kind, codes, scale, false);
  }
  if (is_kivi(kind)) {  // values: per token, groups of 32, planar codes
    const int bits = kivi_bits(kind);
    uint8_t* out = static_cast<uint8_t*>(codes);
    uint16_t* meta = reinterpret_cast<uint16_t*>(scale);
    std::memset(out, 0, static_cast<size_t>(D * bits / 8));
    for (int64_t g = 0; g < D / 32; ++g) {
      float x[32];
      const GroupStats st = group_stats(src, base + g * 32 * stride, stride, in, 32, x);
      const float inv = quant::uint_inv_scale(st.mn, st.mx, bits);
      for (int64_t i = 0; i < 32; ++i) {
        const int64_t d = g * 32 + i;
        out[quant::planar_byte(d, bits)] |= static_cast<uint8_t>(quant::uint_encode(x[i], st.mn, inv, bits) << quant::planar_shift(d, bits));
      }
      meta[2 * g] = st.nan ? quant::kFp16ScaleNaN : float_to_fp16(quant::uint_scale(st.mn, st.mx, bits));
      meta[2 * g + 1] = float_to_fp16(st.mn);
    }
    return;
  }
  if (kind == KVKind::kInt4) {
    uint8_t* out = static_cast<uint8_t*>(codes);
    uint16_t* meta = reinterpret_cast<uint16_t*>(scale);
    for (int64_t g = 0; g < D / kInt4Group; ++g) {
      float x[kInt4Group];
      const GroupStats st = group_stats(src, base + g * kInt4Group * stride, stride, in, kInt4Group, x);
      const float inv = quant::uint_inv_scale(st.mn, st.mx, 4);
      for (int64_t i = 0; i < kInt4Group; i += 2) {
        out[(g * kInt4Group + i) / 2] = static_cast<uint8_t>(quant::uint_encode(x[i], st.mn, inv, 4) |
                                                             (quant::uint_encode(x[i + 1], st.mn, inv, 4) << 4));
      }
      meta[2 * g] = st.nan ? quant::kFp16ScaleNaN : float_to_fp16(quant::uint_scale(st.mn, st.mx, 4));
      meta[2 * g + 1] = float_to_fp16(st.mn);
    }
    return;
  }
  if (kind == KVKind::kInt8 && D <= kMaxRotatedDim) return quantize_int8_row(src, base, stride, in, D, codes, scale);
  if (kind == KVKind::kInt8) {
    float amax = 0.f;
    bool nan = false;
    for (int64_t d = 0; d < D; ++d) {
      const float x = load_as_float(src, base + d * stride, in);
      amax = std::fmax(amax, quant::int8_abs(x));
      nan |= quant::is_nan(x);
    }
    const float inv = quant::int8_inv_scale(amax);
    int8_t* out = static_cast<int8_t*>(codes);
    for (int64_t d = 0; d < D; ++d) out[d] = quant::int8_encode(load_as_float(src, base + d * stride, in), inv);
    *scale = quant::int8_scale(amax, nan);
    return;
  }
  const quant::Fp8Spec spec = kind == KVKind::kFp8E4M3 ? quant::kE4M3 : quant::kE5M2;
  const float inv = 1.f / *scale;
  uint8_t* out = static_cast<uint8_t*>(codes);
  for (int64_t d = 0; d < D; ++d) out[d] = quant::fp8_encode(load_as_float(src, base + d * stride, in) * inv, spec);
}

/// The per-channel (scale, zero) metadata of the KIVI key page (block, h): 2 * head_dim fp16 values.
inline const uint16_t* kivi_key_meta(const float* scales, const PagedLayout& L, int64_t block, int64_t h) {
  return reinterpret_cast<const uint16_t*>(scales) + (block * L.num_kv_heads + h) * 2 * L.head_dim;
}

/// Quantizes one KIVI key page: tokens t < P of one kv head, value (t, d) at src[base + t * t_stride +
/// d * d_stride]; per channel, min/max over the page's tokens. Writes the page's codes (rows of
/// codes_row_bytes, planar) and its metadata (kivi_key_meta layout).
inline void quantize_kivi_key_page(const void* src, int64_t base, int64_t t_stride, int64_t d_stride, DType in,
                                   int64_t P, int64_t D, int bits, uint8_t* codes, uint16_t* meta) {
  const int64_t row_bytes = D * bits / 8;
  std::memset(codes, 0, static_cast<size_t>(P * row_bytes));
  for (int64_t d = 0; d < D; ++d) {
    float mn = INFINITY, mx = -INFINITY;  // over the page's finite values: a bad token's NaN / Inf stays out
    for (int64_t t = 0; t < P; ++t) {
      const float x = load_as_float(src, base + t * t_stride + d * d_stride, in);
      mn = std::fmin(mn, quant::uint_low(x));
      mx = std::fmax(mx, quant::uint_high(x));
    }
    quant::uint_finish(mn, mx);
    const float inv = quant::uint_inv_scale(mn, mx, bits);
    for (int64_t t = 0; t < P; ++t) {
      const float x = load_as_float(src, base + t * t_stride + d * d_stride, in);
      codes[t * row_bytes + quant::planar_byte(d, bits)] |=
          static_cast<uint8_t>(quant::uint_encode(x, mn, inv, bits) << quant::planar_shift(d, bits));
    }
    meta[quant::kivi_key_scale_at(d)] = float_to_fp16(quant::uint_scale(mn, mx, bits));
    meta[quant::kivi_key_zero_at(d)] = float_to_fp16(mn);
  }
}

/// Value d of a stored KIVI row: keys read the page's per-channel metadata, values their row's groups.
inline float dequantize_kivi(const void* codes, const uint16_t* meta, int64_t d, int bits, bool key) {
  const uint8_t c = quant::planar_get(static_cast<const uint8_t*>(codes), d, bits);
  if (key) return quant::uint_decode(c, fp16_to_float(meta[quant::kivi_key_scale_at(d)]), fp16_to_float(meta[quant::kivi_key_zero_at(d)]));
  return quant::uint_decode(c, fp16_to_float(meta[2 * (d / 32)]), fp16_to_float(meta[2 * (d / 32) + 1]));
}

/// Value d of a stored int4 row.
inline float dequantize_int4(const void* codes, const void* meta, int64_t d) {
  const uint8_t byte = static_cast<const uint8_t*>(codes)[d / 2];
  const uint16_t* m = static_cast<const uint16_t*>(meta) + 2 * (d / kInt4Group);
  return quant::uint_decode(static_cast<uint8_t>((d & 1) ? byte >> 4 : byte & 15), fp16_to_float(m[0]), fp16_to_float(m[1]));
}

/// Value d of a stored row, dequantized (int4: use dequantize_int4).
inline float dequantize(const void* codes, int64_t d, KVKind kind, float scale) {
  switch (kind) {
    case KVKind::kInt8: return quant::int8_decode(static_cast<const int8_t*>(codes)[d], scale);
    case KVKind::kFp8E4M3: return quant::fp8_decode(static_cast<const uint8_t*>(codes)[d], quant::kE4M3) * scale;
    default: return quant::fp8_decode(static_cast<const uint8_t*>(codes)[d], quant::kE5M2) * scale;
  }
}

}  // namespace kvcache::cpu
