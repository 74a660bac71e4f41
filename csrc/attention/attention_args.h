// Arguments and work items of paged attention, shared by the CPU and CUDA kernels. Torch-free.
//
// Semantics (the reference is kvcache.reference.paged_attention): sequence b has kv_len[b] tokens in
// the pages, the last q_len[b] of which are its queries (rows cu_q_lens[b]..cu_q_lens[b+1] of
// `query`). Query i of the sequence sits at position p = kv_len - q_len + i and attends key j iff
//   j <= p  and  (window_left < 0 or j >= p - window_left or j < sink_tokens).
// Scores are scale * q.k, soft-capped as cap * tanh(s / cap) when softcap > 0. Query head hq reads
// KV head hq / (q_heads / kv_heads). A query with no visible key gets output 0 and lse -inf.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/kv_format.h"
#include "core/paged_layout.h"

namespace kvcache {

struct AttentionArgs {
  const void* query = nullptr;    // [total_q, q_heads, head_dim], element strides below
  int64_t q_strides[3] = {};
  DType q_dtype = DType::kFloat32;
  const void* k_cache = nullptr;  // [num_blocks, kv_heads, page_size, head_dim]
  const void* v_cache = nullptr;
  DType kv_dtype = DType::kFloat32;       // of full-precision pools
  KVKind k_kind = KVKind::kFull, v_kind = KVKind::kFull;
  const float* k_scale = nullptr;         // quantized pools: see core/kv_format.h
  const float* v_scale = nullptr;
  bool k_rot = false;                     // K rows Hadamard-rotated: queries are rotated on load
  bool v_rot = false;                     // V rows rotated: outputs are unrotated when written
  PagedLayout layout;
  const int32_t* block_tables = nullptr;  // [batch, max_blocks]
  int64_t table_stride = 0;
  const int32_t* kv_lens = nullptr;       // [batch]
  const int32_t* cu_q_lens = nullptr;     // [batch + 1]
  int64_t batch = 0;
  int64_t q_heads = 0;
  int64_t group = 1;                      // q_heads / kv_heads
  float scale = 1.f;
  int64_t window_left = -1;
  int64_t sink_tokens = 0;
  float softcap = 0.f;
  void* out = nullptr;                    // [total_q, q_heads, head_dim], contiguous, q_dtype
  float* lse = nullptr;                   // [total_q, q_heads] or null
};

/// One work item: the queries [tok_begin, tok_end) of sequence `seq`, for the query heads of KV heads
/// [head_begin, head_end), against keys [kv_begin, kv_end). Tasks that cover only part of a sequence's
/// keys (split-K) write a partial state at `partial` instead of the final output.
/// Row r of a task: KV head head_begin + r / (q_tokens * group), then token tok_begin + (r % ...) / group
/// and query head (KV head) * group + r % group.
struct AttentionTask {
  int32_t seq, head_begin, head_end;
  int32_t tok_begin, tok_end;
  int32_t kv_begin, kv_end;
  int32_t partial;  // -1: write out/lse; else the index of this task's partial-state slot
};
// No padding bytes: step plans (plan/step_plan.h) copy tasks as bytes, and an op's output must not carry
// uninitialized memory.
static_assert(sizeof(AttentionTask) == 8 * sizeof(int32_t), "AttentionTask must have no padding");

/// Partial states of split tasks: o [num_slots, rows_per_slot, head_dim], lse [num_slots, rows_per_slot],
/// rows numbered as in AttentionTask.
struct PartialStates {
  float* o = nullptr;
  float* lse = nullptr;
  int64_t rows_per_slot = 0;
};

}  // namespace kvcache
