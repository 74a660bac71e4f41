// EdgeTokens: the width each edge is stored in, and common_prefix (the SIMD loop and its scalar tail)
// against a plain loop, for a mismatch at every position, with request ids that a 16-bit edge must
// not confuse with its own (id + 65536, negative ids).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "prefix/edge_tokens.h"

using kvcache::prefix::EdgeTokens;

namespace {

EdgeTokens edge_of(const std::vector<int32_t>& v) {
  EdgeTokens e;
  e.assign(v.data(), v.data() + v.size());
  return e;
}

std::vector<int32_t> values(const EdgeTokens& e) {
  std::vector<int32_t> v;
  for (int64_t i = 0; i < e.size(); ++i) v.push_back(e[i]);
  return v;
}

int64_t plain_common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b, int64_t n) {
  int64_t i = 0;
  while (i < n && a[static_cast<size_t>(i)] == b[static_cast<size_t>(i)]) ++i;
  return i;
}

}  // namespace

TEST(EdgeTokens, NarrowOnlyWhenEveryIdFitsIn16BitsUnsigned) {
  EXPECT_TRUE(edge_of({0, 1, 65535}).narrow());
  EXPECT_TRUE(edge_of({}).narrow());
  EXPECT_FALSE(edge_of({0, 65536}).narrow());
  EXPECT_FALSE(edge_of({5, -1}).narrow());
  EXPECT_FALSE(edge_of({INT32_MAX}).narrow());
  for (const std::vector<int32_t>& v : {std::vector<int32_t>{0, 1, 65535}, std::vector<int32_t>{7, -1, 1 << 20, 3}}) {
    const EdgeTokens e = edge_of(v);
    EXPECT_EQ(e.size(), static_cast<int64_t>(v.size()));
    EXPECT_EQ(values(e), v);
  }
}

TEST(EdgeTokens, SplittingKeepsValuesAndWidth) {
  for (const int32_t big : {40000, 100000}) {
    std::vector<int32_t> v(37);
    for (size_t i = 0; i < v.size(); ++i) v[i] = big - static_cast<int32_t>(i);
    const EdgeTokens whole = edge_of(v);
    for (int64_t k = 0; k <= whole.size(); ++k) {
      EdgeTokens upper, lower = whole;
      upper.assign_prefix(whole, k);
      lower.erase_prefix(k);
      EXPECT_EQ(values(upper), std::vector<int32_t>(v.begin(), v.begin() + k));
      EXPECT_EQ(values(lower), std::vector<int32_t>(v.begin() + k, v.end()));
      EXPECT_EQ(upper.narrow(), whole.narrow());
      EXPECT_EQ(lower.narrow(), whole.narrow());
    }
  }
}

TEST(EdgeTokens, CommonPrefixMatchesAPlainLoopAtEveryMismatch) {
  std::mt19937 rng(7);
  for (const int32_t vocab : {65536, 1 << 20}) {  // narrow and wide edges
    for (const int64_t n : {0, 1, 15, 16, 17, 31, 32, 33, 100, 257}) {
      std::vector<int32_t> a(static_cast<size_t>(n));
      for (int32_t& t : a) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
      const EdgeTokens e = edge_of(a);
      EXPECT_EQ(e.narrow(), vocab == 65536 || n == 0 || *std::max_element(a.begin(), a.end()) < 65536);
      EXPECT_EQ(e.common_prefix(a.data(), n), n);
      for (int64_t at = 0; at < n; ++at) {
        const int32_t t = a[static_cast<size_t>(at)];
        for (const int32_t other : {t + 1, t + 65536, t - 65536, -1, t ^ (1 << 16)}) {
          if (other == t) continue;
          std::vector<int32_t> b = a;
          b[static_cast<size_t>(at)] = other;
          ASSERT_EQ(e.common_prefix(b.data(), n), plain_common_prefix(a, b, n))
              << "n = " << n << ", mismatch at " << at << ", " << t << " vs " << other;
          ASSERT_EQ(e.common_prefix(b.data(), at), at);  // a shorter compare stops before it
        }
      }
    }
  }
}

// Each compiled implementation of the narrow compare, not only the one this CPU picks.
TEST(EdgeTokens, EveryNarrowCompareMatchesAPlainLoop) {
  using Compare = int64_t (*)(const uint16_t*, const int32_t*, int64_t);
  std::vector<std::pair<const char*, Compare>> impls = {{"sse2", &EdgeTokens::common_prefix_narrow_sse2}};
#if KVCACHE_EDGE_AVX2
  if (EdgeTokens::has_avx2()) impls.emplace_back("avx2", &EdgeTokens::common_prefix_narrow_avx2);
#endif
  std::mt19937 rng(11);
  for (const auto& [name, compare] : impls) {
    for (const int64_t n : {0, 1, 7, 8, 9, 31, 32, 33, 40, 63, 64, 65, 100, 257}) {
      std::vector<int32_t> a(static_cast<size_t>(n));
      for (int32_t& t : a) t = static_cast<int32_t>(rng() % 65536u);
      std::vector<uint16_t> edge(a.begin(), a.end());
      ASSERT_EQ(compare(edge.data(), a.data(), n), n) << name;
      for (int64_t at = 0; at < n; ++at) {
        const int32_t t = a[static_cast<size_t>(at)];
        for (const int32_t other : {t + 1, t + 65536, t - 65536, -1, t ^ (1 << 16),
                                   static_cast<int32_t>(static_cast<uint32_t>(t) | 0x80000000u)}) {
          std::vector<int32_t> b = a;
          b[static_cast<size_t>(at)] = other;
          ASSERT_EQ(compare(edge.data(), b.data(), n), plain_common_prefix(a, b, n))
              << name << ": n = " << n << ", mismatch at " << at << ", " << t << " vs " << other;
          ASSERT_EQ(compare(edge.data(), b.data(), at), at) << name;  // a shorter compare stops before it
        }
      }
    }
  }
}
