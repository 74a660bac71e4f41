// One stored value of a K or V row of any format, dequantized to fp32: the device side of cache/quant_rows.h,
// shared by the dequantizing gather (cache_kernels.cu) and the MLA kernel (mla/mla_kernels.cu).
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

}  // namespace kvcache::cuda
