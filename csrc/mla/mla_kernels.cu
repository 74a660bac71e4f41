// The CUDA kernel of absorbed MLA attention (semantics: mla/mla_args.h). No GPU runs it where this is
// developed: the test suite runs it on the CPU under csrc/cuda_emulation.
//
// One CTA per (query token, kv head, tile of up to kHeads query heads of its group): every warp holds kRows
// query heads (latent and rope dims in pairs per lane), so the latent rows of a key are read once for all the
// heads of a tile (DeepSeek-V3's 128 heads per kv head: 8 tiles, not 128 CTAs each reading every latent row).
// Keys stream through a ring of stages of kKeys latent + rope rows copied with cp.async in their storage type
// (issue #23's decode pipeline, as attention_kernel's): kStages - 1 stages in flight while the CTA works on the
// oldest. A full-precision side is read from the ring as it is; a quantized side (Coded) is decoded once per
// stage into an fp32 tile. Rows that are not whole 16-byte units (or pools off 16 bytes) are staged value by
// value into the fp32 tiles instead.
// That kernel runs on the CUDA cores; 16-bit pools of the query's dtype run on tensor cores instead
// (mla_mma_kernel, below: heads as mma's M dimension, as FlashMLA).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cache/dequant_cuda.cuh"
#include "core/cp_async.cuh"
#include "core/cuda_launch.cuh"
#include "core/dtype_cuda.cuh"
#include "core/warp_mma.cuh"
#include "core/warp_reduce.cuh"
#include "mla/mla_cuda_launch.h"

namespace kvcache::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kCtasPerSm = 3;               // __launch_bounds__: 168 registers, 3 x 48 KB of shared memory
constexpr int64_t kSmemBytes = 48 * 1024;   // static shared memory of a CTA (the limit without opting in)
constexpr int64_t kInFlight = 16 * 1024;    // bytes a CTA's ring keeps in flight: 48 KB per SM at 3 CTAs

/// Rows up to kLatent latent and kRope rope dims, kKeys keys per stage, kRows query heads per warp.
template <int kLatent, int kRope, int kKeys_, int kRows_>
struct MlaShape {
  static constexpr int kMaxLatent = kLatent, kMaxRope = kRope, kKeys = kKeys_, kRows = kRows_;
  static constexpr int kLatPairs = kLatent / 64, kRopePairs = kRope / 64;  // dim pairs per lane
  static constexpr int kHeads = kWarps * kRows;                            // query heads per CTA
};
using Narrow = MlaShape<512, 64, 8, 2>;   // DeepSeek-V2 / V3, Kimi K2 (512 / 64), MiniCPM3 (256 / 32)
using Wide = MlaShape<1024, 256, 4, 1>;   // up to kMlaMaxLatentDim / kMlaMaxRopeDim

/// A quantized side: copied as codes, decoded once per stage into an fp32 tile.
struct Coded {};
template <class T>
constexpr bool kCoded = std::is_same_v<T, Coded>;
template <class T>
constexpr int64_t kElemBytes = kCoded<T> ? 1 : static_cast<int64_t>(sizeof(T));  // Coded: int8 / fp8, the widest

/// Shared memory of mla_attention_kernel<LT, RT, S>: [fp32 latent tile][fp32 rope tile][stage rows][ring].
/// The ring holds kStages stages of kKeys latent + rope rows at the shape's widths; value-by-value staging
/// (rows not whole units) uses both fp32 tiles and no ring.
template <class LT, class RT, class S>
struct MlaPipe {
  static constexpr int64_t kLatRow = S::kMaxLatent * kElemBytes<LT>, kRopeRow = S::kMaxRope * kElemBytes<RT>;
  static constexpr int64_t kStageBytes = S::kKeys * (kLatRow + kRopeRow);
  static constexpr int64_t kLatTile = S::kKeys * S::kMaxLatent * 4, kRopeTile = S::kKeys * S::kMaxRope * 4;
  static constexpr int64_t kDecoded = (kCoded<LT> ? kLatTile : 0) + (kCoded<RT> ? kRopeTile : 0);
  static constexpr int64_t kRowsBytes = S::kKeys * 8;
  static constexpr int64_t kWanted = 1 + (kInFlight + kStageBytes - 1) / kStageBytes;
  static constexpr int64_t kFit = (kSmemBytes - kDecoded) / (kStageBytes + kRowsBytes);
  static constexpr int kStages = static_cast<int>(kWanted < kFit ? kWanted : kFit);
  static_assert(kStages >= 2, "the MLA pipeline needs two stages of shared memory");
  static constexpr int64_t kRingBytes = kDecoded + kStages * (kStageBytes + kRowsBytes);
  static constexpr int64_t kStagedBytes = kLatTile + kRopeTile;
  static constexpr int64_t kBytes = kRingBytes > kStagedBytes ? kRingBytes : kStagedBytes;
};

