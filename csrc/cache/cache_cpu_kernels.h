// CPU kernels of the cache ops. Each processes a range of independent work items so the caller can
// split the range across threads. `U` is an unsigned integer of the element's width: data movement
// copies bits, so float32/float16/bfloat16 share two instantiations and NaN payloads survive.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>

#include "cache/cache_args.h"
#include "cache/quant_rows.h"

namespace kvcache::cpu {

/// Work item i = (b * q_len + q) * num_kv_heads + h: one row of K (head_dim) and of V (v_head_dim).
template <typename U>
void append_rows(const AppendArgs& a, int64_t begin, int64_t end) {
  const PagedLayout L = a.layout.side(false), Lv = a.layout.side(true);
  const U* key = static_cast<const U*>(a.key);
  const U* value = static_cast<const U*>(a.value);
  U* kc = static_cast<U*>(a.k_cache);
  U* vc = static_cast<U*>(a.v_cache);
  const int64_t H = L.num_kv_heads, D = L.head_dim, Dv = Lv.head_dim;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t h = i % H, token = i / H;
    const int64_t b = token / a.q_len, q = token % a.q_len;
    const int64_t slot = a.slots[b * a.slot_strides[0] + q * a.slot_strides[1]];
    if (slot < 0) continue;
    U* kd = kc + L.slot_offset(slot, h);
    U* vd = vc + Lv.slot_offset(slot, h);
    const U* ks = key + b * a.key_strides[0] + h * a.key_strides[1] + q * a.key_strides[2];
    const U* vs = value + b * a.value_strides[0] + h * a.value_strides[1] + q * a.value_strides[2];
    if (a.key_strides[3] == 1) {
      std::memcpy(kd, ks, sizeof(U) * D);
    } else {
      for (int64_t d = 0; d < D; ++d) kd[d] = ks[d * a.key_strides[3]];
    }
    if (a.value_strides[3] == 1) {
      std::memcpy(vd, vs, sizeof(U) * Dv);
    } else {
      for (int64_t d = 0; d < Dv; ++d) vd[d] = vs[d * a.value_strides[3]];
    }
  }
}

/// append into quantized pools (either of K, V or both): work items as in append_rows. A full-precision
/// side copies its elements (elem_bytes wide), a quantized side quantizes from a.in_dtype.
inline void append_rows_quantized(const AppendArgs& a, int elem_bytes, int64_t begin, int64_t end) {
  const int64_t H = a.layout.num_kv_heads;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t h = i % H, token = i / H;
    const int64_t b = token / a.q_len, q = token % a.q_len;
    const int64_t slot = a.slots[b * a.slot_strides[0] + q * a.slot_strides[1]];
    if (slot < 0) continue;
    const int64_t block = a.layout.block_of(slot), pos = a.layout.offset_in_page(slot);
    for (int role = 0; role < 2; ++role) {
      const PagedLayout L = a.layout.side(role == 1);  // this side's pool: its row width
      const int64_t D = L.head_dim;
      const KVKind kind = role == 0 ? a.k_kind : a.v_kind;
      const void* src = role == 0 ? a.key : a.value;
      const int64_t* st = role == 0 ? a.key_strides : a.value_strides;
      void* pool = role == 0 ? a.k_cache : a.v_cache;
      float* scales = role == 0 ? a.k_scale : a.v_scale;
      const int64_t base = b * st[0] + h * st[1] + q * st[2];
      if (role == 0 && is_kivi(kind)) continue;  // kivi keys: whole pages, append_kivi_key_pages
      if (kind == KVKind::kFull) {
        char* dst = static_cast<char*>(pool) + L.offset(block, h, pos) * elem_bytes;
        for (int64_t d = 0; d < D; ++d) {
          std::memcpy(dst + d * elem_bytes, static_cast<const char*>(src) + (base + d * st[3]) * elem_bytes, elem_bytes);
        }
      } else {
        const RowRef r = row_ref(pool, scales, kind, L, block, h, pos);
        quantize_row(src, base, st[3], a.in_dtype, D, kind, r.codes, r.scale, role == 0 ? a.k_rot : a.v_rot);
      }
    }
  }
}

