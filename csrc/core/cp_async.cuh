// Asynchronous global-to-shared copies for the pipelined kernels (issue #23): cp.async.cg of 16 bytes,
// commit_group and wait_group (PTX ISA, "Data Movement and Conversion Instructions: cp.async",
// "cp.async.commit_group", "cp.async.wait_group"; sm_80 and newer). A copy's bytes may be read only after
// a wait_group that retires its group, and by other threads only after a barrier that follows that wait.
//
// Built as C++ against csrc/cuda_emulation, and under nvcc for an architecture without cp.async, the copy
// is done at once, which is one legal schedule of the asynchronous copy (it completes before any wait).
#pragma once

#include <cstdint>
#include <cstring>

#include "core/cuda_launch.cuh"

namespace kvcache::cuda {

/// Starts copying 16 bytes from global `src` to shared `dst`, both 16-byte aligned. `site`: leave it.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, [[maybe_unused]] int site = KVC_CALL_SITE) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned smem = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(src) : "memory");
#elif defined(__CUDA_ARCH__)
  *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
#elif !defined(__CUDACC__)  // the emulator (nvcc's host pass never runs a __device__ function)
  ::kvcache::emu::log_global_load(site, src, 16);
  std::memcpy(dst, src, 16);
#endif
}

/// Closes the group of this thread's copies started since the last commit (an empty group is legal).
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

/// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

}  // namespace kvcache::cuda