/// Values d and d + 1 of row jj of a tile of rows of row_bytes bytes of T (fp32 for a decoded side).
template <class T>
__device__ __forceinline__ void pair_at(const char* tile, int64_t row_bytes, int jj, int d, float& x, float& y) {
  const char* p = tile + jj * row_bytes;
  if constexpr (kCoded<T> || std::is_same_v<T, float>) {
    const float2 v = shared_load(reinterpret_cast<const float2*>(p + d * 4));
    x = v.x;
    y = v.y;
  } else {
    const uint32_t w = shared_load(reinterpret_cast<const uint32_t*>(p + d * 2));  // two 16-bit values, the first low
    const auto lo = static_cast<unsigned short>(w & 0xffffu), hi = static_cast<unsigned short>(w >> 16);
    if constexpr (std::is_same_v<T, __half>) {
      x = __half2float(__ushort_as_half(lo));
      y = __half2float(__ushort_as_half(hi));
    } else {
      x = __bfloat162float(__ushort_as_bfloat16(lo));
      y = __bfloat162float(__ushort_as_bfloat16(hi));
    }
  }
}

/// One side of the MLA pools: codes, kind, dtype of a full-precision pool, scales, layout, K side or not.
struct MlaSide {
  const char* pool;
  KVKind kind;
  DType dtype;
  const float* scales;
  PagedLayout L;
  bool key;
  int64_t row_bytes;  // code bytes of a row
};

/// Decodes one side of a landed stage (rows of `units` 16-byte units) into an fp32 tile of rows of D values,
/// 4 values per thread and step (one float4 store; consecutive lanes write consecutive 16 bytes). Keys past
/// the end (row -1) are left alone: nothing reads them.
template <int kKeys>
__device__ __forceinline__ void decode_side(const MlaSide& s, int64_t h, const char* stage, const int64_t* rows,
                                            float* out) {
  const unsigned units = static_cast<unsigned>(s.row_bytes / 16), D = static_cast<unsigned>(s.L.head_dim);
  const unsigned dims = static_cast<unsigned>(16 * 32 / code_row_bytes(s.kind, 32, s.dtype));  // per unit
  const unsigned parts = dims / 4;
  for (unsigned i = threadIdx.x; i < kKeys * units * parts; i += kThreads) {
    const unsigned unit = i / parts, part = i % parts, jj = unit / units, u = unit % units;
    const int64_t row = rows[jj];
    if (row < 0) continue;
    const uint4 w = shared_load(reinterpret_cast<const uint4*>(stage) + unit);
    *reinterpret_cast<float4*>(out + jj * D + u * dims + part * 4) =
        dequantize_float4(w, row, int64_t(u) * dims, part * 4, s.kind, s.dtype, row_scale(s.kind, s.scales, row, h),
                          s.scales, s.L, s.key);
  }
}

/// A query head held by a warp: its query (pre-scaled) and output in dim pairs 64 k + 2 lane + {0, 1}.
template <class S>
struct MlaRow {
  float ql[2 * S::kLatPairs], qr[2 * S::kRopePairs], o[2 * S::kLatPairs];
  float m, l;
  bool valid;
};

/// The grid of an MLA kernel whose CTAs take `heads` query heads each: (query token, kv head x head tile).
dim3 mla_grid(const MlaArgs& a, int heads) {
  const unsigned head_tiles = static_cast<unsigned>((a.group + heads - 1) / heads);
  return dim3(static_cast<unsigned>(a.total_q), static_cast<unsigned>(a.q_heads / a.group) * head_tiles);
}
/// This CTA's kv head h and head tile (its query heads tile x heads + [0, heads) of the group), as mla_grid lays
/// them out (32-bit: no 64-bit division).
__device__ __forceinline__ void cta_heads(const MlaArgs& a, int heads, int64_t& h, int64_t& tile) {
  const unsigned head_tiles = (static_cast<unsigned>(a.group) + heads - 1) / heads;
  h = blockIdx.y / head_tiles;
  tile = blockIdx.y % head_tiles;
}

/// The sequence b of query token tok (the last b with cu_q_lens[b] <= tok) and the token's position: keys
/// 0..pos are visible to it (pos < 0: none).
__device__ __forceinline__ int32_t token_position(const MlaArgs& a, int64_t tok, int64_t& b) {
  int64_t lo = 0, hi = a.batch;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (a.cu_q_lens[mid] <= tok) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  b = lo;
  const int64_t q_start = a.cu_q_lens[b], q_len = a.cu_q_lens[b + 1] - q_start;
  return static_cast<int32_t>(a.kv_lens[b] - q_len + (tok - q_start));
}

