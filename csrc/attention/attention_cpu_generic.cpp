// The CPU attention kernel built for one instruction set (generic); see attention_cpu_kernel.h.
#define KVC_ISA generic
#include "attention/attention_cpu_kernel.h"
#include "attention/attention_cpu_isa.h"

namespace kvcache::cpu {
void run_attention_task_generic(const AttentionArgs& a, const AttentionTask& t, const PartialStates& p, const CpuPaths& paths) {
  generic::run_task(a, t, p, paths);
}
}  // namespace kvcache::cpu
