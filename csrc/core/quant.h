// The quantization math of every KV format, written once for the CPU kernels, the CUDA kernels and
// the GoogleTest suite, and mirrored line by line in python/kvcache/quant.py. Stored codes must be
// bit-identical between the two, so every step is spelled out: fp32 arithmetic, a reciprocal computed
// once per group, round-half-to-even, explicit clamps.
//
//   int8  symmetric, one scale per (token, kv head):  scale = amax / 127, code = rne(x * (127 / amax))
//   fp8   e4m3fn / e5m2, one scale per kv head:        code = fp8_rne_satfinite(x * (1 / scale))
//   uintN asymmetric groups (int4 along head_dim; KIVI 2/4-bit per channel or per token):
//         zero = min, scale = (max - min) / (2^N - 1), code = clamp(rne((x - min) * ((2^N - 1) / (max - min))))
// A group whose values are all equal (amax = 0, or max = min) gets scale 0 and codes 0; it dequantizes
// to exactly zero (int8) or exactly its value (asymmetric: 0 * 0 + min).
//
// Bad values (NaN, +-Inf) never enter a scale or zero point: amax, min and max are taken over a group's
// finite values only (a group with none is an all-zero group), so one bad token changes nothing stored for
// the other tokens of its page, head or channel. The bad values themselves:
//   NaN   fp8: the NaN code 0x7f. int8 and asymmetric groups: the code nearest 0 (int8: 0), and a group
//         that belongs to one token (an int8 row, an int4 / KIVI-value group) gets a NaN scale, so it reads
//         back NaN as the token would in full precision; KIVI keys (scales shared per channel) cannot say NaN.
//   +-Inf the largest code of its sign (int8 +-127, uintN 2^N - 1 / 0, fp8 +-max finite).
// Huge finite values are data and enter the scales, computed in fp32; asymmetric groups keep fp16
// metadata, so their values saturate at fp16's +-65504 first and no scale or zero point overflows.
//
// The `hadamard` option of a format rotates each (token, kv head) row before quantizing it:
//   rotate(x) = c * H (s . x),  unrotate(y) = s . (H y) / (c D)
// with H the D x D Walsh-Hadamard matrix (D a power of two), s a fixed pattern of signs and
// c = 2^-ceil(log2(D) / 2), so every scaling is a power of two and exact. Rotation spreads a row's outlier
// channels over all dims (lower crest factor, smaller quantization steps) and changes no attention
// output: q.k = rotate_query(q).rotate(k) with rotate_query(q) = rotate(q) / (c^2 D), and
// o = unrotate(sum_j p_j rotate(v_j)). The butterflies run in one fixed order, so fp32 results are
// bit-identical in C++, CUDA and PyTorch.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/host_device.h"

namespace kvcache::quant {

/// Round half to even, as torch.round does (nearbyint under the default rounding mode).
KVC_HOST_DEVICE float rne(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);
#endif
}

KVC_HOST_DEVICE float clampf(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }

KVC_HOST_DEVICE uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
KVC_HOST_DEVICE float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// ---- bad values ---------------------------------------------------------------------------------
// Bit tests, so that no compiler flag can fold them away.
KVC_HOST_DEVICE bool is_finite(float x) { return (float_bits(x) & 0x7fffffffu) < 0x7f800000u; }
KVC_HOST_DEVICE bool is_nan(float x) { return (float_bits(x) & 0x7fffffffu) > 0x7f800000u; }
/// The NaN a group scale is set to (the positive quiet NaN, as torch's float("nan")), in fp32 and fp16.
KVC_HOST_DEVICE float scale_nan() { return bits_float(0x7fc00000u); }
constexpr uint16_t kFp16ScaleNaN = 0x7e00;
constexpr float kFp16Max = 65504.f;

// ---- int8 -------------------------------------------------------------------------------------
/// What x adds to a row's absolute maximum: |x|, or nothing (0) for NaN and +-Inf.
KVC_HOST_DEVICE float int8_abs(float x) { return is_finite(x) ? fabsf(x) : 0.f; }
/// Multiplier that maps a row of absolute maximum `amax` onto [-127, 127] (0 for an all-zero row).
KVC_HOST_DEVICE float int8_inv_scale(float amax) { return amax > 0.f ? 127.f / amax : 0.f; }
/// The row's stored scale; NaN if the row holds a NaN (`nan`): the row then reads back NaN.
KVC_HOST_DEVICE float int8_scale(float amax, bool nan = false) { return nan ? scale_nan() : amax / 127.f; }
KVC_HOST_DEVICE int8_t int8_encode(float x, float inv_scale) {
  const float y = x * inv_scale;  // NaN for a NaN, and for +-Inf in a row with no finite magnitude (any code reads 0)
  return static_cast<int8_t>(clampf(rne(is_nan(y) ? 0.f : y), -127.f, 127.f));
}
KVC_HOST_DEVICE float int8_decode(int8_t code, float scale) { return static_cast<float>(code) * scale; }

