// RadixTree: page-aware matching (including inside a page), namespaces, splits that share the
// straddling page, locks, LRU/LFU eviction into the allocator, the host tier, and bad input that is
// rejected with the state unchanged.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "prefix/radix_tree.h"

using kvcache::prefix::BlockAllocator;
using kvcache::prefix::BlockCopy;
using kvcache::prefix::CopyDirection;
using kvcache::prefix::EvictionPolicy;
using kvcache::prefix::kEmptyPrefix;
using kvcache::prefix::MatchResult;
using kvcache::prefix::OutOfBlocks;
using kvcache::prefix::RadixTree;
using kvcache::prefix::Ragged;

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

std::vector<int32_t> seq(int32_t first, int32_t n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), first);
  return v;
}

/// A tree over a fresh allocator, with helpers that play a request: blocks for tokens, insert, release.
struct Fixture {
  std::shared_ptr<BlockAllocator> alloc;
  std::shared_ptr<RadixTree> tree;
  Fixture(int64_t blocks, int64_t page, EvictionPolicy policy = EvictionPolicy::kLru)
      : alloc(std::make_shared<BlockAllocator>(blocks, page)), tree(RadixTree::create(alloc, policy)) {}

  /// Caches `tokens` the way a finished request would: own blocks, insert, drop its references.
  int64_t put(const std::vector<int32_t>& tokens, const std::string& ns = "m") {
    std::vector<int32_t> table;
    alloc->append(&table, 0, static_cast<int64_t>(tokens.size()));
    const auto r = tree->insert(ns, tokens.data(), static_cast<int64_t>(tokens.size()), table.data(),
                                static_cast<int64_t>(table.size()));
    alloc->free(table.data(), static_cast<int64_t>(table.size()));
    return r.node;
  }
  MatchResult get(const std::vector<int32_t>& tokens, const std::string& ns = "m", bool lock = false) {
    return tree->match(ns, tokens.data(), static_cast<int64_t>(tokens.size()), lock);
  }
  void expect_ok() const { EXPECT_EQ(tree->check_invariants(), ""); }
};

}  // namespace

TEST(RadixTree, EmptyTreeMatchesNothing) {
  Fixture f(8, 4);
  const MatchResult r = f.get(seq(0, 5));
  EXPECT_EQ(r.length, 0);
  EXPECT_TRUE(r.blocks.empty());
  f.expect_ok();
}

TEST(RadixTree, MatchesWholePagesAndEndsInsideAPage) {
  Fixture f(16, 4);
  std::vector<int32_t> a = seq(100, 10);  // 3 pages, the last holding 2 tokens
  f.put(a);
  MatchResult full = f.get(a);
  EXPECT_EQ(full.length, 10);
  EXPECT_EQ(full.blocks, (std::vector<int32_t>{0, 1, 2}));
  std::vector<int32_t> b = a;
  b[6] = 7;  // diverges inside page 1
  MatchResult part = f.get(b);
  EXPECT_EQ(part.length, 6);
  EXPECT_EQ(part.blocks, (std::vector<int32_t>{0, 1}));  // page 1 partial: the caller copies it on write
  f.expect_ok();
}

TEST(RadixTree, CachedLengthIsAMatchThatChangesNothing) {
  // Engine.explain's look: the length a match finds, with no hit counted and no recency given (a look through
  // match() made the prefix the most recent, so the diagnostic decided what was evicted next).
  Fixture f(4, 4);
  const std::vector<int32_t> a = seq(100, 8), b = seq(200, 8);
  f.put(a);
  f.put(b);  // a is the least recently used
  std::vector<int32_t> c = a;
  c[5] = 7;
  const auto before = f.tree->stats();
  EXPECT_EQ(f.tree->cached_length("m", a.data(), 8), 8);
  EXPECT_EQ(f.tree->cached_length("m", c.data(), 8), 5);
  EXPECT_EQ(f.tree->cached_length("m", a.data(), 3), 3);
  EXPECT_EQ(f.tree->cached_length("unknown", a.data(), 8), 0);
  const auto after = f.tree->stats();
  EXPECT_EQ(after.lookups, before.lookups);
  EXPECT_EQ(after.hit_tokens, before.hit_tokens);
  EXPECT_EQ(after.nodes, before.nodes);
  EXPECT_EQ(f.tree->evict(2), 2);  // still a's two blocks: the looks did not make it recent
  EXPECT_EQ(f.get(a).length, 0);
  EXPECT_EQ(f.get(b).length, 8);
  f.expect_ok();
}

TEST(RadixTree, TokenIdsBeyond16BitsMatchExactly) {
  // Edges whose ids all fit in 16 bits are stored narrow, others wide (EdgeTokens); an id that
  // differs from a narrow edge's only above bit 15 must not match, and splits keep each width.
  Fixture f(64, 4);
  const std::vector<int32_t> narrow = seq(65500, 36);  // 65500 .. 65535
  const std::vector<int32_t> wide = seq(65520, 40);    // crosses 65536
  f.put(narrow);
  f.put(wide);
  EXPECT_EQ(f.get(narrow).length, 36);
  EXPECT_EQ(f.get(wide).length, 40);
  for (const int64_t at : {0, 5, 17, 35}) {
    std::vector<int32_t> b = narrow;
    b[static_cast<size_t>(at)] += 65536;
    EXPECT_EQ(f.get(b).length, at) << at;
    b = wide;
    b[static_cast<size_t>(at)] -= 65536;
    EXPECT_EQ(f.get(b).length, at) << at;
  }
  std::vector<int32_t> branch = seq(65520, 10);  // splits the wide edge after 10 tokens
  branch.insert(branch.end(), {1, 2, 3});
  f.put(branch);
  EXPECT_EQ(f.get(branch).length, 13);
  EXPECT_EQ(f.get(wide).length, 40);
  EXPECT_EQ(f.get(narrow).length, 36);
  f.expect_ok();
}

TEST(RadixTree, NamespacesNeverMatchEachOther) {
  Fixture f(16, 4);
  f.put(seq(0, 8), "llama-3|bf16");
  EXPECT_EQ(f.get(seq(0, 8), "llama-3|fp8").length, 0);
  EXPECT_EQ(f.get(seq(0, 8), "llama-3|bf16").length, 8);
  EXPECT_EQ(f.tree->stats().namespaces, 1);  // a lookup makes no namespace
  f.put(seq(0, 4), "llama-3|fp8");  // alternating namespaces (the tree remembers the last one's root)
  EXPECT_EQ(f.tree->stats().namespaces, 2);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(f.get(seq(0, 8), "llama-3|fp8").length, 4);
    EXPECT_EQ(f.get(seq(0, 8), "llama-3|bf16").length, 8);
  }
  f.expect_ok();
}

