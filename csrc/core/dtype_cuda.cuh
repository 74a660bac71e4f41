// Loads and stores of query / output / full-precision elements by runtime dtype, in device code.
// Shared by the CUDA kernels of every op family (nvcc only).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/dtype.h"

namespace kvcache::cuda {

__device__ __forceinline__ float load_any(const void* p, int64_t i, DType t) {
  switch (t) {
    case DType::kFloat32: return static_cast<const float*>(p)[i];
    case DType::kFloat16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  }
}

__device__ __forceinline__ void store_any(void* p, int64_t i, DType t, float v) {
  switch (t) {
    case DType::kFloat32: static_cast<float*>(p)[i] = v; break;
    case DType::kFloat16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    default: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
  }
}

/// A float as element type Out (of a shared-memory tile, an mma fragment), rounded to nearest even.
template <typename Out>
__device__ __forceinline__ Out from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

}  // namespace kvcache::cuda
