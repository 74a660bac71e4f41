// CUDA registrations of paged_attention and merge_states: validate and plan on the host (the same
// AttentionPlan as the CPU), upload the task lists, launch on the current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstring>

#include "attention/attention_cuda_launch.h"
#include "attention/attention_prepare.h"
#include "core/check.h"
#include "plan/step_plan.h"

namespace kvcache {
namespace {

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "kvcache::", op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

/// Copies a vector of POD structs to a device byte tensor.
template <typename T>
at::Tensor to_device(const std::vector<T>& items, const at::Device& device) {
  at::Tensor host = at::empty({static_cast<int64_t>(items.size() * sizeof(T))}, at::dtype(at::kByte));
  if (!items.empty()) std::memcpy(host.data_ptr(), items.data(), items.size() * sizeof(T));
  return host.to(device);
}

int64_t multiprocessors(const at::Device& device) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device.index()) != cudaSuccess) return 80;
  return sms;
}

void paged_attention_cuda(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_q_lens,
                          double scale, int64_t window_left, int64_t sink_tokens, double softcap, at::Tensor& out,
                          const std::optional<at::Tensor>& lse, const std::optional<at::Tensor>& k_scale,
                          const std::optional<at::Tensor>& v_scale, int64_t k_format, int64_t v_format) {
  TORCH_CHECK_VALUE(k_cache.is_cuda(), "k_cache is on ", k_cache.device(), " but the CUDA kernel was dispatched");
  const c10::cuda::CUDAGuard guard(k_cache.device());
  AttentionHostInfo host;
  const AttentionArgs a = prepare_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale,
                                            window_left, sink_tokens, softcap, out, lse, &host,
                                            k_scale, v_scale, k_format, v_format);
  TORCH_CHECK_VALUE(a.layout.head_dim <= cuda::max_head_dim(), "head_dim = ", a.layout.head_dim,
                    " is not supported by the CUDA kernels (at most ", cuda::max_head_dim(), ")");
  const AttentionPlan plan = cuda::plan_cuda_attention(a, host, multiprocessors(k_cache.device()));
  at::Tensor part_o, part_lse;
  const PartialStates partial = allocate_partials(plan.num_slots, plan.rows_per_slot, a.layout.head_dim,
                                                  query.options(), &part_o, &part_lse);
  const at::Tensor d_tasks = to_device(plan.tasks, k_cache.device());
  const at::Tensor d_splits = to_device(plan.splits, k_cache.device());
  check_launch(cuda::launch_attention(a, reinterpret_cast<const AttentionTask*>(d_tasks.data_ptr()),
                                      static_cast<int64_t>(plan.tasks.size()), plan.num_prefill_tasks,
                                      reinterpret_cast<const AttentionPlan::Split*>(d_splits.data_ptr()),
                                      static_cast<int64_t>(plan.splits.size()), partial,
                                      c10::cuda::getCurrentCUDAStream()),
               "paged_attention");
  // The workspace tensors are released here; the caching allocator keeps them until the stream
  // has run past the kernels that use them.
}

void paged_attention_planned_cuda(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& plan_host, const at::Tensor& plan_device, double scale,
                                  int64_t window_left, int64_t sink_tokens, double softcap, at::Tensor& out,
                                  const std::optional<at::Tensor>& lse, const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale, int64_t k_format, int64_t v_format) {
  TORCH_CHECK_VALUE(k_cache.is_cuda(), "k_cache is on ", k_cache.device(), " but the CUDA kernel was dispatched");
  const c10::cuda::CUDAGuard guard(k_cache.device());
  const StepPlanHeader* h = nullptr;
  const AttentionArgs a = prepare_attention_planned(query, k_cache, v_cache, plan_host, plan_device, scale,
                                                    window_left, sink_tokens, softcap, out, lse, k_scale, v_scale,
                                                    k_format, v_format, kPlanForCuda, &h);
  TORCH_CHECK_VALUE(a.layout.head_dim <= cuda::max_head_dim(), "head_dim = ", a.layout.head_dim,
                    " is not supported by the CUDA kernels (at most ", cuda::max_head_dim(), ")");
  at::Tensor part_o, part_lse;
  const PartialStates partial = allocate_partials(h->num_slots, h->rows_per_slot, a.layout.head_dim, query.options(),
                                                  &part_o, &part_lse);
  // The task lists were uploaded once, with the plan: nothing crosses to the device here.
  check_launch(cuda::launch_attention(a, plan_tasks(plan_device, *h, true), h->num_tasks, h->num_prefill_tasks,
                                      plan_splits(plan_device, *h, true), h->num_splits, partial,
                                      c10::cuda::getCurrentCUDAStream()),
               "paged_attention_planned");
}

std::tuple<at::Tensor, at::Tensor> plan_step_cuda(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                                  const at::Tensor& cu_q_lens,
                                                  const std::optional<at::Tensor>& slot_mapping, int64_t q_heads,
                                                  const std::optional<at::Tensor>& k_scale,
                                                  const std::optional<at::Tensor>& v_scale, int64_t k_format,
                                                  int64_t v_format) {
  TORCH_CHECK_VALUE(k_cache.is_cuda(), "k_cache is on ", k_cache.device(), " but the CUDA planner was dispatched");
  const c10::cuda::CUDAGuard guard(k_cache.device());
  const int64_t sms = multiprocessors(k_cache.device());
  return build_step_plan(k_cache, v_cache, block_tables, seq_lens, cu_q_lens, slot_mapping, q_heads, k_scale, v_scale,
                         k_format, v_format, kPlanForCuda,
                         [sms](const AttentionArgs& a) { return cuda::cuda_plan_options(a, sms); });
}

void merge_states_cuda(const at::Tensor& v_a, const at::Tensor& lse_a, const at::Tensor& v_b, const at::Tensor& lse_b,
                       at::Tensor& v_out, at::Tensor& lse_out) {
  check_merge_states(v_a, lse_a, v_b, lse_b, v_out, lse_out);
  const c10::cuda::CUDAGuard guard(v_a.device());
  const at::Tensor va = v_a.contiguous(), vb = v_b.contiguous(), la = lse_a.contiguous(), lb = lse_b.contiguous();
  check_launch(cuda::launch_merge_states(va.data_ptr(), la.data_ptr<float>(), vb.data_ptr(), lb.data_ptr<float>(),
                                         v_out.data_ptr(), lse_out.data_ptr<float>(), v_a.size(0) * v_a.size(1),
                                         v_a.size(2), to_dtype(v_a.scalar_type()), c10::cuda::getCurrentCUDAStream()),
               "merge_states");
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcache, CUDA, m) {
  m.impl("paged_attention", &paged_attention_cuda);
  m.impl("paged_attention_planned", &paged_attention_planned_cuda);
  m.impl("plan_step", &plan_step_cuda);
  m.impl("merge_states", &merge_states_cuda);
}

}  // namespace kvcache