// ---- fp8 --------------------------------------------------------------------------------------
/// fp8 formats: e4m3fn (bias 7, no infinities, max 448) and e5m2 (bias 15, IEEE-like, max 57344).
struct Fp8Spec {
  int man_bits, exp_bias;
  float max_finite;
};
constexpr Fp8Spec kE4M3{3, 7, 448.f};
constexpr Fp8Spec kE5M2{2, 15, 57344.f};

/// fp32 -> fp8, round half to even, saturating to +-max_finite (NaN stays NaN). Matches
/// `x.clamp(-max, max).to(torch.float8_e4m3fn / float8_e5m2)`.
KVC_HOST_DEVICE uint8_t fp8_encode(float x, Fp8Spec s) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  if (is_nan(x)) return 0x7f;  // NaN of either sign: 0x7f is NaN in both formats
  float a = clampf(fabsf(x), 0.f, s.max_finite);  // +-Inf saturates as any value past max_finite
  // Smallest normal exponent of the target is 1 - bias; below it values are subnormal with a fixed
  // quantum of 2^(1 - bias - man_bits). Above, the quantum is 2^(e - man_bits).
  const int min_exp = 1 - s.exp_bias;
  int e;
  frexpf(a, &e);  // a = f * 2^e, f in [0.5, 1): the leading bit has weight 2^(e - 1)
  int lead = e - 1;
  if (a == 0.f) return sign;
  if (lead < min_exp) lead = min_exp;
  const float quantum = ldexpf(1.f, lead - s.man_bits);
  float q = rne(a / quantum) * quantum;  // exact: a / quantum is a power-of-two scaling
  if (q > s.max_finite) q = s.max_finite;
  // Re-encode q (exactly representable now).
  if (q == 0.f) return sign;
  frexpf(q, &e);
  lead = e - 1;
  uint32_t exp_field, man_field;
  if (lead < min_exp) {  // subnormal
    exp_field = 0;
    man_field = static_cast<uint32_t>(q / ldexpf(1.f, min_exp - s.man_bits));
  } else {
    exp_field = static_cast<uint32_t>(lead + s.exp_bias);
    man_field = static_cast<uint32_t>(q / ldexpf(1.f, lead - s.man_bits)) - (1u << s.man_bits);
  }
  return static_cast<uint8_t>(sign | (exp_field << s.man_bits) | man_field);
}

/// fp8 -> fp32 (exact).
KVC_HOST_DEVICE float fp8_decode(uint8_t code, Fp8Spec s) {
  const int exp_bits = 7 - s.man_bits;
  const uint32_t man = code & ((1u << s.man_bits) - 1u);
  const uint32_t exp = (code >> s.man_bits) & ((1u << exp_bits) - 1u);
  const float sign = (code & 0x80u) ? -1.f : 1.f;
  if (s.man_bits == 3 && exp == 15u && man == 7u) return NAN;           // e4m3fn NaN
  if (s.man_bits == 2 && exp == 31u) return man ? NAN : sign * INFINITY;  // e5m2 inf / NaN
  if (exp == 0) return sign * ldexpf(static_cast<float>(man), 1 - s.exp_bias - s.man_bits);
  return sign * ldexpf(static_cast<float>(man + (1u << s.man_bits)), static_cast<int>(exp) - s.exp_bias - s.man_bits);
}

// ---- asymmetric unsigned N-bit groups (int4, KIVI) ------------------------------------------------
/// What x adds to a group's minimum / maximum: x saturated to fp16's range (the metadata is fp16), or nothing
/// (+Inf / -Inf, the identities of min / max) for NaN and +-Inf.
KVC_HOST_DEVICE float uint_low(float x) { return is_finite(x) ? clampf(x, -kFp16Max, kFp16Max) : INFINITY; }
KVC_HOST_DEVICE float uint_high(float x) { return is_finite(x) ? clampf(x, -kFp16Max, kFp16Max) : -INFINITY; }
/// A group with no finite value (min still +Inf) is an all-zero group: min = max = 0.
KVC_HOST_DEVICE void uint_finish(float& mn, float& mx) {
  if (!(mn <= mx)) mn = mx = 0.f;
}
KVC_HOST_DEVICE float uint_levels(int bits) { return static_cast<float>((1 << bits) - 1); }
KVC_HOST_DEVICE float uint_inv_scale(float mn, float mx, int bits) {
  return mx > mn ? uint_levels(bits) / (mx - mn) : 0.f;
}
KVC_HOST_DEVICE float uint_scale(float mn, float mx, int bits) { return (mx - mn) / uint_levels(bits); }
/// A NaN x is encoded as 0 would be; y is NaN only for +-Inf in a constant group (every code reads `mn`).
KVC_HOST_DEVICE uint8_t uint_encode(float x, float mn, float inv_scale, int bits) {
  const float y = ((is_nan(x) ? 0.f : x) - mn) * inv_scale;
  return static_cast<uint8_t>(clampf(rne(is_nan(y) ? 0.f : y), 0.f, uint_levels(bits)));
}
KVC_HOST_DEVICE float uint_decode(uint8_t code, float scale, float zero) { return static_cast<float>(code) * scale + zero; }

