// Butterfly reductions over a full warp: every lane gets the result. Shared by the attention, MLA and
// cache kernels. Built as C++, __shfl_xor_sync is the emulator's warp-collective version
// (cuda_emulation/emulator.h).
#pragma once

#include "core/cuda_launch.cuh"

namespace kvcache::cuda {

__device__ __forceinline__ float warp_sum(float x) {
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

}  // namespace kvcache::cuda
