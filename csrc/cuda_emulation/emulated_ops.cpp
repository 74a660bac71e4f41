// torch.ops.kvcache_cuda_emulation: the ops of torch.ops.kvcache (same schemas, op_schemas.h) on CPU
// tensors, run by the CUDA kernels under the emulator. The host side is that of the CUDA registrations
// (cache_cuda.cpp, attention_cuda.cpp) without device guards and streams: the same validation
// (cache_prepare, attention_prepare), the same plan, the same launchers (swap_blocks' cudaMemcpyAsync
// calls are memcpy here).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "attention/attention_cuda_launch.h"
#include "attention/attention_prepare.h"
#include "cache/cache_cuda_launch.h"
#include "cache/cache_prepare.h"
#include "core/check.h"
#include "core/host_reads.h"
#include "cuda_emulation/emulator.h"
#include "mla/mla_cuda_launch.h"
#include "mla/mla_prepare.h"
#include "op_schemas.h"
#include "plan/step_plan.h"

namespace kvcache {
namespace {

constexpr int64_t kEmulatedMultiprocessors = 4;  // small, so that long sequences are split (split-K)

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "kvcache_cuda_emulation::", op, ": ", cudaGetErrorString(err));
}

void launch_append_call(const AppendArgs& a, const PoolFormats& f, const at::Tensor& k_cache,
                        const at::Tensor& v_cache) {
  if (f.quantized()) {
    const int elem = static_cast<int>(f.k_kind == KVKind::kFull ? k_cache.element_size() : v_cache.element_size());
    check_launch(cuda::launch_append_quantized(a, elem, nullptr), "append");
    return;
  }
  check_launch(cuda::launch_append(a, kv_element_bytes(k_cache), nullptr), "append");
}

void append(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
            const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
            const std::optional<at::Tensor>& v_scale, int64_t k_format, int64_t v_format) {
  const PoolFormats f = make_formats(k_format, v_format, k_scale, v_scale);
  launch_append_call(prepare_append(key, value, k_cache, v_cache, slot_mapping, f), f, k_cache, v_cache);
}

void append_planned(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& plan_host, const at::Tensor& plan_device,
                    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                    int64_t k_format, int64_t v_format) {
  const PoolFormats f = make_formats(k_format, v_format, k_scale, v_scale);
  launch_append_call(prepare_append_planned(key, value, k_cache, v_cache, plan_host, plan_device, f, k_format,
                                            v_format, kPlanForCuda),
                     f, k_cache, v_cache);
}

void paged_gather(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, at::Tensor& k_out, at::Tensor& v_out,
                  const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                  int64_t k_format, int64_t v_format) {
  const PoolFormats f = make_formats(k_format, v_format, k_scale, v_scale);
  const GatherArgs a = prepare_gather(k_cache, v_cache, block_tables, seq_lens, k_out, v_out, f);
  check_launch(f.quantized() ? cuda::launch_gather_dequantized(a, /*ragged=*/false, nullptr)
                             : cuda::launch_gather_padded(a, kv_element_bytes(k_cache), nullptr),
               "paged_gather");
}

void paged_gather_ragged(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                         const at::Tensor& cu_seq_lens, at::Tensor& k_out, at::Tensor& v_out,
                         const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                         int64_t k_format, int64_t v_format) {
  const PoolFormats f = make_formats(k_format, v_format, k_scale, v_scale);
  const GatherArgs a = prepare_gather_ragged(k_cache, v_cache, block_tables, cu_seq_lens, k_out, v_out, f);
  check_launch(f.quantized() ? cuda::launch_gather_dequantized(a, /*ragged=*/true, nullptr)
                             : cuda::launch_gather_ragged(a, kv_element_bytes(k_cache), nullptr),
               "paged_gather_ragged");
}

void copy_blocks(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& block_mapping) {
  const at::Tensor host = block_mapping.contiguous();
  const BlockCopyArgs a = prepare_block_copy(k_cache, v_cache, k_cache, v_cache, host, /*same_pool=*/true);
  check_launch(cuda::launch_copy_blocks(a, nullptr), "copy_blocks");
}

void swap_blocks(const at::Tensor& k_src, const at::Tensor& v_src, at::Tensor& k_dst, at::Tensor& v_dst,
                 const at::Tensor& block_mapping) {
  const at::Tensor mapping = block_mapping.contiguous();  // a.pairs points into it: keep it alive for the launch
  const BlockCopyArgs a = prepare_swap(k_src, v_src, k_dst, v_dst, mapping);
  check_launch(cuda::launch_swap_blocks(a, nullptr), "swap_blocks");
}

void paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_q_lens,
                     double scale, int64_t window_left, int64_t sink_tokens, double softcap, at::Tensor& out,
                     const std::optional<at::Tensor>& lse, const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale, int64_t k_format, int64_t v_format) {
  AttentionHostInfo host;
  const AttentionArgs a = prepare_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale,
                                            window_left, sink_tokens, softcap, out, lse, &host,
                                            k_scale, v_scale, k_format, v_format);
  TORCH_CHECK_VALUE(a.layout.head_dim <= cuda::max_head_dim(), "head_dim = ", a.layout.head_dim,
                    " is not supported by the CUDA kernels (at most ", cuda::max_head_dim(), ")");
  const AttentionPlan plan = cuda::plan_cuda_attention(a, host, kEmulatedMultiprocessors);
  at::Tensor part_o, part_lse;
  const PartialStates partial = allocate_partials(plan.num_slots, plan.rows_per_slot, a.layout.head_dim,
                                                  query.options(), &part_o, &part_lse);
  check_launch(cuda::launch_attention(a, plan.tasks.data(), static_cast<int64_t>(plan.tasks.size()), plan.num_prefill_tasks,
                                      plan.splits.data(), static_cast<int64_t>(plan.splits.size()), partial, nullptr),
               "paged_attention");
}

