// The CUDA kernel of absorbed MLA attention (semantics: mla/mla_args.h). No GPU runs it where this is
// developed: the test suite runs it on the CPU under csrc/cuda_emulation. It is written plainly, for
// correctness first: one CTA per (query token, query head); per tile of 128 keys each thread scores one key
// against the query held in shared memory, the CTA reduces the tile's max and sum once (one rescale per
// tile), then each thread accumulates its own output dims (d = tid + 128 k) over the tile's keys, reading
// the latent rows coalesced. Quantized rows are dequantized in registers (cache/dequant_cuda.cuh).
// NOTE: a CTA per query head re-reads the latent rows for every head of the group; the GQA-shared,
// tensor-core version is the CUDA kernels' own issue (split-K and tiles of heads).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cache/dequant_cuda.cuh"
#include "core/cuda_launch.cuh"
#include "core/dtype_cuda.cuh"
#include "mla/mla_cuda_launch.h"

namespace kvcache::cuda {
namespace {

constexpr int kThreads = 128;  // = keys per tile
constexpr int kWarps = kThreads / 32;
constexpr int kMaxPerThread = static_cast<int>(kMlaMaxLatentDim / kThreads);

/// Max (kMax) or sum of x over the CTA; every thread gets the result.
template <bool kMax>
__device__ __forceinline__ float cta_reduce(float x, float* warp_vals) {
  for (int off = 16; off > 0; off >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, off);
    x = kMax ? fmaxf(x, y) : x + y;
  }
  if (threadIdx.x % 32 == 0) warp_vals[threadIdx.x / 32] = x;
  __syncthreads();
  float r = warp_vals[0];
  for (int w = 1; w < kWarps; ++w) r = kMax ? fmaxf(r, warp_vals[w]) : r + warp_vals[w];
  __syncthreads();  // every thread has read warp_vals before the next reduction writes it
  return r;
}

/// q[0 .. D) . row `row` of a pool (kind, dtype, scale s, scales: dequantize's arguments), summed in dim order:
/// by 16-byte units when `units` (the same values as dequantize, the same order, so the same sum), else one
/// value per load.
__device__ __forceinline__ float row_dot(const float* q, const char* pool, int64_t row, const PagedLayout& L,
                                         KVKind kind, DType dtype, float s, const float* scales, bool key, bool units) {
  float dot = 0.f;
  const int64_t D = L.head_dim;
  if (units) {
    const int64_t row_bytes = code_row_bytes(kind, D, dtype);
    const unsigned n = static_cast<unsigned>(row_bytes / 16), dims = static_cast<unsigned>(D) / n;
    const uint4* src = reinterpret_cast<const uint4*>(pool + row * row_bytes);
    for (unsigned u = 0; u < n; ++u) {
      const uint4 w = src[u];  // a copy: one 128-bit load (a reference into global memory loaded word by word)
      const float* qu = q + u * dims;
      dequantize_unit(w, row, int64_t(u) * dims, dims, kind, dtype, s, scales, L, key,
                      [&](unsigned k, float v) { dot += qu[k] * v; });
    }
    return dot;
  }
  for (int64_t d = 0; d < D; ++d) dot += q[d] * dequantize(pool, row, d, kind, s, dtype, scales, L, key);
  return dot;
}

/// A stored row's scale argument of `dequantize`: the row's int8 scale or the head's fp8 scale.
__device__ __forceinline__ float row_scale(KVKind kind, const float* scales, const PagedLayout& L, int64_t block,
                                           int64_t h, int64_t pos) {
  if (kind == KVKind::kInt8) return scales[L.row_index(block, h, pos)];
  if (kind == KVKind::kFp8E4M3 || kind == KVKind::kFp8E5M2) return scales[h];
  return 1.f;
}

__global__ void mla_attention_kernel(MlaArgs a) {
  const int64_t tok = blockIdx.x, hq = blockIdx.y;
  const int tid = threadIdx.x;
  // the token's sequence: the last b with cu_q_lens[b] <= tok
  int64_t lo = 0, hi = a.batch;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (a.cu_q_lens[mid] <= tok) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const int64_t b = lo, q_start = a.cu_q_lens[b], q_len = a.cu_q_lens[b + 1] - q_start;
  const int64_t pos = a.kv_lens[b] - q_len + (tok - q_start);  // keys 0..pos are visible
  const int64_t h = static_cast<unsigned>(hq) / static_cast<unsigned>(a.group);  // 32-bit: no 64-bit division call
  const PagedLayout Ll = a.layout.side(false), Lr = a.layout.side(true);
  const int64_t Dl = Ll.head_dim, Dr = Lr.head_dim;
  const char* latent = static_cast<const char*>(a.latent_cache);
  const char* rope = static_cast<const char*>(a.rope_cache);
  const int32_t* table = a.block_tables + b * a.table_stride;
  const bool latent_units = whole_units(latent, a.latent_kind, Ll.head_dim, a.latent_dtype);
  const bool rope_units = Dr > 0 && whole_units(rope, a.rope_kind, Lr.head_dim, a.rope_dtype);

  KVC_SHARED(float, q, [kMlaMaxLatentDim + kMlaMaxRopeDim]);
  KVC_SHARED(float, p, [kThreads]);
  KVC_SHARED(float, warp_vals, [kWarps]);
  for (int64_t d = tid; d < Dl + Dr; d += kThreads) {
    q[d] = a.scale * (d < Dl ? load_any(a.q_latent, tok * a.ql_strides[0] + hq * a.ql_strides[1] + d * a.ql_strides[2], a.q_dtype)
                             : load_any(a.q_rope, tok * a.qr_strides[0] + hq * a.qr_strides[1] + (d - Dl) * a.qr_strides[2], a.q_dtype));
  }
  __syncthreads();

  float acc[kMaxPerThread];
  for (int k = 0; k < kMaxPerThread; ++k) acc[k] = 0.f;
  float m = -INFINITY, l = 0.f;
  for (int64_t j0 = 0; j0 <= pos; j0 += kThreads) {
    const int64_t j = j0 + tid;
    float s = -INFINITY;
    if (j <= pos) {  // this thread's key: its score
      const int64_t block = table[j >> Ll.page_shift], pp = j & (Ll.page_size - 1);
      const int64_t row = Ll.row_index(block, h, pp);  // the same row of both pools (only their widths differ)
      const float sl = row_scale(a.latent_kind, a.latent_scale, Ll, block, h, pp);
      const float sr = row_scale(a.rope_kind, a.rope_scale, Lr, block, h, pp);
      s = row_dot(q, latent, row, Ll, a.latent_kind, a.latent_dtype, sl, a.latent_scale, true, latent_units) +
          row_dot(q + Dl, rope, row, Lr, a.rope_kind, a.rope_dtype, sr, a.rope_scale, false, rope_units);
    }
    const float m_new = fmaxf(m, cta_reduce<true>(s, warp_vals));
    const float alpha = expf(m - m_new);  // 0 on the first tile (m = -inf)
    const float pj = j <= pos ? expf(s - m_new) : 0.f;
    l = l * alpha + cta_reduce<false>(pj, warp_vals);
    m = m_new;
    p[tid] = pj;
    __syncthreads();
    for (int k = 0; k < kMaxPerThread; ++k) acc[k] *= alpha;
    const int64_t nk = pos + 1 - j0 < kThreads ? pos + 1 - j0 : kThreads;
    for (int64_t t = 0; t < nk; ++t) {  // each thread its dims of sum_t p_t c_t
      const int64_t key = j0 + t, block = table[key >> Ll.page_shift], pp = key & (Ll.page_size - 1);
      const int64_t row = Ll.row_index(block, h, pp);
      const float sl = row_scale(a.latent_kind, a.latent_scale, Ll, block, h, pp);
      const float pt = p[t];
      for (int k = 0; k < kMaxPerThread; ++k) {
        const int64_t d = tid + int64_t(k) * kThreads;
        if (d < Dl) acc[k] += pt * dequantize(latent, row, d, a.latent_kind, sl, a.latent_dtype, a.latent_scale, Ll, true);
      }
    }
    __syncthreads();  // p is rewritten by the next tile
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  const int64_t row = tok * a.q_heads + hq;
  for (int k = 0; k < kMaxPerThread; ++k) {
    const int64_t d = tid + int64_t(k) * kThreads;
    if (d < Dl) store_any(a.out, row * Dl + d, a.q_dtype, acc[k] * inv);
  }
  if (tid == 0 && a.lse != nullptr) a.lse[row] = l > 0.f ? m + logf(l) : -INFINITY;
}

}  // namespace

cudaError_t launch_mla_attention(const MlaArgs& a, cudaStream_t stream) {
  if (a.total_q == 0 || a.q_heads == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(a.total_q), static_cast<unsigned>(a.q_heads));
  KVC_LAUNCH(grid, kThreads, stream, mla_attention_kernel)(a);
  return cudaGetLastError();
}

}  // namespace kvcache::cuda
