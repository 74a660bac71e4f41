// Emulation stand-in for cuda_fp16.h: the conversions the kernels use, with core/dtype.h's rounding
// (round to nearest even, as __float2half_rn).
#pragma once
#include "core/dtype.h"
#include "cuda_emulation/emulator.h"

struct __half {
  uint16_t bits;
};
inline float __half2float(__half h) { return kvcache::fp16_to_float(h.bits); }
inline __half __float2half_rn(float f) { return {kvcache::float_to_fp16(f)}; }
inline __half __ushort_as_half(unsigned short b) { return {b}; }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
