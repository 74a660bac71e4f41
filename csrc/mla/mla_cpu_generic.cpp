// The CPU MLA kernel built for one instruction set (generic); see mla_cpu_kernel.h.
#define KVC_ISA generic
#include "mla/mla_cpu_kernel.h"

namespace kvcache::cpu {
void run_mla_task_generic(const MlaArgs& a, const MlaTask& t, const MlaPartials& p, GemmF32 gemm) {
  generic::mla::run_task(a, t, p, gemm);
}
}  // namespace kvcache::cpu