/// KIVI key pages of an append (validated: each row's slots are whole pages in order, or -1). Work item
/// i = ((b * (q_len / P)) + page of the row) * num_kv_heads + h.
inline void append_kivi_key_pages(const AppendArgs& a, int64_t begin, int64_t end) {
  const PagedLayout L = a.layout.side(false);
  const int64_t H = L.num_kv_heads, D = L.head_dim, P = L.page_size, per_row = a.q_len / P;
  const int bits = kivi_bits(a.k_kind);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t h = i % H, page = i / H, b = page / per_row, t0 = (page % per_row) * P;
    const int64_t slot = a.slots[b * a.slot_strides[0] + t0 * a.slot_strides[1]];
    if (slot < 0) continue;
    const int64_t block = L.block_of(slot);
    const int64_t* st = a.key_strides;
    uint8_t* codes = static_cast<uint8_t*>(a.k_cache) + L.row_index(block, h, 0) * (D * bits / 8);
    uint16_t* meta = const_cast<uint16_t*>(kivi_key_meta(a.k_scale, L, block, h));
    quantize_kivi_key_page(a.key, b * st[0] + h * st[1] + t0 * st[2], st[2], st[3], a.in_dtype, P, D, bits, codes, meta);
  }
}

/// fp8 code -> fp32 value, all 256 codes of a variant (quant::fp8_decode, exact).
template <bool kE4M3>
inline const float* fp8_values() {
  static const auto table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[c] = quant::fp8_decode(static_cast<uint8_t>(c), kE4M3 ? quant::kE4M3 : quant::kE5M2);
    return t;
  }();
  return table.data();
}

/// Dims [d0, d1) of one stored row, dequantized into x[0 .. d1 - d0) (d0, d1 multiples of 32 but a row's end).
/// KIVI rows: kivi_meta is a value row's (scale, zero) pairs; key_meta a key page's metadata as floats.
/// The same values as dequantize / dequantize_int4 / dequantize_kivi per dim; the format switch is taken once
/// per row, so each loop is plain (8k tokens x 2 heads x 128 dims, 1 thread, ns per value with the switch per
/// dim -> per row: int8 1.6 -> 0.4, fp8 12 -> 0.7, int4 10.4 -> 1.6; an fp32 gather 0.4-0.5).
inline void dequantize_row(KVKind kind, const RowRef& r, const uint16_t* kivi_meta, const float* key_meta, bool key,
                           int64_t d0, int64_t d1, float* x) {
  const int64_t n = d1 - d0;
  switch (kind) {
    case KVKind::kInt8: {
      const int8_t* c = static_cast<const int8_t*>(r.codes) + d0;
      const float scale = *r.scale;
      for (int64_t i = 0; i < n; ++i) x[i] = quant::int8_decode(c[i], scale);
      return;
    }
    case KVKind::kFp8E4M3:
    case KVKind::kFp8E5M2: {
      const float* values = kind == KVKind::kFp8E4M3 ? fp8_values<true>() : fp8_values<false>();
      const uint8_t* c = static_cast<const uint8_t*>(r.codes) + d0;
      const float scale = *r.scale;
      for (int64_t i = 0; i < n; ++i) x[i] = values[c[i]] * scale;
      return;
    }
    case KVKind::kInt4: {
      const uint8_t* c = static_cast<const uint8_t*>(r.codes);
      const uint16_t* m = reinterpret_cast<const uint16_t*>(r.scale);
      for (int64_t g0 = d0; g0 < d1; g0 += kInt4Group) {
        const float scale = fp16_to_float(m[2 * (g0 / kInt4Group)]), zero = fp16_to_float(m[2 * (g0 / kInt4Group) + 1]);
        const int64_t g1 = std::min(d1, g0 + kInt4Group);
        for (int64_t d = g0; d < g1; ++d) {
          const uint8_t byte = c[d / 2];
          x[d - d0] = quant::uint_decode(static_cast<uint8_t>((d & 1) ? byte >> 4 : byte & 15), scale, zero);
        }
      }
      return;
    }
    default: {  // KIVI: keys' (scale, zero) per channel of their page, values' per 32 dims of the row
      const int bits = kivi_bits(kind);
      const uint8_t* c = static_cast<const uint8_t*>(r.codes);
      for (int64_t g0 = d0; g0 < d1; g0 += 32) {
        const int64_t g1 = std::min(d1, g0 + 32);
        if (key) {
          // the page's 32 scales then 32 zeros of this chunk (quant::kivi_key_scale_at / kivi_key_zero_at),
          // widened once per page by the caller (key_meta)
          if (key_meta != nullptr) {
            const float* m = key_meta + (g0 / 32) * 64;
            for (int64_t d = g0; d < g1; ++d) x[d - d0] = quant::uint_decode(quant::planar_get(c, d, bits), m[d % 32], m[32 + d % 32]);
          } else {  // a row wider than the caller's buffer
            for (int64_t d = g0; d < g1; ++d) x[d - d0] = dequantize_kivi(c, kivi_meta, d, bits, true);
          }
        } else {
          const float scale = fp16_to_float(kivi_meta[2 * (g0 / 32)]), zero = fp16_to_float(kivi_meta[2 * (g0 / 32) + 1]);
          for (int64_t d = g0; d < g1; ++d) x[d - d0] = quant::uint_decode(quant::planar_get(c, d, bits), scale, zero);
        }
      }
      return;
    }
  }
}