// ---- KIVI packing: planes per 32-dim chunk ---------------------------------------------------------
// With b bits a chunk of 32 dims takes 4 b bytes; dim j of the chunk sits in byte j % (4 b) at bit
// b * (j / (4 b)). So dims 0-15 and 16-31 of a chunk unpack as two natural-order runs of 16.
// (The in-chunk arithmetic is 32-bit: on a GPU a 64-bit division by the runtime 4 b is a call to a slow subroutine.)
KVC_HOST_DEVICE int64_t planar_byte(int64_t d, int bits) {
  return (d / 32) * 4 * bits + static_cast<int>(d % 32) % (4 * bits);
}
KVC_HOST_DEVICE int planar_shift(int64_t d, int bits) { return bits * (static_cast<int>(d % 32) / (4 * bits)); }
KVC_HOST_DEVICE uint8_t planar_get(const uint8_t* row, int64_t d, int bits) {
  return static_cast<uint8_t>((row[planar_byte(d, bits)] >> planar_shift(d, bits)) & ((1 << bits) - 1));
}
/// Offsets (in fp16 units) of the scale and zero of channel d in one KIVI key page's metadata.
KVC_HOST_DEVICE int64_t kivi_key_scale_at(int64_t d) { return (d / 32) * 64 + d % 32; }
KVC_HOST_DEVICE int64_t kivi_key_zero_at(int64_t d) { return (d / 32) * 64 + 32 + d % 32; }

// ---- Hadamard rotation --------------------------------------------------------------------------
/// Sign s_d flipped onto dim d before the transform (Knuth's multiplicative hash: a fixed, pseudo-random
/// pattern, so a constant offset across channels does not land on one dim after H).
KVC_HOST_DEVICE float rot_sign(int64_t d) { return ((static_cast<uint32_t>(d) * 2654435761u) >> 31) ? -1.f : 1.f; }

KVC_HOST_DEVICE bool rot_supported(int64_t D) { return D >= 2 && D <= 1024 && (D & (D - 1)) == 0; }

/// c = 2^-ceil(log2(D) / 2) (D a power of two).
KVC_HOST_DEVICE float rot_forward_scale(int64_t D) {
  int lg = 0;
  while ((int64_t(1) << lg) < D) ++lg;
  return ldexpf(1.f, -((lg + 1) / 2));
}
/// 1 / (c D), applied after the transform by unrotate.
KVC_HOST_DEVICE float rot_inverse_scale(int64_t D) { return 1.f / (rot_forward_scale(D) * static_cast<float>(D)); }
/// 1 / (c^2 D): rotate_query(q) = rotate(q) * rot_query_scale(D).
KVC_HOST_DEVICE float rot_query_scale(int64_t D) {
  const float c = rot_forward_scale(D);
  return 1.f / (c * c * static_cast<float>(D));
}

/// In-place fast Walsh-Hadamard transform of x[0..D): for h = 1, 2, 4, ..., each pair (x[i], x[i + h])
/// with bit h of i clear becomes (x[i] + x[i + h], x[i] - x[i + h]). Unnormalized.
KVC_HOST_DEVICE void fwht(float* x, int64_t D) {
  for (int64_t h = 1; h < D; h <<= 1) {
    for (int64_t i = 0; i < D; ++i) {
      if (i & h) continue;
      const float a = x[i], b = x[i + h];
      x[i] = a + b;
      x[i + h] = a - b;
    }
  }
}

KVC_HOST_DEVICE void rotate(float* x, int64_t D) {
  for (int64_t d = 0; d < D; ++d) x[d] *= rot_sign(d);
  fwht(x, D);
  const float c = rot_forward_scale(D);
  for (int64_t d = 0; d < D; ++d) x[d] *= c;
}

KVC_HOST_DEVICE void unrotate(float* y, int64_t D) {
  fwht(y, D);
  const float inv = rot_inverse_scale(D);
  for (int64_t d = 0; d < D; ++d) y[d] *= inv * rot_sign(d);
}

}  // namespace kvcache::quant
