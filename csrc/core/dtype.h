// Scalar conversions between fp32 and the 16-bit float formats, for code compiled by the host compiler
// (CPU kernels and tests). bfloat16 rounds to nearest even, like torch.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvcache {

/// Element types of query, output and full-precision KV tensors.
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Host-compiler-only conversions (_Float16 is a GCC/Clang type; device code uses cuda_fp16.h).
#if !defined(__CUDACC__)

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float fp16_to_float(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return static_cast<float>(x);
}

inline uint16_t float_to_fp16(float f) {
  const _Float16 x = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &x, 2);
  return h;
}

inline float load_as_float(const void* base, int64_t index, DType t) {
  switch (t) {
    case DType::kFloat32: return static_cast<const float*>(base)[index];
    case DType::kFloat16: return fp16_to_float(static_cast<const uint16_t*>(base)[index]);
    default: return bf16_to_float(static_cast<const uint16_t*>(base)[index]);
  }
}

inline void store_from_float(void* base, int64_t index, DType t, float v) {
  switch (t) {
    case DType::kFloat32: static_cast<float*>(base)[index] = v; break;
    case DType::kFloat16: static_cast<uint16_t*>(base)[index] = float_to_fp16(v); break;
    default: static_cast<uint16_t*>(base)[index] = float_to_bf16(v); break;
  }
}

/// store_from_float over a row of n values: the dtype switch once, so the conversion loop vectorizes.
inline void store_row_from_float(void* base, int64_t offset, DType t, const float* v, int64_t n) {
  switch (t) {
    case DType::kFloat32: std::memcpy(static_cast<float*>(base) + offset, v, n * sizeof(float)); break;
    case DType::kFloat16: {
      uint16_t* p = static_cast<uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) p[i] = float_to_fp16(v[i]);
      break;
    }
    default: {
      uint16_t* p = static_cast<uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) p[i] = float_to_bf16(v[i]);
    }
  }
}

#endif  // !defined(__CUDACC__)

}  // namespace kvcache
