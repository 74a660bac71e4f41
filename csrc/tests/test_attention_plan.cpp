// The attention planner covers every (sequence, KV head, query, key) exactly once, splits only
// decode-like sequences, and the softmax-state merge is exact.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>
#include <vector>

#include "attention/attention_plan.h"
#include "core/softmax_state.h"

using namespace kvcache;

namespace {
AttentionArgs args_for(int64_t batch, int64_t kv_heads, int64_t group) {
  AttentionArgs a;
  a.layout = PagedLayout(1, 16, kv_heads, 64);
  a.batch = batch;
  a.group = group;
  a.q_heads = kv_heads * group;
  return a;
}
}  // namespace

TEST(AttentionPlan, CoversEveryQueryAndKeyOnce) {
  const AttentionArgs a = args_for(4, 2, 4);
  AttentionHostInfo host{{40000, 300, 1000, 5}, {1, 300, 64, 0}};
  PlanOptions opt;
  opt.parallelism = 2;
  const AttentionPlan plan = make_attention_plan(a, host, opt);
  // count (seq, head, token) -> covered key ranges
  std::map<std::tuple<int, int, int>, std::vector<std::pair<int, int>>> cover;
  for (const AttentionTask& t : plan.tasks) {
    EXPECT_EQ(t.head_end, t.head_begin + 1);
    for (int i = t.tok_begin; i < t.tok_end; ++i) cover[{t.seq, t.head_begin, i}].push_back({t.kv_begin, t.kv_end});
  }
  for (int b = 0; b < 4; ++b) {
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < host.q_lens[b]; ++i) {
        auto ranges = cover[{b, h, i}];
        std::sort(ranges.begin(), ranges.end());
        ASSERT_FALSE(ranges.empty());
        EXPECT_EQ(ranges.front().first, 0);
        for (size_t k = 1; k < ranges.size(); ++k) EXPECT_EQ(ranges[k].first, ranges[k - 1].second);
        EXPECT_EQ(ranges.back().second, host.kv_lens[b]);
      }
    }
  }
  EXPECT_EQ(cover.size(), size_t(2 * (1 + 300 + 64)));  // sequence 3 has no queries: no task
}

TEST(AttentionPlan, SplitsOnlyDecodeAndRecordsTheSlots) {
  const AttentionArgs a = args_for(2, 1, 8);
  AttentionHostInfo host{{100000, 2000}, {1, 100}};
  PlanOptions opt;
  opt.parallelism = 4;
  const AttentionPlan plan = make_attention_plan(a, host, opt);
  ASSERT_EQ(plan.splits.size(), 1u);  // the decode sequence; the prefill one is never split
  EXPECT_EQ(plan.splits[0].seq, 0);
  EXPECT_EQ(plan.splits[0].num_slots, 16);  // 4 tasks per worker x 4 workers, one decode unit
  EXPECT_EQ(plan.rows_per_slot, 8);
  int64_t slots_seen = 0;
  for (const AttentionTask& t : plan.tasks) {
    if (t.seq == 0) {
      EXPECT_GE(t.partial, 0);
      ++slots_seen;
    } else {
      EXPECT_EQ(t.partial, -1);
      EXPECT_EQ(t.kv_begin, 0);
      EXPECT_EQ(t.kv_end, 2000);
    }
  }
  EXPECT_EQ(slots_seen, 16);
}

TEST(AttentionPlan, DecodeTaskCountIsAMultipleOfTheWorkers) {
  // 3 KV heads on 2 workers: 4 tasks per worker asks for 8, which 3 heads reach with 3 splits (9
  // equal tasks: one worker would wait a ninth of the call); the planner takes 4 splits (12 tasks).
  const AttentionArgs a = args_for(1, 3, 3);
  AttentionHostInfo host{{8192}, {1}};
  PlanOptions opt;
  opt.parallelism = 2;
  const AttentionPlan plan = make_attention_plan(a, host, opt);
  EXPECT_EQ(plan.tasks.size(), 12u);
  for (const AttentionTask& t : plan.tasks) EXPECT_EQ(t.kv_end - t.kv_begin, 2048);
  // when the keys are too few to split that far, the count follows the keys, not the workers
  AttentionHostInfo short_host{{1024}, {1}};
  EXPECT_EQ(make_attention_plan(a, short_host, opt).tasks.size(), 6u);  // 1024 / 512 keys: 2 splits per head
}

TEST(SoftmaxState, MergeIsLogAddExpAndHandlesEmptyStates) {
  const MergeWeights w = merge_weights(std::log(3.f), std::log(1.f));
  EXPECT_NEAR(w.lse, std::log(4.f), 1e-6);
  EXPECT_NEAR(w.w_a, 0.75f, 1e-6);
  EXPECT_NEAR(w.w_b, 0.25f, 1e-6);
  const MergeWeights one = merge_weights(-INFINITY, 2.f);
  EXPECT_EQ(one.w_a, 0.f);
  EXPECT_EQ(one.w_b, 1.f);
  EXPECT_EQ(one.lse, 2.f);
  const MergeWeights none = merge_weights(-INFINITY, -INFINITY);
  EXPECT_EQ(none.w_a, 0.f);
  EXPECT_EQ(none.w_b, 0.f);
  EXPECT_TRUE(std::isinf(none.lse) && none.lse < 0);
  const MergeWeights big = merge_weights(1000.f, 999.f);  // no overflow
  EXPECT_NEAR(big.w_a, 1.f / (1.f + std::exp(-1.f)), 1e-6);
}
