// Plain argument structs of the cache ops (append, gather, block copies), shared by the CPU and the
// CUDA kernels. Torch-free: pointers, sizes and element strides only, validated before they get here.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/kv_format.h"
#include "core/paged_layout.h"

namespace kvcache {

/// append: write K/V of new tokens into the pools at their slots.
struct AppendArgs {
  const void* key = nullptr;       // [batch, num_kv_heads, q_len, head_dim], any strides
  const void* value = nullptr;     // [batch, num_kv_heads, q_len, v_head_dim], any strides
  int64_t key_strides[4] = {};     // element strides of key, in (batch, head, token, dim) order
  int64_t value_strides[4] = {};
  int64_t batch = 0;
  int64_t q_len = 0;
  const int64_t* slots = nullptr;  // [batch, q_len]; -1 skips a token
  int64_t slot_strides[2] = {};
  void* k_cache = nullptr;         // [num_blocks, num_kv_heads, page_size, head_dim], contiguous
  void* v_cache = nullptr;         // [num_blocks, num_kv_heads, page_size, v_head_dim], contiguous
  PagedLayout layout;              // layout.side(true): the V pool's
  // Quantized storage (core/kv_format.h): key/value (dtype in_dtype) are quantized on the way in.
  DType in_dtype = DType::kFloat32;
  KVKind k_kind = KVKind::kFull, v_kind = KVKind::kFull;
  float* k_scale = nullptr;        // int8: written per (block, head, pos); fp8: read per head
  float* v_scale = nullptr;
  bool k_rot = false, v_rot = false;  // rows Hadamard-rotated before quantizing (core/quant.h)
};

/// paged_gather / paged_gather_ragged: block tables + lengths -> contiguous K/V.
struct GatherArgs {
  const void* k_cache = nullptr;      // [num_blocks, num_kv_heads, page_size, head_dim]
  const void* v_cache = nullptr;      // [num_blocks, num_kv_heads, page_size, v_head_dim]
  PagedLayout layout;                 // layout.side(true): the V pool's
  const int32_t* block_table = nullptr;  // [batch, max_blocks_per_seq]
  int64_t table_stride = 0;              // elements between rows of block_table
  int64_t batch = 0;
  // padded form: seq_lens [batch]; out [batch, num_kv_heads, max_len, head_dim] (v_out: v_head_dim), padding zeroed
  const int32_t* seq_lens = nullptr;
  int64_t max_len = 0;
  // ragged form: cu_seq_lens [batch + 1]; out [total_tokens, num_kv_heads, head_dim] (v_out: v_head_dim)
  const int32_t* cu_seq_lens = nullptr;
  void* k_out = nullptr;
  void* v_out = nullptr;
  // Quantized storage: rows are dequantized to out_dtype.
  DType out_dtype = DType::kFloat32;
  KVKind k_kind = KVKind::kFull, v_kind = KVKind::kFull;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  bool k_rot = false, v_rot = false;  // rows are unrotated after dequantizing
};

/// copy_blocks / swap_blocks: copy whole blocks (each one contiguous run of bytes) between pools.
struct BlockCopyArgs {
  const int64_t* pairs = nullptr;  // [n, 2] (src block, dst block)
  int64_t n = 0;
  int64_t block_bytes = 0;    // of a K block
  int64_t v_block_bytes = 0;  // of a V block (K and V rows may differ in width)
  const char* k_src = nullptr;
  const char* v_src = nullptr;
  char* k_dst = nullptr;
  char* v_dst = nullptr;
};

/// A run of block pairs consecutive on both sides: (src, dst), (src + 1, dst + 1), ... count of them.
struct BlockRun {
  int64_t src, dst, count;
};

/// The pairs of block_mapping [n, 2] as runs, in their order: swap_blocks moves each run with one copy per
/// pool (blocks are contiguous in a pool), so a prefix swapped out in order costs two copies, not two per block.
inline std::vector<BlockRun> block_runs(const int64_t* pairs, int64_t n) {
  std::vector<BlockRun> runs;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t src = pairs[2 * i], dst = pairs[2 * i + 1];
    if (!runs.empty() && runs.back().src + runs.back().count == src && runs.back().dst + runs.back().count == dst) {
      ++runs.back().count;
    } else {
      runs.push_back({src, dst, 1});
    }
  }
  return runs;
}

}  // namespace kvcache
