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

/// Value d of the row at element offset `off` (its first dim) of a pool of layout L. `scale`: the row's int8
/// scale or the head's fp8 scale (else unused); `scales`: the pool's scale tensor (int4 / KIVI metadata);
/// `key`: the pool is the K side (KIVI keys keep per-channel page metadata).
__device__ __forceinline__ float dequantize(const char* pool, int64_t off, int64_t d, KVKind kind, float scale,
                                            DType full_dtype, const float* scales, const PagedLayout& L, bool key) {
  if (is_kivi(kind)) {  // off: dims of the row start
    const int bits = kivi_bits(kind);
    const int64_t D = L.head_dim, row = off / D;
    const uint8_t code = quant::planar_get(reinterpret_cast<const uint8_t*>(pool) + row * D * bits / 8, d, bits);
    const uint16_t* m = reinterpret_cast<const uint16_t*>(scales);
    if (key) {
      m += (row / L.page_size) * 2 * D;
      return quant::uint_decode(code, __half2float(__ushort_as_half(m[quant::kivi_key_scale_at(d)])),
                                __half2float(__ushort_as_half(m[quant::kivi_key_zero_at(d)])));
    }
    m += ((off + d) / 32) * 2;
    return quant::uint_decode(code, __half2float(__ushort_as_half(m[0])), __half2float(__ushort_as_half(m[1])));
  }
  if (kind == KVKind::kInt4) {  // off: dims; (scale, zero) fp16 pairs per 32 dims in `scales`
    const int64_t i = off + d;
    const uint8_t byte = reinterpret_cast<const uint8_t*>(pool)[i / 2];
    const uint16_t* m = reinterpret_cast<const uint16_t*>(scales) + (i / kInt4Group) * 2;
    return quant::uint_decode(static_cast<uint8_t>((i & 1) ? byte >> 4 : byte & 15),
                              __half2float(__ushort_as_half(m[0])), __half2float(__ushort_as_half(m[1])));
  }
  switch (kind) {
    case KVKind::kFull: return load_any(pool, off + d, full_dtype);
    case KVKind::kInt8: return quant::int8_decode(reinterpret_cast<const int8_t*>(pool)[off + d], scale);
    case KVKind::kFp8E4M3: return quant::fp8_decode(reinterpret_cast<const uint8_t*>(pool)[off + d], quant::kE4M3) * scale;
    default: return quant::fp8_decode(reinterpret_cast<const uint8_t*>(pool)[off + d], quant::kE5M2) * scale;
  }
}

}  // namespace kvcache::cuda
