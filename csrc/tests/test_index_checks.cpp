#include <gtest/gtest.h>

#include <vector>

#include "core/index_checks.h"

using namespace kvcache;

TEST(CheckSlots, AcceptsSkipsAndDistinctSlots) {
  const std::vector<int64_t> s = {0, -1, 7, 3, -1};
  EXPECT_EQ(check_slots("slot_mapping", s.data(), 5, 8), "");
  EXPECT_EQ(check_slots("slot_mapping", s.data(), 0, 0), "");
}

TEST(CheckSlots, RejectsOutOfRangeNamingPositionAndBound) {
  const std::vector<int64_t> hi = {0, 8};
  EXPECT_EQ(check_slots("slot_mapping", hi.data(), 2, 8),
            "slot_mapping[1] = 8 is out of range: slots must be -1 (skip) or in [0, 8) (num_blocks * page_size)");
  const std::vector<int64_t> lo = {-2};
  EXPECT_NE(check_slots("slot_mapping", lo.data(), 1, 8).find("slot_mapping[0] = -2"), std::string::npos);
}

TEST(CheckSlots, RejectsDuplicates) {
  const std::vector<int64_t> s = {4, 1, 4};
  EXPECT_EQ(check_slots("slot_mapping", s.data(), 3, 8),
            "slot_mapping writes slot 4 twice (slot_mapping[0] and slot_mapping[2]); each slot may be written once "
            "per call");
}

TEST(CheckSlots, NamesARowMajorSlotByRowAndColumn) {
  // [2, 3]: the bad slot is row 1, column 2 (flat position 5); the repeated one rows 0 and 1.
  const std::vector<int64_t> bad = {0, 1, 2, 3, 4, 99};
  EXPECT_EQ(check_slots("slot_mapping", bad.data(), 6, 8, 3),
            "slot_mapping[1, 2] = 99 is out of range: slots must be -1 (skip) or in [0, 8) (num_blocks * page_size)");
  const std::vector<int64_t> twice = {0, 5, 2, 3, 4, 5};
  EXPECT_EQ(check_slots("slot_mapping", twice.data(), 6, 8, 3),
            "slot_mapping writes slot 5 twice (slot_mapping[0, 1] and slot_mapping[1, 2]); each slot may be written "
            "once per call");
}

TEST(CheckBlockTable, ValidatesOnlyTheBlocksALengthUses) {
  // 2 sequences, 3 columns, page 4: len 5 uses columns 0-1; column 2 holds garbage (-7) and is ignored.
  const std::vector<int32_t> table = {2, 0, -7, 1, 3, 2};
  const std::vector<int64_t> lens = {5, 12};
  EXPECT_EQ(check_block_table("bt", table.data(), 2, 3, 3, "lens", lens.data(), 4, 4, 12, "max_len"), "");
}

TEST(CheckBlockTable, RejectsEachClassOfBadInput) {
  const std::vector<int32_t> table = {2, 0, 9, 1, 3, 2};
  std::vector<int64_t> lens = {9, 1};
  EXPECT_EQ(check_block_table("bt", table.data(), 2, 3, 3, "lens", lens.data(), 4, 4, 12, "max_len"),
            "bt[0, 2] = 9 is not a block id in [0, 4) (needed for lens[0] = 9)");
  lens = {-1, 1};
  EXPECT_EQ(check_block_table("bt", table.data(), 2, 3, 3, "lens", lens.data(), 4, 4, 12, "max_len"),
            "lens[0] = -1 is negative");
  lens = {1, 13};
  EXPECT_EQ(check_block_table("bt", table.data(), 2, 3, 3, "lens", lens.data(), 4, 4, 100, "max_len"),
            "lens[1] = 13 needs 4 blocks but bt has 3 columns (page_size 4)");
  lens = {1, 11};
  EXPECT_EQ(check_block_table("bt", table.data(), 2, 3, 3, "lens", lens.data(), 4, 4, 10, "max_len"),
            "lens[1] = 11 exceeds max_len = 10");
}

TEST(CheckCuSeqLens, ComputesLengthsAndRejectsBadOffsets) {
  std::vector<int64_t> lens;
  const std::vector<int32_t> ok = {0, 3, 3, 10};
  EXPECT_EQ(check_cu_seq_lens("cu", ok.data(), 3, 10, "total", &lens), "");
  EXPECT_EQ(lens, (std::vector<int64_t>{3, 0, 7}));
  const std::vector<int32_t> start = {1, 3};
  EXPECT_EQ(check_cu_seq_lens("cu", start.data(), 1, 3, "total", &lens), "cu[0] = 1 must be 0");
  const std::vector<int32_t> down = {0, 5, 4};
  EXPECT_EQ(check_cu_seq_lens("cu", down.data(), 2, 4, "total", &lens),
            "cu must be non-decreasing but cu[2] = 4 < cu[1] = 5");
  EXPECT_EQ(check_cu_seq_lens("cu", ok.data(), 3, 11, "total", &lens), "cu[3] = 10 must equal total = 11");
}

TEST(CheckBlockMapping, RangesDuplicatesAndOrderDependence) {
  const std::vector<int64_t> ok = {0, 1, 2, 3};
  EXPECT_EQ(check_block_mapping("m", ok.data(), 2, 4, 4, true), "");
  const std::vector<int64_t> bad_src = {4, 1};
  EXPECT_EQ(check_block_mapping("m", bad_src.data(), 1, 4, 4, true),
            "m[0, 0] = 4 is not a source block id in [0, 4)");
  const std::vector<int64_t> bad_dst = {0, -1};
  EXPECT_EQ(check_block_mapping("m", bad_dst.data(), 1, 4, 4, true),
            "m[0, 1] = -1 is not a destination block id in [0, 4)");
  const std::vector<int64_t> dup = {0, 3, 1, 3};
  EXPECT_EQ(check_block_mapping("m", dup.data(), 2, 4, 4, true), "m writes destination block 3 twice (rows 0 and 1)");
  const std::vector<int64_t> chain = {0, 1, 1, 2};  // block 1 is read and written
  EXPECT_NE(check_block_mapping("m", chain.data(), 2, 4, 4, true).find("reads block 1"), std::string::npos);
  // Across two pools the same ids name different blocks, so a chain is fine; sizes may differ.
  EXPECT_EQ(check_block_mapping("m", chain.data(), 2, 4, 8, false), "");
  const std::vector<int64_t> big_dst = {0, 7};
  EXPECT_EQ(check_block_mapping("m", big_dst.data(), 1, 4, 8, false), "");
}
