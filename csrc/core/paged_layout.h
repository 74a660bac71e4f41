// PagedLayout: the one place that turns (block, kv head, position in page) into an element offset.
//
// A K (or V) pool of one layer is a contiguous tensor
//     [num_blocks, num_kv_heads, page_size, head_dim]          ("head-major", HND)
// NOTE: head-major rather than token-major ([num_blocks, page_size, num_kv_heads, head_dim]) because
// decode attention streams one KV head of one sequence at a time: with HND the page_size x head_dim
// tile of a (block, head) pair is one contiguous run (4 KiB for page 16, d 128, bf16), read with
// unit stride and prefetched well, and a per-(page, head) quantization scale sits next to it. The
// cost lands on append, which writes head_dim-long rows at a stride - a much smaller amount of data.
//
// K and V rows may differ in width (MLA models cache a latent of kv_lora_rank dims as the key and the
// rotary part of qk_rope_head_dim dims as the value): the V pool is then
//     [num_blocks, num_kv_heads, page_size, v_head_dim]
// with the same blocks, heads and pages. Every accessor below describes the K pool; side(true) is the
// layout of the V pool (a single-width layout whose head_dim is v_head_dim), so one code path serves both.
//
// A slot names one token position in the pool: slot = block_id * page_size + offset_in_page.
// Page sizes are powers of two from 1 to 256, so the division is a shift and a mask.
// Torch-free: included by CPU code, CUDA kernels and the GoogleTest suite alike.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace kvcache {

constexpr int64_t kMaxPageSize = 256;

/// True for 1, 2, 4, ..., 256: the page sizes every kernel supports.
KVC_HOST_DEVICE bool is_supported_page_size(int64_t page_size) {
  return page_size >= 1 && page_size <= kMaxPageSize && (page_size & (page_size - 1)) == 0;
}

KVC_HOST_DEVICE int log2_exact(int64_t power_of_two) {
  int shift = 0;
  while ((int64_t{1} << shift) < power_of_two) ++shift;
  return shift;
}

struct PagedLayout {
  int64_t num_blocks = 0;
  int64_t page_size = 0;     // tokens per page, a power of two
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;      // width of a K row (dims per token and kv head)
  int page_shift = 0;        // log2(page_size)
  int64_t v_head_dim = 0;    // width of a V row: head_dim unless the pools differ in width

  PagedLayout() = default;
  /// v_dim < 0: V rows as wide as K rows.
  PagedLayout(int64_t blocks, int64_t page, int64_t heads, int64_t dim, int64_t v_dim = -1)
      : num_blocks(blocks), page_size(page), num_kv_heads(heads), head_dim(dim),
        page_shift(log2_exact(page)), v_head_dim(v_dim < 0 ? dim : v_dim) {}

  /// Whether K and V rows have one width (what paged_attention reads).
  KVC_HOST_DEVICE bool equal_widths() const { return v_head_dim == head_dim; }
  /// Width of the rows of one side: K (value = false) or V (value = true).
  KVC_HOST_DEVICE int64_t dim(bool value) const { return value ? v_head_dim : head_dim; }
  /// The layout of one side's pool as a single-width layout: its accessors give that pool's offsets.
  KVC_HOST_DEVICE PagedLayout side(bool value) const {
    PagedLayout s = *this;
    s.head_dim = s.v_head_dim = dim(value);
    return s;
  }

  KVC_HOST_DEVICE int64_t num_slots() const { return num_blocks << page_shift; }
  KVC_HOST_DEVICE int64_t head_stride() const { return page_size * head_dim; }
  KVC_HOST_DEVICE int64_t block_stride() const { return num_kv_heads * page_size * head_dim; }
  KVC_HOST_DEVICE int64_t pool_elements() const { return num_blocks * block_stride(); }

  KVC_HOST_DEVICE int64_t block_of(int64_t slot) const { return slot >> page_shift; }
  KVC_HOST_DEVICE int64_t offset_in_page(int64_t slot) const { return slot & (page_size - 1); }

  /// Element offset of the first of head_dim values of (block, head, position in page).
  KVC_HOST_DEVICE int64_t offset(int64_t block, int64_t head, int64_t pos) const {
    return block * block_stride() + head * head_stride() + pos * head_dim;
  }
  /// Index of the (block, head, position) row among all rows of the pool: where a per-token scale of
  /// that row lives in a [num_blocks, num_kv_heads, page_size] tensor.
  KVC_HOST_DEVICE int64_t row_index(int64_t block, int64_t head, int64_t pos) const {
    return (block * num_kv_heads + head) * page_size + pos;
  }
  /// Element offset of the head_dim values of one kv head at one slot.
  KVC_HOST_DEVICE int64_t slot_offset(int64_t slot, int64_t head) const {
    return offset(block_of(slot), head, offset_in_page(slot));
  }
  /// Element offset of token `t` of a sequence, given the block id that holds it.
  KVC_HOST_DEVICE int64_t token_offset(int64_t block, int64_t head, int64_t t) const {
    return offset(block, head, t & (page_size - 1));
  }
  /// Number of pages a sequence of `len` tokens occupies.
  KVC_HOST_DEVICE int64_t pages_for(int64_t len) const { return (len + page_size - 1) >> page_shift; }
};

}  // namespace kvcache