template <class LT, class RT, class S>
__global__ void __launch_bounds__(kThreads, kCtasPerSm) mla_attention_kernel(MlaArgs a) {
  using Pipe = MlaPipe<LT, RT, S>;
  KVC_SHARED(uint4, smem, [Pipe::kBytes / 16]);
  const int64_t tok = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int64_t h, tile;
  cta_heads(a, S::kHeads, h, tile);
  int64_t b;
  const int32_t pos = token_position(a, tok, b);  // keys 0..pos are visible
  const int Dl = static_cast<int>(a.layout.head_dim), Dr = static_cast<int>(a.layout.v_head_dim);
  const int64_t lat_bytes = code_row_bytes(a.latent_kind, Dl, a.latent_dtype);
  const int64_t rope_bytes = code_row_bytes(a.rope_kind, Dr, a.rope_dtype);
  const MlaSide lat{static_cast<const char*>(a.latent_cache), a.latent_kind, a.latent_dtype, a.latent_scale,
                    a.layout.side(false), true, lat_bytes};
  const MlaSide rope{static_cast<const char*>(a.rope_cache), a.rope_kind, a.rope_dtype, a.rope_scale,
                     a.layout.side(true), false, rope_bytes};
  const int32_t* table = a.block_tables + b * a.table_stride;
  // the ring takes rows of whole 16-byte units on 16-byte pools that fit its stages
  const bool ring = whole_units(lat.pool, lat.kind, Dl, lat.dtype) &&
                    (Dr == 0 || whole_units(rope.pool, rope.kind, Dr, rope.dtype)) && lat_bytes <= Pipe::kLatRow &&
                    rope_bytes <= Pipe::kRopeRow;

  MlaRow<S> rw[S::kRows];
#pragma unroll
  for (int i = 0; i < S::kRows; ++i) {
    const int64_t g = tile * S::kHeads + i * kWarps + warp;  // the head within the group
    MlaRow<S>& r = rw[i];
    r.valid = g < a.group;
    r.m = -INFINITY;
    r.l = 0.f;
    const int64_t hq = h * a.group + g;
#pragma unroll
    for (int k = 0; k < 2 * S::kLatPairs; ++k) {
      const int d = 64 * (k / 2) + 2 * lane + k % 2;
      r.o[k] = 0.f;
      r.ql[k] = r.valid && d < Dl
                    ? a.scale * load_any(a.q_latent, tok * a.ql_strides[0] + hq * a.ql_strides[1] + d * a.ql_strides[2],
                                         a.q_dtype)
                    : 0.f;
    }
#pragma unroll
    for (int k = 0; k < 2 * S::kRopePairs; ++k) {
      const int d = 64 * (k / 2) + 2 * lane + k % 2;
      r.qr[k] = r.valid && d < Dr
                    ? a.scale * load_any(a.q_rope, tok * a.qr_strides[0] + hq * a.qr_strides[1] + d * a.qr_strides[2],
                                         a.q_dtype)
                    : 0.f;
    }
  }

  // Every warp's rows take keys [t0, t0 + n) of a tile: key jj's latent pair at d is lat_at(jj, d, x, y), its
  // rope pair rope_at(jj, d, x, y). A key's values are read once for all the warp's rows.
  const auto absorb_tile = [&](int n, auto lat_at, auto rope_at) {
    for (int jj = 0; jj < n; ++jj) {
      float c[2 * S::kLatPairs], kr[2 * S::kRopePairs];
#pragma unroll
      for (int k = 0; k < S::kLatPairs; ++k) {
        const int d = 64 * k + 2 * lane;
        c[2 * k] = c[2 * k + 1] = 0.f;
        if (d < Dl) lat_at(jj, d, c[2 * k], c[2 * k + 1]);
      }
#pragma unroll
      for (int k = 0; k < S::kRopePairs; ++k) {
        const int d = 64 * k + 2 * lane;
        kr[2 * k] = kr[2 * k + 1] = 0.f;
        if (d < Dr) rope_at(jj, d, kr[2 * k], kr[2 * k + 1]);
      }
#pragma unroll
      for (int i = 0; i < S::kRows; ++i) {
        MlaRow<S>& r = rw[i];
        if (!r.valid) continue;  // uniform across the warp
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < 2 * S::kLatPairs; ++k) s += r.ql[k] * c[k];
#pragma unroll
        for (int k = 0; k < 2 * S::kRopePairs; ++k) s += r.qr[k] * kr[k];
        s = warp_sum(s);
        if (s > r.m) {
          const float alpha = __expf(r.m - s);  // 0 when m was -inf
          r.l *= alpha;
#pragma unroll
          for (int k = 0; k < 2 * S::kLatPairs; ++k) r.o[k] *= alpha;
          r.m = s;
        }
        const float p = __expf(s - r.m);
        r.l += p;
#pragma unroll
        for (int k = 0; k < 2 * S::kLatPairs; ++k) r.o[k] += p * c[k];
      }
    }
  };

  const int32_t tiles = pos >= 0 ? pos / S::kKeys + 1 : 0;
  const auto keys_in = [&](int32_t n) { return min(S::kKeys, pos + 1 - n * S::kKeys); };
  float* lat_dec = reinterpret_cast<float*>(smem);
  if (ring) {
    // [decoded latent][decoded rope][stage rows][stages]
    float* rope_dec = lat_dec + (kCoded<LT> ? S::kKeys * S::kMaxLatent : 0);
    int64_t* rows_at = reinterpret_cast<int64_t*>(rope_dec + (kCoded<RT> ? S::kKeys * S::kMaxRope : 0));
    char* ring_at = reinterpret_cast<char*>(rows_at + Pipe::kStages * S::kKeys);
    const unsigned lat_units = static_cast<unsigned>(lat_bytes / 16), rope_units = static_cast<unsigned>(rope_bytes / 16);
    const unsigned units = lat_units + rope_units;
    const int64_t stage_bytes = S::kKeys * (lat_bytes + rope_bytes);
    const auto stage = [&](int32_t n) { return ring_at + (n % Pipe::kStages) * stage_bytes; };
    const auto stage_rows = [&](int32_t n) { return rows_at + (n % Pipe::kStages) * S::kKeys; };
    // the copies of tile n's latent and rope rows (one cp.async per 16-byte unit; rows -1 past pos)
    const auto issue = [&](int32_t n) {
      char* dst = stage(n);
      int64_t* rows = stage_rows(n);
      for (unsigned i = threadIdx.x; i < S::kKeys * units; i += kThreads) {  // 32-bit: < kKeys x 2 x 64
        const unsigned jj = i / units, u = i % units;
        const int32_t key = n * S::kKeys + static_cast<int32_t>(jj);
        if (key > pos) {
          if (u == 0) rows[jj] = -1;
          continue;
        }
        const int64_t row = lat.L.row_index(table[key >> lat.L.page_shift], h, key & (lat.L.page_size - 1));
        if (u == 0) rows[jj] = row;
        // one copy instruction for latent and rope units alike (selected addresses): 512 bytes per warp
        const bool is_lat = u < lat_units;
        const unsigned w = is_lat ? u : u - lat_units;
        const int64_t side_bytes = is_lat ? lat_bytes : rope_bytes;
        cp_async_16(dst + (is_lat ? 0 : S::kKeys * lat_bytes) + jj * side_bytes + w * 16,
                    (is_lat ? lat.pool : rope.pool) + row * side_bytes + w * 16);
      }
    };
#pragma unroll
    for (int n = 0; n < Pipe::kStages - 1; ++n) {  // the first kStages - 1 tiles in flight
      if (n < tiles) issue(n);
      cp_async_commit();  // one group per stage, empty or not, so that the wait below counts stages
    }
    for (int32_t n = 0; n < tiles; ++n) {
      cp_async_wait<Pipe::kStages - 2>();  // this thread's copies of tile n have landed
      __syncthreads();  // ... and every thread's; tile n - 1 is no longer read, so its stage is free
      if (n + Pipe::kStages - 1 < tiles) issue(n + Pipe::kStages - 1);
      cp_async_commit();
      const char* lat_raw = stage(n);
      const char* rope_raw = lat_raw + S::kKeys * lat_bytes;
      if constexpr (kCoded<LT> || kCoded<RT>) {
        if constexpr (kCoded<LT>) decode_side<S::kKeys>(lat, h, lat_raw, stage_rows(n), lat_dec);
        if constexpr (kCoded<RT>) {
          if (Dr > 0) decode_side<S::kKeys>(rope, h, rope_raw, stage_rows(n), rope_dec);
        }
        __syncthreads();
      }
      absorb_tile(
          keys_in(n),
          [&](int jj, int d, float& x, float& y) {
            if constexpr (kCoded<LT>) pair_at<float>(reinterpret_cast<const char*>(lat_dec), Dl * 4, jj, d, x, y);
            else pair_at<LT>(lat_raw, lat_bytes, jj, d, x, y);
          },
          [&](int jj, int d, float& x, float& y) {
            if constexpr (kCoded<RT>) pair_at<float>(reinterpret_cast<const char*>(rope_dec), Dr * 4, jj, d, x, y);
            else pair_at<RT>(rope_raw, rope_bytes, jj, d, x, y);
          });
    }
    cp_async_wait<0>();  // no copy outlives the kernel's reads (the empty groups of the last tiles)
  } else {
    // value by value into both fp32 tiles, rows padded to an even width (pairs are read as one 8-byte load;
    // the pad is 0, as the query beyond the row)
    const int Dlp = Dl + (Dl & 1), Drp = Dr + (Dr & 1);
    float* rope_dec = lat_dec + S::kKeys * S::kMaxLatent;
    const unsigned width = static_cast<unsigned>(Dlp + Drp);
    for (int32_t n = 0; n < tiles; ++n) {
      __syncthreads();  // the previous tile is no longer read
      const int nk = keys_in(n);
      for (unsigned i = threadIdx.x; i < static_cast<unsigned>(nk) * width; i += kThreads) {  // 32-bit
        const unsigned jj = i / width, d = i % width;
        const int32_t key = n * S::kKeys + static_cast<int32_t>(jj);
        const int64_t block = table[key >> lat.L.page_shift], pp = key & (lat.L.page_size - 1);
        const int64_t row = lat.L.row_index(block, h, pp);  // the same row of both pools (only their widths differ)
        if (d < static_cast<unsigned>(Dlp)) {
          lat_dec[jj * Dlp + d] = d < static_cast<unsigned>(Dl)
                                      ? dequantize(lat.pool, row, d, lat.kind, row_scale(lat.kind, lat.scales, row, h),
                                                   lat.dtype, lat.scales, lat.L, true)
                                      : 0.f;
        } else {
          const unsigned dd = d - Dlp;
          rope_dec[jj * Drp + dd] = dd < static_cast<unsigned>(Dr)
                                        ? dequantize(rope.pool, row, dd, rope.kind,
                                                     row_scale(rope.kind, rope.scales, row, h), rope.dtype, rope.scales,
                                                     rope.L, false)
                                        : 0.f;
        }
      }
      __syncthreads();
      absorb_tile(
          nk,
          [&](int jj, int d, float& x, float& y) {
            pair_at<float>(reinterpret_cast<const char*>(lat_dec), Dlp * 4, jj, d, x, y);
          },
          [&](int jj, int d, float& x, float& y) {
            pair_at<float>(reinterpret_cast<const char*>(rope_dec), Drp * 4, jj, d, x, y);
          });
    }
  }

