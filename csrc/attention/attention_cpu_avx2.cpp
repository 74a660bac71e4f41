// The CPU attention kernel built for one instruction set (avx2); see attention_cpu_kernel.h.
#define KVC_ISA avx2
#include "attention/attention_cpu_kernel.h"
#include "attention/attention_cpu_isa.h"

namespace kvcache::cpu {
void run_attention_task_avx2(const AttentionArgs& a, const AttentionTask& t, const PartialStates& p, const CpuPaths& paths) {
  avx2::run_task(a, t, p, paths);
}
}  // namespace kvcache::cpu
