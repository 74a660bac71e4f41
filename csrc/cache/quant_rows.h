// Quantizing one (token, kv head) row on append and dequantizing it on gather, for every KVKind:
// the CPU side of csrc/core/quant.h (the CUDA kernels call the same scalar functions).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "core/kv_format.h"
#include "core/quant.h"

namespace kvcache::cpu {

/// Writes the D values src[d * stride] (of dtype in) as `kind` into codes; `scale` is the row's scale
/// slot (int8, written) or the head's scale (fp8, read).
inline void quantize_row(const void* src, int64_t base, int64_t stride, DType in, int64_t D, KVKind kind,
                         void* codes, float* scale) {
  if (kind == KVKind::kInt8) {
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::fmax(amax, std::fabs(load_as_float(src, base + d * stride, in)));
    const float inv = quant::int8_inv_scale(amax);
    int8_t* out = static_cast<int8_t*>(codes);
    for (int64_t d = 0; d < D; ++d) out[d] = quant::int8_encode(load_as_float(src, base + d * stride, in), inv);
    *scale = quant::int8_scale(amax);
    return;
  }
  const quant::Fp8Spec spec = kind == KVKind::kFp8E4M3 ? quant::kE4M3 : quant::kE5M2;
  const float inv = 1.f / *scale;
  uint8_t* out = static_cast<uint8_t*>(codes);
  for (int64_t d = 0; d < D; ++d) out[d] = quant::fp8_encode(load_as_float(src, base + d * stride, in) * inv, spec);
}

/// Value d of a stored row, dequantized.
inline float dequantize(const void* codes, int64_t d, KVKind kind, float scale) {
  switch (kind) {
    case KVKind::kInt8: return quant::int8_decode(static_cast<const int8_t*>(codes)[d], scale);
    case KVKind::kFp8E4M3: return quant::fp8_decode(static_cast<const uint8_t*>(codes)[d], quant::kE4M3) * scale;
    default: return quant::fp8_decode(static_cast<const uint8_t*>(codes)[d], quant::kE5M2) * scale;
  }
}

}  // namespace kvcache::cpu
