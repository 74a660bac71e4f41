// CUDA kernels of the cache ops. No GPU runs them where this is developed (the test suite runs them
// on the CPU under csrc/cuda_emulation), so they stay as plain as possible: one thread per element,
// the same PagedLayout accessors as the CPU kernels, integer math in int64, and every launch checked.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cache/cache_cuda_launch.h"
#include "core/cuda_launch.cuh"
#include "core/dtype_cuda.cuh"
#include "cache/dequant_cuda.cuh"
#include "cache/rotation_cuda.cuh"
#include "core/quant.h"

namespace kvcache::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerCta = 16;     // token rows one CTA of the gather kernels handles per step
constexpr int kMaxGridY = 65535;
constexpr int kMaxPerLane = 8;      // rotated rows: head_dim <= 256, dims lane + 32 k per lane

/// One CTA per token (b, q); its threads copy the num_kv_heads x head_dim values of K and the
/// num_kv_heads x v_head_dim values of V.
template <typename U>
__global__ void append_kernel(AppendArgs a) {
  const int64_t token = blockIdx.x;
  const int64_t b = token / a.q_len, q = token % a.q_len;
  const int64_t slot = a.slots[b * a.slot_strides[0] + q * a.slot_strides[1]];
  if (slot < 0) return;
  for (int role = 0; role < 2; ++role) {
    const PagedLayout L = a.layout.side(role == 1);  // this side's pool: its row width
    const U* src = static_cast<const U*>(role == 0 ? a.key : a.value);
    const int64_t* st = role == 0 ? a.key_strides : a.value_strides;
    U* pool = static_cast<U*>(role == 0 ? a.k_cache : a.v_cache);
    const int64_t n = L.num_kv_heads * L.head_dim;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const int64_t h = i / L.head_dim, d = i % L.head_dim;
      pool[L.slot_offset(slot, h) + d] = src[b * st[0] + h * st[1] + q * st[2] + d * st[3]];
    }
  }
}

/// Copies token row t (< len) of (sequence b, head h), or zeros when `zero` is set.
template <typename U>
__device__ __forceinline__ void gather_row(const GatherArgs& a, int64_t b, int64_t h, int64_t t, U* k_dst,
                                           U* v_dst, bool zero) {
  const PagedLayout K = a.layout.side(false), V = a.layout.side(true);  // K and V rows may differ in width
  if (zero) {
    for (int64_t d = threadIdx.x; d < K.head_dim; d += blockDim.x) k_dst[d] = U(0);
    for (int64_t d = threadIdx.x; d < V.head_dim; d += blockDim.x) v_dst[d] = U(0);
    return;
  }
  const int64_t block = a.block_table[b * a.table_stride + (t >> K.page_shift)];
  const U* kc = static_cast<const U*>(a.k_cache) + K.token_offset(block, h, t);
  const U* vc = static_cast<const U*>(a.v_cache) + V.token_offset(block, h, t);
  for (int64_t d = threadIdx.x; d < K.head_dim; d += blockDim.x) k_dst[d] = kc[d];
  for (int64_t d = threadIdx.x; d < V.head_dim; d += blockDim.x) v_dst[d] = vc[d];
}

/// grid.x = batch * num_kv_heads; grid.y strides over chunks of kRowsPerCta rows of max_len.
template <typename U>
__global__ void gather_padded_kernel(GatherArgs a) {
  const int64_t H = a.layout.num_kv_heads, D = a.layout.head_dim, Dv = a.layout.v_head_dim;
  const int64_t bh = blockIdx.x, b = bh / H, h = bh % H;
  const int64_t len = a.seq_lens[b];
  U* ko = static_cast<U*>(a.k_out) + bh * a.max_len * D;
  U* vo = static_cast<U*>(a.v_out) + bh * a.max_len * Dv;
  for (int64_t t0 = int64_t(blockIdx.y) * kRowsPerCta; t0 < a.max_len; t0 += int64_t(gridDim.y) * kRowsPerCta) {
    for (int64_t t = t0; t < t0 + kRowsPerCta && t < a.max_len; ++t) {
      gather_row<U>(a, b, h, t, ko + t * D, vo + t * Dv, t >= len);
    }
  }
}