TEST(RadixTree, LookupsInUnknownNamespacesLeaveNoTrace) {
  // A lookup in a namespace the tree never saw used to make its root for good (issue 21: memory grew
  // with every salted miss). Every lookup form, locking or not, and inserts of nothing, now miss
  // without a trace; a miss's node is kEmptyPrefix, whose lock and unlock do nothing.
  Fixture f(16, 4);
  f.put(seq(0, 8), "known");
  const auto before = f.tree->stats();
  const std::vector<int32_t> q = seq(0, 8), none;
  std::vector<int32_t> flat = q;
  flat.insert(flat.end(), q.begin(), q.end());
  const std::vector<int64_t> cu{0, 8, 16}, empty_cu{0, 0};
  const Ragged batch{flat.data(), 16, cu.data(), 2}, empty{none.data(), 0, empty_cu.data(), 1};
  for (int i = 0; i < 100; ++i) {
    const std::string ns = "salt-" + std::to_string(i);
    const bool lock = i % 2 == 1;
    const MatchResult m = f.get(q, ns, lock);
    EXPECT_EQ(m.length, 0);
    EXPECT_EQ(m.node, kEmptyPrefix);
    EXPECT_TRUE(m.blocks.empty());
    std::vector<int32_t> blocks;
    int64_t node = -1, length = -1;
    ASSERT_TRUE(f.tree->try_match_into(ns, q.data(), 8, lock, &blocks, &node, &length));
    EXPECT_EQ(length, 0);
    EXPECT_EQ(node, kEmptyPrefix);
    for (bool wait : {false, true}) {
      std::vector<int64_t> lengths(2, -1), cu_blocks(3, -1), nodes(2, -1);
      if (wait) {
        f.tree->match_ragged(ns, batch, lock, lengths.data(), &blocks, cu_blocks.data(), nodes.data());
      } else {
        ASSERT_TRUE(f.tree->try_match_ragged(ns, batch, lock, lengths.data(), &blocks, cu_blocks.data(), nodes.data()));
      }
      EXPECT_EQ(lengths, (std::vector<int64_t>{0, 0}));
      EXPECT_EQ(cu_blocks, (std::vector<int64_t>{0, 0, 0}));
      EXPECT_EQ(nodes, (std::vector<int64_t>{kEmptyPrefix, kEmptyPrefix}));
    }
    EXPECT_TRUE(blocks.empty());
    EXPECT_EQ(f.tree->insert(ns, none.data(), 0, none.data(), 0, lock).node, kEmptyPrefix);
    std::vector<int64_t> prefix(1, -1), nodes(1, -1);
    f.tree->insert_ragged(ns, empty, empty, lock, prefix.data(), nodes.data());
    EXPECT_EQ(nodes[0], kEmptyPrefix);
    f.tree->lock(kEmptyPrefix);
    f.tree->unlock(kEmptyPrefix);
    f.tree->unlock(kEmptyPrefix);  // counted nowhere: nothing to unlock without a lock
    ASSERT_EQ(f.tree->stats().namespaces, 1) << ns;
  }
  const auto after = f.tree->stats();
  EXPECT_EQ(after.lookups, before.lookups + 100 * 6);
  EXPECT_EQ(after.nodes, before.nodes);
  EXPECT_EQ(after.locked_nodes, 0);
  EXPECT_EQ(after.device_blocks, before.device_blocks);
  const MatchResult miss = f.get(seq(50, 4), "known", true);  // a miss in a known namespace: no handle either
  EXPECT_EQ(miss.node, kEmptyPrefix);
  EXPECT_EQ(f.tree->stats().locked_nodes, 0);
  EXPECT_EQ(f.get(q, "known").length, 8);
  f.expect_ok();
}

TEST(RadixTree, NamespacesAreReclaimedWithTheirLastNode) {
  Fixture f(32, 4);
  f.put(seq(0, 8), "x");
  f.put(seq(0, 8), "y");
  EXPECT_EQ(f.tree->stats().namespaces, 2);
  EXPECT_EQ(f.tree->evict(1), 2);  // x's only leaf, the least recently used
  EXPECT_EQ(f.tree->stats().namespaces, 1);
  f.expect_ok();
  const MatchResult locked = f.get(seq(0, 8), "y", true);
  EXPECT_EQ(f.tree->evict(100), 0);  // a locked path keeps its namespace
  EXPECT_EQ(f.tree->stats().namespaces, 1);
  f.tree->unlock(locked.node);
  EXPECT_EQ(f.tree->evict(100), 2);
  EXPECT_EQ(f.tree->stats().namespaces, 0);
  EXPECT_EQ(f.tree->stats().nodes, 0);
  f.expect_ok();

  // The tree remembers the last namespace's root; once reclaimed, its slot may become another
  // namespace's root, which a lookup in the old namespace must not reach.
  Fixture g(32, 4);
  g.put(seq(0, 8), "a");
  EXPECT_EQ(g.get(seq(0, 8), "a").length, 8);  // "a" remembered
  EXPECT_EQ(g.tree->evict(100), 2);
  g.put(seq(50, 4), "c");                      // takes the freed slots, root first
  EXPECT_EQ(g.get(seq(50, 4), "a").length, 0);
  EXPECT_EQ(g.get(seq(50, 4), "c").length, 4);
  g.put(seq(0, 8), "a");                       // a reclaimed namespace works as new
  EXPECT_EQ(g.get(seq(0, 8), "a").length, 8);
  EXPECT_EQ(g.tree->stats().namespaces, 2);
  g.expect_ok();
}

