// CUDA registration of mla_attention: validate on the host (as the CPU), launch on the current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "mla/mla_cuda_launch.h"
#include "mla/mla_prepare.h"

namespace kvcache {
namespace {

void mla_attention_cuda(const at::Tensor& q_latent, const at::Tensor& q_rope, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        const at::Tensor& cu_q_lens, double scale, at::Tensor& out, const std::optional<at::Tensor>& lse,
                        const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                        int64_t k_format, int64_t v_format) {
  TORCH_CHECK_VALUE(k_cache.is_cuda(), "k_cache is on ", k_cache.device(), " but the CUDA kernel was dispatched");
  const c10::cuda::CUDAGuard guard(k_cache.device());
  AttentionHostInfo host;
  const MlaArgs a = prepare_mla_attention(q_latent, q_rope, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale,
                                          out, lse, k_scale, v_scale, k_format, v_format, &host);
  check_mla_cuda_limits(a);
  const cudaError_t err = cuda::launch_mla_attention(a, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "kvcache::mla_attention: CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcache, CUDA, m) { m.impl("mla_attention", &mla_attention_cuda); }

}  // namespace kvcache
