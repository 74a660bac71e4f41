// CPU registrations of the cache ops: validate (cache_prepare), then run the kernels of
// cache_cpu_kernels.h over torch's intra-op thread pool.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cache/cache_cpu_kernels.h"
#include "cache/cache_prepare.h"
#include "core/check.h"
#include "plan/step_plan.h"

namespace kvcache {
namespace {

// Runs fn<U>(args, begin, end) over [0, n) on the thread pool, with U the element's bit width.
template <template <typename> class Fn, typename Args>
void run_by_width(int elem_bytes, const Args& args, int64_t n, int64_t grain) {
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    if (elem_bytes == 4) {
      Fn<uint32_t>::run(args, begin, end);
    } else {
      Fn<uint16_t>::run(args, begin, end);
    }
  });
}

template <typename U> struct AppendFn { static void run(const AppendArgs& a, int64_t b, int64_t e) { cpu::append_rows<U>(a, b, e); } };
template <typename U> struct PaddedFn { static void run(const GatherArgs& a, int64_t b, int64_t e) { cpu::gather_padded<U>(a, b, e); } };
template <typename U> struct RaggedFn { static void run(const GatherArgs& a, int64_t b, int64_t e) { cpu::gather_ragged<U>(a, b, e); } };

void run_append(const AppendArgs& a, const PoolFormats& f, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const int64_t rows = a.batch * a.q_len * a.layout.num_kv_heads;
  if (f.quantized()) {
    const int elem = static_cast<int>(f.k_kind == KVKind::kFull ? k_cache.element_size() : v_cache.element_size());
    at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) { cpu::append_rows_quantized(a, elem, b, e); });
    if (is_kivi(f.k_kind)) {
      const int64_t pages = a.batch * (a.q_len / a.layout.page_size) * a.layout.num_kv_heads;
      at::parallel_for(0, pages, 1, [&](int64_t b, int64_t e) { cpu::append_kivi_key_pages(a, b, e); });
    }
    return;
  }
  run_by_width<AppendFn>(kv_element_bytes(k_cache), a, rows, /*grain=*/256);
}

void append_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
                const std::optional<at::Tensor>& v_scale, int64_t k_format, int64_t v_format) {
  const PoolFormats f = make_formats(k_format, v_format, k_scale, v_scale);
  run_append(prepare_append(key, value, k_cache, v_cache, slot_mapping, f), f, k_cache, v_cache);
}

void append_planned_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                        const at::Tensor& plan_host, const at::Tensor& plan_device,
                        const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                        int64_t k_format, int64_t v_format) {
  const PoolFormats f = make_formats(k_format, v_format, k_scale, v_scale);
  run_append(prepare_append_planned(key, value, k_cache, v_cache, plan_host, plan_device, f, k_format, v_format,
                                    kPlanForCpu),
             f, k_cache, v_cache);
}

void paged_gather_cpu(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, at::Tensor& k_out, at::Tensor& v_out,
                      const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                      int64_t k_format, int64_t v_format) {
  const PoolFormats f = make_formats(k_format, v_format, k_scale, v_scale);
  const GatherArgs a = prepare_gather(k_cache, v_cache, block_tables, seq_lens, k_out, v_out, f);
  if (f.quantized()) {
    at::parallel_for(0, a.batch * a.layout.num_kv_heads, 1,
                     [&](int64_t b, int64_t e) { cpu::gather_padded_dequantized(a, b, e); });
    return;
  }
  run_by_width<PaddedFn>(kv_element_bytes(k_cache), a, a.batch * a.layout.num_kv_heads, /*grain=*/1);
}

void paged_gather_ragged_cpu(const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, const at::Tensor& cu_seq_lens, at::Tensor& k_out,
                             at::Tensor& v_out, const std::optional<at::Tensor>& k_scale,
                             const std::optional<at::Tensor>& v_scale, int64_t k_format, int64_t v_format) {
  const PoolFormats f = make_formats(k_format, v_format, k_scale, v_scale);
  const GatherArgs a = prepare_gather_ragged(k_cache, v_cache, block_tables, cu_seq_lens, k_out, v_out, f);
  if (f.quantized()) {
    at::parallel_for(0, a.batch * a.layout.num_kv_heads, 1,
                     [&](int64_t b, int64_t e) { cpu::gather_ragged_dequantized(a, b, e); });
    return;
  }
  run_by_width<RaggedFn>(kv_element_bytes(k_cache), a, a.batch * a.layout.num_kv_heads, /*grain=*/1);
}

void copy_blocks_cpu(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& block_mapping) {
  KVC_CHECK_SAME_DEVICE(block_mapping, k_cache);
  const at::Tensor mapping = block_mapping.contiguous();
  const BlockCopyArgs a = prepare_block_copy(k_cache, v_cache, k_cache, v_cache, mapping, /*same_pool=*/true);
  at::parallel_for(0, a.n, 8, [&](int64_t b, int64_t e) { cpu::copy_block_pairs(a, b, e); });
}

void swap_blocks_cpu(const at::Tensor& k_src, const at::Tensor& v_src, at::Tensor& k_dst, at::Tensor& v_dst,
                     const at::Tensor& block_mapping) {
  // Dispatch lands here only when every tensor is on the CPU: a host <-> host swap.
  const at::Tensor mapping = block_mapping.contiguous();
  const BlockCopyArgs a = prepare_swap(k_src, v_src, k_dst, v_dst, mapping);
  at::parallel_for(0, a.n, 8, [&](int64_t b, int64_t e) { cpu::copy_block_pairs(a, b, e); });
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcache, CPU, m) {
  m.impl("append", &append_cpu);
  m.impl("append_planned", &append_planned_cpu);
  m.impl("paged_gather", &paged_gather_cpu);
  m.impl("paged_gather_ragged", &paged_gather_ragged_cpu);
  m.impl("copy_blocks", &copy_blocks_cpu);
  m.impl("swap_blocks", &swap_blocks_cpu);
}

}  // namespace kvcache