#pragma unroll
  for (int i = 0; i < S::kRows; ++i) {
    const MlaRow<S>& r = rw[i];
    if (!r.valid) continue;
    const int64_t hq = h * a.group + tile * S::kHeads + i * kWarps + warp;
    const int64_t out_row = tok * a.q_heads + hq;
    const float inv = r.l > 0.f ? 1.f / r.l : 0.f;
#pragma unroll
    for (int k = 0; k < 2 * S::kLatPairs; ++k) {
      const int d = 64 * (k / 2) + 2 * lane + k % 2;
      if (d < Dl) store_any(a.out, out_row * Dl + d, a.q_dtype, r.o[k] * inv);
    }
    if (lane == 0 && a.lse != nullptr) a.lse[out_row] = r.l > 0.f ? r.m + logf(r.l) : -INFINITY;
  }
}

// ---- On tensor cores ------------------------------------------------------------------------------------
// mla_mma_kernel<T> takes the calls mla_mma(a) admits: latent and rope pools of the query's 16-bit dtype T
// (DeepSeek-V2 / V3, Kimi K2, MiniCPM3 in bf16 or fp16). One CTA per (query token, kv head, tile of 16 query
// heads): the heads are the M dimension of mma.m16n8k16 (as FlashMLA), so decode is a GEMM too. Stages of
// kMmaKeys keys' latent + rope rows land in shared memory by cp.async, double-buffered; each row is padded
// by 16 bytes, so that the 8 rows of an ldmatrix fall in 8 different bank groups. Warp w owns a quarter of
// the latent dims: its k-steps of S = Q [C | K_rope]^T (and rope k-step w) and the same dims of O. The
// warps' partial S blocks meet in shared memory; every warp sums them in the same order, takes the online
// softmax of the whole 16 x 16 block (the same values in every warp; one max / rescale per row and stage)
// and adds P C to its quarter of O, P in T as FlashAttention-2 does. Scores are scaled in fp32: the query
// enters the tensor core exactly.

