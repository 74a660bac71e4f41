// Splitting one paged_attention call into tasks, shared by the CPU and CUDA backends. Torch-free.
//
// Decode-like sequences (few query rows per KV head) are bandwidth-bound: each of their KV heads is a
// stream, split along the keys (split-K) until there are enough tasks to keep every core (or SM)
// busy; the split states are merged afterwards. Prefill-like sequences are compute-bound and are cut
// into blocks of query rows instead, so their keys are never split.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention/attention_args.h"

namespace kvcache {

/// Host copies of the per-sequence lengths.
struct AttentionHostInfo {
  std::vector<int64_t> kv_lens;
  std::vector<int64_t> q_lens;
};

struct PlanOptions {
  int64_t parallelism = 1;      // cores, or SMs
  int64_t tasks_per_worker = 4; // aim for this many split tasks per worker
  int64_t decode_rows = 16;     // at most this many query rows per KV head: split the keys
  int64_t min_split_keys = 512; // keys per split task, at least
  int64_t prefill_rows = 64;    // query rows per prefill task
  // KV heads per decode task of a sequence with >= decode_heads_min_keys keys (0: all its heads). Such
  // a task reads its heads' rows of a page in one pass per tile, one contiguous run instead of one per
  // head (see decode_heads_per_page). CUDA kernels take one head per decode task.
  int64_t decode_heads = 1;
  int64_t decode_heads_min_keys = 4096;
  // GPU scheduling (CUDA): the tasks run in waves of parallelism x tasks_per_worker resident CTAs. Prefill
  // tasks fill the wave too, so keys are split only as far as the decode units must go to fill what the
  // prefill tasks leave of it, and not at all once a wave is full; the task count is not padded to a
  // multiple of the workers (a partial wave already overlaps the next kernel's). CPU: false.
  bool fill_waves = false;
  // Prefill tasks first, each group largest first (CUDA: they run in their own kernel, over a prefix of the
  // task list). CPU: false (one largest-first list for the dynamic schedule).
  bool prefill_first = false;
};

/// KV heads whose rows of one page make a 32 KiB run: a head-at-a-time stream of short runs at scattered
/// pages is read neither by the hardware prefetcher nor from open DRAM rows (a DDR5 rank's row is 8 KiB).
/// int8, 8 x 32k tokens, Zen 4: 35-37 -> 28-31 ns per key and KV head from DRAM with 4 KiB runs (2 heads);
/// Zen 5, from DRAM: 4 KiB -> 8 KiB runs took int8 26-27.5 -> 22 ns, int4 20.7 -> 18.5, bf16 40 -> 38.
/// Zen 3 (AVX2), bf16, 8 x 32k, paired rounds: 8 KiB -> 32 KiB runs (2 -> 8 heads) took the step to
/// 0.87-0.89 of its time (a run against itself: 0.98); int8 and batch 1 x 32k unchanged within noise.
constexpr int64_t kDecodeRunBytes = 32768;
inline int64_t decode_heads_per_page(const PagedLayout& L, int64_t k_row_bytes, int64_t v_row_bytes) {
  const int64_t run = L.page_size * std::max<int64_t>(1, std::max(k_row_bytes, v_row_bytes));
  return std::clamp<int64_t>(kDecodeRunBytes / run, 1, L.num_kv_heads);
}

struct AttentionPlan {
  struct Split {
    int32_t seq, head_begin, head_end;
    int32_t first_slot, num_slots;  // int32 like the rest: no padding bytes (see AttentionTask)
  };
  static_assert(sizeof(Split) == 5 * sizeof(int32_t), "Split must have no padding");
  std::vector<AttentionTask> tasks;  // largest first (with PlanOptions::prefill_first: prefill tasks first)
  int64_t num_prefill_tasks = 0;     // tasks of prefill-like sequences (more than decode_rows rows per KV head)
  std::vector<Split> splits;         // (sequence, head) pairs whose keys were split
  int64_t rows_per_slot = 0;
  int64_t num_slots = 0;
};

inline AttentionPlan make_attention_plan(const AttentionArgs& a, const AttentionHostInfo& host, const PlanOptions& opt) {
  AttentionPlan plan;
  const int64_t H = a.layout.num_kv_heads, G = a.group;
  // heads per decode task of sequence b
  const auto heads_of = [&](int64_t b) -> int64_t {
    if (host.kv_lens[b] < opt.decode_heads_min_keys) return 1;
    return opt.decode_heads > 0 ? std::min(opt.decode_heads, H) : H;
  };
  const int64_t prefill_tokens = std::max<int64_t>(1, opt.prefill_rows / G);  // query tokens per prefill task
  int64_t decode_units = 0, prefill_tasks = 0;
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t q_len = host.q_lens[b];
    if (q_len > 0 && q_len * G <= opt.decode_rows) {
      decode_units += (H + heads_of(b) - 1) / heads_of(b);
    } else if (q_len > 0) {
      prefill_tasks += H * ((q_len + prefill_tokens - 1) / prefill_tokens);
    }
  }
  const int64_t want = opt.tasks_per_worker * opt.parallelism;
  int64_t want_splits = 1;
  if (opt.fill_waves) {
    if (decode_units > 0 && decode_units + prefill_tasks < want) {
      // The split count whose tasks fill their waves best, the smallest on a tie: 384 units on 396 slots
      // stay whole (two half tasks each would fill two waves no better), 8 units take 49 splits, not 50.
      const auto tasks = [&](int64_t s) { return decode_units * s + prefill_tasks; };
      const auto slots = [&](int64_t s) { return (tasks(s) + want - 1) / want * want; };
      const int64_t most = (want - prefill_tasks + decode_units - 1) / decode_units;
      for (int64_t s = 2; s <= most; ++s) {
        if (tasks(s) * slots(want_splits) > tasks(want_splits) * slots(s)) want_splits = s;
      }
    }
  } else {
    want_splits = decode_units > 0 ? std::max<int64_t>(1, (want + decode_units - 1) / decode_units) : 1;
    // A task count that the workers divide evenly: 3 KV heads x 3 splits on 2 cores would leave one
    // core idle for a ninth of the call; 3 x 4 does not.
    while (decode_units > 0 && (decode_units * want_splits) % opt.parallelism != 0 &&
           want_splits < want + opt.parallelism) {
      ++want_splits;
    }
  }
  struct Costed {
    bool ahead;    // a prefill task, with PlanOptions::prefill_first
    int64_t cost;  // rows x keys
    AttentionTask task;
  };
  std::vector<Costed> costed;
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t q_len = host.q_lens[b], kv_len = host.kv_lens[b];
    if (q_len == 0) continue;  // kv_len >= q_len > 0 below
    const int64_t HS = heads_of(b);
    for (int64_t h = 0; h < H; ++h) {
      if (q_len * G <= opt.decode_rows) {
        if (h % HS != 0) continue;  // covered by the task of head h - h % HS
        const int64_t h1 = std::min(H, h + HS);
        const int64_t splits = std::max<int64_t>(1, std::min(want_splits, kv_len / opt.min_split_keys));
        const int64_t chunk = ((kv_len + splits - 1) / splits + 15) / 16 * 16;
        const int64_t first = plan.num_slots;
        for (int64_t k0 = 0; k0 < kv_len; k0 += chunk) {
          const int64_t k1 = std::min(kv_len, k0 + chunk);
          AttentionTask t{int32_t(b), int32_t(h), int32_t(h1), 0, int32_t(q_len), int32_t(k0), int32_t(k1), -1};
          if (splits > 1) t.partial = int32_t(plan.num_slots++);
          costed.push_back({false, q_len * G * (h1 - h) * (k1 - k0), t});
        }
        if (splits > 1) {
          plan.splits.push_back({int32_t(b), int32_t(h), int32_t(h1), int32_t(first), int32_t(plan.num_slots - first)});
          plan.rows_per_slot = std::max(plan.rows_per_slot, q_len * G * (h1 - h));
        }
      } else {
        for (int64_t i0 = 0; i0 < q_len; i0 += prefill_tokens) {
          const int64_t i1 = std::min(q_len, i0 + prefill_tokens);
          AttentionTask t{int32_t(b), int32_t(h), int32_t(h + 1), int32_t(i0), int32_t(i1), 0, int32_t(kv_len), -1};
          costed.push_back({opt.prefill_first, (i1 - i0) * G * (kv_len - q_len + i1), t});
          ++plan.num_prefill_tasks;
        }
      }
    }
  }
  // Largest first, so a dynamic schedule ends with the small tasks (after the prefill tasks, when they go first).
  std::stable_sort(costed.begin(), costed.end(), [](const Costed& x, const Costed& y) {
    return x.ahead != y.ahead ? x.ahead : x.cost > y.cost;
  });
  plan.tasks.reserve(costed.size());
  for (const Costed& c : costed) plan.tasks.push_back(c.task);
  return plan;
}

}  // namespace kvcache
