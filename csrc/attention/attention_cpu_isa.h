// Entry points of the per-instruction-set builds of the CPU attention kernel.
#pragma once

#include "attention/attention_args.h"
#include "attention/attention_cpu_gemm.h"

namespace kvcache::cpu {

/// Runs one task; `blas`'s entry points may be null (then no task takes that GEMM path).
using AttentionTaskFn = void (*)(const AttentionArgs&, const AttentionTask&, const PartialStates&, const Blas& blas);

void run_attention_task_avx512bf16(const AttentionArgs& a, const AttentionTask& t, const PartialStates& p, const Blas& blas);
void run_attention_task_avx512(const AttentionArgs& a, const AttentionTask& t, const PartialStates& p, const Blas& blas);
void run_attention_task_avx2(const AttentionArgs& a, const AttentionTask& t, const PartialStates& p, const Blas& blas);
void run_attention_task_generic(const AttentionArgs& a, const AttentionTask& t, const PartialStates& p, const Blas& blas);

}  // namespace kvcache::cpu
