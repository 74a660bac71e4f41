// Validation and argument packing of the cache ops, shared by the CPU and the CUDA registrations.
// Everything is checked before the first write, so a rejected call leaves the pools untouched.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "cache/cache_args.h"

namespace kvcache {

/// Checks a K/V pool pair ([num_blocks, num_kv_heads, page_size, head_dim] each) and returns its layout.
PagedLayout check_pools(const at::Tensor& k_cache, const at::Tensor& v_cache, const char* k_name = "k_cache",
                        const char* v_name = "v_cache");

/// The storage format of the K and V pools of a call: kinds (core/kv_format.h) and scale tensors.
struct PoolFormats {
  KVKind k_kind = KVKind::kFull, v_kind = KVKind::kFull;
  bool k_rot = false, v_rot = false;  // Hadamard-rotated rows (kRotatedFlag)
  const std::optional<at::Tensor>* k_scale = nullptr;
  const std::optional<at::Tensor>* v_scale = nullptr;
  bool quantized() const { return k_kind != KVKind::kFull || v_kind != KVKind::kFull; }
};

PoolFormats make_formats(int64_t k_format, int64_t v_format, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& v_scale);

/// check_pools for any storage format: codes dtypes, scale tensors' dtype/shape/device.
PagedLayout check_formatted_pools(const at::Tensor& k_cache, const at::Tensor& v_cache, const PoolFormats& f);

AppendArgs prepare_append(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& slot_mapping, const PoolFormats& f = {});

/// append on a plan (plan/step_plan.h): the same checks but no slot reads; the slots are the plan's, validated
/// when it was made.
AppendArgs prepare_append_planned(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& plan_host,
                                  const at::Tensor& plan_device, const PoolFormats& f, int64_t k_format,
                                  int64_t v_format, int64_t backend);

/// The values of a slot_mapping [rows, q_len] (host pointer): -1 or a slot of the pool, none twice; KIVI keys
/// are written whole pages. Raises IndexError / ValueError.
void check_slot_values(const int64_t* slots, int64_t rows, int64_t q_len, const PagedLayout& layout, KVKind k_kind);

GatherArgs prepare_gather(const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& k_out, const at::Tensor& v_out, const PoolFormats& f = {});

GatherArgs prepare_gather_ragged(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& block_tables, const at::Tensor& cu_seq_lens,
                                 const at::Tensor& k_out, const at::Tensor& v_out, const PoolFormats& f = {});

/// copy_blocks (src == dst pools) and swap_blocks (src and dst pools may live on different devices).
/// `block_mapping` must be the CPU copy of the mapping; its pointer goes into the result.
BlockCopyArgs prepare_block_copy(const at::Tensor& k_src, const at::Tensor& v_src, const at::Tensor& k_dst,
                                 const at::Tensor& v_dst, const at::Tensor& block_mapping,
                                 bool same_pool);

/// swap_blocks: distinct src and dst pools of one block shape; the mapping must be a contiguous CPU tensor that
/// the caller keeps alive until the copies are done (its pointer goes into the result: pass a local
/// `block_mapping.contiguous()`, never a temporary).
BlockCopyArgs prepare_swap(const at::Tensor& k_src, const at::Tensor& v_src, const at::Tensor& k_dst,
                           const at::Tensor& v_dst, const at::Tensor& block_mapping);

/// Size in bytes of one element of a supported KV dtype (float32, float16, bfloat16).
int kv_element_bytes(const at::Tensor& cache);

}  // namespace kvcache