void paged_attention_planned(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& plan_host, const at::Tensor& plan_device, double scale,
                             int64_t window_left, int64_t sink_tokens, double softcap, at::Tensor& out,
                             const std::optional<at::Tensor>& lse, const std::optional<at::Tensor>& k_scale,
                             const std::optional<at::Tensor>& v_scale, int64_t k_format, int64_t v_format) {
  const StepPlanHeader* h = nullptr;
  const AttentionArgs a = prepare_attention_planned(query, k_cache, v_cache, plan_host, plan_device, scale,
                                                    window_left, sink_tokens, softcap, out, lse, k_scale, v_scale,
                                                    k_format, v_format, kPlanForCuda, &h);
  TORCH_CHECK_VALUE(a.layout.head_dim <= cuda::max_head_dim(), "head_dim = ", a.layout.head_dim,
                    " is not supported by the CUDA kernels (at most ", cuda::max_head_dim(), ")");
  at::Tensor part_o, part_lse;
  const PartialStates partial = allocate_partials(h->num_slots, h->rows_per_slot, a.layout.head_dim, query.options(),
                                                  &part_o, &part_lse);
  check_launch(cuda::launch_attention(a, plan_tasks(plan_device, *h, true), h->num_tasks, h->num_prefill_tasks,
                                      plan_splits(plan_device, *h, true), h->num_splits, partial, nullptr),
               "paged_attention_planned");
}

std::tuple<at::Tensor, at::Tensor> plan_step(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                             const at::Tensor& cu_q_lens, const std::optional<at::Tensor>& slot_mapping,
                                             int64_t q_heads, const std::optional<at::Tensor>& k_scale,
                                             const std::optional<at::Tensor>& v_scale, int64_t k_format,
                                             int64_t v_format) {
  return build_step_plan(k_cache, v_cache, block_tables, seq_lens, cu_q_lens, slot_mapping, q_heads, k_scale, v_scale,
                         k_format, v_format, kPlanForCuda,
                         [](const AttentionArgs& a) { return cuda::cuda_plan_options(a, kEmulatedMultiprocessors); });
}

void merge_states(const at::Tensor& v_a, const at::Tensor& lse_a, const at::Tensor& v_b, const at::Tensor& lse_b,
                  at::Tensor& v_out, at::Tensor& lse_out) {
  check_merge_states(v_a, lse_a, v_b, lse_b, v_out, lse_out);
  const at::Tensor va = v_a.contiguous(), vb = v_b.contiguous(), la = lse_a.contiguous(), lb = lse_b.contiguous();
  check_launch(cuda::launch_merge_states(va.data_ptr(), la.data_ptr<float>(), vb.data_ptr(), lb.data_ptr<float>(),
                                         v_out.data_ptr(), lse_out.data_ptr<float>(), v_a.size(0) * v_a.size(1),
                                         v_a.size(2), to_dtype(v_a.scalar_type()), nullptr),
               "merge_states");
}

}  // namespace

void mla_attention(const at::Tensor& q_latent, const at::Tensor& q_rope, const at::Tensor& k_cache,
                   const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                   const at::Tensor& cu_q_lens, double scale, at::Tensor& out, const std::optional<at::Tensor>& lse,
                   const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                   int64_t k_format, int64_t v_format) {
  AttentionHostInfo host;
  const MlaArgs a = prepare_mla_attention(q_latent, q_rope, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale,
                                          out, lse, k_scale, v_scale, k_format, v_format, &host);
  check_mla_cuda_limits(a);
  check_launch(cuda::launch_mla_attention(a, nullptr), "mla_attention");
}

// The emulator's global-load log around a few ops (tests/test_cuda_access_log.py): start, run, stop.
void access_log_start() { emu::start_access_log(); }

/// [warp-wide loads, bytes, sector bytes, fewest bytes of a warp-wide load, bytes read again, warp-wide mma,
/// warp-wide ldmatrix, ldmatrix wavefronts beyond one per matrix (bank conflicts), warp-wide shared loads logged
/// by the kernels (shared_load), their wavefronts beyond one per phase (bank conflicts)]
std::vector<int64_t> access_log_stop() {
  const emu::AccessSummary s = emu::stop_access_log();
  return {s.warp_loads, s.bytes,    s.sector_bytes,  s.min_warp_bytes,           s.bytes_read_again,
          s.mma,        s.ldmatrix, s.ldmatrix_extra_wavefronts, s.shared_loads, s.shared_extra_wavefronts};
}

TORCH_LIBRARY(kvcache_cuda_emulation, m) {
  for (const char* schema : kOpSchemas) m.def(schema);
  m.def("access_log_start() -> ()", &access_log_start);
  m.def("access_log_stop() -> int[]", &access_log_stop);
}

TORCH_LIBRARY_IMPL(kvcache_cuda_emulation, CPU, m) {
  m.impl("append", &append);
  m.impl("append_planned", &append_planned);
  m.impl("plan_step", &plan_step);
  m.impl("paged_attention_planned", &paged_attention_planned);
  m.impl("paged_gather", &paged_gather);
  m.impl("paged_gather_ragged", &paged_gather_ragged);
  m.impl("copy_blocks", &copy_blocks);
  m.impl("swap_blocks", &swap_blocks);
  m.impl("paged_attention", &paged_attention);
  m.impl("merge_states", &merge_states);
  m.impl("mla_attention", &mla_attention);
}

}  // namespace kvcache

// The host-read counter of this library (core/host_reads.h), for the tests (ctypes).
extern "C" int64_t kvcache_emulation_host_index_reads() { return kvcache::host_index_reads().load(); }
