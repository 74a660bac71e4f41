// Entry points of the per-instruction-set builds of the CPU attention kernel.
#pragma once

#include "attention/attention_args.h"
#include "attention/attention_cpu_gemm.h"

namespace kvcache::cpu {

/// Runs one task; `paths` says which alternative paths it may take (a null GEMM: no task takes that path).
using AttentionTaskFn = void (*)(const AttentionArgs&, const AttentionTask&, const PartialStates&, const CpuPaths& paths);

void run_attention_task_avx512bf16(const AttentionArgs& a, const AttentionTask& t, const PartialStates& p, const CpuPaths& paths);
void run_attention_task_avx512(const AttentionArgs& a, const AttentionTask& t, const PartialStates& p, const CpuPaths& paths);
void run_attention_task_avx2(const AttentionArgs& a, const AttentionTask& t, const PartialStates& p, const CpuPaths& paths);
void run_attention_task_generic(const AttentionArgs& a, const AttentionTask& t, const PartialStates& p, const CpuPaths& paths);

}  // namespace kvcache::cpu
