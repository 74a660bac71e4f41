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
