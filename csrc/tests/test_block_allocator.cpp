// BlockAllocator: O(1) allocate/free with reference counts, copy-on-write append, exact accounting,
// exhaustion through the reclaimer, and bad input that is rejected with the state unchanged.
#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "prefix/block_allocator.h"

using kvcache::prefix::AllocatorStats;
using kvcache::prefix::BlockAllocator;
using kvcache::prefix::BlockCopy;
using kvcache::prefix::OutOfBlocks;
using kvcache::prefix::Reclaimer;

namespace {

template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "<no error>";
}

bool same(const AllocatorStats& a, const AllocatorStats& b) {
  return a.free == b.free && a.used == b.used && a.shared == b.shared && a.references == b.references &&
         a.filled_tokens == b.filled_tokens;
}

}  // namespace

TEST(BlockAllocator, HandsOutLowIdsAndCountsThem) {
  BlockAllocator a(8, 16);
  EXPECT_EQ(a.allocate(3), (std::vector<int32_t>{0, 1, 2}));
  AllocatorStats s = a.stats();
  EXPECT_EQ(s.free, 5);
  EXPECT_EQ(s.used, 3);
  EXPECT_EQ(s.references, 3);
  EXPECT_EQ(s.waste_tokens, 0);  // raw blocks count as full
  const int32_t b[] = {1};
  EXPECT_EQ(a.free(b, 1), 1);
  EXPECT_EQ(a.allocate(1), (std::vector<int32_t>{1}));  // last freed, first reused
}

TEST(BlockAllocator, SharedBlocksGoBackAfterTheLastReference) {
  BlockAllocator a(4, 4);
  std::vector<int32_t> b = a.allocate(2);
  a.share(b.data(), 2);
  EXPECT_EQ(a.refcount(b[0]), 2);
  EXPECT_EQ(a.stats().shared, 2);
  EXPECT_EQ(a.free(b.data(), 2), 0);
  EXPECT_EQ(a.free(b.data(), 2), 2);
  EXPECT_EQ(a.num_free(), 4);
}

TEST(BlockAllocator, RejectsBadConstruction) {
  EXPECT_NE(error_of<std::invalid_argument>([] { BlockAllocator(8, 12); }).find("page_size = 12"), std::string::npos);
  EXPECT_NE(error_of<std::invalid_argument>([] { BlockAllocator(-1, 16); }).find("num_blocks = -1"), std::string::npos);
}

TEST(BlockAllocator, DoubleFreeIsRejectedAndChangesNothing) {
  BlockAllocator a(32, 16);
  std::vector<int32_t> b = a.allocate(18);
  const int32_t seventeen[] = {17};
  a.free(seventeen, 1);
  const AllocatorStats before = a.stats();
  const int32_t again[] = {3, 17};  // 3 is valid: a half-applied free would release it
  EXPECT_EQ(error_of<std::invalid_argument>([&] { a.free(again, 2); }), "block 17 is free; cannot free it again");
  EXPECT_TRUE(same(before, a.stats()));
  EXPECT_EQ(a.refcount(3), 1);
}

TEST(BlockAllocator, FreeingMoreTimesThanReferencedIsRejected) {
  BlockAllocator a(4, 16);
  std::vector<int32_t> b = a.allocate(1);
  const int32_t twice[] = {b[0], b[0]};
  EXPECT_EQ(error_of<std::invalid_argument>([&] { a.free(twice, 2); }),
            "block 0 is freed 2 times but has only 1 reference(s)");
  EXPECT_EQ(a.refcount(b[0]), 1);
}

TEST(BlockAllocator, UnknownIdsAreIndexErrors) {
  BlockAllocator a(4, 16);
  a.allocate(2);
  const int32_t bad[] = {0, 4};
  EXPECT_EQ(error_of<std::out_of_range>([&] { a.free(bad, 2); }), "blocks[1] = 4 is not a block id: ids are in [0, 4)");
  const int32_t negative[] = {-1};
  EXPECT_NE(error_of<std::out_of_range>([&] { a.share(negative, 1); }).find("blocks[0] = -1"), std::string::npos);
  EXPECT_EQ(a.refcount(0), 1);
}

TEST(BlockAllocator, SharingAFreeBlockIsRejected) {
  BlockAllocator a(4, 16);
  a.allocate(1);
  const int32_t ids[] = {0, 2};
  EXPECT_NE(error_of<std::invalid_argument>([&] { a.share(ids, 2); }).find("block 2 is free"), std::string::npos);
  EXPECT_EQ(a.refcount(0), 1);
}

TEST(BlockAllocator, ExhaustionIsAClearErrorWithNothingAllocated) {
  BlockAllocator a(4, 16);
  a.allocate(3);
  EXPECT_NE(error_of<OutOfBlocks>([&] { a.allocate(2); }).find("need 2, 1 free of 4"), std::string::npos);
  EXPECT_EQ(a.num_free(), 1);
  std::vector<int32_t> none;
  EXPECT_FALSE(a.try_allocate(2, &none));
  EXPECT_TRUE(none.empty());
}

