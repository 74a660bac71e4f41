// Entry points of the per-instruction-set builds of the CPU MLA kernel (mla_cpu_kernel.h).
#pragma once

#include "attention/attention_cpu_gemm.h"
#include "mla/mla_args.h"

namespace kvcache::cpu {

/// Partial states of split tasks: o [num_slots, rows_per_slot, latent_dim], lse [num_slots, rows_per_slot].
struct MlaPartials {
  float* o = nullptr;
  float* lse = nullptr;
  int64_t rows_per_slot = 0;
};

/// Runs one task; `gemm` null: plain loops instead of BLAS.
using MlaTaskFn = void (*)(const MlaArgs&, const MlaTask&, const MlaPartials&, GemmF32 gemm);

void run_mla_task_avx512bf16(const MlaArgs& a, const MlaTask& t, const MlaPartials& p, GemmF32 gemm);
void run_mla_task_avx512(const MlaArgs& a, const MlaTask& t, const MlaPartials& p, GemmF32 gemm);
void run_mla_task_avx2(const MlaArgs& a, const MlaTask& t, const MlaPartials& p, GemmF32 gemm);
void run_mla_task_generic(const MlaArgs& a, const MlaTask& t, const MlaPartials& p, GemmF32 gemm);

}  // namespace kvcache::cpu
