// Portability macros for code that is compiled by both the host compiler and nvcc.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define KVC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVC_HOST_DEVICE inline
#endif