/// grid.x = batch * num_kv_heads; grid.y strides over chunks of each sequence's rows.
template <typename U>
__global__ void gather_ragged_kernel(GatherArgs a) {
  const int64_t H = a.layout.num_kv_heads, D = a.layout.head_dim, Dv = a.layout.v_head_dim;
  const int64_t bh = blockIdx.x, b = bh / H, h = bh % H;
  const int64_t start = a.cu_seq_lens[b], len = a.cu_seq_lens[b + 1] - start;
  U* ko = static_cast<U*>(a.k_out);
  U* vo = static_cast<U*>(a.v_out);
  for (int64_t t0 = int64_t(blockIdx.y) * kRowsPerCta; t0 < len; t0 += int64_t(gridDim.y) * kRowsPerCta) {
    for (int64_t t = t0; t < t0 + kRowsPerCta && t < len; ++t) {
      const int64_t row = (start + t) * H + h;
      gather_row<U>(a, b, h, t, ko + row * D, vo + row * Dv, false);
    }
  }
}

/// One CTA per (src, dst) pair; copies the block's bytes of K and of V (blocks of their own sizes) in units of U.
template <typename U>
__global__ void copy_blocks_kernel(BlockCopyArgs a) {
  const int64_t i = blockIdx.x;
  const int64_t src = a.pairs[2 * i], dst = a.pairs[2 * i + 1];
  const int64_t n = a.block_bytes / int64_t(sizeof(U)), nv = a.v_block_bytes / int64_t(sizeof(U));
  const U* ks = reinterpret_cast<const U*>(a.k_src + src * a.block_bytes);
  const U* vs = reinterpret_cast<const U*>(a.v_src + src * a.v_block_bytes);
  U* kd = reinterpret_cast<U*>(a.k_dst + dst * a.block_bytes);
  U* vd = reinterpret_cast<U*>(a.v_dst + dst * a.v_block_bytes);
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) kd[j] = ks[j];
  for (int64_t j = threadIdx.x; j < nv; j += blockDim.x) vd[j] = vs[j];
}

__device__ __forceinline__ float warp_max(float x) {
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

/// Min / max over the warp of an asymmetric group's finite values (lane i: quant::uint_low / uint_high of its
/// value), and whether any lane's value is NaN; min = max = 0 for a group with no finite value.
__device__ __forceinline__ bool warp_group_stats(float x, float& mn, float& mx) {
  mn = quant::uint_low(x);
  mx = quant::uint_high(x);
  int nan = quant::is_nan(x);
  for (int o = 16; o > 0; o >>= 1) {
    mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, o));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    nan |= __shfl_xor_sync(0xffffffffu, nan, o);
  }
  quant::uint_finish(mn, mx);
  return nan != 0;
}

/// A group's fp16 scale as stored: NaN for a group that holds a NaN (it belongs to one token).
__device__ __forceinline__ uint16_t group_scale_bits(float mn, float mx, int bits, bool nan) {
  return nan ? quant::kFp16ScaleNaN : __half_as_ushort(__float2half_rn(quant::uint_scale(mn, mx, bits)));
}