TEST(RadixTree, SplitInsideAPageSharesThatPage) {
  Fixture f(16, 4);
  std::vector<int32_t> a = seq(0, 8);
  f.put(a);  // blocks 0, 1
  std::vector<int32_t> b = a;
  b[6] = 99;  // diverges at position 6, inside page 1
  std::vector<int32_t> table;
  f.alloc->append(&table, 0, 8);  // the request's own blocks 2, 3
  const auto ins = f.tree->insert("m", b.data(), 8, table.data(), 2);
  EXPECT_EQ(ins.prefix_length, 6);
  f.alloc->free(table.data(), 2);
  // Page 1 (block 1) straddles the split of a: the upper and lower halves both hold it.
  EXPECT_EQ(f.alloc->refcount(1), 2);
  EXPECT_EQ(f.alloc->refcount(0), 1);
  EXPECT_EQ(f.alloc->refcount(2), 0);  // b's page 0 duplicated the tree's: released
  EXPECT_EQ(f.alloc->refcount(3), 1);  // b's own page 1 (tokens 4, 5 shared, 99, 7 its own)
  EXPECT_EQ(f.get(a).blocks, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(f.get(b).blocks, (std::vector<int32_t>{0, 3}));
  f.expect_ok();
}

TEST(RadixTree, InsertReturnsWhatWasAlreadyCached) {
  Fixture f(16, 4);
  f.put(seq(0, 10));
  std::vector<int32_t> longer = seq(0, 14), table;
  f.alloc->append(&table, 0, 14);
  const auto r = f.tree->insert("m", longer.data(), 14, table.data(), 4);
  EXPECT_EQ(r.prefix_length, 10);
  // The new leaf starts at 10, inside page 2: it holds the request's pages 2 and 3.
  EXPECT_EQ(f.alloc->refcount(table[2]), 2);
  EXPECT_EQ(f.alloc->refcount(table[0]), 1);
  f.alloc->free(table.data(), 4);
  EXPECT_EQ(f.get(longer).blocks, (std::vector<int32_t>{0, 1, table[2], table[3]}));
  const auto again = f.tree->insert("m", longer.data(), 14, f.get(longer).blocks.data(), 4);
  EXPECT_EQ(again.prefix_length, 14);
  f.expect_ok();
}

TEST(RadixTree, EvictsLeastRecentlyUsedLeavesIntoTheAllocator) {
  Fixture f(16, 4);
  f.put(seq(0, 8));
  f.put(seq(100, 8));
  f.put(seq(200, 8));
  f.get(seq(0, 8));  // touch the oldest
  EXPECT_EQ(f.alloc->num_free(), 10);
  EXPECT_EQ(f.tree->evict(2), 2);
  EXPECT_EQ(f.get(seq(100, 8)).length, 0);  // the least recently used went first
  EXPECT_EQ(f.get(seq(0, 8)).length, 8);
  EXPECT_EQ(f.tree->stats().evicted_nodes, 1);
  EXPECT_EQ(f.tree->evict(100), 4);
  EXPECT_EQ(f.alloc->num_free(), 16);
  f.expect_ok();
}

TEST(RadixTree, EvictionFollowsLastUseAcrossManyTouches) {
  // More touches of queued leaves than there are leaves: the eviction heap is rebuilt with fresh
  // keys rather than fixed up one stale entry at a time; either way the order is the last use.
  Fixture f(64, 4);
  for (int32_t i = 0; i < 10; ++i) f.put(seq(100 * i, 4));
  const int32_t order[] = {3, 7, 1, 9, 0, 5, 2, 8, 6, 4};
  for (int round = 0; round < 4; ++round) {
    for (int32_t i : order) f.get(seq(100 * i, 4));
  }
  for (int32_t i : order) {
    EXPECT_EQ(f.tree->evict(1), 1);
    EXPECT_EQ(f.get(seq(100 * i, 4)).length, 0) << "leaf " << i << " should have gone next";  // touches nothing
    f.expect_ok();
  }
  EXPECT_EQ(f.alloc->num_free(), 64);
}

TEST(RadixTree, ManySiblingsSurviveEvictionAndReinsertion) {
  // A thousand children of one root: the edge map grows, loses half its entries and refills.
  Fixture f(2048, 1);
  for (int32_t i = 0; i < 1000; ++i) f.put({i, i + 1});
  f.expect_ok();
  EXPECT_EQ(f.tree->evict(1000), 1000);  // the 500 oldest leaves
  f.expect_ok();
  for (int32_t i = 0; i < 1000; ++i) EXPECT_EQ(f.get({i, i + 1}).length, i < 500 ? 0 : 2) << i;
  for (int32_t i = 0; i < 500; ++i) f.put({i, i + 1});
  for (int32_t i = 0; i < 1000; ++i) ASSERT_EQ(f.get({i, i + 1}).length, 2) << i;
  f.expect_ok();
  EXPECT_EQ(f.tree->evict(1 << 20), 2000);
  EXPECT_EQ(f.alloc->num_free(), 2048);
  f.expect_ok();
}

TEST(RadixTree, ChildrenStayFindableThroughRandomChurn) {
  // Random first tokens, random eviction order: edges are deleted from the middle of probe runs.
  Fixture f(8192, 1);
  std::mt19937 rng(7);
  std::set<int32_t> live;
  for (int round = 0; round < 40; ++round) {
    for (int k = 0; k < 150; ++k) {
      const int32_t t = static_cast<int32_t>(rng() % 100000);
      if (live.insert(t).second) f.put({t});
    }
    for (int32_t t : live) {
      if (rng() & 1) f.get({t});  // scrambles the LRU order
    }
    ASSERT_EQ(f.tree->evict(100), 100);
    std::set<int32_t> found;
    for (int32_t t : live) {
      if (f.get({t}).length == 1) found.insert(t);
    }
    ASSERT_EQ(found.size(), live.size() - 100) << "round " << round;
    live = found;
    f.expect_ok();
  }
}

TEST(RadixTree, LfuEvictsTheLeastHit) {
  Fixture f(16, 4, EvictionPolicy::kLfu);
  f.put(seq(0, 4));
  f.put(seq(100, 4));
  for (int i = 0; i < 3; ++i) f.get(seq(0, 4));
  f.get(seq(100, 4));  // most recent, but hit less often
  f.tree->evict(1);
  EXPECT_EQ(f.get(seq(100, 4)).length, 0);
  EXPECT_EQ(f.get(seq(0, 4)).length, 4);
}

TEST(RadixTree, LockedPathsAreNeverEvicted) {
  Fixture f(16, 4);
  const int64_t node = f.put(seq(0, 8));
  f.put(seq(100, 8));
  f.tree->lock(node);
  EXPECT_EQ(f.tree->evict(100), 2);  // only the unlocked leaf
  EXPECT_EQ(f.get(seq(0, 8)).length, 8);
  f.tree->unlock(node);
  EXPECT_EQ(f.tree->evict(100), 2);
  EXPECT_EQ(f.alloc->num_free(), 16);
}

TEST(RadixTree, LockingAChildPinsItsAncestors) {
  Fixture f(16, 4);
  f.put(seq(0, 8));
  std::vector<int32_t> longer = seq(0, 12);
  const MatchResult m = f.get(longer);  // 8 tokens
  std::vector<int32_t> table = m.blocks;
  f.alloc->share(table.data(), 2);
  f.alloc->append(&table, 8, 4);
  const auto leaf = f.tree->insert("m", longer.data(), 12, table.data(), 3, /*lock=*/true);
  f.alloc->free(table.data(), 3);
  EXPECT_EQ(f.tree->evict(100), 0);
  EXPECT_EQ(f.tree->stats().locked_nodes, 2);
  f.tree->unlock(leaf.node);
  EXPECT_EQ(f.tree->evict(100), 3);
}

TEST(RadixTree, BadHandlesAndUnlockWithoutLock) {
  Fixture f(16, 4);
  const int64_t node = f.put(seq(0, 4));
  EXPECT_EQ(error_of<std::invalid_argument>([&] { f.tree->unlock(node); }),
            "node handle " + std::to_string(node) + " is not locked; unlock without lock");
  f.tree->evict(1);
  EXPECT_NE(error_of<std::out_of_range>([&] { f.tree->lock(node); }).find("unknown or stale"), std::string::npos);
  f.put(seq(50, 4));  // reuses the slot under a new generation
  EXPECT_THROW(f.tree->lock(node), std::out_of_range);
  EXPECT_THROW(f.tree->unlock(12345), std::out_of_range);
  f.expect_ok();
}

TEST(RadixTree, BadInsertChangesNothing) {
  Fixture f(16, 4);
  f.put(seq(0, 8));
  std::vector<int32_t> tokens = seq(0, 12);
  std::vector<int32_t> table = f.alloc->allocate(2);
  const auto before = f.tree->stats();
  EXPECT_EQ(error_of<std::invalid_argument>([&] { f.tree->insert("m", tokens.data(), 12, table.data(), 2); }),
            "blocks has 2 entries but 12 tokens occupy ceil(12 / 4) = 3 pages");
  std::vector<int32_t> freed{table[0], table[1], 9};
  EXPECT_NE(error_of<std::invalid_argument>([&] { f.tree->insert("m", tokens.data(), 12, freed.data(), 3); })
                .find("blocks[2] = block 9 is free"),
            std::string::npos);
  std::vector<int32_t> unknown{table[0], table[1], 77};
  EXPECT_THROW(f.tree->insert("m", tokens.data(), 12, unknown.data(), 3), std::out_of_range);
  // one block for two pages: a later match would read page 0's K/V as page 2's
  std::vector<int32_t> repeated{table[0], table[1], table[0]};
  EXPECT_EQ(error_of<std::invalid_argument>([&] { f.tree->insert("m", tokens.data(), 12, repeated.data(), 3); }),
            "blocks[2] = block " + std::to_string(table[0]) + " is blocks[0] too: a sequence's pages are distinct blocks");
  const auto after = f.tree->stats();
  EXPECT_EQ(after.nodes, before.nodes);
  EXPECT_EQ(after.device_blocks, before.device_blocks);
  EXPECT_EQ(f.alloc->refcount(table[0]), 1);
  f.expect_ok();
}

TEST(RadixTree, ShortAllocationsEvictThroughTheTree) {
  Fixture f(8, 4);
  f.put(seq(0, 16));  // 4 blocks cached
  f.put(seq(100, 8));  // 2 more
  std::vector<int32_t> got = f.alloc->allocate(5);  // 2 free: the tree gives back the oldest leaf
  EXPECT_EQ(got.size(), 5u);
  EXPECT_EQ(f.get(seq(0, 16)).length, 0);
  EXPECT_EQ(f.get(seq(100, 8)).length, 8);
  EXPECT_THROW(f.alloc->allocate(4), OutOfBlocks);  // 1 free + 2 cached is not enough
  f.alloc->free(got.data(), 5);
  f.expect_ok();
}

TEST(RadixTree, DestroyingTheTreeReleasesItsBlocks) {
  auto alloc = std::make_shared<BlockAllocator>(8, 4);
  {
    auto tree = RadixTree::create(alloc);
    std::vector<int32_t> t = seq(0, 10), table;
    alloc->append(&table, 0, 10);
    tree->insert("m", t.data(), 10, table.data(), 3);
    alloc->free(table.data(), 3);
    EXPECT_EQ(alloc->num_free(), 5);
  }
  EXPECT_EQ(alloc->num_free(), 8);
  EXPECT_EQ(alloc->allocate(8).size(), 8u);  // and the reclaimer went with it
}

namespace {
/// A host tier whose "pools" are vectors of page ids: copies move the id of the data they carry.
struct HostFixture : Fixture {
  std::shared_ptr<BlockAllocator> host;
  std::vector<int32_t> device_pages, host_pages;  // what each block holds
  std::vector<std::pair<CopyDirection, BlockCopy>> log;
  HostFixture(int64_t device_blocks, int64_t host_blocks, int64_t page) : Fixture(device_blocks, page) {
    host = std::make_shared<BlockAllocator>(host_blocks, page);
    device_pages.assign(static_cast<size_t>(device_blocks), -1);
    host_pages.assign(static_cast<size_t>(host_blocks), -1);
    tree->set_host_tier(host, [this](CopyDirection d, const std::vector<BlockCopy>& copies) {
      for (const BlockCopy& c : copies) {
        log.push_back({d, c});
        if (d == CopyDirection::kDeviceToHost) host_pages[c.dst] = device_pages[c.src];
        else device_pages[c.dst] = host_pages[c.src];
      }
    });
  }
  /// Like put, writing "page content" = 1000 * tag + page index into the blocks.
  void put_tagged(const std::vector<int32_t>& tokens, int32_t tag) {
    std::vector<int32_t> table;
    alloc->append(&table, 0, static_cast<int64_t>(tokens.size()));
    for (size_t p = 0; p < table.size(); ++p) device_pages[table[p]] = 1000 * tag + static_cast<int32_t>(p);
    tree->insert("m", tokens.data(), static_cast<int64_t>(tokens.size()), table.data(), static_cast<int64_t>(table.size()));
    alloc->free(table.data(), static_cast<int64_t>(table.size()));
  }
};
}  // namespace

TEST(RadixTree, HostTierKeepsEvictedPrefixesAndLoadsThemBack) {
  HostFixture f(8, 8, 4);
  f.put_tagged(seq(0, 8), 1);
  f.put_tagged(seq(100, 8), 2);
  EXPECT_EQ(f.tree->evict(2), 2);  // seq 0 goes to the host
  auto s = f.tree->stats();
  EXPECT_EQ(s.host_nodes, 1);
  EXPECT_EQ(s.demoted_blocks, 2);
  EXPECT_EQ(f.host->num_free(), 6);
  const MatchResult m = f.get(seq(0, 8));
  EXPECT_EQ(m.length, 8);
  ASSERT_EQ(m.blocks.size(), 2u);
  EXPECT_EQ(f.device_pages[m.blocks[0]], 1000);  // the data came back
  EXPECT_EQ(f.device_pages[m.blocks[1]], 1001);
  EXPECT_EQ(f.host->num_free(), 8);
  EXPECT_EQ(f.tree->stats().loaded_nodes, 1);
  f.expect_ok();
}

TEST(RadixTree, TryMatchRunsAtOnceOrNotAtAll) {
  Fixture f(16, 4);
  f.put(seq(0, 8));
  const std::vector<int32_t> q = {0, 1, 2, 3, 4, 9};
  std::vector<int32_t> blocks = {-7};  // appended to, like match_into
  int64_t node = 0, length = 0;
  ASSERT_TRUE(f.tree->try_match_into("m", q.data(), 6, false, &blocks, &node, &length));
  const MatchResult m = f.get(q);
  EXPECT_EQ(length, m.length);
  EXPECT_EQ(node, m.node);
  EXPECT_EQ(std::vector<int32_t>(blocks.begin() + 1, blocks.end()), m.blocks);

  // A host tier could turn a match into copies: the try form leaves those calls to the waiting form.
  HostFixture h(8, 8, 4);
  h.put_tagged(seq(0, 8), 1);
  const int64_t lookups = h.tree->stats().lookups;
  blocks.clear();
  EXPECT_FALSE(h.tree->try_match_into("m", q.data(), 6, false, &blocks, &node, &length));
  std::vector<int64_t> lengths(1), cu_blocks(2), nodes(1);
  const std::vector<int64_t> cu = {0, 6};
  EXPECT_FALSE(h.tree->try_match_ragged("m", Ragged{q.data(), 6, cu.data(), 1}, false, lengths.data(), &blocks,
                                        cu_blocks.data(), nodes.data()));
  EXPECT_TRUE(blocks.empty());
  EXPECT_EQ(h.tree->stats().lookups, lookups);
}

TEST(RadixTree, HostTierDropsItsOldestLeavesWhenFull) {
  HostFixture f(4, 2, 4);
  f.put_tagged(seq(0, 8), 1);
  f.tree->evict(2);  // -> host (2 of 2 host blocks)
  f.put_tagged(seq(100, 8), 2);
  f.tree->evict(2);  // -> host, dropping seq 0 from it
  EXPECT_EQ(f.get(seq(0, 8)).length, 0);
  EXPECT_EQ(f.get(seq(100, 8)).length, 8);
  f.expect_ok();
}

TEST(RadixTree, HostTierKeepsANamespaceUntilItDropsItsLastNode) {
  HostFixture f(4, 2, 4);
  std::vector<int32_t> t = seq(0, 8), table;
  for (const char* ns : {"a", "b"}) {
    table.clear();
    f.alloc->append(&table, 0, 8);
    f.tree->insert(ns, t.data(), 8, table.data(), 2);
    f.alloc->free(table.data(), 2);
    EXPECT_EQ(f.tree->evict(2), 2);  // to the host, which has room for one prefix: b's pushes a's out
    const auto s = f.tree->stats();
    EXPECT_EQ(s.namespaces, 1) << ns;
    EXPECT_EQ(s.host_nodes, 1) << ns;
    f.expect_ok();
  }
  EXPECT_EQ(f.get(t, "a").length, 0);
  EXPECT_EQ(f.get(t, "b").length, 8);  // loaded back
  EXPECT_EQ(f.tree->evict(100), 2);     // to the host again
  EXPECT_EQ(f.tree->stats().namespaces, 1);
  f.expect_ok();
}

TEST(RadixTree, StatsCountDistinctBlocksAndTheirReferences) {
  // A page split between a parent and its child is one block with two references, and so are the
  // same blocks inserted in two namespaces: device_blocks counts blocks (what evicting everything
  // frees), device_block_refs references.
  Fixture f(16, 4);
  std::vector<int32_t> t = seq(0, 10), table;
  f.alloc->append(&table, 0, 10);                       // pages 0, 1, 2
  f.tree->insert("a", t.data(), 6, table.data(), 2);    // [0, 6): pages 0, 1
  f.tree->insert("a", t.data(), 10, table.data(), 3);   // [6, 10): pages 1, 2
  f.tree->insert("b", t.data(), 10, table.data(), 3);   // [0, 10) again: pages 0, 1, 2
  f.alloc->free(table.data(), 3);
  auto s = f.tree->stats();
  EXPECT_EQ(s.device_blocks, 3);
  EXPECT_EQ(s.device_block_refs, 7);
  EXPECT_EQ(static_cast<int64_t>(f.tree->block_references(false).size()), s.device_block_refs);
  EXPECT_EQ(f.alloc->stats().used, s.device_blocks);
  EXPECT_EQ(f.tree->evict(100), s.device_blocks);
  s = f.tree->stats();
  EXPECT_EQ(s.device_blocks, 0);
  EXPECT_EQ(s.device_block_refs, 0);

  // On the host: every demoted node gets blocks of its own.
  HostFixture h(8, 8, 4);
  table.clear();
  h.alloc->append(&table, 0, 10);
  h.tree->insert("m", t.data(), 6, table.data(), 2);
  h.tree->insert("m", t.data(), 10, table.data(), 3);  // page 1 in both nodes
  h.alloc->free(table.data(), 3);
  s = h.tree->stats();
  EXPECT_EQ(s.device_blocks, 3);
  EXPECT_EQ(s.device_block_refs, 4);
  EXPECT_EQ(h.tree->evict(3), 3);  // the leaf, then its parent, to the host
  s = h.tree->stats();
  EXPECT_EQ(s.host_nodes, 2);
  EXPECT_EQ(s.host_blocks, 4);
  EXPECT_EQ(s.host_block_refs, 4);
  EXPECT_EQ(h.host->stats().used, s.host_blocks);
  EXPECT_EQ(s.device_blocks, 0);
  h.expect_ok();
}

TEST(RadixTree, RaggedMatchWhoseLoadsEvictAndDropNodesFetchedAhead) {
  // match_ragged looks up each sequence's first node a few sequences ahead; loading an earlier
  // sequence from the host can demote, or drop, those nodes meanwhile. Every sequence must still
  // get exactly what is cached when its turn comes, with its own data.
  HostFixture f(4, 4, 4);  // room for 2 prefixes of 8 tokens on the device, 2 on the host
  f.put_tagged(seq(100, 8), 1);
  f.put_tagged(seq(0, 8), 0);
  f.tree->evict(4);  // both to the host, tag 1 the older
  f.put_tagged(seq(200, 8), 2);
  f.put_tagged(seq(300, 8), 3);  // the device is full again
  // Loading tag 0 demotes tag 2 (the device's oldest), which drops tag 1 from the full host while
  // its node is already looked up for the third sequence; loading tag 2 back demotes tag 3, which
  // then cannot come back: the device holds this call's two earlier results, which it must not evict.
  const std::vector<int32_t> tags = {0, 2, 1, 3};
  std::vector<int32_t> flat;
  std::vector<int64_t> cu{0};
  for (int32_t tag : tags) {
    const std::vector<int32_t> q = seq(100 * tag, 8);
    flat.insert(flat.end(), q.begin(), q.end());
    cu.push_back(static_cast<int64_t>(flat.size()));
  }
  std::vector<int64_t> lengths(4), cu_blocks(5), handles(4);
  std::vector<int32_t> blocks;
  f.tree->match_ragged("m", Ragged{flat.data(), static_cast<int64_t>(flat.size()), cu.data(), 4}, false,
                       lengths.data(), &blocks, cu_blocks.data(), handles.data());
  EXPECT_EQ(lengths, (std::vector<int64_t>{8, 8, 0, 0}));
  for (size_t i = 0; i < tags.size(); ++i) {
    for (int64_t b = cu_blocks[i]; b < cu_blocks[i + 1]; ++b) {
      EXPECT_EQ(f.device_pages[blocks[static_cast<size_t>(b)]], 1000 * tags[i] + (b - cu_blocks[i])) << i;
    }
  }
  EXPECT_EQ(f.tree->stats().loaded_nodes, 2);
  EXPECT_EQ(f.tree->stats().locked_nodes, 0);  // the call's own locks are gone
  f.expect_ok();
}

TEST(RadixTree, HostTierMatchLoadsAChainAndEvictsOthersForRoom) {
  HostFixture f(5, 8, 4);
  std::vector<int32_t> a = seq(0, 8), ab = seq(0, 16);
  f.put_tagged(a, 1);
  f.put_tagged(ab, 2);  // a -> (a, b): 4 device blocks
  f.tree->evict(4);     // the whole chain to the host
  EXPECT_EQ(f.tree->stats().host_nodes, 2);
  f.put_tagged(seq(100, 8), 3);  // 2 device blocks
  const MatchResult m = f.get(ab);  // loading 4 needs 4: the seq-100 leaf is demoted for room
  EXPECT_EQ(m.length, 16);
  EXPECT_EQ(f.device_pages[m.blocks[3]], 2003);
  EXPECT_EQ(f.get(seq(100, 8)).length, 8);  // and then comes back itself, evicting the chain's tail
  f.expect_ok();
}

TEST(RadixTree, InsertThroughAHostNodeAdoptsTheCallersBlocks) {
  HostFixture f(8, 8, 4);
  f.put_tagged(seq(0, 8), 1);
  f.tree->evict(2);
  const size_t copies_before = f.log.size();
  f.put_tagged(seq(0, 12), 2);  // recomputed by a request: its blocks replace the host copy
  EXPECT_EQ(f.log.size(), copies_before);  // no copy needed
  EXPECT_EQ(f.tree->stats().host_nodes, 0);
  EXPECT_EQ(f.host->num_free(), 8);
  const MatchResult m = f.get(seq(0, 12));
  EXPECT_EQ(m.length, 12);
  EXPECT_EQ(f.device_pages[m.blocks[0]], 2000);
  f.expect_ok();
}

TEST(RadixTree, ConcurrentRequestsKeepTheTreeConsistent) {
  Fixture f(512, 16);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&f, t] {
      for (int i = 0; i < 300; ++i) {
        std::vector<int32_t> tokens = seq(0, 64);  // a shared system prompt
        for (int32_t j = 0; j < 40; ++j) tokens.push_back((i * 31 + j * 7 + t) % 50);
        const MatchResult m = f.tree->match("m", tokens.data(), static_cast<int64_t>(tokens.size()), true);
        std::vector<int32_t> table = m.blocks;
        f.alloc->share(table.data(), static_cast<int64_t>(table.size()));
        f.alloc->append(&table, m.length, static_cast<int64_t>(tokens.size()) - m.length);
        const auto ins = f.tree->insert("m", tokens.data(), static_cast<int64_t>(tokens.size()), table.data(),
                                        static_cast<int64_t>(table.size()), true);
        f.tree->unlock(m.node);
        f.alloc->free(table.data(), static_cast<int64_t>(table.size()));
        f.tree->unlock(ins.node);
        if (i % 50 == 0) f.tree->evict(8);
      }
    });
  }
  for (auto& th : threads) th.join();
  f.expect_ok();
  f.tree->evict(1 << 20);
  EXPECT_EQ(f.alloc->num_free(), 512);
}

