// The BLAS entry point handed to the torch-free CPU attention kernels (see attention_cpu.cpp).
#pragma once

#include <cstdint>

namespace kvcache::cpu {

/// Row-major fp32 GEMM: C[m, n] = A[m, k] . op(B) + beta * C, where op(B) = B^T for B stored [n, k]
/// (b_transposed) and B for B stored [k, n]. Leading dimensions are row strides in elements.
using GemmF32 = void (*)(bool b_transposed, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                         const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

/// The sgemm of the BLAS that torch links (MKL in the x86 wheels) as a GemmF32, or null when torch exports
/// none (defined in attention_cpu.cpp; the MLA kernel uses it too).
GemmF32 blas_gemm();

}  // namespace kvcache::cpu
