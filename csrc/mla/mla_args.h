// Arguments and work items of absorbed MLA attention (mla_attention), shared by the CPU and CUDA kernels.
// Torch-free.
//
// Semantics (the reference is kvcache.reference.mla_attention): an MLA model caches per token and kv head a
// latent c (latent_dim = kv_lora_rank values, the K pool) and its rotated key part k_rope (rope_dim values, the
// V pool). Query head hq (kv head hq / group) of the query at position p = kv_len - q_len + i scores key j <= p
// as  s = scale * (q_latent . c_j + q_rope . k_rope_j)  and its output is  sum_j softmax(s)_j c_j  (latent_dim
// values; the caller projects it through W_UV). A row that sees no key gets output 0 and lse -inf.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/kv_format.h"
#include "core/paged_layout.h"

namespace kvcache {

struct MlaArgs {
  const void* q_latent = nullptr;  // [total_q, q_heads, latent_dim], element strides below
  int64_t ql_strides[3] = {};
  const void* q_rope = nullptr;    // [total_q, q_heads, rope_dim]
  int64_t qr_strides[3] = {};
  DType q_dtype = DType::kFloat32;
  // The pools: latent (K side) [num_blocks, kv_heads, page_size, latent_dim] and rope (V side) [..., rope_dim].
  const void* latent_cache = nullptr;
  const void* rope_cache = nullptr;
  DType latent_dtype = DType::kFloat32, rope_dtype = DType::kFloat32;  // of full-precision pools
  KVKind latent_kind = KVKind::kFull, rope_kind = KVKind::kFull;
  const float* latent_scale = nullptr;  // quantized pools: see core/kv_format.h
  const float* rope_scale = nullptr;
  PagedLayout layout;                   // head_dim = latent_dim, v_head_dim = rope_dim
  const int32_t* block_tables = nullptr;  // [batch, max_blocks]
  int64_t table_stride = 0;
  const int32_t* kv_lens = nullptr;       // [batch]
  const int32_t* cu_q_lens = nullptr;     // [batch + 1]
  int64_t batch = 0;
  int64_t total_q = 0;
  int64_t q_heads = 0;
  int64_t group = 1;                      // q_heads / kv_heads
  float scale = 1.f;
  void* out = nullptr;                    // [total_q, q_heads, latent_dim], contiguous, q_dtype
  float* lse = nullptr;                   // [total_q, q_heads] or null

  int64_t latent_dim() const { return layout.head_dim; }
  int64_t rope_dim() const { return layout.v_head_dim; }
};

/// One CPU work item: query tokens [tok_begin, tok_end) of sequence `seq` with every query head of kv head
/// `head`, against keys [kv_begin, kv_end). Rows are token-major: row r is token tok_begin + r / group,
/// query head head * group + r % group. A task of a split (partial >= 0) writes its state to partial slot
/// `partial` instead of the output.
struct MlaTask {
  int32_t seq, head, tok_begin, tok_end, kv_begin, kv_end, partial;
};

/// A (sequence, kv head, token block) whose keys were split over `num_slots` tasks, slots first_slot...
struct MlaSplit {
  int32_t seq, head, tok_begin, tok_end, first_slot, num_slots;
};

}  // namespace kvcache