constexpr int kMmaHeads = 16;                     // query heads per CTA: mma's M
constexpr int kMmaKeys = 16;                      // keys per stage: S's N, P C's K
constexpr int kMmaMaxLatent = 512, kMmaMaxRope = 64;
constexpr int kMmaLatSteps = kMmaMaxLatent / 16 / kWarps;  // latent k-steps of S per warp
constexpr int kMmaOTiles = kMmaMaxLatent / 8 / kWarps;     // n-tiles of O per warp
constexpr int64_t kMmaStageBytes = kMmaKeys * ((2 * kMmaMaxLatent + 16) + (2 * kMmaMaxRope + 16));
constexpr int64_t kMmaPartialBytes = kWarps * 2 * 32 * 16;  // a warp's S block: 2 float4 per lane
static_assert(2 * kMmaStageBytes + kMmaPartialBytes <= kSmemBytes, "two stages and the S blocks fit");

/// Whether call `a` runs in mla_mma_kernel: a 16-bit query over full-precision pools of its dtype, the
/// latent width a multiple of 64 (16 dims per warp) up to 512, the rope width a multiple of 16 up to 64,
/// pools 16-byte aligned (cp.async).
bool mla_mma(const MlaArgs& a) {
  const int64_t Dl = a.layout.head_dim, Dr = a.layout.v_head_dim;
  const auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  return (a.q_dtype == DType::kBFloat16 || a.q_dtype == DType::kFloat16) && a.latent_kind == KVKind::kFull &&
         a.rope_kind == KVKind::kFull && a.latent_dtype == a.q_dtype && a.rope_dtype == a.q_dtype && Dl > 0 &&
         Dl % 64 == 0 && Dl <= kMmaMaxLatent && Dr % 16 == 0 && Dr <= kMmaMaxRope && aligned(a.latent_cache) &&
         (Dr == 0 || aligned(a.rope_cache));
}