/// Quantizing append: one warp per (token, kv head) row; lanes stride over head_dim. A full-precision
/// side copies elem_bytes-wide elements; a quantized side encodes with core/quant.h.
__global__ void append_quantized_kernel(AppendArgs a, int elem_bytes) {
  KVC_SHARED(float, rotated, [kThreads / 32][kMaxPerLane * 32]);  // one row buffer per warp
  const int64_t H = a.layout.num_kv_heads;
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= a.batch * a.q_len * H) return;  // whole warps exit together
  const int64_t h = row % H, token = row / H, b = token / a.q_len, q = token % a.q_len;
  const int64_t slot = a.slots[b * a.slot_strides[0] + q * a.slot_strides[1]];
  if (slot < 0) return;
  const int64_t block = a.layout.block_of(slot), pos = a.layout.offset_in_page(slot);
  for (int role = 0; role < 2; ++role) {
    const PagedLayout L = a.layout.side(role == 1);  // this side's pool: its row width
    const int64_t D = L.head_dim, off = L.offset(block, h, pos);
    const KVKind kind = role == 0 ? a.k_kind : a.v_kind;
    const void* src = role == 0 ? a.key : a.value;
    const int64_t* st = role == 0 ? a.key_strides : a.value_strides;
    char* pool = static_cast<char*>(role == 0 ? a.k_cache : a.v_cache);
    float* scales = role == 0 ? a.k_scale : a.v_scale;
    int64_t base = b * st[0] + h * st[1] + q * st[2];
    DType in_dtype = a.in_dtype;
    int64_t stride = st[3];
    if (role == 0 ? a.k_rot : a.v_rot) {
      // Rotate the row in registers, then quantize it from this warp's shared buffer (fp32, unit stride).
      float x[kMaxPerLane];
#pragma unroll
      for (int k = 0; k < kMaxPerLane; ++k) {
        const int64_t d = lane + 32 * k;
        x[k] = d < D ? load_any(src, base + d * st[3], a.in_dtype) : 0.f;
      }
      warp_rotate(x, D, lane);
      float* buf = rotated[threadIdx.x / 32];
#pragma unroll
      for (int k = 0; k < kMaxPerLane; ++k) {
        if (lane + 32 * k < D) buf[lane + 32 * k] = x[k];
      }
      __syncwarp();
      src = buf;
      base = 0;
      stride = 1;
      in_dtype = DType::kFloat32;
    }
    if (role == 0 && is_kivi(kind)) continue;  // kivi keys: whole pages, append_kivi_key_kernel
    if (is_kivi(kind)) {
      // Values: one group of 32 dims per warp step, lane i holds dim 32 g + i; codes packed in planes:
      // lanes < 4 bits gather the codes of lanes + 4 bits, + 8 bits, ... into their byte.
      const int bits = kivi_bits(kind), span = 4 * bits;
      const int64_t row_idx = L.row_index(block, h, pos);
      uint8_t* codes = reinterpret_cast<uint8_t*>(pool) + row_idx * D * bits / 8;
      uint16_t* meta = reinterpret_cast<uint16_t*>(scales) + row_idx * (D / 32) * 2;
      for (int64_t g = 0; g < D / 32; ++g) {
        const float x = load_any(src, base + (g * 32 + lane) * stride, in_dtype);
        float mn, mx;
        const bool nan = warp_group_stats(x, mn, mx);
        const uint32_t code = quant::uint_encode(x, mn, quant::uint_inv_scale(mn, mx, bits), bits);
        uint32_t byte = code;
        for (int s = 1; s < 8 / bits; ++s) byte |= __shfl_down_sync(0xffffffffu, code, s * span) << (s * bits);
        if (lane < span) codes[g * span + lane] = static_cast<uint8_t>(byte);
        if (lane == 0) {
          meta[2 * g] = group_scale_bits(mn, mx, bits, nan);
          meta[2 * g + 1] = __half_as_ushort(__float2half_rn(mn));
        }
      }
    } else if (kind == KVKind::kFull) {
      for (int64_t d = lane; d < D; d += 32) {
        for (int k = 0; k < elem_bytes; ++k) {
          pool[(off + d) * elem_bytes + k] = static_cast<const char*>(src)[(base + d * st[3]) * elem_bytes + k];
        }
      }
    } else if (kind == KVKind::kInt4) {
      // One group of 32 dims per warp step: lane i holds dim 32 g + i; min/max over the warp.
      const int64_t row_idx = L.row_index(block, h, pos);
      uint8_t* codes = reinterpret_cast<uint8_t*>(pool) + row_idx * D / 2;
      uint16_t* meta = reinterpret_cast<uint16_t*>(scales) + row_idx * (D / kInt4Group) * 2;
      for (int64_t g = 0; g < D / kInt4Group; ++g) {
        const float x = load_any(src, base + (g * kInt4Group + lane) * stride, in_dtype);
        float mn, mx;
        const bool nan = warp_group_stats(x, mn, mx);
        const uint8_t code = quant::uint_encode(x, mn, quant::uint_inv_scale(mn, mx, 4), 4);
        const uint8_t odd = static_cast<uint8_t>(__shfl_down_sync(0xffffffffu, code, 1));
        if ((lane & 1) == 0) codes[(g * kInt4Group + lane) / 2] = static_cast<uint8_t>(code | (odd << 4));
        if (lane == 0) {
          meta[2 * g] = group_scale_bits(mn, mx, 4, nan);
          meta[2 * g + 1] = __half_as_ushort(__float2half_rn(mn));
        }
      }
    } else if (kind == KVKind::kInt8) {
      float amax = 0.f;
      int nan = 0;
      for (int64_t d = lane; d < D; d += 32) {
        const float x = load_any(src, base + d * stride, in_dtype);
        amax = fmaxf(amax, quant::int8_abs(x));
        nan |= quant::is_nan(x);
      }
      amax = warp_max(amax);
      for (int o = 16; o > 0; o >>= 1) nan |= __shfl_xor_sync(0xffffffffu, nan, o);
      const float inv = quant::int8_inv_scale(amax);
      for (int64_t d = lane; d < D; d += 32) {
        reinterpret_cast<int8_t*>(pool)[off + d] = quant::int8_encode(load_any(src, base + d * stride, in_dtype), inv);
      }
      if (lane == 0) scales[L.row_index(block, h, pos)] = quant::int8_scale(amax, nan != 0);
    } else {
      const quant::Fp8Spec spec = kind == KVKind::kFp8E4M3 ? quant::kE4M3 : quant::kE5M2;
      const float inv = 1.f / scales[h];
      for (int64_t d = lane; d < D; d += 32) {
        reinterpret_cast<uint8_t*>(pool)[off + d] = quant::fp8_encode(load_any(src, base + d * stride, in_dtype) * inv, spec);
      }
    }
    __syncwarp();  // the row buffer is read by all lanes before the next role rewrites it
  }
}

