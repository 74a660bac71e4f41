// The CPU MLA kernel built for one instruction set (avx2); see mla_cpu_kernel.h.
#define KVC_ISA avx2
#include "mla/mla_cpu_kernel.h"

namespace kvcache::cpu {
void run_mla_task_avx2(const MlaArgs& a, const MlaTask& t, const MlaPartials& p, GemmF32 gemm) {
  avx2::mla::run_task(a, t, p, gemm);
}
}  // namespace kvcache::cpu