namespace {

/// Sequences flattened varlen style, with blocks the caller holds for each (allocated all up front).
struct Batch {
  std::vector<int32_t> tokens, blocks;
  std::vector<int64_t> cu{0}, cu_blocks{0};
  Batch(BlockAllocator& alloc, const std::vector<std::vector<int32_t>>& seqs) {
    for (const auto& s : seqs) {
      std::vector<int32_t> table;
      alloc.append(&table, 0, static_cast<int64_t>(s.size()));
      tokens.insert(tokens.end(), s.begin(), s.end());
      blocks.insert(blocks.end(), table.begin(), table.end());
      cu.push_back(static_cast<int64_t>(tokens.size()));
      cu_blocks.push_back(static_cast<int64_t>(blocks.size()));
    }
  }
  int64_t batch() const { return static_cast<int64_t>(cu.size()) - 1; }
  Ragged ragged_tokens() const { return {tokens.data(), static_cast<int64_t>(tokens.size()), cu.data(), batch()}; }
  Ragged ragged_blocks() const { return {blocks.data(), static_cast<int64_t>(blocks.size()), cu_blocks.data(), batch()}; }
};

}  // namespace

TEST(RadixTree, RaggedCallsEqualSingleCalls) {
  const std::vector<std::vector<int32_t>> prompts = {seq(0, 7), seq(0, 3), seq(100, 9), {0, 1, 2, 9, 9}, {}};
  Fixture ragged(64, 4), single(64, 4);
  const Batch a(*ragged.alloc, prompts), b(*single.alloc, prompts);  // the same block ids in both
  ASSERT_EQ(a.blocks, b.blocks);
  std::vector<int64_t> prefix(5), nodes(5);
  ragged.tree->insert_ragged("m", a.ragged_tokens(), a.ragged_blocks(), false, prefix.data(), nodes.data());
  for (int64_t i = 0; i < b.batch(); ++i) {
    const auto r = single.tree->insert("m", b.tokens.data() + b.cu[i], b.cu[i + 1] - b.cu[i],
                                       b.blocks.data() + b.cu_blocks[i], b.cu_blocks[i + 1] - b.cu_blocks[i]);
    EXPECT_EQ(prefix[i], r.prefix_length) << i;
  }
  EXPECT_EQ(prefix, (std::vector<int64_t>{0, 3, 0, 3, 0}));
  ragged.expect_ok();

  const std::vector<std::vector<int32_t>> queries = {seq(0, 5), {0, 1, 2, 9, 9, 9}, seq(100, 12), {7}, {}};
  std::vector<int32_t> flat;
  std::vector<int64_t> cu{0};
  for (const auto& q : queries) {
    flat.insert(flat.end(), q.begin(), q.end());
    cu.push_back(static_cast<int64_t>(flat.size()));
  }
  std::vector<int64_t> lengths(5), cu_blocks(6), handles(5);
  std::vector<int32_t> blocks = {-7};  // appended to, after what is there
  ragged.tree->match_ragged("m", Ragged{flat.data(), static_cast<int64_t>(flat.size()), cu.data(), 5}, false,
                            lengths.data(), &blocks, cu_blocks.data(), handles.data());
  EXPECT_EQ(lengths, (std::vector<int64_t>{5, 5, 9, 0, 0}));
  for (size_t i = 0; i < queries.size(); ++i) {
    const MatchResult m = ragged.get(queries[i]);
    EXPECT_EQ(lengths[i], m.length) << i;
    EXPECT_EQ(handles[i], m.node) << i;
    EXPECT_EQ(std::vector<int32_t>(blocks.begin() + 1 + cu_blocks[i], blocks.begin() + 1 + cu_blocks[i + 1]), m.blocks)
        << i;
  }
  EXPECT_EQ(blocks[0], -7);
}