/// KIVI key pages of an append (validated: whole pages in order, or -1): one warp per (page of a row,
/// kv head); per 32-channel chunk, lane i owns channel 32 c + i: min/max over the page's tokens, then
/// each token's codes, packed in planes as for values.
__global__ void append_kivi_key_kernel(AppendArgs a) {
  const PagedLayout L = a.layout;
  const int64_t H = L.num_kv_heads, D = L.head_dim, P = L.page_size, per_row = a.q_len / P;
  const int64_t item = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (item >= a.batch * per_row * H) return;  // whole warps exit together
  const int64_t h = item % H, page = item / H, b = page / per_row, t0 = (page % per_row) * P;
  const int64_t slot = a.slots[b * a.slot_strides[0] + t0 * a.slot_strides[1]];
  if (slot < 0) return;
  const int64_t block = L.block_of(slot);
  const int bits = kivi_bits(a.k_kind), span = 4 * bits;
  const int64_t row_bytes = D * bits / 8;
  const int64_t* st = a.key_strides;
  const int64_t base = b * st[0] + h * st[1] + t0 * st[2];
  uint8_t* codes = static_cast<uint8_t*>(a.k_cache) + L.row_index(block, h, 0) * row_bytes;
  uint16_t* meta = reinterpret_cast<uint16_t*>(a.k_scale) + (block * H + h) * 2 * D;
  for (int64_t c = 0; c < D / 32; ++c) {
    const int64_t d = 32 * c + lane;
    float mn = INFINITY, mx = -INFINITY;  // over the page's finite values: a bad token's NaN / Inf stays out
    for (int64_t t = 0; t < P; ++t) {
      const float x = load_any(a.key, base + t * st[2] + d * st[3], a.in_dtype);
      mn = fminf(mn, quant::uint_low(x));
      mx = fmaxf(mx, quant::uint_high(x));
    }
    quant::uint_finish(mn, mx);
    const float inv = quant::uint_inv_scale(mn, mx, bits);
    for (int64_t t = 0; t < P; ++t) {
      const uint32_t code = quant::uint_encode(load_any(a.key, base + t * st[2] + d * st[3], a.in_dtype), mn, inv, bits);
      uint32_t byte = code;
      for (int s = 1; s < 8 / bits; ++s) byte |= __shfl_down_sync(0xffffffffu, code, s * span) << (s * bits);
      if (lane < span) codes[t * row_bytes + c * span + lane] = static_cast<uint8_t>(byte);
    }
    meta[quant::kivi_key_scale_at(d)] = __half_as_ushort(__float2half_rn(quant::uint_scale(mn, mx, bits)));
    meta[quant::kivi_key_zero_at(d)] = __half_as_ushort(__float2half_rn(mn));
  }
}