TEST(BlockAllocator, AppendAllocatesPagesAndAccountsWaste) {
  BlockAllocator a(8, 4);
  std::vector<int32_t> table;
  EXPECT_TRUE(a.append(&table, 0, 6).empty());
  EXPECT_EQ(table.size(), 2u);
  AllocatorStats s = a.stats();
  EXPECT_EQ(s.filled_tokens, 6);
  EXPECT_EQ(s.waste_tokens, 2);
  a.append(&table, 6, 3);  // fills page 1, opens page 2 with one token
  EXPECT_EQ(table.size(), 3u);
  s = a.stats();
  EXPECT_EQ(s.filled_tokens, 9);
  EXPECT_EQ(s.waste_tokens, 3);
}

TEST(BlockAllocator, ForkCopiesThePartialPageOnFirstWriteOnly) {
  BlockAllocator a(8, 4);
  std::vector<int32_t> parent;
  a.append(&parent, 0, 6);                             // pages [0, 1], page 1 half full
  std::vector<int32_t> child = parent;                 // fork: share every block
  a.share(child.data(), static_cast<int64_t>(child.size()));
  std::vector<BlockCopy> copies = a.append(&child, 6, 1);
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].src, parent[1]);
  EXPECT_EQ(copies[0].dst, child[1]);
  EXPECT_EQ(child[0], parent[0]);                      // the full page stays shared
  EXPECT_EQ(a.refcount(parent[0]), 2);
  EXPECT_EQ(a.refcount(parent[1]), 1);
  EXPECT_TRUE(a.append(&parent, 6, 1).empty());        // now the sole owner: writes in place
  EXPECT_TRUE(a.append(&child, 7, 4).empty());         // its own page now: fills it, opens another
  EXPECT_EQ(child.size(), 3u);
  std::vector<int32_t> grandchild = child;             // forked mid-page
  a.share(grandchild.data(), 3);
  EXPECT_EQ(a.append(&grandchild, 11, 1).size(), 1u);  // page 2 holds 3 of 4 tokens: copied
  std::vector<int32_t> aligned;
  a.append(&aligned, 0, 4);
  std::vector<int32_t> twin = aligned;
  a.share(twin.data(), 1);
  EXPECT_TRUE(a.append(&twin, 4, 2).empty());          // full pages are never written: no copy
}

TEST(BlockAllocator, AppendRejectsAMismatchedTable) {
  BlockAllocator a(8, 4);
  std::vector<int32_t> table = a.allocate(1);
  const AllocatorStats before = a.stats();
  EXPECT_EQ(error_of<std::invalid_argument>([&] { a.append(&table, 5, 1); }),
            "the block table has 1 blocks but 5 tokens occupy ceil(5 / 4) = 2");
  std::vector<int32_t> stale{6};
  EXPECT_NE(error_of<std::invalid_argument>([&] { a.append(&stale, 2, 1); }).find("block 6 is free"), std::string::npos);
  EXPECT_TRUE(same(before, a.stats()));
}

TEST(BlockAllocator, AppendThatCannotFitChangesNothing) {
  BlockAllocator a(3, 4);
  std::vector<int32_t> table;
  a.append(&table, 0, 6);
  std::vector<int32_t> fork = table;
  a.share(fork.data(), 2);
  const AllocatorStats before = a.stats();
  // Needs a copy of the shared half page plus one new page: 2 blocks, 1 free.
  EXPECT_THROW(a.append(&fork, 6, 3), OutOfBlocks);
  EXPECT_EQ(fork, table);
  EXPECT_TRUE(same(before, a.stats()));
}

namespace {
struct FreeingReclaimer : Reclaimer {
  BlockAllocator* allocator = nullptr;
  std::vector<int32_t> held;
  int calls = 0;
  int64_t reclaim(int64_t n) override {
    ++calls;
    int64_t given = 0;
    while (given < n && !held.empty()) {
      given += allocator->free(&held.back(), 1);
      held.pop_back();
    }
    return given;
  }
};
}  // namespace

TEST(BlockAllocator, ShortAllocationsAskTheReclaimer) {
  BlockAllocator a(4, 16);
  auto reclaimer = std::make_shared<FreeingReclaimer>();
  reclaimer->allocator = &a;
  reclaimer->held = a.allocate(3);
  a.set_reclaimer(reclaimer);
  EXPECT_EQ(a.allocate(3).size(), 3u);
  EXPECT_EQ(reclaimer->calls, 1);
  EXPECT_EQ(reclaimer->held.size(), 1u);
  EXPECT_THROW(a.allocate(5), OutOfBlocks);  // larger than the pool: no eviction is tried
  EXPECT_EQ(reclaimer->calls, 1);
  auto second = std::make_shared<FreeingReclaimer>();
  EXPECT_THROW(a.set_reclaimer(second), std::invalid_argument);
}

TEST(BlockAllocator, ConcurrentUseEndsWithEveryBlockFree) {
  BlockAllocator a(256, 16);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&a, t] {
      for (int i = 0; i < 2000; ++i) {
        std::vector<int32_t> table;
        a.append(&table, 0, 1 + (i * 7 + t) % 100);
        std::vector<int32_t> fork = table;
        a.share(fork.data(), static_cast<int64_t>(fork.size()));
        a.append(&fork, (1 + (i * 7 + t) % 100), 5);
        a.free(table.data(), static_cast<int64_t>(table.size()));
        a.free(fork.data(), static_cast<int64_t>(fork.size()));
      }
    });
  }
  for (auto& th : threads) th.join();
  const AllocatorStats s = a.stats();
  EXPECT_EQ(s.free, 256);
  EXPECT_EQ(s.references, 0);
}
