// CPU registration of mla_attention: validate, plan the tasks (token blocks of whole GQA groups; keys split
// over the threads when there are fewer blocks than threads), run them on torch's thread pool, merge the
// split states.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "attention/attention_cpu.h"
#include "attention/run_dynamic.h"
#include "core/softmax_state.h"
#include "mla/mla_cpu.h"
#include "mla/mla_prepare.h"

namespace kvcache::cpu {
namespace {

constexpr int64_t kRowsPerTask = 128;    // query rows (token x head) per task: one BLAS-sized block
constexpr int64_t kMinSplitKeys = 256;   // a split task reads at least this many keys

MlaTaskFn mla_task_fn() {
  switch (current_isa()) {  // the attention kernel's choice (kvcache.set_cpu_isa applies to both)
    case Isa::kAvx512Bf16: return run_mla_task_avx512bf16;
    case Isa::kAvx512: return run_mla_task_avx512;
    case Isa::kAvx2: return run_mla_task_avx2;
    default: return run_mla_task_generic;
  }
}

struct MlaPlan {
  std::vector<MlaTask> tasks;
  std::vector<MlaSplit> splits;
  int64_t rows_per_slot = 0, num_slots = 0;
};

/// Tasks of `tokens`-token blocks per (sequence, kv head); when they are fewer than twice the threads
/// (decode), each block's keys are split so that every thread has work.
MlaPlan plan_mla(const MlaArgs& a, const AttentionHostInfo& host, int64_t threads) {
  const int64_t H = a.layout.num_kv_heads, G = a.group;
  const int64_t tokens = std::max<int64_t>(1, kRowsPerTask / G);
  int64_t blocks = 0;
  for (int64_t b = 0; b < a.batch; ++b) blocks += H * ((host.q_lens[b] + tokens - 1) / tokens);
  const int64_t want = blocks > 0 ? (2 * threads + blocks - 1) / blocks : 1;
  MlaPlan plan;
  plan.rows_per_slot = tokens * G;
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t q_len = host.q_lens[b], kv_len = host.kv_lens[b];
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t t0 = 0; t0 < q_len; t0 += tokens) {
        const int64_t t1 = std::min(q_len, t0 + tokens);
        const int64_t keys = kv_len - q_len + t1;  // what the block's last token sees
        const int64_t parts = std::clamp<int64_t>(keys / kMinSplitKeys, 1, want);
        if (parts == 1) {
          plan.tasks.push_back({int32_t(b), int32_t(h), int32_t(t0), int32_t(t1), 0, int32_t(keys), -1});
          continue;
        }
        const int64_t chunk = (keys + parts - 1) / parts;
        plan.splits.push_back({int32_t(b), int32_t(h), int32_t(t0), int32_t(t1), int32_t(plan.num_slots), int32_t(parts)});
        for (int64_t p = 0; p < parts; ++p) {
          plan.tasks.push_back({int32_t(b), int32_t(h), int32_t(t0), int32_t(t1), int32_t(p * chunk),
                                int32_t(std::min(keys, (p + 1) * chunk)), int32_t(plan.num_slots++)});
        }
      }
    }
  }
  return plan;
}

void mla_attention_cpu(const at::Tensor& q_latent, const at::Tensor& q_rope, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                       const at::Tensor& cu_q_lens, double scale, at::Tensor& out, const std::optional<at::Tensor>& lse,
                       const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                       int64_t k_format, int64_t v_format) {
  AttentionHostInfo host;
  const MlaArgs a = prepare_mla_attention(q_latent, q_rope, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale,
                                          out, lse, k_scale, v_scale, k_format, v_format, &host);
  const MlaPlan plan = plan_mla(a, host, at::get_num_threads());
  const int64_t Dl = a.latent_dim(), G = a.group;
  at::Tensor part_o, part_lse;
  MlaPartials part;
  if (plan.num_slots > 0) {
    part_o = at::empty({plan.num_slots, plan.rows_per_slot, Dl}, q_latent.options().dtype(at::kFloat));
    part_lse = at::empty({plan.num_slots, plan.rows_per_slot}, q_latent.options().dtype(at::kFloat));
    part = {part_o.data_ptr<float>(), part_lse.data_ptr<float>(), plan.rows_per_slot};
  }
  const MlaTaskFn fn = mla_task_fn();
  const GemmF32 gemm = blas_gemm();
  run_dynamic(static_cast<int64_t>(plan.tasks.size()), [&](int64_t i) { fn(a, plan.tasks[i], part, gemm); });

  run_dynamic(static_cast<int64_t>(plan.splits.size()), [&](int64_t i) {  // merge each split's states
    const MlaSplit& sp = plan.splits[i];
    const int64_t q_start = a.cu_q_lens[sp.seq], rows = int64_t(sp.tok_end - sp.tok_begin) * G;
    std::vector<float> acc(Dl);
    for (int64_t r = 0; r < rows; ++r) {
      const float acc_lse = merge_slot_rows(part.o, part.lse, part.rows_per_slot, Dl, sp.first_slot, sp.num_slots, r,
                                            acc.data());
      const int64_t row = (q_start + sp.tok_begin + r / G) * a.q_heads + sp.head * G + r % G;
      store_row_from_float(a.out, row * Dl, a.q_dtype, acc.data(), Dl);
      if (a.lse != nullptr) a.lse[row] = acc_lse;
    }
  });
}

}  // namespace
}  // namespace kvcache::cpu

namespace kvcache {
TORCH_LIBRARY_IMPL(kvcache, CPU, m) { m.impl("mla_attention", &cpu::mla_attention_cpu); }
}  // namespace kvcache
