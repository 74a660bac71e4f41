// CUDA kernels of the cache ops. No GPU runs them where this is developed (the test suite runs them
// on the CPU under csrc/cuda_emulation), so they stay as plain as possible: one thread per copy unit,
// the same PagedLayout accessors as the CPU kernels, offsets in int64, and every launch checked.
// Full-precision rows move in 16-byte units (uint4) whenever every row and base pointer allows it: the
// launchers then hand the kernels a layout counted in 16-byte words (in_units), so the kernels are the
// same for both widths. Index divisions within a CTA's work are 32-bit (no 64-bit division calls).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cache/cache_cuda_launch.h"
#include "core/cuda_launch.cuh"
#include "core/dtype_cuda.cuh"
#include "core/warp_reduce.cuh"
#include "cache/dequant_cuda.cuh"
#include "cache/rotation_cuda.cuh"
#include "core/quant.h"

namespace kvcache::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerCta = 16;     // token rows one CTA of the gather kernels handles per step
constexpr int kMaxGridY = 65535;
constexpr unsigned kRaggedGridY = 64;  // chunks of rows per (sequence, head) when the lengths are on the device
constexpr int kMaxPerLane = 8;      // rotated rows: head_dim <= 256, dims lane + 32 k per lane

/// One CTA per token (b, q); its threads copy the num_kv_heads x head_dim units of K and the
/// num_kv_heads x v_head_dim units of V (a unit is an element, or 16 bytes when the launcher widened it).
template <typename U>
__global__ void append_kernel(AppendArgs a) {
  const unsigned token = blockIdx.x, q_len = static_cast<unsigned>(a.q_len);
  const int64_t b = token / q_len, q = token % q_len;
  const int64_t slot = a.slots[b * a.slot_strides[0] + q * a.slot_strides[1]];
  if (slot < 0) return;
  for (int role = 0; role < 2; ++role) {
    const PagedLayout L = a.layout.side(role == 1);  // this side's pool: its row width
    const U* src = static_cast<const U*>(role == 0 ? a.key : a.value);
    const int64_t* st = role == 0 ? a.key_strides : a.value_strides;
    U* pool = static_cast<U*>(role == 0 ? a.k_cache : a.v_cache);
    const unsigned D = static_cast<unsigned>(L.head_dim), n = static_cast<unsigned>(L.num_kv_heads) * D;
    const int64_t row0 = b * st[0] + q * st[2];
    for (unsigned i = threadIdx.x; i < n; i += blockDim.x) {
      const unsigned h = i / D, d = i % D;
      pool[L.slot_offset(slot, h) + d] = src[row0 + h * st[1] + d * st[3]];
    }
  }
}

/// Copies rows [t0, t0 + n) of (sequence b, KV head h) of one pool to out (row r at out + r * out_stride),
/// zeros for rows at or past len; threads stride over the n x head_dim units.
template <typename U>
__device__ __forceinline__ void gather_rows(const PagedLayout& L, const U* pool, const int32_t* table, int64_t h,
                                            int64_t t0, unsigned n, int64_t len, U* out, int64_t out_stride) {
  const unsigned D = static_cast<unsigned>(L.head_dim);
  for (unsigned i = threadIdx.x; i < n * D; i += blockDim.x) {
    const unsigned r = i / D, d = i % D;
    const int64_t t = t0 + r;
    U v{};
    if (t < len) v = pool[L.token_offset(table[t >> L.page_shift], h, t) + d];
    out[r * out_stride + d] = v;
  }
}