/// Dequantizing gather. grid.x = batch * num_kv_heads; threads stride over (token, dim) of the sequence,
/// first of K, then of V (their rows may differ in width).
/// Padded (ragged = false): out [batch, H, max_len, D], rows past the length zeroed. Ragged: [total, H, D].
__global__ void gather_dequantized_kernel(GatherArgs a, bool ragged) {
  const int64_t H = a.layout.num_kv_heads;
  const int64_t bh = blockIdx.x, b = bh / H, h = bh % H;
  const int64_t start = ragged ? a.cu_seq_lens[b] : 0;
  const int64_t len = ragged ? a.cu_seq_lens[b + 1] - start : a.seq_lens[b];
  const int64_t rows = ragged ? len : a.max_len;
  const int32_t* table = a.block_table + b * a.table_stride;
  for (int role = 0; role < 2; ++role) {
    const PagedLayout L = a.layout.side(role == 1);  // this side's pool: its row width
    const int64_t D = L.head_dim;
    const KVKind kind = role == 0 ? a.k_kind : a.v_kind;
    const float* scales = role == 0 ? a.k_scale : a.v_scale;
    const char* pool = static_cast<const char*>(role == 0 ? a.k_cache : a.v_cache);
    void* out = role == 0 ? a.k_out : a.v_out;
    for (int64_t i = threadIdx.x; i < rows * D; i += blockDim.x) {
      const int64_t t = i / D, d = i % D;
      const int64_t dst = ragged ? ((start + t) * H + h) * D + d : (bh * a.max_len + t) * D + d;
      if (t >= len) {
        store_any(out, dst, a.out_dtype, 0.f);
        continue;
      }
      const int64_t block = table[t >> L.page_shift], pos = t & (L.page_size - 1), off = L.offset(block, h, pos);
      const int64_t r = L.row_index(block, h, pos);
      const float s = kind == KVKind::kInt8 ? scales[r]
                      : (kind == KVKind::kFp8E4M3 || kind == KVKind::kFp8E5M2 ? scales[h] : 1.f);
      store_any(out, dst, a.out_dtype, dequantize(pool, off, d, kind, s, a.out_dtype, scales, L, role == 0));
    }
  }
}