/// Dequantized (or converted) copy of tokens [0, len) of one (sequence, head) into out rows of dtype
/// a.out_dtype (k_row_stride / v_row_stride elements apart).
inline void gather_head_dequantized(const GatherArgs& a, int64_t b, int64_t h, int64_t len, int64_t k_dst,
                                    int64_t v_dst, int64_t k_row_stride, int64_t v_row_stride) {
  const int32_t* row = a.block_table + b * a.table_stride;
  float buf[kMaxRotatedDim];
  // KIVI keys: the current page's per-channel metadata as floats (fp16 -> fp32 is a libgcc call per value
  // without F16C), widened once per page instead of twice per value
  float key_meta[2 * kMaxRotatedDim];
  const uint16_t* key_meta_of = nullptr;
  for (int64_t t = 0; t < len; ++t) {
    const int64_t block = row[t >> a.layout.page_shift], pos = t & (a.layout.page_size - 1);
    for (int role = 0; role < 2; ++role) {
      const PagedLayout L = a.layout.side(role == 1);  // this side's pool: its row width
      const int64_t D = L.head_dim;
      const KVKind kind = role == 0 ? a.k_kind : a.v_kind;
      const void* pool = role == 0 ? a.k_cache : a.v_cache;
      const float* scales = role == 0 ? a.k_scale : a.v_scale;
      void* out = role == 0 ? a.k_out : a.v_out;
      const int64_t dst = role == 0 ? k_dst + t * k_row_stride : v_dst + t * v_row_stride;
      const int64_t off = L.offset(block, h, pos);
      if (kind == KVKind::kFull) {  // full-precision side of a mixed pair: the pool has out's dtype
        const int64_t size = a.out_dtype == DType::kFloat32 ? 4 : 2;
        std::memcpy(static_cast<char*>(out) + dst * size, static_cast<const char*>(pool) + off * size, D * size);
        continue;
      }
      const RowRef r = row_ref(const_cast<void*>(pool), const_cast<float*>(scales), kind, L, block, h, pos);
      const bool rot = role == 0 ? a.k_rot : a.v_rot;
      const uint16_t* kivi_meta = !is_kivi(kind) ? nullptr
                                  : role == 0 ? kivi_key_meta(scales, L, block, h)
                                              : reinterpret_cast<const uint16_t*>(r.scale);
      const bool widened = role == 0 && kivi_meta != nullptr && D <= kMaxRotatedDim;
      if (widened && kivi_meta != key_meta_of) {
        for (int64_t i = 0; i < 2 * D; ++i) key_meta[i] = fp16_to_float(kivi_meta[i]);
        key_meta_of = kivi_meta;
      }
      if (rot) {  // (rotated rows are at most kMaxRotatedDim wide)
        dequantize_row(kind, r, kivi_meta, widened ? key_meta : nullptr, role == 0, 0, D, buf);
        quant::unrotate(buf, D);
        store_row_from_float(out, dst, a.out_dtype, buf, D);
        continue;
      }
      for (int64_t d0 = 0; d0 < D; d0 += kMaxRotatedDim) {
        const int64_t d1 = std::min(D, d0 + kMaxRotatedDim);
        dequantize_row(kind, r, kivi_meta, widened ? key_meta : nullptr, role == 0, d0, d1, buf);
        store_row_from_float(out, dst + d0, a.out_dtype, buf, d1 - d0);
      }
    }
  }
}

/// Padded and ragged gathers from quantized pools. Work item i = b * num_kv_heads + h.
inline void gather_padded_dequantized(const GatherArgs& a, int64_t begin, int64_t end) {
  const int64_t H = a.layout.num_kv_heads, D = a.layout.head_dim, Dv = a.layout.v_head_dim;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t b = i / H, h = i % H, len = a.seq_lens[b];
    gather_head_dequantized(a, b, h, len, i * a.max_len * D, i * a.max_len * Dv, D, Dv);
    for (int64_t e = len * D; e < a.max_len * D; ++e) store_from_float(a.k_out, i * a.max_len * D + e, a.out_dtype, 0.f);
    for (int64_t e = len * Dv; e < a.max_len * Dv; ++e) store_from_float(a.v_out, i * a.max_len * Dv + e, a.out_dtype, 0.f);
  }
}

