// The scalar quantization math of csrc/core/quant.h (bit-exactness against torch is tested from
// Python, tests/test_quant.py, through the same functions exposed by the extension).
#include <gtest/gtest.h>

#include <cmath>

#include "core/quant.h"

using namespace kvcache::quant;

TEST(Quant, RoundHalfToEven) {
  EXPECT_EQ(rne(0.5f), 0.f);
  EXPECT_EQ(rne(1.5f), 2.f);
  EXPECT_EQ(rne(2.5f), 2.f);
  EXPECT_EQ(rne(-2.5f), -2.f);
  EXPECT_EQ(rne(-0.7f), -1.f);
}

TEST(Quant, Int8RowRoundTrip) {
  const float row[4] = {0.5f, -1.f, 0.25f, 0.f};
  const float inv = int8_inv_scale(1.f), scale = int8_scale(1.f);
  EXPECT_EQ(int8_encode(row[0], inv), 64);  // 63.5 -> 64 (half to even)
  EXPECT_EQ(int8_encode(row[1], inv), -127);
  EXPECT_EQ(int8_encode(row[2], inv), 32);  // 31.75 -> 32
  EXPECT_EQ(int8_encode(row[3], inv), 0);
  EXPECT_FLOAT_EQ(int8_decode(-127, scale), -1.f);
  EXPECT_EQ(int8_inv_scale(0.f), 0.f);      // an all-zero row: codes 0, scale 0
  EXPECT_EQ(int8_encode(3.f, 0.f), 0);
}

TEST(Quant, Fp8KnownValues) {
  EXPECT_EQ(fp8_encode(1.f, kE4M3), 0x38);  // 0 0111 000
  EXPECT_EQ(fp8_encode(-2.f, kE4M3), 0xC0);
  EXPECT_EQ(fp8_encode(448.f, kE4M3), 0x7E);
  EXPECT_EQ(fp8_encode(1e6f, kE4M3), 0x7E);  // saturates
  EXPECT_EQ(fp8_encode(1.f, kE5M2), 0x3C);  // 0 01111 00
  EXPECT_EQ(fp8_encode(57344.f, kE5M2), 0x7B);
  EXPECT_EQ(fp8_encode(0.f, kE4M3), 0x00);
  EXPECT_EQ(fp8_decode(0x01, kE4M3), std::ldexp(1.f, -9));  // smallest subnormal
  EXPECT_EQ(fp8_decode(0x01, kE5M2), std::ldexp(1.f, -16));
  EXPECT_TRUE(std::isnan(fp8_decode(0x7F, kE4M3)));
}

TEST(Quant, Fp8EncodeDecodeIsIdentityOnEveryCode) {
  for (const Fp8Spec s : {kE4M3, kE5M2}) {
    for (int c = 0; c < 256; ++c) {
      const float v = fp8_decode(static_cast<uint8_t>(c), s);
      if (std::isnan(v) || std::isinf(v)) continue;
      const uint8_t back = fp8_encode(v, s);
      if (v == 0.f) {
        EXPECT_EQ(back & 0x7f, 0) << c;
      } else {
        EXPECT_EQ(back, c) << "code " << c << " value " << v;
      }
    }
  }
}

TEST(Quant, UintGroups) {
  // values 0..15 spread over [-1, 2]: exact grid, codes 0..15
  const float mn = -1.f, mx = 2.f;
  const float inv = uint_inv_scale(mn, mx, 4), scale = uint_scale(mn, mx, 4);
  for (int k = 0; k <= 15; ++k) {
    const float x = mn + k * 0.2f;
    EXPECT_EQ(uint_encode(x, mn, inv, 4), k) << x;
    EXPECT_NEAR(uint_decode(static_cast<uint8_t>(k), scale, mn), x, 1e-6f);
  }
  EXPECT_EQ(uint_encode(5.f, mn, inv, 4), 15);  // clamps
  EXPECT_EQ(uint_encode(0.3f, 0.3f, uint_inv_scale(0.3f, 0.3f, 2), 2), 0);  // a constant group
  EXPECT_EQ(uint_decode(0, uint_scale(0.3f, 0.3f, 2), 0.3f), 0.3f);
}

