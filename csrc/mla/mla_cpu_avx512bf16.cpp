// The CPU MLA kernel built for one instruction set (avx512bf16); see mla_cpu_kernel.h.
#define KVC_ISA avx512bf16
#include "mla/mla_cpu_kernel.h"

namespace kvcache::cpu {
void run_mla_task_avx512bf16(const MlaArgs& a, const MlaTask& t, const MlaPartials& p, GemmF32 gemm) {
  avx512bf16::mla::run_task(a, t, p, gemm);
}
}  // namespace kvcache::cpu
