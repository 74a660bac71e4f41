// CUDA registrations of the cache ops: validate on the host (cache_prepare), then launch the kernels
// of cache_kernels.cu on the current stream of the pools' device.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "cache/cache_cuda_launch.h"
#include "cache/cache_prepare.h"
#include "core/check.h"
#include "plan/step_plan.h"

namespace kvcache {
namespace {

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "kvcache::", op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

void check_on_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.is_cuda(), name, " is on ", t.device(), " but the pools are on a CUDA device");
}

// The CUDA kernels hold a rotated row in registers: 8 dims per lane.
void check_rotated_dim(const PoolFormats& f, const PagedLayout& layout) {
  TORCH_CHECK_VALUE(!f.k_rot || layout.head_dim <= 256, "k_cache: head_dim = ", layout.head_dim,
                    " is too large for Hadamard-rotated formats on CUDA (at most 256)");
  TORCH_CHECK_VALUE(!f.v_rot || layout.v_head_dim <= 256, "v_cache: head_dim = ", layout.v_head_dim,
                    " is too large for Hadamard-rotated formats on CUDA (at most 256)");
}

void launch_append_call(const AppendArgs& a, const PoolFormats& f, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const char* op) {
  check_rotated_dim(f, a.layout);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (f.quantized()) {
    const int elem = static_cast<int>(f.k_kind == KVKind::kFull ? k_cache.element_size() : v_cache.element_size());
    check_launch(cuda::launch_append_quantized(a, elem, stream), op);
    return;
  }
  check_launch(cuda::launch_append(a, kv_element_bytes(k_cache), stream), op);
}

void append_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                 const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
                 const std::optional<at::Tensor>& v_scale, int64_t k_format, int64_t v_format) {
  check_on_cuda(k_cache, "k_cache");
  const c10::cuda::CUDAGuard guard(k_cache.device());
  const PoolFormats f = make_formats(k_format, v_format, k_scale, v_scale);
  launch_append_call(prepare_append(key, value, k_cache, v_cache, slot_mapping, f), f, k_cache, v_cache, "append");
}

void append_planned_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                         const at::Tensor& plan_host, const at::Tensor& plan_device,
                         const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                         int64_t k_format, int64_t v_format) {
  check_on_cuda(k_cache, "k_cache");
  const c10::cuda::CUDAGuard guard(k_cache.device());
  const PoolFormats f = make_formats(k_format, v_format, k_scale, v_scale);
  launch_append_call(prepare_append_planned(key, value, k_cache, v_cache, plan_host, plan_device, f, k_format,
                                            v_format, kPlanForCuda),
                     f, k_cache, v_cache, "append_planned");
}

void paged_gather_cuda(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                       const at::Tensor& seq_lens, at::Tensor& k_out, at::Tensor& v_out,
                       const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                       int64_t k_format, int64_t v_format) {
  check_on_cuda(k_cache, "k_cache");
  const c10::cuda::CUDAGuard guard(k_cache.device());
  const PoolFormats f = make_formats(k_format, v_format, k_scale, v_scale);
  const GatherArgs a = prepare_gather(k_cache, v_cache, block_tables, seq_lens, k_out, v_out, f);
  check_rotated_dim(f, a.layout);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  check_launch(f.quantized() ? cuda::launch_gather_dequantized(a, /*ragged=*/false, stream)
                             : cuda::launch_gather_padded(a, kv_element_bytes(k_cache), stream),
               "paged_gather");
}

void paged_gather_ragged_cuda(const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, const at::Tensor& cu_seq_lens, at::Tensor& k_out,
                              at::Tensor& v_out, const std::optional<at::Tensor>& k_scale,
                              const std::optional<at::Tensor>& v_scale, int64_t k_format, int64_t v_format) {
  check_on_cuda(k_cache, "k_cache");
  const c10::cuda::CUDAGuard guard(k_cache.device());
  const PoolFormats f = make_formats(k_format, v_format, k_scale, v_scale);
  const GatherArgs a = prepare_gather_ragged(k_cache, v_cache, block_tables, cu_seq_lens, k_out, v_out, f);
  check_rotated_dim(f, a.layout);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  check_launch(f.quantized() ? cuda::launch_gather_dequantized(a, /*ragged=*/true, stream)
                             : cuda::launch_gather_ragged(a, kv_element_bytes(k_cache), stream),
               "paged_gather_ragged");
}

void copy_blocks_cuda(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& block_mapping) {
  check_on_cuda(k_cache, "k_cache");
  const c10::cuda::CUDAGuard guard(k_cache.device());
  TORCH_CHECK_VALUE(block_mapping.is_cpu() || block_mapping.device() == k_cache.device(), "block_mapping is on ",
                    block_mapping.device(), "; it must be on the CPU or on the pools' device ", k_cache.device());
  const at::Tensor host = block_mapping.to(at::kCPU).contiguous();
  BlockCopyArgs a = prepare_block_copy(k_cache, v_cache, k_cache, v_cache, host, /*same_pool=*/true);
  const at::Tensor device_pairs = block_mapping.is_cpu() ? host.to(k_cache.device()) : block_mapping.contiguous();
  a.pairs = device_pairs.data_ptr<int64_t>();
  check_launch(cuda::launch_copy_blocks(a, c10::cuda::getCurrentCUDAStream()), "copy_blocks");
}

void swap_blocks_cuda(const at::Tensor& k_src, const at::Tensor& v_src, at::Tensor& k_dst, at::Tensor& v_dst,
                      const at::Tensor& block_mapping) {
  // At least one pool is on a CUDA device; the other may be host memory (pinned memory makes the
  // copies asynchronous, pageable memory makes them synchronous).
  TORCH_CHECK_VALUE(k_src.device() == v_src.device() && k_dst.device() == v_dst.device(),
                    "k_src/v_src are on ", k_src.device(), "/", v_src.device(), " and k_dst/v_dst on ",
                    k_dst.device(), "/", v_dst.device(), "; each K/V pair must share a device");
  const at::Device cuda_device = k_dst.is_cuda() ? k_dst.device() : k_src.device();
  const c10::cuda::CUDAGuard guard(cuda_device);
  const at::Tensor mapping = block_mapping.contiguous();  // a.pairs points into it: keep it alive for the launch
  const BlockCopyArgs a = prepare_swap(k_src, v_src, k_dst, v_dst, mapping);
  check_launch(cuda::launch_swap_blocks(a, c10::cuda::getCurrentCUDAStream()), "swap_blocks");
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcache, CUDA, m) {
  m.impl("append", &append_cuda);
  m.impl("append_planned", &append_planned_cuda);
  m.impl("paged_gather", &paged_gather_cuda);
  m.impl("paged_gather_ragged", &paged_gather_ragged_cuda);
  m.impl("copy_blocks", &copy_blocks_cuda);
  m.impl("swap_blocks", &swap_blocks_cuda);
}

}  // namespace kvcache