/// Dequantizing gather when K or V rows are Hadamard-rotated: one warp per token row (the inverse
/// transform needs the whole row). grid.x = batch * num_kv_heads; warps stride over the rows.
__global__ void gather_rotated_kernel(GatherArgs a, bool ragged) {
  const int64_t H = a.layout.num_kv_heads;
  const int64_t bh = blockIdx.x, b = bh / H, h = bh % H;
  const int64_t start = ragged ? a.cu_seq_lens[b] : 0;
  const int64_t len = ragged ? a.cu_seq_lens[b + 1] - start : a.seq_lens[b];
  const int64_t rows = ragged ? len : a.max_len;
  const int32_t* table = a.block_table + b * a.table_stride;
  const int lane = threadIdx.x % 32;
  for (int64_t t = threadIdx.x / 32; t < rows; t += blockDim.x / 32) {
    for (int role = 0; role < 2; ++role) {
      const PagedLayout L = a.layout.side(role == 1);  // this side's pool: its row width
      const int64_t D = L.head_dim;
      const int64_t dst = ragged ? ((start + t) * H + h) * D : (bh * a.max_len + t) * D;
      void* out = role == 0 ? a.k_out : a.v_out;
      const KVKind kind = role == 0 ? a.k_kind : a.v_kind;
      const float* scales = role == 0 ? a.k_scale : a.v_scale;
      const char* pool = static_cast<const char*>(role == 0 ? a.k_cache : a.v_cache);
      const int64_t block = t < len ? table[t >> L.page_shift] : 0, pos = t & (L.page_size - 1);
      const int64_t off = L.offset(block, h, pos), r = L.row_index(block, h, pos);
      const float s = t >= len ? 0.f
                      : kind == KVKind::kInt8 ? scales[r]
                      : (kind == KVKind::kFp8E4M3 || kind == KVKind::kFp8E5M2 ? scales[h] : 1.f);
      if (!(role == 0 ? a.k_rot : a.v_rot)) {  // the other side's rows, of any width (K and V may differ)
        for (int64_t d = lane; d < D; d += 32) {
          store_any(out, dst + d, a.out_dtype, t < len ? dequantize(pool, off, d, kind, s, a.out_dtype, scales, L, role == 0) : 0.f);
        }
        continue;
      }
      float x[kMaxPerLane];
#pragma unroll
      for (int k = 0; k < kMaxPerLane; ++k) x[k] = 0.f;
      if (t < len) {  // uniform across the warp
#pragma unroll
        for (int k = 0; k < kMaxPerLane; ++k) {
          const int64_t d = lane + 32 * k;
          if (d < D) x[k] = dequantize(pool, off, d, kind, s, a.out_dtype, scales, L, role == 0);
        }
        warp_unrotate(x, D, lane);
      }
#pragma unroll
      for (int k = 0; k < kMaxPerLane; ++k) {
        const int64_t d = lane + 32 * k;
        if (d < D) store_any(out, dst + d, a.out_dtype, x[k]);
      }
    }
  }
}

