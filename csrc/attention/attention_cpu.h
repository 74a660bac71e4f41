// Choosing the instruction set of the CPU attention kernel (for tests and benchmarks; the default is
// the best one the machine supports).
#pragma once

namespace kvcache::cpu {

enum class Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

void set_isa(Isa isa);
Isa current_isa();
Isa best_supported_isa();

}  // namespace kvcache::cpu
