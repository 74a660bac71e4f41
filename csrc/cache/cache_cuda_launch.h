// Raw-pointer launchers of the CUDA cache kernels (cache_kernels.cu). Torch-free: the torch side
// (cache_cuda.cpp) validates, picks the stream and turns a returned error into an exception.
#pragma once

#include <cuda_runtime_api.h>

#include "cache/cache_args.h"

namespace kvcache::cuda {

cudaError_t launch_append(const AppendArgs& a, int elem_bytes, cudaStream_t stream);
cudaError_t launch_gather_padded(const GatherArgs& a, int elem_bytes, cudaStream_t stream);
cudaError_t launch_gather_ragged(const GatherArgs& a, int elem_bytes, cudaStream_t stream);
/// Quantizing append / dequantizing gathers (any KVKind on either side).
cudaError_t launch_append_quantized(const AppendArgs& a, int elem_bytes, cudaStream_t stream);
cudaError_t launch_gather_dequantized(const GatherArgs& a, bool ragged, cudaStream_t stream);
/// `a.pairs` must point to device memory here.
cudaError_t launch_copy_blocks(const BlockCopyArgs& a, cudaStream_t stream);
/// One cudaMemcpyAsync per (block, K/V) between pools on any devices; `a.pairs` is host memory here.
cudaError_t launch_swap_blocks(const BlockCopyArgs& a, cudaStream_t stream);

}  // namespace kvcache::cuda
