// Kernel launches are written KVC_LAUNCH(grid, block, stream, kernel)(args...) and shared arrays
// KVC_SHARED(type, name, [dims]): plain CUDA under nvcc, and csrc/cuda_emulation's CPU emulator when
// the kernels are built as C++ for the emulation tests (no GPU where this library is developed).
// kvc_ctas_per_sm(kernel, threads): how many CTAs of `kernel` an SM of the current device holds at once.
#pragma once

#if defined(__CUDACC__)
#define KVC_LAUNCH(grid, block, stream, ...) __VA_ARGS__<<<(grid), (block), 0, (stream)>>>
#define KVC_SHARED(type, name, dims) __shared__ type name dims
template <class Kernel>
inline int kvc_ctas_per_sm(Kernel kernel, int threads) {
  int n = 0;  // registers, shared memory and the CTA / warp limits of the device, as the occupancy calculator
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0) == cudaSuccess && n > 0 ? n : 1;
}
#else
#include "cuda_emulation/emulator.h"
#endif

// The caller's line, for the emulator's access log (emu::log_global_load, emu::log_shared_load): a load's
// call site.
#if defined(__CUDACC__)
#define KVC_CALL_SITE 0
#else
#define KVC_CALL_SITE __builtin_LINE()
#endif

namespace kvcache::cuda {

/// *p, a load from shared memory the emulator's access log sees, for its bank-conflict count (issue #23,
/// check 4). Under nvcc a plain load. `site`: leave it.
template <class T>
__device__ __forceinline__ T shared_load(const T* p, [[maybe_unused]] int site = KVC_CALL_SITE) {
#if !defined(__CUDACC__)
  ::kvcache::emu::log_shared_load(site, p, sizeof(T));
#endif
  return *p;
}

}  // namespace kvcache::cuda
