// Emulation stand-in for cuda_bf16.h: the conversions the kernels use, with core/dtype.h's rounding
// (round to nearest even, as __float2bfloat16_rn).
#pragma once
#include "core/dtype.h"
#include "cuda_emulation/emulator.h"

struct __nv_bfloat16 {
  uint16_t bits;
};
inline float __bfloat162float(__nv_bfloat16 h) { return kvcache::bf16_to_float(h.bits); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {kvcache::float_to_bf16(f)}; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short b) { return {b}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.bits; }