inline void gather_ragged_dequantized(const GatherArgs& a, int64_t begin, int64_t end) {
  const int64_t H = a.layout.num_kv_heads, D = a.layout.head_dim, Dv = a.layout.v_head_dim;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t b = i / H, h = i % H;
    const int64_t start = a.cu_seq_lens[b], len = a.cu_seq_lens[b + 1] - start;
    gather_head_dequantized(a, b, h, len, (start * H + h) * D, (start * H + h) * Dv, H * D, H * Dv);
  }
}

/// Copies tokens [0, len) of one side's pool (layout L) of one (sequence, head) into a run of len rows,
/// dst_row_stride elements apart.
template <typename U>
inline void gather_side(const GatherArgs& a, const PagedLayout& L, const U* pool, int64_t b, int64_t h, int64_t len,
                        U* dst, int64_t dst_row_stride) {
  const int32_t* row = a.block_table + b * a.table_stride;
  const int64_t D = L.head_dim;
  // One page at a time: within a page the rows of one head are contiguous (head-major layout).
  for (int64_t t0 = 0; t0 < len; t0 += L.page_size) {
    const int64_t n = (len - t0 < L.page_size) ? len - t0 : L.page_size;
    const int64_t src = L.offset(row[t0 >> L.page_shift], h, 0);
    if (dst_row_stride == D) {
      std::memcpy(dst + t0 * D, pool + src, sizeof(U) * n * D);
    } else {
      for (int64_t t = 0; t < n; ++t) std::memcpy(dst + (t0 + t) * dst_row_stride, pool + src + t * D, sizeof(U) * D);
    }
  }
}

/// Copies tokens [0, len) of one (sequence, head) from the K and V pages into dense runs of len rows.
template <typename U>
inline void gather_head(const GatherArgs& a, int64_t b, int64_t h, int64_t len, U* k_dst, U* v_dst,
                        int64_t k_row_stride, int64_t v_row_stride) {
  gather_side<U>(a, a.layout.side(false), static_cast<const U*>(a.k_cache), b, h, len, k_dst, k_row_stride);
  gather_side<U>(a, a.layout.side(true), static_cast<const U*>(a.v_cache), b, h, len, v_dst, v_row_stride);
}

/// Padded gather. Work item i = b * num_kv_heads + h; rows past seq_lens[b] are zeroed.
template <typename U>
void gather_padded(const GatherArgs& a, int64_t begin, int64_t end) {
  const int64_t H = a.layout.num_kv_heads, D = a.layout.head_dim, Dv = a.layout.v_head_dim;
  U* ko = static_cast<U*>(a.k_out);
  U* vo = static_cast<U*>(a.v_out);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t b = i / H, h = i % H;
    const int64_t len = a.seq_lens[b];
    U* kd = ko + i * a.max_len * D;  // out is [batch, H, max_len, D] (v_out: Dv), contiguous
    U* vd = vo + i * a.max_len * Dv;
    gather_head<U>(a, b, h, len, kd, vd, D, Dv);
    std::memset(kd + len * D, 0, sizeof(U) * (a.max_len - len) * D);
    std::memset(vd + len * Dv, 0, sizeof(U) * (a.max_len - len) * Dv);
  }
}

/// Ragged gather into [total_tokens, num_kv_heads, head_dim] (v_out: v_head_dim). Work item i = b * num_kv_heads + h.
template <typename U>
void gather_ragged(const GatherArgs& a, int64_t begin, int64_t end) {
  const int64_t H = a.layout.num_kv_heads, D = a.layout.head_dim, Dv = a.layout.v_head_dim;
  U* ko = static_cast<U*>(a.k_out);
  U* vo = static_cast<U*>(a.v_out);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t b = i / H, h = i % H;
    const int64_t start = a.cu_seq_lens[b], len = a.cu_seq_lens[b + 1] - start;
    gather_head<U>(a, b, h, len, ko + (start * H + h) * D, vo + (start * H + h) * Dv, H * D, H * Dv);
  }
}

/// Work item i: block pair i, K and V.
inline void copy_block_pairs(const BlockCopyArgs& a, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const int64_t src = a.pairs[2 * i], dst = a.pairs[2 * i + 1];
    std::memcpy(a.k_dst + dst * a.block_bytes, a.k_src + src * a.block_bytes, a.block_bytes);
    std::memcpy(a.v_dst + dst * a.v_block_bytes, a.v_src + src * a.v_block_bytes, a.v_block_bytes);
  }
}

}  // namespace kvcache::cpu
