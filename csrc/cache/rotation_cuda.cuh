// Hadamard rotation (core/quant.h: rotate / unrotate) of a row held by one warp: lane `lane` holds
// dims lane + 32 k in x[k]. Same butterflies in the same order as quant::fwht, so results are
// bit-identical to the CPU and to PyTorch. Every lane of the warp must call these together.
#pragma once

#include <cstdint>

#include "core/quant.h"

namespace kvcache::cuda {

/// The butterflies between registers k and k + kHk (k & kHk == 0) for the runtime stride hk = kHk, found by
/// recursion over the powers of two below N. NOTE: every index is a constant: a runtime x[k + hk] made ptxas
/// keep x in a stack frame (append_quantized_kernel: 32 bytes, 130 local loads and 141 local stores).
template <int N, int kHk = 1>
__device__ __forceinline__ void register_butterflies(float (&x)[N], int hk) {
  if constexpr (kHk < N) {
    if (hk != kHk) return register_butterflies<N, 2 * kHk>(x, hk);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if ((k & kHk) == 0 && k + kHk < N) {
        const float a = x[k], b = x[k + kHk];
        x[k] = a + b;
        x[k + kHk] = a - b;
      }
    }
  }
}

template <int N>
__device__ __forceinline__ void warp_fwht(float (&x)[N], int64_t D, int lane) {
  // Butterflies across lanes (h < 32): the lower dim of a pair computes a + b, the upper a - b.
  for (int h = 1; h < 32 && h < D; h <<= 1) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float other = __shfl_xor_sync(0xffffffffu, x[k], h);
      x[k] = (lane & h) ? other - x[k] : x[k] + other;
    }
  }
  // Butterflies across registers (h >= 32): dims lane + 32 k and lane + 32 (k + h / 32).
  for (int64_t h = 32; h < D; h <<= 1) register_butterflies(x, static_cast<int>(h / 32));
}

/// `lane`, opaque to the compiler: the signs computed from it are recomputed at each call instead of hoisted
/// out of the caller's loops. (Hoisted out of attention_kernel's passes, the 8 signs of a 256-dim row were held
/// across the whole pass, and at 168 registers ptxas spilled them: KIVI instances on sm_90a.)
__device__ __forceinline__ int opaque_lane(int lane) {
#if defined(__CUDA_ARCH__)
  asm volatile("" : "+r"(lane));
#endif
  return lane;
}

template <int N>
__device__ __forceinline__ void warp_rotate(float (&x)[N], int64_t D, int lane) {
  const int l = opaque_lane(lane);
#pragma unroll
  for (int k = 0; k < N; ++k) x[k] *= quant::rot_sign(l + 32 * k);
  warp_fwht(x, D, lane);
  const float c = quant::rot_forward_scale(D);
#pragma unroll
  for (int k = 0; k < N; ++k) x[k] *= c;
}

template <int N>
__device__ __forceinline__ void warp_unrotate(float (&x)[N], int64_t D, int lane) {
  warp_fwht(x, D, lane);
  const float inv = quant::rot_inverse_scale(D);
  const int l = opaque_lane(lane);
#pragma unroll
  for (int k = 0; k < N; ++k) x[k] *= inv * quant::rot_sign(l + 32 * k);
}

}  // namespace kvcache::cuda
