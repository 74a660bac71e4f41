// How K or V is stored in the pages, as the kernels see it (the Python side: kvcache/formats.py).
// Torch-free.
#pragma once

#include <cstdint>

namespace kvcache {

/// Storage kinds. kFull keeps the model's dtype (the pool tensor's dtype says which).
///   kInt8      int8 codes [blocks, heads, page, head_dim] + float32 scale [blocks, heads, page]
///   kFp8E4M3   uint8 codes [blocks, heads, page, head_dim] + float32 scale [heads]
///   kFp8E5M2   as kFp8E4M3
///   kInt4      uint8 codes [blocks, heads, page, head_dim / 2] (even dim in the low nibble) + float16
///              (scale, zero) per group of 32 dims [blocks, heads, page, head_dim / 32, 2] (in k_scale)
enum class KVKind : int { kFull = 0, kInt8 = 1, kFp8E4M3 = 2, kFp8E5M2 = 3, kInt4 = 4 };

constexpr int kNumKVKinds = 5;
constexpr int64_t kInt4Group = 32;

/// Dims per stored code element (packed int4: 2).
inline int64_t dims_per_code(KVKind k) { return k == KVKind::kInt4 ? 2 : 1; }

inline bool is_quantized(KVKind k) { return k != KVKind::kFull; }
inline bool has_token_scales(KVKind k) { return k == KVKind::kInt8; }
inline bool has_head_scales(KVKind k) { return k == KVKind::kFp8E4M3 || k == KVKind::kFp8E5M2; }

}  // namespace kvcache