TEST(RadixTree, RaggedInsertChecksEveryRequestFirst) {
  Fixture f(64, 4);
  Batch b(*f.alloc, {seq(0, 7), seq(50, 4), seq(90, 2)});
  std::vector<int64_t> prefix(3), nodes(3);
  const auto insert = [&](const Ragged& tokens, const Ragged& blocks) {
    f.tree->insert_ragged("m", tokens, blocks, false, prefix.data(), nodes.data());
  };
  const auto before = f.tree->stats();
  std::vector<int32_t> five = b.blocks;
  five.push_back(b.blocks.back());
  std::vector<int64_t> bad_cu_blocks = {0, 2, 4, 5};  // sequence 1: 4 tokens = 1 page, given 2 blocks
  EXPECT_EQ(error_of<std::invalid_argument>([&] {
              insert(b.ragged_tokens(), Ragged{five.data(), 5, bad_cu_blocks.data(), 3});
            }),
            "sequence 1 has 4 tokens = 1 pages but 2 blocks");
  std::vector<int64_t> short_cu = {0, 7, 11};
  EXPECT_EQ(error_of<std::invalid_argument>([&] {
              insert(Ragged{b.tokens.data(), 11, short_cu.data(), 2}, b.ragged_blocks());
            }),
            "cu_lens has 3 entries but cu_blocks has 4; both are [batch + 1]");
  std::vector<int64_t> unsorted = {0, 11, 7, 13};
  EXPECT_EQ(error_of<std::out_of_range>([&] { insert(Ragged{b.tokens.data(), 13, unsorted.data(), 3}, b.ragged_blocks()); }),
            "cu_lens must be non-decreasing but cu_lens[2] = 7 < cu_lens[1] = 11");
  std::vector<int64_t> offset = {1, 7, 11, 13};
  EXPECT_EQ(error_of<std::out_of_range>([&] { insert(Ragged{b.tokens.data(), 13, offset.data(), 3}, b.ragged_blocks()); }),
            "cu_lens[0] = 1 must be 0");
  EXPECT_EQ(error_of<std::out_of_range>([&] { insert(Ragged{b.tokens.data(), 12, b.cu.data(), 3}, b.ragged_blocks()); }),
            "cu_lens[-1] = 13 must equal len(tokens) = 12");
  // The last request's block is no longer held: nothing of the batch goes in.
  f.alloc->free(&b.blocks.back(), 1);
  EXPECT_NE(error_of<std::invalid_argument>([&] { insert(b.ragged_tokens(), b.ragged_blocks()); }).find("is free"),
            std::string::npos);
  const auto after = f.tree->stats();
  EXPECT_EQ(after.inserts, before.inserts);
  EXPECT_EQ(after.nodes, 0);
  EXPECT_EQ(f.alloc->num_free(), 64 - 3);
  f.expect_ok();
}

