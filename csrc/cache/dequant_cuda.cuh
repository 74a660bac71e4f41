// Stored values of a K or V row of any format, dequantized to fp32: the device side of cache/quant_rows.h,
// one value at a time (dequantize) or a 16-byte unit of codes at a time (dequantize_unit), shared by the
// dequantizing gather (cache_kernels.cu), the attention kernel's tile staging and the MLA kernel.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "core/dtype_cuda.cuh"
#include "core/kv_format.h"
#include "core/paged_layout.h"
#include "core/quant.h"

namespace kvcache::cuda {

/// Value d of pool row `row` (L.row_index(block, head, pos), which also indexes int8 scales) of a pool of
/// layout L. `scale`: the row's int8 scale or the head's fp8 scale (else unused); `scales`: the pool's scale
/// tensor (int4 / KIVI metadata); `key`: the pool is the K side (KIVI keys keep per-channel page metadata).
/// NOTE: addressed by row, not by element offset: finding a KIVI row's page from an element offset took
/// two 64-bit divisions by runtime values (head_dim, page_size), each a call to a slow SASS subroutine.
__device__ __forceinline__ float dequantize(const char* pool, int64_t row, int64_t d, KVKind kind, float scale,
                                            DType full_dtype, const float* scales, const PagedLayout& L, bool key) {
  const int64_t D = L.head_dim, i = row * D + d;  // i: the value's dim index in the pool
  if (is_kivi(kind)) {
    const int bits = kivi_bits(kind);
    const uint8_t code = quant::planar_get(reinterpret_cast<const uint8_t*>(pool) + row * D * bits / 8, d, bits);
    const uint16_t* m = reinterpret_cast<const uint16_t*>(scales);
    if (key) {
      m += (row >> L.page_shift) * 2 * D;  // the (block, head) page of the row
      return quant::uint_decode(code, __half2float(__ushort_as_half(m[quant::kivi_key_scale_at(d)])),
                                __half2float(__ushort_as_half(m[quant::kivi_key_zero_at(d)])));
    }
    m += (i / 32) * 2;
    return quant::uint_decode(code, __half2float(__ushort_as_half(m[0])), __half2float(__ushort_as_half(m[1])));
  }
  if (kind == KVKind::kInt4) {  // (scale, zero) fp16 pairs per 32 dims in `scales`
    const uint8_t byte = reinterpret_cast<const uint8_t*>(pool)[i / 2];
    const uint16_t* m = reinterpret_cast<const uint16_t*>(scales) + (i / kInt4Group) * 2;
    return quant::uint_decode(static_cast<uint8_t>((i & 1) ? byte >> 4 : byte & 15),
                              __half2float(__ushort_as_half(m[0])), __half2float(__ushort_as_half(m[1])));
  }
  switch (kind) {
    case KVKind::kFull: return load_any(pool, i, full_dtype);
    case KVKind::kInt8: return quant::int8_decode(reinterpret_cast<const int8_t*>(pool)[i], scale);
    case KVKind::kFp8E4M3: return quant::fp8_decode(reinterpret_cast<const uint8_t*>(pool)[i], quant::kE4M3) * scale;
    default: return quant::fp8_decode(reinterpret_cast<const uint8_t*>(pool)[i], quant::kE5M2) * scale;
  }
}

/// Whether every row of a pool (codes of `kind` at head_dim D, full-precision dtype `full`) is whole 16-byte
/// units and the pool starts on 16 bytes: then its rows are read a unit (one LDG.E.128) at a time. The pool
/// tensors start on their allocation, so checking the base is enough for every row.
KVC_HOST_DEVICE bool whole_units(const void* pool, KVKind kind, int64_t D, DType full) {
  return code_row_bytes(kind, D, full) % 16 == 0 && (reinterpret_cast<uintptr_t>(pool) & 15u) == 0;
}

/// Word j (0-3) of a 16-byte unit. NOTE: selects, not an array indexed at run time (which the compiler puts
/// in local memory: a stack frame and local loads per value).
__device__ __forceinline__ uint32_t word_at(const uint4& w, unsigned j) {
  return j < 2 ? (j == 0 ? w.x : w.y) : (j == 2 ? w.z : w.w);
}
__device__ __forceinline__ uint8_t byte_at(const uint4& w, unsigned j) {
  return static_cast<uint8_t>(word_at(w, j / 4) >> (8 * (j % 4)));
}

/// Values [first, first + count) of a 16-byte unit of codes `w` of pool row `row` whose first dim is d0 (for
/// int4 and KIVI a unit starts a 32-dim chunk), dequantized: out(k, value of dim d0 + first + k) for
/// k < count. `full_dtype`: a full-precision side's dtype; `s`: the row's int8 or the head's fp8 scale;
/// `scales`: the int4 / KIVI metadata; `key`: K side (KIVI keys: per-channel page metadata). The same
/// arithmetic as dequantize().
template <class Out>
__device__ __forceinline__ void dequantize_part(const uint4& w, int64_t row, int64_t d0, unsigned first, unsigned count,
                                                KVKind kind, DType full_dtype, float s, const float* scales,
                                                const PagedLayout& L, bool key, Out out) {
  const uint16_t* meta = reinterpret_cast<const uint16_t*>(scales);
  const int64_t D = L.head_dim;
  const auto half = [](uint16_t x) { return __half2float(__ushort_as_half(x)); };
  const auto emit = [&](auto value) {
#pragma unroll
    for (unsigned k = 0; k < count; ++k) out(k, value(first + k));
  };
  switch (kind) {
    case KVKind::kFull:
      return emit([&](unsigned k) {
        if (full_dtype == DType::kFloat32) return __uint_as_float(word_at(w, k));
        const auto bits = static_cast<unsigned short>(word_at(w, k / 2) >> (16 * (k % 2)));
        return full_dtype == DType::kFloat16 ? __half2float(__ushort_as_half(bits))
                                            : __bfloat162float(__ushort_as_bfloat16(bits));
      });
    case KVKind::kInt8:
      return emit([&](unsigned k) { return quant::int8_decode(static_cast<int8_t>(byte_at(w, k)), s); });
    case KVKind::kFp8E4M3: return emit([&](unsigned k) { return quant::fp8_decode(byte_at(w, k), quant::kE4M3) * s; });
    case KVKind::kFp8E5M2: return emit([&](unsigned k) { return quant::fp8_decode(byte_at(w, k), quant::kE5M2) * s; });
    case KVKind::kInt4: {  // one (scale, zero) pair for the unit's 32 dims
      const uint16_t* m = meta + (row * (D / kInt4Group) + d0 / kInt4Group) * 2;
      const float scale = half(m[0]), zero = half(m[1]);
      return emit([&](unsigned k) {
        return quant::uint_decode(static_cast<uint8_t>((byte_at(w, k / 2) >> (4 * (k % 2))) & 15), scale, zero);
      });
    }
    default: {  // KIVI: planes per 32-dim chunk (core/quant.h), and the unit holds whole chunks
      const int bits = kivi_bits(kind);
      const auto code = [&](unsigned k) {  // quant::planar_get on the unit's bytes
        const auto byte = byte_at(w, static_cast<unsigned>(quant::planar_byte(k, bits)));
        return static_cast<uint8_t>((byte >> quant::planar_shift(k, bits)) & ((1u << bits) - 1));
      };
      if (key) {
        const uint16_t* m = meta + (row >> L.page_shift) * 2 * D;  // the row's (block, head) page
        return emit([&](unsigned k) {
          const int64_t d = d0 + k;
          return quant::uint_decode(code(k), half(m[quant::kivi_key_scale_at(d)]), half(m[quant::kivi_key_zero_at(d)]));
        });
      }
      return emit([&](unsigned k) {
        const uint16_t* m = meta + (row * (D / 32) + (d0 + k) / 32) * 2;
        return quant::uint_decode(code(k), half(m[0]), half(m[1]));
      });
    }
  }
}

/// Values [first, first + 4) of a unit (dequantize_part) as one float4, for a single 16-byte shared store.
__device__ __forceinline__ float4 dequantize_float4(const uint4& w, int64_t row, int64_t d0, unsigned first,
                                                    KVKind kind, DType full_dtype, float s, const float* scales,
                                                    const PagedLayout& L, bool key) {
  float4 v;
  dequantize_part(w, row, d0, first, 4, kind, full_dtype, s, scales, L, key, [&](unsigned d, float x) {
    if (d == 0) v.x = x;
    else if (d == 1) v.y = x;
    else if (d == 2) v.z = x;
    else v.w = x;
  });
  return v;
}

/// The scale a unit of pool row `row` of head h is decoded with: per row for int8, per head for fp8, else 1.
__device__ __forceinline__ float row_scale(KVKind kind, const float* scales, int64_t row, int64_t h) {
  return kind == KVKind::kInt8 ? scales[row] : (has_head_scales(kind) ? scales[h] : 1.f);
}

/// The whole unit: dims [d0, d0 + dims) (dequantize_part's values 0 .. dims).
template <class Out>
__device__ __forceinline__ void dequantize_unit(const uint4& w, int64_t row, int64_t d0, unsigned dims, KVKind kind,
                                                DType full_dtype, float s, const float* scales, const PagedLayout& L,
                                                bool key, Out out) {
  dequantize_part(w, row, d0, 0, dims, kind, full_dtype, s, scales, L, key, out);
}

}  // namespace kvcache::cuda