/// grid.x = batch * num_kv_heads; grid.y strides over chunks of kRowsPerCta rows of max_len.
template <typename U>
__global__ void gather_padded_kernel(GatherArgs a) {
  const PagedLayout K = a.layout.side(false), V = a.layout.side(true);  // K and V rows may differ in width
  const int64_t H = a.layout.num_kv_heads, D = K.head_dim, Dv = V.head_dim;
  const unsigned bh = blockIdx.x, heads = static_cast<unsigned>(H);  // 32-bit: no 64-bit division call
  const int64_t b = bh / heads, h = bh % heads;
  const int64_t len = a.seq_lens[b];
  const int32_t* table = a.block_table + b * a.table_stride;
  U* ko = static_cast<U*>(a.k_out) + bh * a.max_len * D;
  U* vo = static_cast<U*>(a.v_out) + bh * a.max_len * Dv;
  for (int64_t t0 = int64_t(blockIdx.y) * kRowsPerCta; t0 < a.max_len; t0 += int64_t(gridDim.y) * kRowsPerCta) {
    const unsigned n = static_cast<unsigned>(min(int64_t(kRowsPerCta), a.max_len - t0));
    gather_rows(K, static_cast<const U*>(a.k_cache), table, h, t0, n, len, ko + t0 * D, D);
    gather_rows(V, static_cast<const U*>(a.v_cache), table, h, t0, n, len, vo + t0 * Dv, Dv);
  }
}