namespace {

/// The Python layer's locking contract, in C++: nothing but the tree's and the allocators' own mutexes.
/// Four std::threads run what kvcache.Engine does with one tree and allocator (locked lookups, single and
/// ragged; sequences that share what matched; appends with copy-on-write; inserts, single and ragged;
/// releases and unlocks) plus forks, raw allocations, evictions to a host tier and back, stats and
/// invariant checks, on a pool too small for all of them (OutOfBlocks is expected). Each token position's
/// "KV" is a hash of its namespace and token prefix, written by the thread that owns the block, so a block
/// handed out twice, a locked prefix evicted, a shared page written or a copy gone wrong reads back wrong.
struct SharedPool {
  static constexpr int64_t kPage = 4, kDevice = 32, kHost = 32;
  std::shared_ptr<BlockAllocator> alloc = std::make_shared<BlockAllocator>(kDevice, kPage);
  std::shared_ptr<BlockAllocator> host = std::make_shared<BlockAllocator>(kHost, kPage);
  std::shared_ptr<RadixTree> tree = RadixTree::create(alloc);
  std::vector<std::array<uint32_t, kPage>> device, host_pages;  // what each block holds

  SharedPool() : device(kDevice), host_pages(kHost) {
    // Called under the tree's mutex; it reads blocks the tree holds (never written again) and writes
    // blocks just taken from a free stack under that mutex, so it races with no writer.
    tree->set_host_tier(host, [this](CopyDirection d, const std::vector<BlockCopy>& copies) {
      for (const BlockCopy& c : copies) {
        if (d == CopyDirection::kDeviceToHost) host_pages[c.dst] = device[c.src];
        else device[c.dst] = host_pages[c.src];
      }
    });
  }
  static std::vector<uint32_t> values(int ns, const std::vector<int32_t>& tokens) {
    std::vector<uint32_t> out;
    uint32_t h = static_cast<uint32_t>(ns) + 1;
    for (int32_t t : tokens) out.push_back(h = (h * 31 + static_cast<uint32_t>(t) + 1) % 1048573);
    return out;
  }
  bool holds(const std::vector<int32_t>& blocks, int ns, const std::vector<int32_t>& tokens, int64_t n) const {
    const std::vector<uint32_t> want = values(ns, tokens);
    for (int64_t p = 0; p < n; ++p) {
      if (device[blocks[p / kPage]][p % kPage] != want[p]) return false;
    }
    return true;
  }
  void write(const std::vector<int32_t>& blocks, int ns, const std::vector<int32_t>& tokens, int64_t from) {
    const std::vector<uint32_t> v = values(ns, tokens);
    for (size_t p = static_cast<size_t>(from); p < tokens.size(); ++p) device[blocks[p / kPage]][p % kPage] = v[p];
  }
  void apply(const std::vector<BlockCopy>& copies) {
    for (const BlockCopy& c : copies) device[c.dst] = device[c.src];
  }
};

/// One request, as the Engine runs it; returns false if it ran out of blocks (having given everything back).
bool engine_request(SharedPool& s, std::mt19937& rng, std::vector<std::string>& failures) {
  const int ns = static_cast<int>(rng() % 2);
  const std::string name = ns ? "b" : "a";
  std::vector<int32_t> tokens;
  const int32_t shared_prefix = static_cast<int32_t>(rng() % 13);  // the same first tokens in every thread
  for (int32_t i = 0; i < shared_prefix; ++i) tokens.push_back(i + 1);
  for (uint32_t i = 0, n = 1 + rng() % 16; i < n; ++i) tokens.push_back(static_cast<int32_t>(1 + rng() % 6));
  const int64_t n = static_cast<int64_t>(tokens.size());
  MatchResult m;
  if (rng() % 2) {
    m = s.tree->match(name, tokens.data(), n - 1, true);
  } else {  // batched: this request and a shorter one, both locked
    const std::vector<int64_t> cu = {0, n - 1, n - 1 + (n - 1) / 2};
    std::vector<int32_t> flat(tokens.begin(), tokens.end() - 1);
    flat.insert(flat.end(), tokens.begin(), tokens.begin() + (n - 1) / 2);
    std::vector<int64_t> lengths(2), cu_blocks(3), nodes(2);
    s.tree->match_ragged(name, Ragged{flat.data(), static_cast<int64_t>(flat.size()), cu.data(), 2}, true,
                         lengths.data(), &m.blocks, cu_blocks.data(), nodes.data());
    s.tree->unlock(nodes[1]);
    m.blocks.resize(static_cast<size_t>(cu_blocks[1]));
    m.length = lengths[0];
    m.node = nodes[0];
  }
  std::vector<std::vector<int32_t>> tables;
  std::vector<int64_t> locked = {m.node};
  bool ok = true;
  try {
    if (!s.holds(m.blocks, ns, tokens, m.length)) failures.push_back("a locked match reads wrong values");
    std::vector<int32_t> table = m.blocks;
    s.alloc->share(table.data(), static_cast<int64_t>(table.size()));
    tables.push_back(table);
    s.apply(s.alloc->append(&tables[0], m.length, n - m.length));
    s.write(tables[0], ns, tokens, m.length);
    if (!s.holds(tables[0], ns, tokens, n)) failures.push_back("a sequence reads wrong values after its writes");
    if (rng() % 3 == 0) {  // a fork that diverges inside the shared last page
      std::vector<int32_t> fork = tables[0];
      s.alloc->share(fork.data(), static_cast<int64_t>(fork.size()));
      tables.push_back(fork);
      std::vector<int32_t> extra = tokens;
      extra.push_back(static_cast<int32_t>(1 + rng() % 6));
      s.apply(s.alloc->append(&tables[1], n, 1));
      s.write(tables[1], ns, extra, n);
      if (!s.holds(tables[1], ns, extra, n + 1)) failures.push_back("a fork reads wrong values");
    }
    if (rng() % 2) {
      locked.push_back(s.tree->insert(name, tokens.data(), n, tables[0].data(), static_cast<int64_t>(tables[0].size()),
                                      true).node);
    } else {
      const std::vector<int64_t> cu = {0, n}, cub = {0, static_cast<int64_t>(tables[0].size())};
      int64_t prefix = 0, node = 0;
      s.tree->insert_ragged(name, Ragged{tokens.data(), n, cu.data(), 1},
                            Ragged{tables[0].data(), cub[1], cub.data(), 1}, false, &prefix, &node);
    }
    if (!s.holds(tables[0], ns, tokens, n)) failures.push_back("a sequence's values changed under it");
  } catch (const OutOfBlocks&) {
    ok = false;
  }
  for (const auto& t : tables) s.alloc->free(t.data(), static_cast<int64_t>(t.size()));
  for (int64_t node : locked) s.tree->unlock(node);
  return ok;
}

}  // namespace

