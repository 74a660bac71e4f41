#include <gtest/gtest.h>

#include <set>

#include "cache/cache_args.h"
#include "core/paged_layout.h"

using kvcache::BlockRun;
using kvcache::block_runs;
using kvcache::PagedLayout;

TEST(PagedLayout, SupportedPageSizesArePowersOfTwoUpTo256) {
  for (int64_t p = 1; p <= 256; p *= 2) EXPECT_TRUE(kvcache::is_supported_page_size(p)) << p;
  for (int64_t p : {0, -1, 3, 12, 48, 100, 257, 512}) EXPECT_FALSE(kvcache::is_supported_page_size(p)) << p;
}

TEST(PagedLayout, OffsetsAreHeadMajorAndMatchRowMajorIndexing) {
  for (int64_t page = 1; page <= 256; page *= 2) {
    const PagedLayout L(/*blocks=*/3, page, /*heads=*/5, /*dim=*/7);
    EXPECT_EQ(L.page_shift, __builtin_ctzll(page));
    EXPECT_EQ(L.num_slots(), 3 * page);
    EXPECT_EQ(L.pool_elements(), 3 * 5 * page * 7);
    for (int64_t b = 0; b < 3; ++b)
      for (int64_t h = 0; h < 5; ++h)
        for (int64_t t = 0; t < page; ++t) {
          const int64_t row_major = ((b * 5 + h) * page + t) * 7;  // [blocks, heads, page, dim]
          EXPECT_EQ(L.offset(b, h, t), row_major);
          EXPECT_EQ(L.slot_offset(b * page + t, h), row_major);
          EXPECT_EQ(L.token_offset(b, h, 5 * page + t), row_major);  // any token index maps into its page
        }
  }
}

TEST(PagedLayout, EverySlotAndHeadMapsToADistinctRowInsideThePool) {
  const PagedLayout L(4, 8, 3, 16);
  std::set<int64_t> seen;
  for (int64_t s = 0; s < L.num_slots(); ++s) {
    EXPECT_EQ(L.block_of(s) * L.page_size + L.offset_in_page(s), s);
    for (int64_t h = 0; h < L.num_kv_heads; ++h) {
      const int64_t off = L.slot_offset(s, h);
      EXPECT_GE(off, 0);
      EXPECT_LE(off + L.head_dim, L.pool_elements());
      EXPECT_EQ(off % L.head_dim, 0);
      EXPECT_TRUE(seen.insert(off).second) << "slot " << s << " head " << h;
    }
  }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), L.num_slots() * L.num_kv_heads);
}

TEST(PagedLayout, PagesFor) {
  const PagedLayout L(1, 16, 1, 1);
  EXPECT_EQ(L.pages_for(0), 0);
  EXPECT_EQ(L.pages_for(1), 1);
  EXPECT_EQ(L.pages_for(16), 1);
  EXPECT_EQ(L.pages_for(17), 2);
  EXPECT_EQ(PagedLayout(1, 1, 1, 1).pages_for(5), 5);
}

TEST(PagedLayout, ValueRowsDefaultToTheKeysWidth) {
  const PagedLayout L(3, 4, 2, 16);
  EXPECT_EQ(L.v_head_dim, 16);
  EXPECT_TRUE(L.equal_widths());
  EXPECT_EQ(L.dim(false), 16);
  EXPECT_EQ(L.dim(true), 16);
  for (bool value : {false, true}) {
    const PagedLayout S = L.side(value);
    EXPECT_EQ(S.pool_elements(), L.pool_elements());
    EXPECT_EQ(S.offset(2, 1, 3), L.offset(2, 1, 3));
  }
}

TEST(PagedLayout, ValueRowsOfAnotherWidthHaveTheirOwnOffsets) {
  // MLA: a 512-dim latent as K, the 64-dim rotary part as V; one kv head, the same blocks and pages
  for (int64_t page = 1; page <= 256; page *= 4) {
    const PagedLayout L(/*blocks=*/5, page, /*heads=*/2, /*dim=*/24, /*v_dim=*/6);
    EXPECT_FALSE(L.equal_widths());
    EXPECT_EQ(L.dim(false), 24);
    EXPECT_EQ(L.dim(true), 6);
    const PagedLayout K = L.side(false), V = L.side(true);
    EXPECT_TRUE(K.equal_widths() && V.equal_widths());
    EXPECT_EQ(K.pool_elements(), 5 * 2 * page * 24);
    EXPECT_EQ(V.pool_elements(), 5 * 2 * page * 6);
    EXPECT_EQ(V.num_slots(), L.num_slots());
    EXPECT_EQ(V.page_shift, L.page_shift);
    std::set<int64_t> seen;
    for (int64_t s = 0; s < L.num_slots(); ++s) {
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t b = s / page, t = s % page;
        EXPECT_EQ(K.slot_offset(s, h), ((b * 2 + h) * page + t) * 24);  // [blocks, heads, page, 24]
        EXPECT_EQ(V.slot_offset(s, h), ((b * 2 + h) * page + t) * 6);   // [blocks, heads, page, 6]
        EXPECT_EQ(V.row_index(b, h, t), K.row_index(b, h, t));         // per-row scales: one index for both
        EXPECT_LE(V.slot_offset(s, h) + 6, V.pool_elements());
        EXPECT_TRUE(seen.insert(V.slot_offset(s, h)).second);
      }
    }
  }
}

TEST(BlockRuns, ConsecutiveOnBothSidesMergeInOrder) {
  // (3,10) (4,11) (5,12): one run; (9,13): src jumps; (10,2): dst jumps back; (11,3) follows it; (11,4) repeats src
  const std::vector<int64_t> pairs = {3, 10, 4, 11, 5, 12, 9, 13, 10, 2, 11, 3, 11, 4};
  const std::vector<BlockRun> runs = block_runs(pairs.data(), 7);
  ASSERT_EQ(runs.size(), 4u);
  EXPECT_EQ(runs[0].src, 3); EXPECT_EQ(runs[0].dst, 10); EXPECT_EQ(runs[0].count, 3);
  EXPECT_EQ(runs[1].src, 9); EXPECT_EQ(runs[1].dst, 13); EXPECT_EQ(runs[1].count, 1);
  EXPECT_EQ(runs[2].src, 10); EXPECT_EQ(runs[2].dst, 2); EXPECT_EQ(runs[2].count, 2);
  EXPECT_EQ(runs[3].src, 11); EXPECT_EQ(runs[3].dst, 4); EXPECT_EQ(runs[3].count, 1);
  // every pair is covered once, in order
  std::vector<int64_t> back;
  for (const BlockRun& r : runs) {
    for (int64_t k = 0; k < r.count; ++k) back.insert(back.end(), {r.src + k, r.dst + k});
  }
  EXPECT_EQ(back, pairs);
  EXPECT_TRUE(block_runs(nullptr, 0).empty());
}
