// How K or V is stored in the pages, as the kernels see it (the Python side: kvcache/formats.py).
// Torch-free.
#pragma once

#include <cstdint>

#include "core/dtype.h"
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

KVC_HOST_DEVICE constexpr bool is_kivi(KVKind k) { return k == KVKind::kKivi4 || k == KVKind::kKivi2; }
KVC_HOST_DEVICE constexpr int kivi_bits(KVKind k) { return k == KVKind::kKivi2 ? 2 : 4; }

/// Dims per stored code element (packed int4 and kivi4: 2, kivi2: 4).
KVC_HOST_DEVICE constexpr int64_t dims_per_code(KVKind k) {
  return k == KVKind::kInt4 || k == KVKind::kKivi4 ? 2 : (k == KVKind::kKivi2 ? 4 : 1);
}

/// Bytes of one value of a full-precision tensor of dtype t.
KVC_HOST_DEVICE constexpr int64_t dtype_bytes(DType t) { return t == DType::kFloat32 ? 4 : 2; }

/// Bytes of one stored row of codes (a token of one head), without its scales. `full`: the pool's dtype,
/// which sets the row's size for kFull.
KVC_HOST_DEVICE constexpr int64_t code_row_bytes(KVKind k, int64_t head_dim, DType full) {
  // (a shift, not a division: device code computes this too, where a 64-bit division is a slow call)
  return k == KVKind::kFull ? head_dim * dtype_bytes(full)
                            : head_dim >> (dims_per_code(k) == 4 ? 2 : dims_per_code(k) - 1);
}

constexpr bool is_quantized(KVKind k) { return k != KVKind::kFull; }
constexpr bool has_token_scales(KVKind k) { return k == KVKind::kInt8; }
constexpr bool has_head_scales(KVKind k) { return k == KVKind::kFp8E4M3 || k == KVKind::kFp8E5M2; }

/// A stored kind as a type, for the kernels' compile-time dispatch. `full` is the element type of kFull
/// pages (the pool tensor's dtype) and is kBFloat16 for every other kind.
template <KVKind K, DType Full = DType::kBFloat16>
struct Stored {
  static constexpr KVKind kind = K;
  static constexpr DType full = Full;
};

namespace detail {
template <class Fn>
void with_quantized_kind(KVKind k, Fn&& fn) {
  switch (k) {
    case KVKind::kInt8: return fn(Stored<KVKind::kInt8>{});
    case KVKind::kFp8E4M3: return fn(Stored<KVKind::kFp8E4M3>{});
    case KVKind::kFp8E5M2: return fn(Stored<KVKind::kFp8E5M2>{});
    default: return fn(Stored<KVKind::kInt4>{});
  }
}
template <class Fn>
void with_kivi_kind(KVKind k, Fn&& fn) {
  if (k == KVKind::kKivi4) return fn(Stored<KVKind::kKivi4>{});
  fn(Stored<KVKind::kKivi2>{});
}
}  // namespace detail

/// The one KV-kind dispatcher of the attention kernels (CPU and CUDA): calls fn(Stored<K>{}, Stored<V>{})
/// for the kinds of the keys and values, each kernel mapping Stored to its own reader or element type.
/// Only the pairs the host accepts are instantiated (attention_prepare.cpp validates them): full with
/// full of one dtype (`full_dtype`), quantized (int8, fp8, int4) with quantized, KIVI with KIVI.
template <class Fn>
void with_kv_kinds(KVKind k, KVKind v, DType full_dtype, Fn&& fn) {
  if (is_kivi(k)) {
    return detail::with_kivi_kind(k, [&](auto sk) { detail::with_kivi_kind(v, [&](auto sv) { fn(sk, sv); }); });
  }
  if (is_quantized(k)) {
    return detail::with_quantized_kind(k, [&](auto sk) { detail::with_quantized_kind(v, [&](auto sv) { fn(sk, sv); }); });
  }
  switch (full_dtype) {
    case DType::kFloat32: return fn(Stored<KVKind::kFull, DType::kFloat32>{}, Stored<KVKind::kFull, DType::kFloat32>{});
    case DType::kFloat16: return fn(Stored<KVKind::kFull, DType::kFloat16>{}, Stored<KVKind::kFull, DType::kFloat16>{});
    default: return fn(Stored<KVKind::kFull, DType::kBFloat16>{}, Stored<KVKind::kFull, DType::kBFloat16>{});
  }
}

}  // namespace kvcache
