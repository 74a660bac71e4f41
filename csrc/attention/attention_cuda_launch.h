// Raw-pointer launchers of the CUDA attention kernels (attention_kernels.cu). Torch-free.
#pragma once

#include <cuda_runtime_api.h>

#include "attention/attention_args.h"
#include "attention/attention_plan.h"

namespace kvcache::cuda {

/// Largest head_dim the kernels support.
int64_t max_head_dim();

/// Resident CTAs per SM of the attention kernel for a's formats: the occupancy API on a GPU (queried once per
/// kernel instantiation, on the current device); a fixed 2 under the emulator, which has no register file.
int64_t attention_ctas_per_sm(const AttentionArgs& a);

/// The planner's options for call `a` on a device with `multiprocessors` SMs (host code: the CUDA registration
/// and the emulation tests share it).
PlanOptions cuda_plan_options(const AttentionArgs& a, int64_t multiprocessors);

/// The plan of a paged_attention call on a device with `multiprocessors` SMs.
AttentionPlan plan_cuda_attention(const AttentionArgs& a, const AttentionHostInfo& host, int64_t multiprocessors);

/// Runs a plan's tasks (a device array), then merges the split states. The first `num_prefill` tasks are the
/// prefill tasks of a plan made with PlanOptions::prefill_first (they run on tensor cores when they can).
cudaError_t launch_attention(const AttentionArgs& a, const AttentionTask* tasks, int64_t num_tasks, int64_t num_prefill,
                             const AttentionPlan::Split* splits, int64_t num_splits, const PartialStates& partial,
                             cudaStream_t stream);

/// merge_states over contiguous v [rows, head_dim] and lse [rows].
cudaError_t launch_merge_states(const void* v_a, const float* lse_a, const void* v_b, const float* lse_b, void* v_out,
                                float* lse_out, int64_t rows, int64_t head_dim, DType dtype, cudaStream_t stream);

}  // namespace kvcache::cuda