template <class T>
__global__ void __launch_bounds__(kThreads, kCtasPerSm) mla_mma_kernel(MlaArgs a) {
  KVC_SHARED(uint4, smem, [(2 * kMmaStageBytes + kMmaPartialBytes) / 16]);
  const int64_t tok = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
  int64_t h, tile;
  cta_heads(a, kMmaHeads, h, tile);
  int64_t b;
  const int32_t pos = token_position(a, tok, b);  // keys 0..pos are visible
  const int Dl = static_cast<int>(a.layout.head_dim), Dr = static_cast<int>(a.layout.v_head_dim);
  const int lat_stride = 2 * Dl + 16, rope_stride = 2 * Dr + 16;  // padded rows in the stage
  const unsigned lat_units = static_cast<unsigned>(Dl / 8), units = lat_units + static_cast<unsigned>(Dr / 8);
  const int stage_bytes = kMmaKeys * (lat_stride + rope_stride);
  const PagedLayout L = a.layout.side(false);  // the same row of both pools (only their widths differ)
  const int32_t* table = a.block_tables + b * a.table_stride;
  const char* lat_pool = static_cast<const char*>(a.latent_cache);
  const char* rope_pool = static_cast<const char*>(a.rope_cache);
  char* ring = reinterpret_cast<char*>(smem);
  float4* partial = reinterpret_cast<float4*>(ring + 2 * kMmaStageBytes);  // [warp][n-tile][lane]

  // this warp's dims: latent [lat0, lat0 + Dl / 4), rope [16 warp, 16 warp + 16) when Dr has them
  const int lat0 = warp * (Dl / 4), lat_steps = Dl / 64;
  const bool has_rope = 16 * warp < Dr;
  // A fragments of Q (rows: heads g and g + 8 of the tile; 0 past the group), loaded in T as they are
  const auto q_pair = [&](const void* q, const int64_t* st, int row, int d) -> uint32_t {
    const int64_t head = tile * kMmaHeads + row;
    if (head >= a.group) return 0u;
    const auto* p = static_cast<const uint16_t*>(q) + tok * st[0] + (h * a.group + head) * st[1];
    return uint32_t{p[d * st[2]]} | (uint32_t{p[(d + 1) * st[2]]} << 16);
  };
  const auto q_frag = [&](const void* q, const int64_t* st, int d0, uint32_t (&f)[4]) {
    f[0] = q_pair(q, st, g, d0 + 2 * tq);
    f[1] = q_pair(q, st, g + 8, d0 + 2 * tq);
    f[2] = q_pair(q, st, g, d0 + 2 * tq + 8);
    f[3] = q_pair(q, st, g + 8, d0 + 2 * tq + 8);
  };
  uint32_t qa[kMmaLatSteps][4] = {}, qr[4] = {};
#pragma unroll
  for (int kk = 0; kk < kMmaLatSteps; ++kk) {
    if (kk < lat_steps) q_frag(a.q_latent, a.ql_strides, lat0 + 16 * kk, qa[kk]);
  }
  if (has_rope) q_frag(a.q_rope, a.qr_strides, 16 * warp, qr);

  // the copies of stage n, one cp.async per 16-byte unit of a visible key's rows; keys past pos get zeros (P is
  // 0 there, and 0 x a stale NaN of shared memory would not be). Latent rows: 8 threads per key, so a thread
  // looks its row up once per stage and a warp copies 4 keys x 128 contiguous bytes at a time; rope rows (16
  // keys x at most 8 units): a unit per thread.
  static_assert(kThreads == 8 * kMmaKeys, "8 threads per key of a stage");
  const int32_t stages = pos >= 0 ? pos / kMmaKeys + 1 : 0;
  const unsigned rope_units = units - lat_units;
  const auto row_of = [&](int32_t key) {
    return L.row_index(table[key >> L.page_shift], h, key & (L.page_size - 1));
  };
  const auto issue = [&](int32_t n) {
    char* dst = ring + (n & 1) * stage_bytes;
    {
      const int jj = threadIdx.x / 8, u0 = threadIdx.x % 8;
      const int32_t key = n * kMmaKeys + jj;
      char* to = dst + jj * lat_stride + u0 * 16;
      if (key > pos) {
        for (unsigned u = u0; u < lat_units; u += 8, to += 128) *reinterpret_cast<uint4*>(to) = uint4{0u, 0u, 0u, 0u};
      } else {
        const char* from = lat_pool + row_of(key) * (2 * Dl) + u0 * 16;
        for (unsigned u = u0; u < lat_units; u += 8, to += 128, from += 128) cp_async_16(to, from);
      }
    }
    if (threadIdx.x < kMmaKeys * rope_units) {
      const unsigned jj = threadIdx.x / rope_units, u = threadIdx.x % rope_units;  // 32-bit
      const int32_t key = n * kMmaKeys + static_cast<int32_t>(jj);
      char* to = dst + kMmaKeys * lat_stride + int(jj) * rope_stride + int(u) * 16;
      if (key > pos) {
        *reinterpret_cast<uint4*>(to) = uint4{0u, 0u, 0u, 0u};
      } else {
        cp_async_16(to, rope_pool + row_of(key) * (2 * Dr) + u * 16);
      }
    }
  };

  float o[kMmaOTiles][4] = {};  // C fragments of this warp's O: n-tile n holds dims lat0 + [8 n, 8 n + 8)
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // rows g, g + 8; l: this lane's partial sum
  if (stages > 0) issue(0);
  cp_async_commit();
  for (int32_t n = 0; n < stages; ++n) {
    cp_async_wait<0>();  // this thread's copies of stage n have landed
    __syncthreads();     // ... and every thread's; stage n - 1 and the S blocks are no longer read
    if (n + 1 < stages) issue(n + 1);
    cp_async_commit();
    const char* lat_s = ring + (n & 1) * stage_bytes;
    const char* rope_s = lat_s + kMmaKeys * lat_stride;
    // this warp's part of S: matrix lane / 8 of an ldmatrix is keys 8 (lane / 16) + [0, 8), dims
    // 8 ((lane / 8) % 2) + [0, 8) of the k-step
    const int key_row = 8 * (lane / 16) + lane % 8, dim_half = 8 * ((lane / 8) % 2);
    float s[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < kMmaLatSteps; ++kk) {
      if (kk >= lat_steps) break;
      uint32_t f[4];
      ldmatrix(f, lat_s + key_row * lat_stride + (lat0 + 16 * kk + dim_half) * 2);
      const uint32_t b0[2] = {f[0], f[1]}, b1[2] = {f[2], f[3]};
      mma_m16n8k16<T>(s[0], qa[kk], b0, s[0]);
      mma_m16n8k16<T>(s[1], qa[kk], b1, s[1]);
    }
    if (has_rope) {
      uint32_t f[4];
      ldmatrix(f, rope_s + key_row * rope_stride + (16 * warp + dim_half) * 2);
      const uint32_t b0[2] = {f[0], f[1]}, b1[2] = {f[2], f[3]};
      mma_m16n8k16<T>(s[0], qr, b0, s[0]);
      mma_m16n8k16<T>(s[1], qr, b1, s[1]);
    }
    // the warps' blocks summed (in warp order: the same S in every warp), scaled and masked
    partial[(warp * 2 + 0) * 32 + lane] = float4{s[0][0], s[0][1], s[0][2], s[0][3]};
    partial[(warp * 2 + 1) * 32 + lane] = float4{s[1][0], s[1][1], s[1][2], s[1][3]};
    __syncthreads();
    const int last_col = min(pos - n * kMmaKeys, kMmaKeys - 1);  // keys past pos: -inf
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float4 sum = shared_load(partial + j * 32 + lane);
#pragma unroll
      for (int w = 1; w < kWarps; ++w) {
        const float4 x = shared_load(partial + (w * 2 + j) * 32 + lane);
        sum.x += x.x;
        sum.y += x.y;
        sum.z += x.z;
        sum.w += x.w;
      }
      const float v[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int col = 8 * j + 2 * tq + (c & 1);
        s[j][c] = col <= last_col ? v[c] * a.scale : -INFINITY;
        tile_max[c / 2] = fmaxf(tile_max[c / 2], s[j][c]);
      }
    }
    float base[2];  // one rescale per row and stage
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
      const float m_new = fmaxf(m[i], tile_max[i]);  // finite: key n * kMmaKeys is visible
      const float alpha = __expf(m[i] - m_new);      // 0 when m was -inf
      base[i] = m_new;
      m[i] = m_new;
      l[i] *= alpha;
#pragma unroll
      for (int t = 0; t < kMmaOTiles; ++t) {
        o[t][2 * i] *= alpha;
        o[t][2 * i + 1] *= alpha;
      }
    }
    // P in T: S's fragments of n-tiles 0 and 1 are P's A fragment for the stage's 16 keys
    float p[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        p[j][c] = __expf(s[j][c] - base[c / 2]);
        l[c / 2] += p[j][c];
      }
    }
    const uint32_t pa[4] = {pack_pair(from_float<T>(p[0][0]), from_float<T>(p[0][1])),
                            pack_pair(from_float<T>(p[0][2]), from_float<T>(p[0][3])),
                            pack_pair(from_float<T>(p[1][0]), from_float<T>(p[1][1])),
                            pack_pair(from_float<T>(p[1][2]), from_float<T>(p[1][3]))};
    // O += P C over this warp's dims: C's 16 x 16 blocks (keys x dims), transposed