TEST(Quant, BadValuesStayOutOfScales) {
  EXPECT_TRUE(is_nan(NAN) && is_nan(-NAN) && !is_nan(INFINITY) && !is_nan(3e38f));
  EXPECT_TRUE(is_finite(3e38f) && is_finite(-0.f) && !is_finite(INFINITY) && !is_finite(-INFINITY) && !is_finite(NAN));
  // int8: NaN and +-Inf add nothing to the row's amax; NaN is code 0 (its row's scale NaN), +-Inf +-127
  EXPECT_EQ(int8_abs(NAN), 0.f);
  EXPECT_EQ(int8_abs(-INFINITY), 0.f);
  EXPECT_EQ(int8_abs(-2.f), 2.f);
  const float inv = int8_inv_scale(1.f);
  EXPECT_EQ(int8_encode(NAN, inv), 0);
  EXPECT_EQ(int8_encode(INFINITY, inv), 127);
  EXPECT_EQ(int8_encode(-INFINITY, inv), -127);
  EXPECT_EQ(int8_encode(INFINITY, int8_inv_scale(0.f)), 0);  // no finite magnitude in the row: scale 0
  EXPECT_TRUE(std::isnan(int8_scale(1.f, true)));
  EXPECT_EQ(int8_scale(3.4e38f), 3.4e38f / 127.f);           // huge finite values: fp32 scales hold them
  // asymmetric groups: min / max over finite values saturated at fp16's range; none: min = max = 0
  EXPECT_EQ(uint_low(NAN), INFINITY);
  EXPECT_EQ(uint_high(INFINITY), -INFINITY);
  EXPECT_EQ(uint_low(1e30f), 65504.f);
  EXPECT_EQ(uint_high(-3e38f), -65504.f);
  float mn = INFINITY, mx = -INFINITY;
  uint_finish(mn, mx);
  EXPECT_EQ(mn, 0.f);
  EXPECT_EQ(mx, 0.f);
  EXPECT_EQ(uint_scale(-65504.f, 65504.f, 2), 131008.f / 3.f);  // fits fp16 (<= 65504)
  const float uinv = uint_inv_scale(-1.f, 2.f, 4);
  EXPECT_EQ(uint_encode(NAN, -1.f, uinv, 4), 5);  // as 0 would be: (0 + 1) * 5
  EXPECT_EQ(uint_encode(INFINITY, -1.f, uinv, 4), 15);
  EXPECT_EQ(uint_encode(-INFINITY, -1.f, uinv, 4), 0);
  EXPECT_EQ(uint_encode(INFINITY, 0.3f, uint_inv_scale(0.3f, 0.3f, 2), 2), 0);  // a constant group
  // fp8: NaN of either sign is 0x7f; +-Inf saturates (e5m2 too, though it has an infinity)
  EXPECT_EQ(fp8_encode(-NAN, kE4M3), 0x7F);
  EXPECT_EQ(fp8_encode(NAN, kE5M2), 0x7F);
  EXPECT_EQ(fp8_encode(INFINITY, kE5M2), 0x7B);
  EXPECT_EQ(fp8_encode(-INFINITY, kE4M3), 0xFE);
}

TEST(Quant, HadamardTransformMatchesTheMatrix) {
  // fwht == multiplication by H with H[i][j] = (-1)^popcount(i & j)
  for (int64_t D : {2, 8, 64, 128}) {
    float x[128], y[128];
    for (int64_t i = 0; i < D; ++i) x[i] = y[i] = static_cast<float>((i * 37) % 11) - 5.f;  // small ints: exact
    fwht(y, D);
    for (int64_t i = 0; i < D; ++i) {
      float want = 0.f;
      for (int64_t j = 0; j < D; ++j) want += (__builtin_popcountll(i & j) & 1) ? -x[j] : x[j];
      EXPECT_EQ(y[i], want) << "D=" << D << " i=" << i;
    }
  }
}

TEST(Quant, RotationScalesArePowersOfTwoAndInvert) {
  EXPECT_EQ(rot_forward_scale(64), 0.125f);   // orthonormal: c^2 D = 1
  EXPECT_EQ(rot_forward_scale(128), 0.0625f);  // c^2 D = 1/2: the query scale makes up for it
  EXPECT_EQ(rot_query_scale(128), 2.f);
  EXPECT_EQ(rot_inverse_scale(128), 0.125f);
  EXPECT_TRUE(rot_supported(256));
  EXPECT_FALSE(rot_supported(96));
  for (int64_t D : {16, 64, 128}) {
    float x[128], q[128], k[128];
    float qk = 0.f;
    for (int64_t i = 0; i < D; ++i) {
      x[i] = k[i] = std::sin(0.37f * static_cast<float>(i)) * 3.f;
      q[i] = std::cos(0.11f * static_cast<float>(i));
      qk += q[i] * k[i];
    }
    rotate(x, D);
    rotate(k, D);
    rotate(q, D);
    float rqk = 0.f;
    for (int64_t i = 0; i < D; ++i) rqk += q[i] * rot_query_scale(D) * k[i];
    EXPECT_NEAR(rqk, qk, 1e-4f * D);  // rotation keeps every dot product
    unrotate(x, D);
    for (int64_t i = 0; i < D; ++i) EXPECT_NEAR(x[i], std::sin(0.37f * static_cast<float>(i)) * 3.f, 1e-5f);
  }
}

TEST(Quant, KiviPlanarPacking) {
  // 4 bits: dims j and j + 16 of a chunk share byte j; 2 bits: dims j, j + 8, j + 16, j + 24 share byte j
  EXPECT_EQ(planar_byte(17, 4), 1);
  EXPECT_EQ(planar_shift(17, 4), 4);
  EXPECT_EQ(planar_byte(32 + 3, 4), 16 + 3);
  EXPECT_EQ(planar_byte(26, 2), 2);
  EXPECT_EQ(planar_shift(26, 2), 6);
  EXPECT_EQ(planar_byte(64 + 9, 2), 16 + 1);
  uint8_t row[16] = {};
  for (int64_t d = 0; d < 64; ++d) row[planar_byte(d, 2)] |= static_cast<uint8_t>((d % 4) << planar_shift(d, 2));
  for (int64_t d = 0; d < 64; ++d) EXPECT_EQ(planar_get(row, d, 2), d % 4);
  EXPECT_EQ(kivi_key_scale_at(33), 64 + 1);
  EXPECT_EQ(kivi_key_zero_at(33), 64 + 32 + 1);
}
