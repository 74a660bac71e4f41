// Warp-level tensor-core primitives for the prefill kernels (issue #23): ldmatrix (shared memory to mma
// fragments) and mma.m16n8k16 with f32 accumulation, for f16 and bf16 inputs. Under nvcc: inline PTX,
// sm_80 and newer. Built as C++ against csrc/cuda_emulation: the emulator's warp-collective versions,
// which implement the PTX ISA's fragment layouts ("Matrix Fragments for mma.m16n8k16 with floating point
// type", "Warp-level matrix load instruction: ldmatrix"; csrc/tests/test_warp_mma.cpp checks them).
//
// Both are .sync.aligned: every lane of the warp must call them, at the same call site, with the same
// template arguments.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "core/cuda_launch.cuh"

namespace kvcache::cuda {

template <class T>
inline constexpr bool kMmaInput = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

/// d = A * B + c for one 16 x 8 tile of D with k = 16, in f32; T is __half or __nv_bfloat16. A lane's
/// fragments, with g = lane / 4, t = lane % 4, each register holding two elements (the first in its low
/// 16 bits, as two consecutive elements are in memory):
///   a[0] = A[g][2t, 2t+1]    a[1] = A[g+8][2t, 2t+1]    a[2] = A[g][2t+8, 2t+9]    a[3] = A[g+8][2t+8, 2t+9]
///   b[0] = B[2t, 2t+1][g]    b[1] = B[2t+8, 2t+9][g]
///   c[0], c[1] = C[g][2t, 2t+1]    c[2], c[3] = C[g+8][2t, 2t+1]    (d the same)
/// The summation order inside the tensor core is unspecified: compare with a tolerance, except where every
/// partial sum is exact (small integers).
template <class T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                             const float (&c)[4]) {
  static_assert(kMmaInput<T>, "mma_m16n8k16 multiplies __half or __nv_bfloat16 fragments");
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
  }
#else
  static_assert(!kMmaInput<T>, "mma.m16n8k16 with f32 accumulation needs sm_80 or newer");
#endif
#elif !defined(__CUDACC__)
  ::kvcache::emu::mma_m16n8k16(
      std::is_same_v<T, __nv_bfloat16> ? ::kvcache::emu::MmaInput::kBF16 : ::kvcache::emu::MmaInput::kF16, a, b,
      c, d);
#endif
}

/// Two values as one mma fragment register, the first in the low 16 bits (as in memory).
__device__ __forceinline__ uint32_t pack_pair(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  return uint32_t{__bfloat16_as_ushort(lo)} | (uint32_t{__bfloat16_as_ushort(hi)} << 16);
}
__device__ __forceinline__ uint32_t pack_pair(__half lo, __half hi) {
  return uint32_t{__half_as_ushort(lo)} | (uint32_t{__half_as_ushort(hi)} << 16);
}

namespace detail {

// The asm template must be a string literal per variant: one macro spells the six.
#define KVC_LDMATRIX_PTX(num, trans) "ldmatrix.sync.aligned.m8n8." num trans ".shared.b16 "

template <int N, bool kTrans>
__device__ __forceinline__ void ldmatrix_b16(uint32_t (&r)[N], const void* row) {
  static_assert(N == 1 || N == 2 || N == 4, "ldmatrix loads 1, 2 or 4 matrices");
#if defined(__CUDA_ARCH__)
  // sm_80, not ldmatrix's sm_75: before sm_80 the lanes from 8N on must hold valid addresses too, which
  // the callers here do not promise.
#if __CUDA_ARCH__ >= 800
  const auto p = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  // "memory": the load must stay after this thread's own stores to the tile.
  if constexpr (N == 1 && !kTrans) {
    asm volatile(KVC_LDMATRIX_PTX("x1", "") "{%0}, [%1];\n" : "=r"(r[0]) : "r"(p) : "memory");
  } else if constexpr (N == 1) {
    asm volatile(KVC_LDMATRIX_PTX("x1", ".trans") "{%0}, [%1];\n" : "=r"(r[0]) : "r"(p) : "memory");
  } else if constexpr (N == 2 && !kTrans) {
    asm volatile(KVC_LDMATRIX_PTX("x2", "") "{%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(p) : "memory");
  } else if constexpr (N == 2) {
    asm volatile(KVC_LDMATRIX_PTX("x2", ".trans") "{%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(p)
                 : "memory");
  } else if constexpr (!kTrans) {
    asm volatile(KVC_LDMATRIX_PTX("x4", "") "{%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(p)
                 : "memory");
  } else {
    asm volatile(KVC_LDMATRIX_PTX("x4", ".trans") "{%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(p)
                 : "memory");
  }
#else
  static_assert(N == 0, "ldmatrix without valid addresses in every lane needs sm_80 or newer");
#endif
#elif !defined(__CUDACC__)
  ::kvcache::emu::ldmatrix_b16(N, kTrans, row, r);
#endif
}

#undef KVC_LDMATRIX_PTX

}  // namespace detail

/// ldmatrix.sync.aligned.m8n8.xN.shared.b16: N 8 x 8 matrices of 16-bit elements from shared memory into
/// r[0, N). Lane l passes the address of row l % 8 of matrix l / 8 (16 contiguous bytes, 16-byte aligned;
/// lanes from 8N on pass anything). Lane l receives in r[m] the elements (l / 4, 2 (l % 4)) and
/// (l / 4, 2 (l % 4) + 1) of matrix m. For mma_m16n8k16:
///   a from a row-major 16 x 16 tile of A (m x k):  x4, lane l passing &A[l % 16][8 (l / 16)]
///   b from a row-major 8 x 16 tile of K (n x k), B = K^T:  x2, lane l < 16 passing &K[l % 8][8 (l / 8)]
template <int N>
__device__ __forceinline__ void ldmatrix(uint32_t (&r)[N], const void* row) {
  detail::ldmatrix_b16<N, false>(r, row);
}

/// ldmatrix ... .trans: the same addresses, each matrix transposed: lane l receives in r[m] the elements
/// (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4) of matrix m. For mma_m16n8k16's b from a row-major k x n
/// tile of B (V in attention's P V):
///   16 x 8:   x2, lane l < 16 passing &B[l][0]
///   16 x 16:  x4, lane l passing &B[l % 16][8 (l / 16)]; r[0, 2) is b for columns 0-7, r[2, 4) for 8-15
template <int N>
__device__ __forceinline__ void ldmatrix_trans(uint32_t (&r)[N], const void* row) {
  detail::ldmatrix_b16<N, true>(r, row);
}

}  // namespace kvcache::cuda
