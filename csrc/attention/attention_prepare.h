// Validation and argument packing of paged_attention and merge_states, shared by CPU and CUDA.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <vector>

#include "attention/attention_args.h"
#include "attention/attention_plan.h"

namespace kvcache {

struct StepPlanHeader;

AttentionArgs prepare_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                const at::Tensor& cu_q_lens, double scale, int64_t window_left,
                                int64_t sink_tokens, double softcap, const at::Tensor& out,
                                const std::optional<at::Tensor>& lse, AttentionHostInfo* host,
                                const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                                int64_t k_format, int64_t v_format);

/// paged_attention on a plan (plan/step_plan.h): the same checks but no index reads; the index pointers point
/// into `plan_device`, and `*header` to the plan's header in `plan_host`. `backend`: kPlanForCpu or
/// kPlanForCuda, the task list the caller runs.
AttentionArgs prepare_attention_planned(const at::Tensor& query, const at::Tensor& k_cache,
                                        const at::Tensor& v_cache, const at::Tensor& plan_host,
                                        const at::Tensor& plan_device, double scale, int64_t window_left,
                                        int64_t sink_tokens, double softcap, const at::Tensor& out,
                                        const std::optional<at::Tensor>& lse,
                                        const std::optional<at::Tensor>& k_scale,
                                        const std::optional<at::Tensor>& v_scale, int64_t k_format,
                                        int64_t v_format, int64_t backend, const StepPlanHeader** header);

/// Shapes, dtypes and devices of the index tensors of paged_attention (and of a step plan): no value reads.
void check_index_tensors(const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_q_lens,
                         const at::Tensor& device_of);

/// The values of those index tensors (host pointers): q offsets summing to `total_q`, q_len <= seq_len, and
/// the block ids the lengths use in [0, num_blocks). Raises IndexError; fills `host`.
void check_index_values(const int32_t* cu, const int32_t* lens, const int32_t* table, int64_t table_stride,
                        int64_t table_width, int64_t batch, int64_t total_q, const char* total_q_what,
                        const PagedLayout& layout, AttentionHostInfo* host);

/// check_index_tensors, then the values of those tensors read on the host (check_index_values) against `total_q`
/// queries (`total_q_what` names it in errors) and the pool `layout`; seq_lens and cu_q_lens must be contiguous.
void check_indices_on_host(const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_q_lens,
                           const at::Tensor& k_cache, int64_t total_q, const char* total_q_what,
                           const PagedLayout& layout, AttentionHostInfo* host);

/// An attention op's optional lse output: [total_q, q_heads] float32, contiguous, on k_cache's device.
void check_lse_out(const std::optional<at::Tensor>& lse, int64_t total_q, int64_t q_heads, const at::Tensor& k_cache);

/// Float32 workspace for the partial states of a plan's split tasks (its num_slots x rows_per_slot) (empty when nothing is split);
/// the tensors own the memory the returned PartialStates points into.
PartialStates allocate_partials(int64_t num_slots, int64_t rows_per_slot, int64_t head_dim,
                                const at::TensorOptions& options, at::Tensor* o, at::Tensor* lse);

/// Checks merge_states' arguments: v_* [tokens, heads, head_dim], lse_* [tokens, heads] float32.
void check_merge_states(const at::Tensor& v_a, const at::Tensor& lse_a, const at::Tensor& v_b,
                        const at::Tensor& lse_b, const at::Tensor& v_out, const at::Tensor& lse_out);

DType to_dtype(at::ScalarType t);

}  // namespace kvcache