#pragma unroll
    for (int t = 0; t < kMmaOTiles; t += 2) {
      if (8 * t >= Dl / 4) break;
      uint32_t f[4];
      ldmatrix_trans(f, lat_s + (lane % 16) * lat_stride + (lat0 + 8 * t + 8 * (lane / 16)) * 2);
      const uint32_t b0[2] = {f[0], f[1]}, b1[2] = {f[2], f[3]};
      mma_m16n8k16<T>(o[t], pa, b0, o[t]);
      mma_m16n8k16<T>(o[t + 1], pa, b1, o[t + 1]);
    }
  }
  cp_async_wait<0>();  // no copy outlives the kernel (the last, empty group)

  // l over the quad; rows g and g + 8 normalized, dims lat0 + 8 t + 2 tq + {0, 1}
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    const int64_t head = tile * kMmaHeads + g + 8 * i;
    if (head >= a.group) continue;
    const int64_t out_row = tok * a.q_heads + h * a.group + head;
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
#pragma unroll
    for (int t = 0; t < kMmaOTiles; ++t) {
      if (8 * t >= Dl / 4) break;
      const int64_t d = lat0 + 8 * t + 2 * tq;
      store_any(a.out, out_row * Dl + d, a.q_dtype, o[t][2 * i] * inv);
      store_any(a.out, out_row * Dl + d + 1, a.q_dtype, o[t][2 * i + 1] * inv);
    }
    if (warp == 0 && tq == 0 && a.lse != nullptr) a.lse[out_row] = l[i] > 0.f ? m[i] + logf(l[i]) : -INFINITY;
  }
}

