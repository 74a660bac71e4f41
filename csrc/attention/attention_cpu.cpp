// CPU registrations of paged_attention and merge_states: validate, plan the tasks (split-K for
// decode, query blocks for prefill), run them on torch's thread pool with dynamic scheduling, and
// merge the split partial states.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <string>

#include "attention/attention_cpu.h"
#include "attention/attention_cpu_isa.h"
#include "attention/attention_prepare.h"
#include "attention/run_dynamic.h"
#include "core/check.h"
#include "core/softmax_state.h"
#include "plan/step_plan.h"

// The Fortran BLAS sgemm that the PyTorch x86 wheels export (MKL, LP64). Weak: a torch built
// without it leaves this null, and prefill takes the register kernel instead.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

// MKL's bf16 GEMM (cblas_gemm_bf16bf16f32; the enums passed as their int values), weak for the same reason.
extern "C" void cblas_gemm_bf16bf16f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                                       const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta, float* c,
                                       int ldc) __attribute__((weak));

namespace kvcache {
namespace cpu {
namespace {

std::atomic<int> g_isa{-1};  // -1: not chosen yet
std::atomic<int> g_bf16_gemm{-1};  // set_bf16_gemm's mode
std::atomic<int> g_bf16_dot{-1};   // set_bf16_dot's mode

/// GemmBf16 on MKL (row-major, so no transposition of the layout).
void blas_gemm_bf16(bool b_transposed, int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                    const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // CBLAS_LAYOUT, CBLAS_TRANSPOSE
  cblas_gemm_bf16bf16f32(kRowMajor, kNoTrans, b_transposed ? kTrans : kNoTrans, static_cast<int>(m),
                         static_cast<int>(n), static_cast<int>(k), 1.f, a, static_cast<int>(lda), b,
                         static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

bool cpu_has_amx_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("amx-bf16");
}

/// GemmF32 on BLAS. Column-major BLAS sees row-major X as X^T, so it computes C^T = op(B)^T . A^T.
void blas_gemm_f32(bool b_transposed, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                   const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const char ta = b_transposed ? 'T' : 'N', tb = 'N';
  const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
  const int LDA = static_cast<int>(ldb), LDB = static_cast<int>(lda), LDC = static_cast<int>(ldc);
  const float one = 1.f;
  sgemm_(&ta, &tb, &M, &N, &K, &one, b, &LDA, a, &LDB, &beta, c, &LDC);
}

int best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma")) {
    // (the dot-product build also takes byte dot products, AVX512_VNNI, and byte lookups, AVX512_VBMI: every
    // CPU with BF16 has both but Cooper Lake, which takes the avx512 build)
    const bool dot = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni") &&
                     __builtin_cpu_supports("avx512vbmi");
    return static_cast<int>(dot ? Isa::kAvx512Bf16 : Isa::kAvx512);
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    return static_cast<int>(Isa::kAvx2);
  }
  return static_cast<int>(Isa::kGeneric);
}

AttentionTaskFn task_fn() {
  int isa = g_isa.load(std::memory_order_relaxed);
  if (isa < 0) {
    isa = best_isa();
    g_isa.store(isa);
  }
  switch (static_cast<Isa>(isa)) {
    case Isa::kAvx512Bf16: return run_attention_task_avx512bf16;
    case Isa::kAvx512: return run_attention_task_avx512;
    case Isa::kAvx2: return run_attention_task_avx2;
    default: return run_attention_task_generic;
  }
}

/// The CPU planner's options for a call: split decode keys over the threads, prefill in BLAS-sized row
/// blocks, and long decodes over a page's 32 KiB run of heads.
PlanOptions plan_options(const AttentionArgs& a) {
  PlanOptions opt;
  opt.parallelism = at::get_num_threads();
  opt.prefill_rows = 128;  // prefill goes through BLAS (attention_cpu_kernel.h): larger products
  if (a.k_kind == KVKind::kFull && a.v_kind == KVKind::kFull && a.kv_dtype == DType::kBFloat16 &&
      current_isa() == Isa::kAvx512Bf16 && bf16_gemm() != nullptr) {
    // bf16 pages through the bf16 GEMM (cpu_kernel/prefill_gemm.h): each task copies its keys once, so
    // fewer, taller tasks copy less (512 queries over 8k, Xeon with AMX: 129 ms at 128 rows, 100 at 512)
    opt.prefill_rows = 512;
  }
  const int64_t D = a.layout.head_dim;
  opt.decode_heads = decode_heads_per_page(a.layout, code_row_bytes(a.k_kind, D, a.kv_dtype),
                                           code_row_bytes(a.v_kind, D, a.kv_dtype));
  return opt;
}

/// Runs a plan's tasks and merges its split states into the output.
void run_plan(const AttentionArgs& a, const AttentionTask* tasks, int64_t num_tasks,
              const AttentionPlan::Split* splits, int64_t num_splits, int64_t rows_per_slot, int64_t num_slots,
              const at::TensorOptions& options) {
  at::Tensor part_o, part_lse;
  const PartialStates partial = allocate_partials(num_slots, rows_per_slot, a.layout.head_dim, options, &part_o, &part_lse);
  const AttentionTaskFn fn = task_fn();
  const CpuPaths paths{blas_gemm(), bf16_gemm(), bf16_dot()};
  run_dynamic(num_tasks, [&](int64_t i) { fn(a, tasks[i], partial, paths); });

  // Merge the split states of each (sequence, kv head) into the output.
  const int64_t G = a.group, D = a.layout.head_dim;
  run_dynamic(num_splits, [&](int64_t i) {
    const AttentionPlan::Split& sp = splits[i];
    const int64_t q_start = a.cu_q_lens[sp.seq], per_head = (a.cu_q_lens[sp.seq + 1] - q_start) * G;
    const int64_t rows = (sp.head_end - sp.head_begin) * per_head;
    std::vector<float> acc(D);
    for (int64_t r = 0; r < rows; ++r) {
      const float acc_lse = merge_slot_rows(partial.o, partial.lse, partial.rows_per_slot, D, sp.first_slot,
                                            sp.num_slots, r, acc.data());
      const int64_t h = sp.head_begin + r / per_head, local = r % per_head;
      const int64_t row = (q_start + local / G) * a.q_heads + h * G + local % G;
      store_row_from_float(a.out, row * D, a.q_dtype, acc.data(), D);
      if (a.lse) a.lse[row] = acc_lse;
    }
  });
}

void paged_attention_cpu(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_q_lens,
                         double scale, int64_t window_left, int64_t sink_tokens, double softcap, at::Tensor& out,
                         const std::optional<at::Tensor>& lse, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& v_scale, int64_t k_format, int64_t v_format) {
  AttentionHostInfo host;
  const AttentionArgs a = prepare_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale,
                                            window_left, sink_tokens, softcap, out, lse, &host,
                                            k_scale, v_scale, k_format, v_format);
  const AttentionPlan plan = make_attention_plan(a, host, plan_options(a));
  run_plan(a, plan.tasks.data(), static_cast<int64_t>(plan.tasks.size()), plan.splits.data(),
           static_cast<int64_t>(plan.splits.size()), plan.rows_per_slot, plan.num_slots, query.options());
}

void paged_attention_planned_cpu(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& plan_host, const at::Tensor& plan_device, double scale,
                                 int64_t window_left, int64_t sink_tokens, double softcap, at::Tensor& out,
                                 const std::optional<at::Tensor>& lse, const std::optional<at::Tensor>& k_scale,
                                 const std::optional<at::Tensor>& v_scale, int64_t k_format, int64_t v_format) {
  const StepPlanHeader* h = nullptr;
  const AttentionArgs a = prepare_attention_planned(query, k_cache, v_cache, plan_host, plan_device, scale,
                                                    window_left, sink_tokens, softcap, out, lse, k_scale, v_scale,
                                                    k_format, v_format, kPlanForCpu, &h);
  run_plan(a, plan_tasks(plan_host, *h, false), h->num_tasks, plan_splits(plan_host, *h, false), h->num_splits,
           h->rows_per_slot, h->num_slots, query.options());
}

std::tuple<at::Tensor, at::Tensor> plan_step_cpu(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                 const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                                 const at::Tensor& cu_q_lens,
                                                 const std::optional<at::Tensor>& slot_mapping, int64_t q_heads,
                                                 const std::optional<at::Tensor>& k_scale,
                                                 const std::optional<at::Tensor>& v_scale, int64_t k_format,
                                                 int64_t v_format) {
  return build_step_plan(k_cache, v_cache, block_tables, seq_lens, cu_q_lens, slot_mapping, q_heads, k_scale, v_scale,
                         k_format, v_format, kPlanForCpu, plan_options);
}

void merge_states_cpu(const at::Tensor& v_a, const at::Tensor& lse_a, const at::Tensor& v_b, const at::Tensor& lse_b,
                      at::Tensor& v_out, at::Tensor& lse_out) {
  check_merge_states(v_a, lse_a, v_b, lse_b, v_out, lse_out);
  const at::Tensor va = v_a.contiguous(), vb = v_b.contiguous();
  const at::Tensor la = lse_a.contiguous(), lb = lse_b.contiguous();
  const DType dt = to_dtype(v_a.scalar_type());
  const int64_t rows = v_a.size(0) * v_a.size(1), D = v_a.size(2);
  const float* pla = la.data_ptr<float>();
  const float* plb = lb.data_ptr<float>();
  float* plo = lse_out.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const MergeWeights w = merge_weights(pla[r], plb[r]);
      for (int64_t d = 0; d < D; ++d) {
        const float x = load_as_float(va.data_ptr(), r * D + d, dt), y = load_as_float(vb.data_ptr(), r * D + d, dt);
        store_from_float(v_out.data_ptr(), r * D + d, dt, w.w_a * x + w.w_b * y);
      }
      plo[r] = w.lse;
    }
  });
}

}  // namespace

