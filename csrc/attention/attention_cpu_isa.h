// Entry points of the per-instruction-set builds of the CPU attention kernel.
#pragma once

#include "attention/attention_args.h"

namespace kvcache::cpu {

using AttentionTaskFn = void (*)(const AttentionArgs&, const AttentionTask&, const PartialStates&);

void run_attention_task_avx512bf16(const AttentionArgs& a, const AttentionTask& t, const PartialStates& p);
void run_attention_task_avx512(const AttentionArgs& a, const AttentionTask& t, const PartialStates& p);
void run_attention_task_avx2(const AttentionArgs& a, const AttentionTask& t, const PartialStates& p);
void run_attention_task_generic(const AttentionArgs& a, const AttentionTask& t, const PartialStates& p);

}  // namespace kvcache::cpu