/// grid.x = batch * num_kv_heads; grid.y strides over chunks of each sequence's rows.
template <typename U>
__global__ void gather_ragged_kernel(GatherArgs a) {
  const PagedLayout K = a.layout.side(false), V = a.layout.side(true);
  const int64_t H = a.layout.num_kv_heads, D = K.head_dim, Dv = V.head_dim;
  const unsigned bh = blockIdx.x, heads = static_cast<unsigned>(H);  // 32-bit: no 64-bit division call
  const int64_t b = bh / heads, h = bh % heads;
  const int64_t start = a.cu_seq_lens[b], len = a.cu_seq_lens[b + 1] - start;
  const int32_t* table = a.block_table + b * a.table_stride;
  U* ko = static_cast<U*>(a.k_out);
  U* vo = static_cast<U*>(a.v_out);
  for (int64_t t0 = int64_t(blockIdx.y) * kRowsPerCta; t0 < len; t0 += int64_t(gridDim.y) * kRowsPerCta) {
    const unsigned n = static_cast<unsigned>(min(int64_t(kRowsPerCta), len - t0));
    const int64_t row = (start + t0) * H + h;  // out rows of one head are H rows apart
    gather_rows(K, static_cast<const U*>(a.k_cache), table, h, t0, n, len, ko + row * D, H * D);
    gather_rows(V, static_cast<const U*>(a.v_cache), table, h, t0, n, len, vo + row * Dv, H * Dv);
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
__global__ void __launch_bounds__(kThreads, 4) append_quantized_kernel(AppendArgs a, int elem_bytes) {
  KVC_SHARED(float, rotated, [kThreads / 32][kMaxPerLane * 32]);  // one row buffer per warp
  const int64_t H = a.layout.num_kv_heads;
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= a.batch * a.q_len * H) return;  // whole warps exit together
  // 32-bit index arithmetic (rows < 2^32: the grid counts them in 32 bits): no 64-bit division calls
  const unsigned r32 = static_cast<unsigned>(row), H32 = static_cast<unsigned>(H), q_len32 = static_cast<unsigned>(a.q_len);
  const int64_t h = r32 % H32, token = r32 / H32, b = unsigned(token) / q_len32, q = unsigned(token) % q_len32;
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
  const int64_t H = L.num_kv_heads, D = L.head_dim, P = L.page_size, per_row = a.q_len >> L.page_shift;
  const int64_t item = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (item >= a.batch * per_row * H) return;  // whole warps exit together
  // 32-bit index arithmetic (items < 2^32: the grid counts them in 32 bits): no 64-bit division calls
  const unsigned i32 = static_cast<unsigned>(item), H32 = static_cast<unsigned>(H), per_row32 = static_cast<unsigned>(per_row);
  const unsigned page = i32 / H32;
  const int64_t h = i32 % H32, b = page / per_row32, t0 = int64_t(page % per_row32) * P;
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

/// Dequantizing gather. grid.x = batch * num_kv_heads, grid.y strides over chunks of kRowsPerCta rows of
/// the sequence; threads stride over a chunk's (token, unit), first of K, then of V (their rows may differ
/// in width). A unit is 16 bytes of codes, read with one 128-bit load, when kUnits (every row of both pools
/// is a whole number of units and the pools are 16-byte aligned: launch_gather_dequantized checks), else
/// one value. Padded (ragged = false): out [batch, H, max_len, D], rows past the length zeroed. Ragged:
/// [total, H, D].
template <bool kUnits>
__global__ void gather_dequantized_kernel(GatherArgs a, bool ragged) {
  const int64_t H = a.layout.num_kv_heads;
  const unsigned bh = blockIdx.x, heads = static_cast<unsigned>(H);  // 32-bit: no 64-bit division call
  const int64_t b = bh / heads, h = bh % heads;
  const int64_t start = ragged ? a.cu_seq_lens[b] : 0;
  const int64_t len = ragged ? a.cu_seq_lens[b + 1] - start : a.seq_lens[b];
  const int64_t rows = ragged ? len : a.max_len;
  const int32_t* table = a.block_table + b * a.table_stride;
  for (int64_t t0 = int64_t(blockIdx.y) * kRowsPerCta; t0 < rows; t0 += int64_t(gridDim.y) * kRowsPerCta) {
    const unsigned n = static_cast<unsigned>(min(int64_t(kRowsPerCta), rows - t0));
    for (int role = 0; role < 2; ++role) {
      const PagedLayout L = a.layout.side(role == 1);  // this side's pool: its row width
      const int64_t D = L.head_dim;
      const KVKind kind = role == 0 ? a.k_kind : a.v_kind;
      const float* scales = role == 0 ? a.k_scale : a.v_scale;
      const char* pool = static_cast<const char*>(role == 0 ? a.k_cache : a.v_cache);
      void* out = role == 0 ? a.k_out : a.v_out;
      // per row: `units` loads of `dims` values each
      const int64_t row_bytes = code_row_bytes(kind, D, a.out_dtype);  // a full-precision side is stored so
      const unsigned units = kUnits ? static_cast<unsigned>(row_bytes / 16) : static_cast<unsigned>(D);
      const unsigned dims = static_cast<unsigned>(D) / units;
      for (unsigned i = threadIdx.x; i < n * units; i += blockDim.x) {
        const int64_t t = t0 + i / units, d0 = int64_t(i % units) * dims;
        const int64_t dst = (ragged ? ((start + t) * H + h) * D : (bh * a.max_len + t) * D) + d0;
        if (t >= len) {
          for (unsigned k = 0; k < dims; ++k) store_any(out, dst + k, a.out_dtype, 0.f);
          continue;
        }
        const int64_t block = table[t >> L.page_shift], pos = t & (L.page_size - 1);
        const int64_t r = L.row_index(block, h, pos);
        const float s = kind == KVKind::kInt8 ? scales[r]
                        : (kind == KVKind::kFp8E4M3 || kind == KVKind::kFp8E5M2 ? scales[h] : 1.f);
        if constexpr (kUnits) {
          const uint4 w = reinterpret_cast<const uint4*>(pool + r * row_bytes)[i % units];
          dequantize_unit(w, r, d0, dims, kind, a.out_dtype, s, scales, L, role == 0,
                          [&](unsigned k, float v) { store_any(out, dst + k, a.out_dtype, v); });
        } else {
          store_any(out, dst, a.out_dtype, dequantize(pool, r, d0, kind, s, a.out_dtype, scales, L, role == 0));
        }
      }
    }
  }
}

/// Dequantizing gather when K or V rows are Hadamard-rotated: one warp per token row (the inverse
/// transform needs the whole row). grid.x = batch * num_kv_heads; grid.y strides over chunks of
/// kRowsPerCta rows, and warps over a chunk's rows.
__global__ void gather_rotated_kernel(GatherArgs a, bool ragged) {
  const int64_t H = a.layout.num_kv_heads;
  const unsigned bh = blockIdx.x, heads = static_cast<unsigned>(H);  // 32-bit: no 64-bit division call
  const int64_t b = bh / heads, h = bh % heads;
  const int64_t start = ragged ? a.cu_seq_lens[b] : 0;
  const int64_t len = ragged ? a.cu_seq_lens[b + 1] - start : a.seq_lens[b];
  const int64_t rows = ragged ? len : a.max_len;
  const int32_t* table = a.block_table + b * a.table_stride;
  const int lane = threadIdx.x % 32;
  for (int64_t t0 = int64_t(blockIdx.y) * kRowsPerCta; t0 < rows; t0 += int64_t(gridDim.y) * kRowsPerCta) {
    for (int64_t t = t0 + threadIdx.x / 32; t < min(rows, t0 + kRowsPerCta); t += blockDim.x / 32) {
      for (int role = 0; role < 2; ++role) {
        const PagedLayout L = a.layout.side(role == 1);  // this side's pool: its row width
        const int64_t D = L.head_dim;
        const int64_t dst = ragged ? ((start + t) * H + h) * D : (bh * a.max_len + t) * D;
        void* out = role == 0 ? a.k_out : a.v_out;
        const KVKind kind = role == 0 ? a.k_kind : a.v_kind;
        const float* scales = role == 0 ? a.k_scale : a.v_scale;
        const char* pool = static_cast<const char*>(role == 0 ? a.k_cache : a.v_cache);
        const int64_t block = t < len ? table[t >> L.page_shift] : 0, pos = t & (L.page_size - 1);
        const int64_t r = L.row_index(block, h, pos);
        const float s = t >= len ? 0.f
                        : kind == KVKind::kInt8 ? scales[r]
                        : (kind == KVKind::kFp8E4M3 || kind == KVKind::kFp8E5M2 ? scales[h] : 1.f);
        if (!(role == 0 ? a.k_rot : a.v_rot)) {  // the other side's rows, of any width (K and V may differ)
          for (int64_t d = lane; d < D; d += 32) {
            store_any(out, dst + d, a.out_dtype, t < len ? dequantize(pool, r, d, kind, s, a.out_dtype, scales, L, role == 0) : 0.f);
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
            if (d < D) x[k] = dequantize(pool, r, d, kind, s, a.out_dtype, scales, L, role == 0);
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
}

unsigned grid_y(int64_t rows) {
  const int64_t chunks = (rows + kRowsPerCta - 1) / kRowsPerCta;
  return static_cast<unsigned>(chunks < 1 ? 1 : (chunks > kMaxGridY ? kMaxGridY : chunks));
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

/// Whether K and V rows of elem_bytes-wide elements are whole numbers of 16-byte units (then every row of
/// a 16-byte-aligned pool starts on 16 bytes).
bool wide_rows(const PagedLayout& L, int elem_bytes) {
  return (L.head_dim * elem_bytes) % 16 == 0 && (L.v_head_dim * elem_bytes) % 16 == 0;
}

/// The layout counted in 16-byte units instead of elem_bytes-wide elements (wide_rows holds).
PagedLayout in_units(PagedLayout L, int elem_bytes) {
  L.head_dim = L.head_dim * elem_bytes / 16;
  L.v_head_dim = L.v_head_dim * elem_bytes / 16;
  return L;
}

/// Whether the pools' rows can move in 16-byte units: every K and V row a whole number of units, both pools
/// 16-byte aligned (then every row starts on 16 bytes). append and gather add their other operands' terms.
bool wide_pools(const PagedLayout& L, int elem_bytes, const void* k_cache, const void* v_cache) {
  return wide_rows(L, elem_bytes) && aligned16(k_cache) && aligned16(v_cache);
}

/// Runs launch(unit, args) with the widest copy unit gather's pools and outputs allow: 16 bytes (args in
/// units), else the element.
template <class Launch>
void by_gather_unit(const GatherArgs& a, int elem_bytes, Launch launch) {
  if (wide_pools(a.layout, elem_bytes, a.k_cache, a.v_cache) && aligned16(a.k_out) && aligned16(a.v_out)) {
    GatherArgs w = a;
    w.layout = in_units(a.layout, elem_bytes);
    launch(uint4{}, w);
  } else if (elem_bytes == 4) {
    launch(uint32_t{}, a);
  } else {
    launch(uint16_t{}, a);
  }
}

}  // namespace

cudaError_t launch_append(const AppendArgs& a, int elem_bytes, cudaStream_t stream) {
  const int64_t tokens = a.batch * a.q_len;
  if (tokens == 0) return cudaSuccess;
  // 16-byte units when every row of the pools and of key / value starts on 16 bytes and is a whole number
  // of units, and key / value rows are contiguous (any other stride of theirs a multiple of 16 bytes).
  const auto wide_src = [&](const void* p, const int64_t* st) {
    return aligned16(p) && st[3] == 1 && (st[0] * elem_bytes) % 16 == 0 && (st[1] * elem_bytes) % 16 == 0 &&
           (st[2] * elem_bytes) % 16 == 0;
  };
  if (wide_pools(a.layout, elem_bytes, a.k_cache, a.v_cache) && wide_src(a.key, a.key_strides) &&
      wide_src(a.value, a.value_strides)) {
    AppendArgs w = a;
    w.layout = in_units(a.layout, elem_bytes);
    for (int i = 0; i < 3; ++i) {
      w.key_strides[i] = a.key_strides[i] * elem_bytes / 16;
      w.value_strides[i] = a.value_strides[i] * elem_bytes / 16;
    }
    KVC_LAUNCH(static_cast<unsigned>(tokens), kThreads, stream, append_kernel<uint4>)(w);
  } else if (elem_bytes == 4) {
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
  by_gather_unit(a, elem_bytes, [&](auto unit, const GatherArgs& args) {
    KVC_LAUNCH(grid, kThreads, stream, gather_padded_kernel<decltype(unit)>)(args);
  });
  return cudaGetLastError();
}

cudaError_t launch_gather_ragged(const GatherArgs& a, int elem_bytes, cudaStream_t stream) {
  const int64_t bh = a.batch * a.layout.num_kv_heads;
  if (bh == 0) return cudaSuccess;
  // Lengths live on the device; a fixed grid.y strides over however many rows each sequence has.
  const dim3 grid(static_cast<unsigned>(bh), kRaggedGridY);
  by_gather_unit(a, elem_bytes, [&](auto unit, const GatherArgs& args) {
    KVC_LAUNCH(grid, kThreads, stream, gather_ragged_kernel<decltype(unit)>)(args);
  });
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
  if (!ragged && a.max_len == 0) return cudaSuccess;
  // (sequence, head, chunk of rows): a batch-1 gather of a long sequence spreads over many CTAs.
  const dim3 grid(static_cast<unsigned>(bh), ragged ? kRaggedGridY : grid_y(a.max_len));
  if (a.k_rot || a.v_rot) {
    KVC_LAUNCH(grid, kThreads, stream, gather_rotated_kernel)(a, ragged);
    return cudaGetLastError();
  }
  // 128-bit loads when every row of both pools is a whole number of 16-byte units (the pool tensors start
  // on 16 bytes, so every row does): int8 / fp8 head dims of 16 k, int4 / kivi4 32 k, kivi2 64 k.
  const bool units = whole_units(a.k_cache, a.k_kind, a.layout.head_dim, a.out_dtype) &&
                     whole_units(a.v_cache, a.v_kind, a.layout.v_head_dim, a.out_dtype);
  if (units) {
    KVC_LAUNCH(grid, kThreads, stream, gather_dequantized_kernel<true>)(a, ragged);
  } else {
    KVC_LAUNCH(grid, kThreads, stream, gather_dequantized_kernel<false>)(a, ragged);
  }
  return cudaGetLastError();
}

cudaError_t launch_swap_blocks(const BlockCopyArgs& a, cudaStream_t stream) {
  for (const BlockRun& run : block_runs(a.pairs, a.n)) {  // runs of consecutive blocks: one copy per pool
    for (int kv = 0; kv < 2; ++kv) {
      const int64_t bytes = kv == 0 ? a.block_bytes : a.v_block_bytes;  // K and V blocks may differ in size
      const char* from = (kv == 0 ? a.k_src : a.v_src) + run.src * bytes;
      char* to = (kv == 0 ? a.k_dst : a.v_dst) + run.dst * bytes;
      const cudaError_t err = cudaMemcpyAsync(to, from, run.count * bytes, cudaMemcpyDefault, stream);
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
