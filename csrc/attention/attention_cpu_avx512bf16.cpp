// The CPU attention kernel built for one instruction set (avx512 + bf16 dot products); see attention_cpu_kernel.h.
#define KVC_ISA avx512bf16
#include "attention/attention_cpu_kernel.h"
#include "attention/attention_cpu_isa.h"

namespace kvcache::cpu {
void run_attention_task_avx512bf16(const AttentionArgs& a, const AttentionTask& t, const PartialStates& p, const CpuPaths& paths) {
  avx512bf16::run_task(a, t, p, paths);
}
}  // namespace kvcache::cpu
