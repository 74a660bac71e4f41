// Validation and argument packing of paged_attention and merge_states, shared by CPU and CUDA.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <vector>

#include "attention/attention_args.h"
#include "attention/attention_plan.h"

namespace kvcache {

AttentionArgs prepare_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                const at::Tensor& cu_q_lens, double scale, int64_t window_left,
                                int64_t sink_tokens, double softcap, const at::Tensor& out,
                                const std::optional<at::Tensor>& lse, AttentionHostInfo* host,
                                const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                                int64_t k_format, int64_t v_format);

/// Float32 workspace for the partial states of a plan's split tasks (empty when nothing is split);
/// the tensors own the memory the returned PartialStates points into.
PartialStates allocate_partials(const AttentionPlan& plan, int64_t head_dim, const at::TensorOptions& options,
                                at::Tensor* o, at::Tensor* lse);

/// Checks merge_states' arguments: v_* [tokens, heads, head_dim], lse_* [tokens, heads] float32.
void check_merge_states(const at::Tensor& v_a, const at::Tensor& lse_a, const at::Tensor& v_b,
                        const at::Tensor& lse_b, const at::Tensor& v_out, const at::Tensor& lse_out);

DType to_dtype(at::ScalarType t);

}  // namespace kvcache
