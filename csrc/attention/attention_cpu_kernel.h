// The CPU paged-attention kernel: one AttentionTask at a time, online softmax, fp32 accumulation.
//
// Written once with GCC vector extensions (16-lane float vectors) and intrinsics, and compiled four
// times, by attention_cpu_{avx512bf16,avx512,avx2,generic}.cpp, each with its own instruction-set flags
// and namespace (KVC_ISA); attention_cpu.cpp picks the best one the machine supports at run time.
//
// How a task runs: its rows are (query token, head of the GQA group) pairs; they are processed in
// register blocks of 1-4 rows against tiles of 16 keys. Each K/V tile is read from the pages once per task (and once
// per KV head: every query head of the group shares it), converted to fp32 in registers, never
// written anywhere. Scores use the dot-product form (q.k along head_dim, then a 16-way reduction
// tree), so K is consumed in its stored layout; P.V accumulates straight into the output rows.
//
// NOTE: bfloat16 rows are widened without shuffles: a 64-byte load of 32 bf16 values, shifted left
// 16 bits, gives the even dims as fp32; masked, the odd dims. Queries and outputs are kept in the same
// even/odd order ("storage order"), so dot products need no reordering; outputs are put back in
// natural order once, at the end of the task.
//
// The parts, in csrc/attention/cpu_kernel/ (each includes the ones before it):
//   simd.h             vector types, exp, reductions
//   kv_readers.h       a stored row of any format as fp32 vectors
//   task_state.h       query rows, softmax state, prefetcher, scratch, writing a task's result
//   policies_16lane.h  q.k and P.V for AVX-512 (fp32 FMA, bf16 and byte dot products) and generic builds
//   policies_avx2.h    q.k and P.V for AVX2 (8-lane register tiles)
//   task_loop.h        tiles, masks, online softmax; the scalar loop for any head_dim
//   prefill_gemm.h     chunked prefill through BLAS (non-AVX-512 builds)
//   dispatch.h         run_task: the reader, policies and block size for a task
#pragma once

#ifndef KVC_ISA
#error "define KVC_ISA (the namespace of this instruction-set build) before including this header"
#endif

#include "attention/cpu_kernel/dispatch.h"