GemmF32 blas_gemm() { return sgemm_ != nullptr ? blas_gemm_f32 : nullptr; }

bool bf16_gemm_available() { return cblas_gemm_bf16bf16f32 != nullptr; }

GemmBf16 bf16_gemm() {
  static const bool amx = cpu_has_amx_bf16();
  const int mode = g_bf16_gemm.load(std::memory_order_relaxed);
  const bool on = mode < 0 ? amx : mode > 0;
  return on && bf16_gemm_available() ? blas_gemm_bf16 : nullptr;
}

void set_bf16_gemm(int mode) {
  TORCH_CHECK_VALUE(mode >= -1 && mode <= 1, "set_bf16_gemm: mode must be -1, 0 or 1, got ", mode);
  g_bf16_gemm.store(mode);
}

bool bf16_dot() {
  static const bool intel = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  const int mode = g_bf16_dot.load(std::memory_order_relaxed);
  return mode < 0 ? !intel : mode > 0;
}

void set_bf16_dot(int mode) {
  TORCH_CHECK_VALUE(mode >= -1 && mode <= 1, "set_bf16_dot: mode must be -1, 0 or 1, got ", mode);
  g_bf16_dot.store(mode);
}

void set_isa(Isa isa) {
  const int best = best_isa();
  TORCH_CHECK_VALUE(static_cast<int>(isa) <= best, "this CPU does not support the requested instruction set");
  g_isa.store(static_cast<int>(isa));
}

Isa current_isa() {
  task_fn();
  return static_cast<Isa>(g_isa.load());
}

Isa best_supported_isa() { return static_cast<Isa>(best_isa()); }

}  // namespace cpu

TORCH_LIBRARY_IMPL(kvcache, CPU, m) {
  m.impl("paged_attention", &cpu::paged_attention_cpu);
  m.impl("paged_attention_planned", &cpu::paged_attention_planned_cpu);
  m.impl("plan_step", &cpu::plan_step_cpu);
  m.impl("merge_states", &cpu::merge_states_cpu);
}

}  // namespace kvcache
