// Raw-pointer launcher of the CUDA MLA kernel (mla_kernels.cu). Torch-free.
#pragma once

#include <cuda_runtime_api.h>

#include "mla/mla_args.h"

namespace kvcache::cuda {

/// Widest latent (kv_lora_rank) and rope (qk_rope_head_dim) rows the kernel supports.
constexpr int64_t kMlaMaxLatentDim = 1024;
constexpr int64_t kMlaMaxRopeDim = 256;

/// Absorbed MLA attention: one CTA per (query token, kv head, tile of query heads) (mla_kernels.cu).
cudaError_t launch_mla_attention(const MlaArgs& a, cudaStream_t stream);

}  // namespace kvcache::cuda
