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

/// Row-major bf16 x bf16 -> fp32 GEMM, the same contract as GemmF32 with bf16 bits for A and B: products
/// exact, sums in fp32 (as vdpbf16ps).
using GemmBf16 = void (*)(bool b_transposed, int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                          const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc);

/// The alternative paths a CPU attention call's tasks may take: BLAS entry points (either may be null: then
/// the register kernel), and whether the avx512bf16 build multiplies bf16 values with vdpbf16ps.
struct CpuPaths {
  GemmF32 f32 = nullptr;    // fp32 prefill products (non-AVX-512 builds)
  GemmBf16 bf16 = nullptr;  // bf16 pages with a bf16 query (the avx512bf16 build)
  bool bf16_dot = true;     // bf16 and fp8 pages with a bf16 query: vdpbf16ps, else fp32 FMAs (avx512bf16 build)
};

/// MKL's gemm_bf16bf16f32 as a GemmBf16 where the bf16 prefill takes it, else null. By default on CPUs with
/// AMX-BF16 (tile matrix units, which the register kernel does not use: ~5-10x its products there);
/// set_bf16_gemm overrides that (the tests run both paths on any CPU).
GemmBf16 bf16_gemm();
/// -1: the default above, 0: never, 1: wherever torch's MKL exports the routine.
void set_bf16_gemm(int mode);
/// Whether torch's BLAS exports the bf16 GEMM at all.
bool bf16_gemm_available();

/// Whether the avx512bf16 build takes vdpbf16ps for bf16 and fp8 pages with a bf16 query (else the fp32 FMAs
/// of the avx512 build, on the same pages). By default everywhere but on Intel cores: there vdpbf16ps retires
/// one per two cycles against two 16-lane FMAs per cycle, so widening bf16 to fp32 (two shifts) and FMAs
/// is the faster way to the same exact products (Xeon with AMX, family 6 model 207: q.k of a GQA group of
/// 4, 128 dims, from L1: 13.2 ns per key with vdpbf16ps, 10.7 with FMAs); on Zen 4 / 5 the dot products win.
bool bf16_dot();
/// -1: the default above, 0: never, 1: always (where the build has them).
void set_bf16_dot(int mode);

}  // namespace kvcache::cpu
