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

namespace {
/// The planner options of the CUDA backend (attention_kernels.cu: cuda_plan_options) on a device with `sms`
/// SMs holding `ctas` attention CTAs each, pages of 16 keys.
PlanOptions gpu_options(int64_t sms, int64_t ctas) {
  PlanOptions opt;
  opt.parallelism = sms;
  opt.tasks_per_worker = ctas;
  opt.fill_waves = true;
  opt.decode_rows = 64;
  opt.min_split_keys = 16;
  opt.prefill_rows = 16;
  return opt;
}
int64_t split_tasks(const AttentionPlan& plan) {
  return std::count_if(plan.tasks.begin(), plan.tasks.end(), [](const AttentionTask& t) { return t.partial >= 0; });
}
}  // namespace

TEST(AttentionPlanGpu, SmallBatchFillsTheResidentCtasAndSplitsDownToSinglePages) {
  // batch 1, 8 KV heads, 1k keys on an H100-sized device (132 SMs x 3 CTAs = 396 slots). The options the
  // CUDA backend had before (2 per SM, splits of >= 256 keys) gave 32 CTAs.
  const AttentionArgs a = args_for(1, 8, 4);
  AttentionHostInfo host{{1024}, {1}};
  const AttentionPlan plan = make_attention_plan(a, host, gpu_options(132, 3));
  // 49 splits per head fill the 396 slots best (50 would start a second wave); chunks round up to whole tiles
  // of 16 keys: 21 -> 32 keys, 32 splits
  EXPECT_EQ(plan.tasks.size(), 8u * 32u);
  EXPECT_GE(plan.tasks.size(), 132u);  // every SM has work
  for (const AttentionTask& t : plan.tasks) {
    EXPECT_EQ(t.kv_end - t.kv_begin, 32);
    EXPECT_GE(t.partial, 0);
  }
  EXPECT_EQ(plan.splits.size(), 8u);
  // 256 keys: a single page (16 keys) per task, and no further
  AttentionHostInfo short_host{{256}, {1}};
  const AttentionPlan short_plan = make_attention_plan(a, short_host, gpu_options(132, 3));
  EXPECT_EQ(short_plan.tasks.size(), 8u * 16u);
  for (const AttentionTask& t : short_plan.tasks) EXPECT_EQ(t.kv_end - t.kv_begin, 16);
}

TEST(AttentionPlanGpu, AFullWaveIsNotSplit) {
  const AttentionArgs a = args_for(50, 8, 4);  // 400 decode units >= 396 slots
  AttentionHostInfo host{std::vector<int64_t>(50, 8192), std::vector<int64_t>(50, 1)};
  const AttentionPlan plan = make_attention_plan(a, host, gpu_options(132, 3));
  EXPECT_EQ(plan.tasks.size(), 400u);
  EXPECT_TRUE(plan.splits.empty());
  EXPECT_EQ(plan.num_slots, 0);
  // 48 sequences (384 units) leave 12 slots free, but halving every task would fill two waves no better
  const AttentionArgs b = args_for(48, 8, 4);
  AttentionHostInfo host_b{std::vector<int64_t>(48, 8192), std::vector<int64_t>(48, 1)};
  EXPECT_EQ(make_attention_plan(b, host_b, gpu_options(132, 3)).tasks.size(), 384u);
  // 24 sequences (192 units) take 2 splits each: 384 of the 396 slots
  const AttentionArgs c = args_for(24, 8, 4);
  AttentionHostInfo host_c{std::vector<int64_t>(24, 8192), std::vector<int64_t>(24, 1)};
  EXPECT_EQ(make_attention_plan(c, host_c, gpu_options(132, 3)).tasks.size(), 384u);
}

TEST(AttentionPlanGpu, PrefillTasksCountTowardTheWave) {
  const AttentionArgs a = args_for(2, 8, 4);
  // a long prefill (2000 tokens, 4 per task: 4000 CTAs) fills the device: the decode sequence is not split
  AttentionHostInfo busy{{4096, 2000}, {1, 2000}};
  const AttentionPlan plan = make_attention_plan(a, busy, gpu_options(132, 3));
  EXPECT_TRUE(plan.splits.empty());
  EXPECT_EQ(plan.tasks.size(), 8u + 8u * 500u);
  // a short one (40 tokens: 80 CTAs) leaves 316 slots to the 8 decode heads: 39 splits fill them best,
  // chunks of 106 keys round up to 112, 37 tasks per head
  AttentionHostInfo light{{4096, 40}, {1, 40}};
  const AttentionPlan plan_light = make_attention_plan(a, light, gpu_options(132, 3));
  EXPECT_EQ(plan_light.splits.size(), 8u);
  EXPECT_EQ(split_tasks(plan_light), 8 * 37);
  EXPECT_EQ(plan_light.tasks.size(), size_t(8 * 37 + 80));
}

TEST(AttentionPlanGpu, PrefillTasksGoFirstWhenAsked) {
  // a decode sequence between two prefills: with prefill_first the prefill tasks make a prefix of the list
  // (prefill_mma_kernel runs over it), each group largest first; without it, one largest-first list
  const AttentionArgs a = args_for(3, 2, 4);
  AttentionHostInfo host{{40, 5000, 300}, {40, 1, 300}};
  PlanOptions opt = gpu_options(4, 2);
  opt.prefill_rows = 64;  // 16 tokens of a group of 4 per task
  const auto is_prefill = [](const AttentionTask& t) { return t.seq != 1; };
  const auto cost = [&](const AttentionTask& t) {  // the planner's: rows x keys seen (causal for prefill)
    return is_prefill(t) ? int64_t(t.tok_end - t.tok_begin) * (host.kv_lens[t.seq] - host.q_lens[t.seq] + t.tok_end)
                         : int64_t(t.kv_end - t.kv_begin);
  };
  for (bool first : {true, false}) {
    opt.prefill_first = first;
    const AttentionPlan plan = make_attention_plan(a, host, opt);
    const int64_t prefill = 2 * (3 + 19);  // 2 KV heads x (40 / 16 -> 3, 300 / 16 -> 19 tasks)
    EXPECT_EQ(plan.num_prefill_tasks, prefill);
    ASSERT_GT(static_cast<int64_t>(plan.tasks.size()), prefill);
    if (first) {
      for (int64_t i = 0; i < static_cast<int64_t>(plan.tasks.size()); ++i) {
        EXPECT_EQ(is_prefill(plan.tasks[i]), i < prefill) << "task " << i;
        if (i > 0 && i != prefill) {
          EXPECT_GE(cost(plan.tasks[i - 1]), cost(plan.tasks[i])) << "task " << i;
        }
      }
    } else {
      EXPECT_FALSE(is_prefill(plan.tasks[0]));  // the decode splits of 5000 keys are the largest tasks
    }
  }
}

TEST(AttentionPlanGpu, UpTo64RowsPerKvHeadIsDecode) {
  const AttentionArgs a = args_for(2, 2, 4);
  AttentionHostInfo host{{4096, 4096}, {16, 17}};  // 64 rows per KV head: decode; 68: prefill
  const AttentionPlan plan = make_attention_plan(a, host, gpu_options(132, 3));
  EXPECT_EQ(plan.splits.size(), 2u);
  EXPECT_EQ(plan.rows_per_slot, 64);
  for (const AttentionTask& t : plan.tasks) {
    if (t.seq == 0) {
      EXPECT_GE(t.partial, 0);
    } else {
      EXPECT_EQ(t.partial, -1);
      EXPECT_EQ(t.kv_end - t.kv_begin, 4096);
    }
  }
}
