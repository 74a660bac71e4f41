// How K or V is stored in the pages, as the kernels see it (the Python side: kvcache/formats.py).
// Torch-free.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace kvcache {

/// Storage kinds. kFull keeps the model's dtype (the pool tensor's dtype says which).
///   kInt8      int8 codes [blocks, heads, page, head_dim] + float32 scale [blocks, heads, page]
///   kFp8E4M3   uint8 codes [blocks, heads, page, head_dim] + float32 scale [heads]
///   kFp8E5M2   as kFp8E4M3
///   kInt4      uint8 codes [blocks, heads, page, head_dim / 2] (even dim in the low nibble) + float16
///              (scale, zero) per group of 32 dims [blocks, heads, page, head_dim / 32, 2] (in k_scale)
///   kKivi4/2   KIVI, 4 or 2 bits, asymmetric: uint8 codes [blocks, heads, page, head_dim * bits / 8], packed
///              in planes per 32-dim chunk (core/quant.h: planar_byte). Keys per channel over the tokens of
///              a page: float16 [blocks, heads, head_dim / 32, 2, 32] (32 scales, then 32 zeros, per
///              chunk); a key page is written whole. Values per token in groups of 32 dims: float16
///              (scale, zero) [blocks, heads, page, head_dim / 32, 2], as int4.
enum class KVKind : int { kFull = 0, kInt8 = 1, kFp8E4M3 = 2, kFp8E5M2 = 3, kInt4 = 4, kKivi4 = 5, kKivi2 = 6 };

constexpr int kNumKVKinds = 7;
/// Added to a format id (k_format / v_format) for the `hadamard` option: rows are rotated
/// (core/quant.h: rotate) before they are quantized. Quantized kinds only; head_dim a power of two.
constexpr int64_t kRotatedFlag = 16;
constexpr int64_t kInt4Group = 32;

KVC_HOST_DEVICE bool is_kivi(KVKind k) { return k == KVKind::kKivi4 || k == KVKind::kKivi2; }
KVC_HOST_DEVICE int kivi_bits(KVKind k) { return k == KVKind::kKivi2 ? 2 : 4; }

/// Dims per stored code element (packed int4 and kivi4: 2, kivi2: 4).
inline int64_t dims_per_code(KVKind k) {
  return k == KVKind::kInt4 || k == KVKind::kKivi4 ? 2 : (k == KVKind::kKivi2 ? 4 : 1);
}

/// Bytes of one stored row of codes (a token of one head), without its scales. `full_bytes`: the
/// element size of the pool's dtype, for kFull.
inline int64_t code_row_bytes(KVKind k, int64_t head_dim, int64_t full_bytes) {
  return k == KVKind::kFull ? head_dim * full_bytes : head_dim / dims_per_code(k);
}

inline bool is_quantized(KVKind k) { return k != KVKind::kFull; }
inline bool has_token_scales(KVKind k) { return k == KVKind::kInt8; }
inline bool has_head_scales(KVKind k) { return k == KVKind::kFp8E4M3 || k == KVKind::kFp8E5M2; }

}  // namespace kvcache