template <class LT, class RT, class S>
void launch_instance(const MlaArgs& a, cudaStream_t stream) {
  const dim3 grid = mla_grid(a, S::kHeads);
  KVC_LAUNCH(grid, kThreads, stream, mla_attention_kernel<LT, RT, S>)(a);
}

/// A side's instance type: its full-precision dtype, or Coded.
template <class F>
void with_side(KVKind kind, DType dtype, F f) {
  if (kind != KVKind::kFull) return f(Coded{});
  switch (dtype) {
    case DType::kFloat32: return f(float{});
    case DType::kFloat16: return f(__half{});
    default: return f(__nv_bfloat16{});
  }
}

template <class S>
void launch_shape(const MlaArgs& a, cudaStream_t stream) {
  with_side(a.latent_kind, a.latent_dtype, [&](auto l) {
    with_side(a.rope_kind, a.rope_dtype, [&](auto r) {
      using LT = decltype(l);
      using RT = decltype(r);
      // full sides of two dtypes (not a pool the library makes): the Coded instance decodes either
      if constexpr (!kCoded<LT> && !kCoded<RT> && !std::is_same_v<LT, RT>) {
        launch_instance<Coded, Coded, S>(a, stream);
      } else {
        launch_instance<LT, RT, S>(a, stream);
      }
    });
  });
}

}  // namespace

cudaError_t launch_mla_attention(const MlaArgs& a, cudaStream_t stream) {
  if (a.total_q == 0 || a.q_heads == 0) return cudaSuccess;
  if (mla_mma(a)) {
    const dim3 grid = mla_grid(a, kMmaHeads);
    if (a.q_dtype == DType::kFloat16) {
      KVC_LAUNCH(grid, kThreads, stream, mla_mma_kernel<__half>)(a);
    } else {
      KVC_LAUNCH(grid, kThreads, stream, mla_mma_kernel<__nv_bfloat16>)(a);
    }
  } else if (a.latent_dim() <= Narrow::kMaxLatent && a.rope_dim() <= Narrow::kMaxRope) {
    launch_shape<Narrow>(a, stream);
  } else {
    launch_shape<Wide>(a, stream);
  }
  return cudaGetLastError();
}

}  // namespace kvcache::cuda