unsigned grid_y(int64_t rows) {
  const int64_t chunks = (rows + kRowsPerCta - 1) / kRowsPerCta;
  return static_cast<unsigned>(chunks < 1 ? 1 : (chunks > kMaxGridY ? kMaxGridY : chunks));
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

cudaError_t launch_append(const AppendArgs& a, int elem_bytes, cudaStream_t stream) {
  const int64_t tokens = a.batch * a.q_len;
  if (tokens == 0) return cudaSuccess;
  if (elem_bytes == 4) {
    KVC_LAUNCH(static_cast<unsigned>(tokens), kThreads, stream, append_kernel<uint32_t>)(a);
  } else {
    KVC_LAUNCH(static_cast<unsigned>(tokens), kThreads, stream, append_kernel<uint16_t>)(a);
  }
  return cudaGetLastError();
}

cudaError_t launch_gather_padded(const GatherArgs& a, int elem_bytes, cudaStream_t stream) {
  const int64_t bh = a.batch * a.layout.num_kv_heads;
  if (bh == 0 || a.max_len == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(bh), grid_y(a.max_len));
  const int64_t wider = a.layout.head_dim > a.layout.v_head_dim ? a.layout.head_dim : a.layout.v_head_dim;
  const int threads = wider < kThreads ? static_cast<int>(wider) : kThreads;
  if (elem_bytes == 4) {
    KVC_LAUNCH(grid, threads, stream, gather_padded_kernel<uint32_t>)(a);
  } else {
    KVC_LAUNCH(grid, threads, stream, gather_padded_kernel<uint16_t>)(a);
  }
  return cudaGetLastError();
}

cudaError_t launch_gather_ragged(const GatherArgs& a, int elem_bytes, cudaStream_t stream) {
  const int64_t bh = a.batch * a.layout.num_kv_heads;
  if (bh == 0) return cudaSuccess;
  // Lengths live on the device; a fixed grid.y strides over however many rows each sequence has.
  const dim3 grid(static_cast<unsigned>(bh), 64);
  const int64_t wider = a.layout.head_dim > a.layout.v_head_dim ? a.layout.head_dim : a.layout.v_head_dim;
  const int threads = wider < kThreads ? static_cast<int>(wider) : kThreads;
  if (elem_bytes == 4) {
    KVC_LAUNCH(grid, threads, stream, gather_ragged_kernel<uint32_t>)(a);
  } else {
    KVC_LAUNCH(grid, threads, stream, gather_ragged_kernel<uint16_t>)(a);
  }
  return cudaGetLastError();
}

cudaError_t launch_append_quantized(const AppendArgs& a, int elem_bytes, cudaStream_t stream) {
  const int64_t rows = a.batch * a.q_len * a.layout.num_kv_heads;
  if (rows == 0) return cudaSuccess;
  const int warps_per_block = kThreads / 32;
  const auto row_blocks = static_cast<unsigned>((rows + warps_per_block - 1) / warps_per_block);
  KVC_LAUNCH(row_blocks, kThreads, stream, append_quantized_kernel)(a, elem_bytes);
  if (is_kivi(a.k_kind)) {
    const int64_t pages = a.batch * (a.q_len / a.layout.page_size) * a.layout.num_kv_heads;
    if (pages > 0) {
      const auto page_blocks = static_cast<unsigned>((pages + warps_per_block - 1) / warps_per_block);
      KVC_LAUNCH(page_blocks, kThreads, stream, append_kivi_key_kernel)(a);
    }
  }
  return cudaGetLastError();
}

cudaError_t launch_gather_dequantized(const GatherArgs& a, bool ragged, cudaStream_t stream) {
  const int64_t bh = a.batch * a.layout.num_kv_heads;
  if (bh == 0) return cudaSuccess;
  if (a.k_rot || a.v_rot) {
    KVC_LAUNCH(static_cast<unsigned>(bh), kThreads, stream, gather_rotated_kernel)(a, ragged);
    return cudaGetLastError();
  }
  KVC_LAUNCH(static_cast<unsigned>(bh), kThreads, stream, gather_dequantized_kernel)(a, ragged);
  return cudaGetLastError();
}

cudaError_t launch_swap_blocks(const BlockCopyArgs& a, cudaStream_t stream) {
  for (int64_t i = 0; i < a.n; ++i) {
    const int64_t src = a.pairs[2 * i], dst = a.pairs[2 * i + 1];
    for (int kv = 0; kv < 2; ++kv) {
      const int64_t bytes = kv == 0 ? a.block_bytes : a.v_block_bytes;  // K and V blocks may differ in size
      const char* from = (kv == 0 ? a.k_src : a.v_src) + src * bytes;
      char* to = (kv == 0 ? a.k_dst : a.v_dst) + dst * bytes;
      const cudaError_t err = cudaMemcpyAsync(to, from, bytes, cudaMemcpyDefault, stream);
      if (err != cudaSuccess) return err;
    }
  }
  return cudaSuccess;
}

cudaError_t launch_copy_blocks(const BlockCopyArgs& a, cudaStream_t stream) {
  if (a.n == 0 || (a.block_bytes == 0 && a.v_block_bytes == 0)) return cudaSuccess;
  const bool wide = a.block_bytes % 16 == 0 && a.v_block_bytes % 16 == 0 && aligned16(a.k_src) && aligned16(a.v_src) &&
                    aligned16(a.k_dst) && aligned16(a.v_dst);
  if (wide) {
    KVC_LAUNCH(static_cast<unsigned>(a.n), kThreads, stream, copy_blocks_kernel<uint4>)(a);
  } else {
    KVC_LAUNCH(static_cast<unsigned>(a.n), kThreads, stream, copy_blocks_kernel<uint8_t>)(a);
  }
  return cudaGetLastError();
}

}  // namespace kvcache::cuda