TEST(RadixTree, FourThreadsRunTheEnginesMixWithAHostTier) {
  SharedPool s;
  std::vector<std::vector<std::string>> failures(4);
  std::vector<int64_t> out_of_blocks(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<uint32_t>(t));
      for (int step = 0; step < 2500; ++step) {
        const uint32_t op = rng() % 100;
        try {
          if (op < 60) {
            out_of_blocks[t] += !engine_request(s, rng, failures[t]);
          } else if (op < 70) {
            s.tree->evict(1 + rng() % 8);
          } else if (op < 80) {
            const auto a = s.alloc->stats();
            const auto c = s.tree->stats();
            if (a.free + a.used != SharedPool::kDevice || c.device_blocks > c.device_block_refs ||
                c.locked_nodes > c.nodes) {
              failures[t].push_back("inconsistent stats");
            }
          } else if (op < 90) {  // raw blocks; now and then more than the pool holds
            std::vector<int32_t> b = s.alloc->allocate(rng() % 30 ? 1 + rng() % 3 : SharedPool::kDevice + 1);
            s.alloc->share(b.data(), static_cast<int64_t>(b.size()));
            if (s.alloc->free(b.data(), static_cast<int64_t>(b.size())) != 0) failures[t].push_back("freed too early");
            if (s.alloc->free(b.data(), static_cast<int64_t>(b.size())) != static_cast<int64_t>(b.size())) {
              failures[t].push_back("not freed");
            }
          } else if (op < 99) {
            const std::string problem = s.tree->check_invariants();
            if (!problem.empty()) failures[t].push_back(problem);
          } else {
            s.tree->evict(SharedPool::kDevice);
          }
        } catch (const OutOfBlocks&) {
          ++out_of_blocks[t];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& f : failures) EXPECT_TRUE(f.empty()) << f.size() << " failures, the first: " << f.front();
  EXPECT_GT(out_of_blocks[0] + out_of_blocks[1] + out_of_blocks[2] + out_of_blocks[3], 0);
  const auto c = s.tree->stats();
  EXPECT_GT(c.demoted_blocks, 0);
  EXPECT_GT(c.loaded_blocks, 0);
  EXPECT_EQ(c.locked_nodes, 0);
  EXPECT_EQ(s.tree->check_invariants(), "");
  // Every reference left is the tree's: none leaked by a request, none dropped twice.
  EXPECT_EQ(s.alloc->stats().references, c.device_block_refs);
  EXPECT_EQ(s.host->stats().references, c.host_block_refs);
  s.tree->evict(SharedPool::kDevice);
  EXPECT_EQ(s.alloc->num_free(), SharedPool::kDevice);
  s.tree.reset();  // the host tier's blocks go with the tree
  EXPECT_EQ(s.host->num_free(), SharedPool::kHost);
}
