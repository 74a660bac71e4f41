// CUDA kernels of paged_attention and merge_states.
//
// No GPU is available where this is developed: these kernels are compiled and linked in every CI run,
// and the test suite runs them on the CPU under csrc/cuda_emulation (never yet on a GPU). They are
// kept deliberately plain: a warp owns query rows (its lanes split head_dim), scores are warp-reduced
// dot products, and the online-softmax and merge math is the same as the CPU kernel's
// (core/softmax_state.h). Work is cut into the same AttentionTasks as on the CPU (attention_plan.h),
// each of one KV head: decode tasks (a few rows, a range of keys: split-K) and prefill tasks (a block
// of query rows, all their keys). attention_kernel serves decode tasks, and the prefill tasks that
// prefill_mma_kernel (tensor cores, below) does not take: the CTA stages tiles of kTile keys of its KV
// head in shared memory (through a cp.async ring of several tiles in flight: DecodePipe), and every warp
// reuses them for its rows, so each page is read once per KV head and task, not once per query head. A task
// holds at most kRowsPerCta rows per pass; a wider GQA group (e.g. MQA with 32 query heads) takes several
// passes over the keys.
// Split tasks write partial states that merge_partials_kernel folds into the output.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "attention/attention_cuda_launch.h"
#include "cache/dequant_cuda.cuh"
#include "cache/rotation_cuda.cuh"
#include "core/cp_async.cuh"
#include "core/cuda_launch.cuh"
#include "core/dtype_cuda.cuh"
#include "core/warp_reduce.cuh"
#include "core/quant.h"
#include "core/softmax_state.h"
#include "core/warp_mma.cuh"

namespace kvcache::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxPerLane = 8;   // head_dim <= 256: each lane holds at most 8 dims
// A warp keeps kLaneFloats query dims (and as many output dims) of its rows per lane: 4 rows of head_dim <= 128
// (4 dims per lane), 2 of head_dim <= 256 (8 per lane), so that registers do not grow with the largest head_dim.
constexpr int kLaneFloats = 16;
constexpr int kRowsPerCta = kWarps * kLaneFloats / 4;  // rows of one pass over the keys at head_dim <= 128
constexpr int kTile = 16;        // keys per shared-memory tile
constexpr int kPipeMaxDim = 128;  // attention_kernel's cp.async pipeline: head_dim up to this
constexpr int64_t kSmemBytes = 48 * 1024;  // static shared memory of a CTA (the limit without opting in)
// attention_kernel is compiled for at least this many resident CTAs per SM (at most 168 registers a thread),
// and its cp.async ring keeps kPipeInFlight bytes in flight per CTA: issue #23's 32 KB per sm_90 SM at 3 CTAs.
constexpr int kDecodeCtasPerSm = 3;
constexpr int64_t kPipeInFlight = 12 * 1024;
constexpr int kMergeThreads = 128;  // merge_states: threads per row (head dims are 64-256)

// Element types of the pools. Quantized codes widen to their code value; the scale is applied per key
// (token_scale below), on the score for K and on the value for V.
struct Fp8E4M3 { uint8_t bits; };
struct Fp8E5M2 { uint8_t bits; };
struct Int4 { uint8_t bits; };  // two codes per byte; dequantized (scale, zero per 32 dims) by kv_at
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(int8_t x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(Fp8E4M3 x) { return quant::fp8_decode(x.bits, quant::kE4M3); }
__device__ __forceinline__ float to_float(Fp8E5M2 x) { return quant::fp8_decode(x.bits, quant::kE5M2); }

/// KIVI codes (planar, core/quant.h); keys read their page's per-channel metadata, values their row's.
template <int kBits, bool kKey>
struct Kivi { uint8_t bits; };

/// Value d of pool row `row` (L.row_index: rows, not element offsets, so that no 64-bit division by the
/// runtime head_dim or page_size is needed); int4 reads its nibble and its group's fp16 (scale, zero) from `meta`.
template <typename T>
__device__ __forceinline__ float kv_at(const T* pool, const uint16_t* /*meta*/, const PagedLayout& L, int64_t row,
                                       int64_t d) {
  return to_float(pool[row * L.head_dim + d]);
}
template <int kBits, bool kKey>
__device__ __forceinline__ float kv_at(const Kivi<kBits, kKey>* pool, const uint16_t* meta, const PagedLayout& L,
                                       int64_t row, int64_t d) {
  const int64_t D = L.head_dim, i = row * D + d;
  const uint8_t code = quant::planar_get(reinterpret_cast<const uint8_t*>(pool) + row * (D * kBits / 8), d, kBits);
  if (kKey) {
    const uint16_t* m = meta + (row >> L.page_shift) * 2 * D;  // the row's (block, head) page
    return quant::uint_decode(code, __half2float(__ushort_as_half(m[quant::kivi_key_scale_at(d)])),
                              __half2float(__ushort_as_half(m[quant::kivi_key_zero_at(d)])));
  }
  const uint16_t* m = meta + (i / 32) * 2;
  return quant::uint_decode(code, __half2float(__ushort_as_half(m[0])), __half2float(__ushort_as_half(m[1])));
}
__device__ __forceinline__ float kv_at(const Int4* pool, const uint16_t* meta, const PagedLayout& L, int64_t row,
                                       int64_t d) {
  const int64_t i = row * L.head_dim + d;
  const uint8_t byte = pool[i / 2].bits;
  const uint16_t* m = meta + (i / kInt4Group) * 2;
  return quant::uint_decode(static_cast<uint8_t>((i & 1) ? byte >> 4 : byte & 15),
                            __half2float(__ushort_as_half(m[0])), __half2float(__ushort_as_half(m[1])));
}

/// The stored kind and full-precision dtype of a pool element type (constants, so that dequantize_unit's
/// switch folds away in each instance).
template <typename T>
struct KvType;
template <>
struct KvType<float> { static constexpr KVKind kind = KVKind::kFull; static constexpr DType dtype = DType::kFloat32; };
template <>
struct KvType<__half> { static constexpr KVKind kind = KVKind::kFull; static constexpr DType dtype = DType::kFloat16; };
template <>
struct KvType<__nv_bfloat16> {
  static constexpr KVKind kind = KVKind::kFull;
  static constexpr DType dtype = DType::kBFloat16;
};
template <>
struct KvType<int8_t> { static constexpr KVKind kind = KVKind::kInt8; static constexpr DType dtype = DType::kFloat32; };
template <>
struct KvType<Fp8E4M3> { static constexpr KVKind kind = KVKind::kFp8E4M3; static constexpr DType dtype = DType::kFloat32; };
template <>
struct KvType<Fp8E5M2> { static constexpr KVKind kind = KVKind::kFp8E5M2; static constexpr DType dtype = DType::kFloat32; };
template <>
struct KvType<Int4> { static constexpr KVKind kind = KVKind::kInt4; static constexpr DType dtype = DType::kFloat32; };
template <int kBits, bool kKey>
struct KvType<Kivi<kBits, kKey>> {
  static constexpr KVKind kind = kBits == 2 ? KVKind::kKivi2 : KVKind::kKivi4;
  static constexpr DType dtype = DType::kFloat32;
};

/// Bytes of one stored row of element type T (codes only: scales and metadata live apart).
template <typename T>
__device__ __forceinline__ int64_t stored_row_bytes(int64_t D) {
  return code_row_bytes(KvType<T>::kind, D, KvType<T>::dtype);
}

/// The scale of the key at (block, head, pos): per row for int8, per head for fp8, 1 otherwise (full
/// precision, and int4 whose kv_at already dequantizes).
__device__ __forceinline__ float token_scale(KVKind kind, const float* scales, const PagedLayout& L, int64_t block,
                                             int64_t h, int64_t pos) {
  switch (kind) {
    case KVKind::kInt8: return scales[L.row_index(block, h, pos)];
    case KVKind::kFp8E4M3:
    case KVKind::kFp8E5M2: return scales[h];
    default: return 1.f;
  }
}

/// One query row held by a warp: its query (pre-scaled) and output dims d = lane + 32 k, k < kPerLane.
template <int kPerLane>
struct Row {
  float q[kPerLane];
  float o[kPerLane];
  float m, l;
  int32_t pos, lo;  // position of the query, first key of its window (kv_lens are int32)
  bool valid;       // finish_row finds the row's place in out / lse again (task_row): two registers fewer
};

template <int kPerLane>
__device__ __forceinline__ bool key_visible(const AttentionArgs& a, const Row<kPerLane>& r, int32_t j) {
  return j <= r.pos && (j >= r.lo || j < a.sink_tokens);
}

/// Online-softmax update of a row with one key: score s (already reduced over the warp) and the
/// key's V, read through `v_at(d)`.
template <int kPerLane, class VAt>
__device__ __forceinline__ void absorb(const AttentionArgs& a, Row<kPerLane>& r, float s, int lane, VAt v_at) {
  if (a.softcap > 0.f) s = a.softcap * tanhf(s / a.softcap);
  if (s > r.m) {
    const float alpha = __expf(r.m - s);  // 0 when m was -inf
    r.l *= alpha;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) r.o[k] *= alpha;
    r.m = s;
  }
  const float p = __expf(s - r.m);
  r.l += p;
  const int64_t D = a.layout.head_dim;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int64_t d = lane + 32 * k;
    if (d < D) r.o[k] += p * v_at(d);
  }
}

/// Where row r of a task sits: its query position, window, output row and query (init_row, prefill_mma_kernel).
struct TaskRow {
  int64_t pos = -1, lo = 0;  // position of the query, first key of its window
  int64_t out_row = 0;       // (token, query head) of out / lse
  int64_t q_at = 0;          // its query's first element in `query`
  bool valid = false;
};

/// Row r of task t (numbered as in AttentionTask); invalid past the task's rows.
__device__ __forceinline__ TaskRow task_row(const AttentionArgs& a, const AttentionTask& t, int64_t r) {
  TaskRow row;
  const int64_t G = a.group, per_head = int64_t(t.tok_end - t.tok_begin) * G;
  if (r >= int64_t(t.head_end - t.head_begin) * per_head) return row;
  const unsigned r32 = static_cast<unsigned>(r), per_head32 = static_cast<unsigned>(per_head);
  const unsigned local = r32 % per_head32, G32 = static_cast<unsigned>(G);
  const int64_t h = t.head_begin + r32 / per_head32;
  const int64_t i = t.tok_begin + local / G32, hq = h * G + local % G32;
  const int64_t q_start = a.cu_q_lens[t.seq], q_len = a.cu_q_lens[t.seq + 1] - q_start;
  row.valid = true;
  row.pos = a.kv_lens[t.seq] - q_len + i;
  row.lo = a.window_left >= 0 ? max(int64_t(0), row.pos - a.window_left) : int64_t(0);
  row.out_row = (q_start + i) * a.q_heads + hq;
  row.q_at = (q_start + i) * a.q_strides[0] + hq * a.q_strides[1];
  return row;
}

/// Sets up row `r` of task `t` (numbered as in AttentionTask) for this warp.
template <int kPerLane>
__device__ void init_row(const AttentionArgs& a, const AttentionTask& t, int64_t r, int lane, Row<kPerLane>& row) {
  const int64_t D = a.layout.head_dim;
  const TaskRow place = task_row(a, t, r);
  row.valid = place.valid;
  row.pos = static_cast<int32_t>(place.pos);
  row.lo = static_cast<int32_t>(place.lo);
  row.m = -INFINITY;
  row.l = 0.f;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) row.q[k] = row.o[k] = 0.f;
  if (!row.valid) return;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int64_t d = lane + 32 * k;
    if (d < D) row.q[k] = load_any(a.query, place.q_at + d * a.q_strides[2], a.q_dtype);
  }
  if (a.k_rot) {  // keys are stored rotated: rotate the query alike (whole warp: row.valid is uniform)
    warp_rotate(row.q, D, lane);
    const float s = quant::rot_query_scale(D);
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) row.q[k] *= s;
  }
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) row.q[k] = lane + 32 * k < D ? row.q[k] * a.scale : 0.f;
}

/// Normalizes a finished row and writes it: the output and lse, or the task's partial state.
template <int kPerLane>
__device__ void finish_row(const AttentionArgs& a, const AttentionTask& t, const PartialStates& partial,
                           Row<kPerLane>& row, int64_t r, int lane) {
  if (!row.valid) return;
  const int64_t D = a.layout.head_dim;
  if (a.v_rot) warp_unrotate(row.o, D, lane);  // values stored rotated; the state is linear in V
  const float inv = row.l > 0.f ? 1.f / row.l : 0.f;
  const float lse = row.l > 0.f ? row.m + logf(row.l) : -INFINITY;
  if (t.partial < 0) {
    const int64_t out_row = task_row(a, t, r).out_row;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int64_t d = lane + 32 * k;
      if (d < D) store_any(a.out, out_row * D + d, a.q_dtype, row.o[k] * inv);
    }
    if (a.lse != nullptr && lane == 0) a.lse[out_row] = lse;
  } else {
    const int64_t slot_row = t.partial * partial.rows_per_slot + r;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int64_t d = lane + 32 * k;
      if (d < D) partial.o[slot_row * D + d] = row.o[k] * inv;
    }
    if (lane == 0) partial.lse[slot_row] = lse;
  }
}

/// Stages keys [t0, t0 + kKeys) of one side (K or V) of head h into `tile` (rows of kCols elements of Out),
/// dequantized with their scales, from 16-byte units of codes: one LDG.E.128 per unit (4 fp32, 8 bf16 / fp16,
/// 16 int8 / fp8, 32 int4 / kivi4 or 64 kivi2 values), decoded in registers; a full-precision unit already
/// in the tile's type is stored as it is (one STS.128). Keys at or past `end` stage 0. Needs every row to be
/// whole units and the pool 16-byte aligned (units_ok). The same values as kv_at x token_scale.
/// NOTE: one unit per thread at a time: two loaded before either was decoded took the quantized instances to
/// 165-250 registers with spills (sm_80), for no more bytes in flight in the model.
template <int kKeys, typename T, typename Out, int kCols>
__device__ __forceinline__ void stage_units(const AttentionArgs& a, const T* pool, const float* scales, bool key,
                                            const int32_t* table, int64_t h, int64_t t0, int64_t end,
                                            Out (*tile)[kCols]) {
  constexpr KVKind kind = KvType<T>::kind;
  // values per unit: a constant of the type, so that the decode below unrolls (no loop around a unit's values)
  constexpr unsigned kDims = static_cast<unsigned>(16 * 32 / code_row_bytes(kind, 32, KvType<T>::dtype));
  const PagedLayout& L = a.layout;
  const int64_t row_bytes = stored_row_bytes<T>(L.head_dim);
  const unsigned units = static_cast<unsigned>(row_bytes / 16), n = kKeys * units;  // 32-bit: n < kKeys x 64
  for (unsigned i = threadIdx.x; i < n; i += kThreads) {
    const int64_t k = t0 + i / units;
    Out* out = tile[i / units] + (i % units) * kDims;
    if (k >= end) {
#pragma unroll
      for (unsigned d = 0; d < kDims; ++d) out[d] = from_float<Out>(0.f);
      continue;
    }
    const int64_t block = table[k >> L.page_shift], pos = k & (L.page_size - 1);
    const int64_t row = L.row_index(block, h, pos);
    const uint4 w = reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(pool) + row * row_bytes)[i % units];
    if constexpr (std::is_same_v<T, Out>) {
      *reinterpret_cast<uint4*>(out) = w;  // full precision in the tile's own type: nothing to decode
    } else {
      // 4 values at a time, in a loop kept rolled: unrolled, ptxas hoisted a KIVI-2 unit's 128 metadata loads
      // ahead of its 64 values and the head_dim-256 instances spilled on sm_90a
      const float s = token_scale(kind, scales, L, block, h, pos);
#pragma unroll 1
      for (unsigned part = 0; part < kDims; part += 4) {
        dequantize_part(w, row, int64_t(i % units) * kDims, part, 4, kind, KvType<T>::dtype, s, scales, L, key,
                        [&](unsigned d, float v) { out[part + d] = from_float<Out>(v); });
      }
    }
  }
}

/// Whether stage_units can read pools of K type KT and V type VT: whole 16-byte units per row, aligned pools.
template <typename KT, typename VT>
__device__ __forceinline__ bool units_ok(const AttentionArgs& a) {
  const int64_t D = a.layout.head_dim;
  return whole_units(a.k_cache, KvType<KT>::kind, D, KvType<KT>::dtype) &&
         whole_units(a.v_cache, KvType<VT>::kind, D, KvType<VT>::dtype);
}

/// stage_units for a tile whose keys' pool rows are already in `rows` (shared memory, -1 past the sequence's
/// end): the K and V sides share one block-table read and row_index per key, and a thread steps through its
/// (key, unit) pairs without a division per unit.
template <int kKeys, typename T, typename Out, int kCols>
__device__ __forceinline__ void stage_rows(const AttentionArgs& a, const T* pool, const float* scales, bool key,
                                           int64_t h, const int64_t* rows, Out (*tile)[kCols]) {
  constexpr KVKind kind = KvType<T>::kind;
  constexpr unsigned kDims = static_cast<unsigned>(16 * 32 / code_row_bytes(kind, 32, KvType<T>::dtype));
  const PagedLayout& L = a.layout;
  const int64_t row_bytes = stored_row_bytes<T>(L.head_dim);
  const unsigned units = static_cast<unsigned>(row_bytes / 16);
  const unsigned step_key = kThreads / units, step_unit = kThreads % units;  // 32-bit, once per call
  unsigned jj = threadIdx.x / units, u = threadIdx.x % units;
  for (; jj < kKeys; jj += step_key, u += step_unit) {
    if (u >= units) {
      u -= units;
      ++jj;
      if (jj >= kKeys) break;
    }
    Out* out = tile[jj] + u * kDims;
    const int64_t row = rows[jj];
    if (row < 0) {
#pragma unroll
      for (unsigned d = 0; d < kDims; ++d) out[d] = from_float<Out>(0.f);
      continue;
    }
    const uint4 w = reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(pool) + row * row_bytes)[u];
    if constexpr (std::is_same_v<T, Out>) {
      *reinterpret_cast<uint4*>(out) = w;
    } else {
      dequantize_unit(w, row, int64_t(u) * kDims, kDims, kind, KvType<T>::dtype, row_scale(kind, scales, row, h),
                      scales, L, key,
                      [&](unsigned d, float v) { out[d] = from_float<Out>(v); });
    }
  }
}

/// The decode pipeline of attention_kernel<KT, VT> (head_dim <= kPipeMaxDim, rows of whole 16-byte units):
/// a ring of kStages tiles of kTile keys whose K and V rows are copied with cp.async in their storage type,
/// kStages - 1 tiles in flight while the CTA works on the oldest. A full-precision side is read from the
/// ring as it is; a quantized side is decoded once per tile into an fp32 tile (kTile x head_dim) that every
/// warp then reads. Sizes at head_dim 128; a smaller head_dim fills less of each stage.
template <typename KT, typename VT>
struct DecodePipe {
  static constexpr bool kKeyFull = KvType<KT>::kind == KVKind::kFull;
  static constexpr bool kValueFull = KvType<VT>::kind == KVKind::kFull;
  static constexpr int64_t kKeyRow = code_row_bytes(KvType<KT>::kind, kPipeMaxDim, KvType<KT>::dtype);
  static constexpr int64_t kValueRow = code_row_bytes(KvType<VT>::kind, kPipeMaxDim, KvType<VT>::dtype);
  static constexpr int64_t kStageBytes = kTile * (kKeyRow + kValueRow);
  static constexpr int64_t kDecodedTile = kTile * kPipeMaxDim * 4;  // one side's fp32 tile
  static constexpr int64_t kDecodedBytes = (kKeyFull ? 0 : kDecodedTile) + (kValueFull ? 0 : kDecodedTile);
  static constexpr int64_t kRowsBytes = kTile * 8;  // a stage's pool rows (int64)
  // Enough stages that kPipeInFlight bytes are in flight, as many as fit beside the decoded tiles.
  static constexpr int64_t kWanted = 1 + (kPipeInFlight + kStageBytes - 1) / kStageBytes;
  static constexpr int64_t kFit = (kSmemBytes - kDecodedBytes) / (kStageBytes + kRowsBytes);
  static constexpr int kStages = static_cast<int>(kWanted < kFit ? kWanted : kFit);
  static_assert(kStages >= 2, "the decode pipeline needs two stages of shared memory");
  static constexpr int64_t kBytes = kDecodedBytes + kStages * (kStageBytes + kRowsBytes);
};

/// Starts the copies of keys [t0, t0 + kTile) of K and V into a stage (keys at or past `end` are not
/// copied) and writes the keys' pool rows (-1 past `end`) for the decode. One cp.async per 16-byte unit.
__device__ __forceinline__ void issue_stage(const AttentionArgs& a, const int32_t* table, int64_t h, int32_t t0,
                                            int32_t end, unsigned k_units, unsigned v_units, char* k_stage,
                                            char* v_stage, int64_t* rows) {
  const PagedLayout& L = a.layout;
  const unsigned units = k_units + v_units;  // 32-bit: a unit index is < kTile x 2 x 64
  const char* kc = static_cast<const char*>(a.k_cache);
  const char* vc = static_cast<const char*>(a.v_cache);
  // a thread's (key, unit) pairs are threadIdx.x + k kThreads; stepped without a division per unit
  // (units <= 64 < kThreads at head_dim <= kPipeMaxDim, so one wrap per step is enough)
  const unsigned step_key = kThreads / units, step_unit = kThreads % units;
  unsigned jj = threadIdx.x / units, u = threadIdx.x % units;
  for (; jj < kTile; jj += step_key, u += step_unit) {
    if (u >= units) {
      u -= units;
      ++jj;
      if (jj >= kTile) break;
    }
    const int32_t key = t0 + static_cast<int32_t>(jj);
    if (key >= end) {
      if (u == 0) rows[jj] = -1;
      continue;
    }
    const int64_t row = L.row_index(table[key >> L.page_shift], h, key & (L.page_size - 1));
    if (u == 0) rows[jj] = row;
    // one copy instruction for K and V units alike (selected addresses, not two branches): a warp's 32 lanes
    // copy 512 bytes together
    const bool k_side = u < k_units;
    const unsigned w = k_side ? u : u - k_units, side_units = k_side ? k_units : v_units;
    char* dst = (k_side ? k_stage : v_stage) + (jj * side_units + w) * 16;
    cp_async_16(dst, (k_side ? kc : vc) + (row * side_units + w) * 16);
  }
}

/// Decodes one side of a landed stage (rows of `units` 16-byte units of T) into `out` (kTile rows of D
/// floats), with the same values as kv_at x token_scale. Keys past the end (row -1) are left alone: no
/// warp reads them. A thread decodes 4 values of a unit at a time and stores them as one float4: all 128
/// threads share the tile's work (a unit per thread left 96 of them idle for KIVI-2 and took the mixed
/// KIVI instances to spills on sm_90a), and consecutive lanes write consecutive 16 bytes (no bank conflict).
template <typename T>
__device__ __forceinline__ void decode_stage(const AttentionArgs& a, const float* scales, bool key, int64_t h,
                                             const char* stage, const int64_t* rows, unsigned units, float* out) {
  constexpr KVKind kind = KvType<T>::kind;
  constexpr unsigned kDims = static_cast<unsigned>(16 * 32 / code_row_bytes(kind, 32, KvType<T>::dtype));
  constexpr unsigned kParts = kDims / 4;  // 4 (int8 / fp8), 8 (int4 / KIVI-4) or 16 (KIVI-2): a shift below
  const PagedLayout& L = a.layout;
  const unsigned D = static_cast<unsigned>(L.head_dim);
  for (unsigned i = threadIdx.x; i < kTile * units * kParts; i += kThreads) {
    const unsigned unit = i / kParts, part = i % kParts;
    const unsigned jj = unit / units, u = unit % units;
    const int64_t row = rows[jj];
    if (row < 0) continue;
    const uint4 w = shared_load(reinterpret_cast<const uint4*>(stage) + unit);  // the lanes of a unit read it together
    *reinterpret_cast<float4*>(out + jj * D + u * kDims + part * 4) =
        dequantize_float4(w, row, int64_t(u) * kDims, part * 4, kind, KvType<T>::dtype,
                          row_scale(kind, scales, row, h), scales, L, key);
  }
}

/// Every row of this warp takes keys [t0, min(t0 + kTile, end)) of a tile: key jj's dim d is k_at(jj, d),
/// its value's v_at(jj, d).
template <int kPerLane, int kRows, class KAt, class VAt>
__device__ __forceinline__ void absorb_tile(const AttentionArgs& a, Row<kPerLane> (&rw)[kRows], int32_t t0, int32_t end,
                                            int lane, KAt k_at, VAt v_at) {
  const int64_t D = a.layout.head_dim;
  for (int jj = 0; jj < kTile && t0 + jj < end; ++jj) {
    const int32_t key = t0 + jj;  // < kv_len, an int32
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      Row<kPerLane>& row = rw[i];
      if (!row.valid || !key_visible(a, row, key)) continue;  // uniform across the warp
      float s = 0.f;
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int d = lane + 32 * k;
        if (d < D) s += row.q[k] * k_at(jj, d);
      }
      s = warp_sum(s);
      absorb<kPerLane>(a, row, s, lane, [&](int d) { return v_at(jj, d); });
    }
  }
}

/// One task (one KV head): K/V tiles staged in shared memory, kRowsPerCta rows per pass over the keys
/// (half as many at head_dim > 128).
/// Rows are dealt to the warps in turn (row i * kWarps + warp of the pass), so that a decode step of a
/// GQA group of 4 keeps all four warps busy. Every warp walks the same tiles (the union of the task's
/// keys) so that __syncthreads() is uniform. With head_dim <= kPipeMaxDim and rows of whole 16-byte units
/// the tiles stream through DecodePipe's cp.async ring; otherwise each tile is loaded and dequantized into
/// fp32 tiles of kTile x 256 before the warps read it.
template <typename KT, typename VT>
__global__ void __launch_bounds__(kThreads, kDecodeCtasPerSm)
    attention_kernel(AttentionArgs a, const AttentionTask* tasks, PartialStates partial) {
  using Pipe = DecodePipe<KT, VT>;
  constexpr int64_t kStagedBytes = 2 * kTile * kMaxPerLane * 32 * 4;  // the fp32 tiles of the other path
  KVC_SHARED(uint4, smem, [(Pipe::kBytes > kStagedBytes ? Pipe::kBytes : kStagedBytes) / 16]);
  const AttentionTask t = tasks[blockIdx.x];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const PagedLayout L = a.layout;
  const int64_t D = L.head_dim;
  const int64_t h = t.head_begin;
  const int32_t* table = a.block_tables + t.seq * a.table_stride;
  // task-level counts in 32 bits (key indices are < kv_len, an int32; rows < total_q x q_heads): each int64
  // held across the passes is two registers, and at 168 the KIVI instances spilled such values on sm_90a
  const int32_t rows = (t.tok_end - t.tok_begin) * static_cast<int32_t>(a.group) * (t.head_end - t.head_begin);
  // the task's keys end at its last query's position + 1
  const int32_t end = min(t.kv_end, a.kv_lens[t.seq] - (a.cu_q_lens[t.seq + 1] - a.cu_q_lens[t.seq]) + t.tok_end);
  const bool units = units_ok<KT, VT>(a);  // 128-bit loads, else one value per load
  const bool pipe = units && D <= kPipeMaxDim;
  // the pipeline's shared memory: [decoded K][decoded V][stage rows][stages]
  float* k_dec = reinterpret_cast<float*>(smem);
  float* v_dec = k_dec + (Pipe::kKeyFull ? 0 : Pipe::kDecodedTile / 4);
  int64_t* stage_rows_at = reinterpret_cast<int64_t*>(v_dec + (Pipe::kValueFull ? 0 : Pipe::kDecodedTile / 4));
  char* ring = reinterpret_cast<char*>(stage_rows_at + Pipe::kStages * kTile);
  const unsigned k_units = static_cast<unsigned>(stored_row_bytes<KT>(D) / 16);
  const unsigned v_units = static_cast<unsigned>(stored_row_bytes<VT>(D) / 16);
  const int64_t stage_bytes = kTile * int64_t(k_units + v_units) * 16;
  // the staged path's fp32 tiles
  auto ks = reinterpret_cast<float(*)[kMaxPerLane * 32]>(smem);
  auto vs = ks + kTile;

  // kPerLane dims per lane, kRows rows per warp and pass: 4 x 4 at head_dim <= 128, 8 x 2 above
  const auto passes = [&](auto per_lane) {
    constexpr int kPerLane = decltype(per_lane)::value, kRows = kLaneFloats / kPerLane;
    for (int32_t first = 0; first < rows; first += kWarps * kRows) {
      Row<kPerLane> rw[kRows];
      int32_t last = -1;  // the last key any row of this warp sees
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        init_row(a, t, first + i * kWarps + warp, lane, rw[i]);
        last = max(last, rw[i].pos);
      }
      if (kPerLane * 32 == kPipeMaxDim && pipe) {
        const auto stage = [&](int32_t n) { return ring + (n % Pipe::kStages) * stage_bytes; };
        const auto stage_rows = [&](int32_t n) { return stage_rows_at + (n % Pipe::kStages) * kTile; };
        const int32_t tiles = (max(end - t.kv_begin, 0) + kTile - 1) / kTile;
        __syncthreads();  // the previous pass no longer reads the ring
#pragma unroll
        for (int n = 0; n < Pipe::kStages - 1; ++n) {  // the first kStages - 1 tiles in flight
          if (n < tiles) {
            issue_stage(a, table, h, t.kv_begin + n * kTile, end, k_units, v_units, stage(n),
                        stage(n) + kTile * k_units * 16, stage_rows(n));
          }
          cp_async_commit();  // one group per stage, empty or not, so that the wait below counts stages
        }
        for (int32_t n = 0; n < tiles; ++n) {
          const int32_t t0 = t.kv_begin + n * kTile;
          cp_async_wait<Pipe::kStages - 2>();  // this thread's copies of tile n have landed
          __syncthreads();  // ... and every thread's; tile n - 1 is no longer read, so its stage is free
          if (n + Pipe::kStages - 1 < tiles) {
            const int32_t next = n + Pipe::kStages - 1;
            issue_stage(a, table, h, t.kv_begin + next * kTile, end, k_units, v_units, stage(next),
                        stage(next) + kTile * k_units * 16, stage_rows(next));
          }
          cp_async_commit();
          const char* ks_raw = stage(n);
          const char* vs_raw = ks_raw + kTile * k_units * 16;
          if constexpr (!Pipe::kKeyFull || !Pipe::kValueFull) {
            if constexpr (!Pipe::kKeyFull) {
              decode_stage<KT>(a, a.k_scale, true, h, ks_raw, stage_rows(n), k_units, k_dec);
            }
            if constexpr (!Pipe::kValueFull) {
              decode_stage<VT>(a, a.v_scale, false, h, vs_raw, stage_rows(n), v_units, v_dec);
            }
            __syncthreads();
          }
          if (t0 > last) continue;  // nothing visible for this warp in this tile (still joins the barriers)
          absorb_tile(
              a, rw, t0, end, lane,
              [&](int jj, int d) {
                if constexpr (Pipe::kKeyFull)
                  return to_float(shared_load(reinterpret_cast<const KT*>(ks_raw) + jj * D + d));
                else return shared_load(k_dec + jj * D + d);
              },
              [&](int jj, int d) {
                if constexpr (Pipe::kValueFull)
                  return to_float(shared_load(reinterpret_cast<const VT*>(vs_raw) + jj * D + d));
                else return shared_load(v_dec + jj * D + d);
              });
        }
        cp_async_wait<0>();  // no copy outlives the pass (the empty groups of the last tiles)
      } else {
        const KT* kc = static_cast<const KT*>(a.k_cache);
        const VT* vc = static_cast<const VT*>(a.v_cache);
        const uint16_t* k_meta = reinterpret_cast<const uint16_t*>(a.k_scale);  // read only for int4 / kivi
        const uint16_t* v_meta = reinterpret_cast<const uint16_t*>(a.v_scale);
        for (int32_t t0 = t.kv_begin; t0 < end; t0 += kTile) {
          __syncthreads();  // the previous tile is no longer read
          if (units) {
            stage_units<kTile>(a, kc, a.k_scale, true, table, h, t0, end, ks);
            stage_units<kTile>(a, vc, a.v_scale, false, table, h, t0, end, vs);
          } else {
            for (unsigned idx = threadIdx.x; idx < kTile * D; idx += kThreads) {  // 32-bit: < kTile x 256
              const unsigned jj = idx / static_cast<unsigned>(D), d = idx % static_cast<unsigned>(D);
              const int32_t key = t0 + static_cast<int32_t>(jj);
              float kv = 0.f, vv = 0.f;
              if (key < end) {  // staged dequantized: scales applied here, once per element
                const int64_t block = table[key >> L.page_shift], pos = key & (L.page_size - 1);
                const int64_t row = L.row_index(block, h, pos);
                kv = kv_at(kc, k_meta, L, row, d) * token_scale(a.k_kind, a.k_scale, L, block, h, pos);
                vv = kv_at(vc, v_meta, L, row, d) * token_scale(a.v_kind, a.v_scale, L, block, h, pos);
              }
              ks[jj][d] = kv;
              vs[jj][d] = vv;
            }
          }
          __syncthreads();
          if (t0 > last) continue;
          absorb_tile(
              a, rw, t0, end, lane, [&](int jj, int d) { return shared_load(&ks[jj][d]); },
              [&](int jj, int d) { return shared_load(&vs[jj][d]); });
        }
      }
#pragma unroll
      for (int i = 0; i < kRows; ++i) finish_row(a, t, partial, rw[i], first + i * kWarps + warp, lane);
    }
  };
  if (D <= kPipeMaxDim) {
    passes(std::integral_constant<int, kPipeMaxDim / 32>{});
  } else {
    passes(std::integral_constant<int, kMaxPerLane>{});
  }
}

// ---- Prefill on tensor cores -------------------------------------------------------------------------
// Prefill tasks (more query rows per KV head than a decode step: the planner orders them first) run in
// prefill_mma_kernel when mma_prefill(a) holds: FlashAttention-2's scheme on mma.m16n8k16 (core/warp_mma.cuh)
// in the query's dtype with fp32 accumulation. A warp owns 16 query rows (kMmaRows per pass of the CTA); the
// CTA stages tiles of kMmaKeys keys of K and V in shared memory, dequantized to the query's dtype; a warp
// computes its 16 x 64 block of S = Q K^T, takes the online softmax of it in registers and adds P V to its
// output, P going from S's accumulator fragments straight into A fragments (the two layouts match). Scores
// are scaled in fp32 (the query is not pre-scaled, so a bf16 query enters the tensor core exactly).

constexpr int kMmaRows = kWarps * 16;       // query rows of one pass: one m16 tile per warp
constexpr int kMmaKeys = 64;                // keys per shared-memory tile
constexpr int kMmaMaxDim = 128;             // O takes head_dim / 2 fp32 registers per lane
constexpr int kMmaStride = kMmaMaxDim + 8;  // a tile row: +16 bytes, so that ldmatrix's 8 rows hit 8 bank groups
static_assert(kMmaRows <= kMmaKeys, "the query block is staged through the K tile");

template <typename In>
struct alignas(16) MmaTile {
  In v[kMmaKeys][kMmaStride];
};

/// Whether prefill tasks of call `a` run on tensor cores: a bf16 query over bf16 or quantized pages, or an
/// fp16 query over fp16 pages (quantized pages are dequantized to bf16: an fp16 query would lose precision
/// in bf16), head_dim a multiple of 16 up to kMmaMaxDim, rows of whole 16-byte units, no Hadamard rotation
/// (a rotated query or output needs a warp's whole row, which the mma fragments spread over a quad).
/// The part of mma_prefill a step plan can check (it knows no query dtype and no pool pointers).
KVC_HOST_DEVICE bool mma_prefill_shape(const AttentionArgs& a) {
  const int64_t D = a.layout.head_dim;
  return D % 16 == 0 && D <= kMmaMaxDim && !a.k_rot && !a.v_rot;
}
KVC_HOST_DEVICE bool mma_prefill(const AttentionArgs& a) {
  const int64_t D = a.layout.head_dim;
  const auto fits = [&](KVKind kind) {
    return kind == KVKind::kFull ? a.kv_dtype == a.q_dtype : a.q_dtype == DType::kBFloat16;
  };
  return (a.q_dtype == DType::kBFloat16 || a.q_dtype == DType::kFloat16) && fits(a.k_kind) && fits(a.v_kind) &&
         mma_prefill_shape(a) && whole_units(a.k_cache, a.k_kind, D, a.kv_dtype) &&
         whole_units(a.v_cache, a.v_kind, D, a.kv_dtype);
}

/// Prefill tasks of one KV head (t.head_begin == t.head_end - 1, as the planner makes them) on tensor cores.
template <typename KT, typename VT, typename In>
__global__ void __launch_bounds__(kThreads) prefill_mma_kernel(AttentionArgs a, const AttentionTask* tasks,
                                                               PartialStates partial) {
  KVC_SHARED(MmaTile<In>, ks, [1]);
  KVC_SHARED(MmaTile<In>, vs, [1]);
  KVC_SHARED(int64_t, tile_rows, [kMmaKeys]);  // pool rows of the tile's keys (K and V alike), -1 past the end
  const AttentionTask t = tasks[blockIdx.x];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
  const PagedLayout L = a.layout;
  const int64_t D = L.head_dim;
  const int64_t h = t.head_begin;
  const int32_t* table = a.block_tables + t.seq * a.table_stride;
  const int64_t rows = int64_t(t.tok_end - t.tok_begin) * a.group * (t.head_end - t.head_begin);
  const int64_t q_len = a.cu_q_lens[t.seq + 1] - a.cu_q_lens[t.seq];
  const int64_t cta_last = a.kv_lens[t.seq] - q_len + t.tok_end - 1;
  const int64_t end = min(int64_t(t.kv_end), cta_last + 1);
  constexpr int kSteps = kMmaMaxDim / 16;  // k-steps of S = Q K^T; n-tiles of O are 2 per step
  constexpr int kKeyTiles = kMmaKeys / 8;  // n-tiles of S
  const float inv_cap = a.softcap > 0.f ? 1.f / a.softcap : 0.f;  // (a division per score is a slow-path call)

  for (int64_t first = 0; first < rows; first += kMmaRows) {
    const int64_t r0 = first + warp * 16;
    const TaskRow row[2] = {task_row(a, t, r0 + g), task_row(a, t, r0 + g + 8)};
    // the query block, through the K tile: rows [first, first + kMmaRows) x dims [0, D), 0 past the task's rows
    __syncthreads();  // the previous pass no longer reads the tiles
    for (unsigned rr = warp; rr < kMmaRows; rr += kWarps) {  // a row per warp: its mapping once, not per dim
      const TaskRow q = task_row(a, t, first + rr);
      for (unsigned d = lane; d < static_cast<unsigned>(D); d += 32) {
        ks[0].v[rr][d] = from_float<In>(q.valid ? load_any(a.query, q.q_at + d * a.q_strides[2], a.q_dtype) : 0.f);
      }
    }
    __syncthreads();
    uint32_t qa[kSteps][4] = {};  // A fragments of the warp's 16 query rows
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
      if (kk * 16 < D) ldmatrix(qa[kk], &ks[0].v[warp * 16 + lane % 16][kk * 16 + 8 * (lane / 16)]);
    }
    float o[2 * kSteps][4] = {};  // C fragments of O: n-tile n holds dims [8 n, 8 n + 8)
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // per row (g, g + 8); l: this lane's partial sum
    const int64_t warp_last = max(row[0].pos, row[1].pos);  // the quad's rows; reduced over the warp below
    int64_t last = warp_last;
    for (int off = 16; off > 0; off >>= 1) last = max(last, int64_t(__shfl_xor_sync(0xffffffffu, warp_last, off)));

    for (int64_t t0 = t.kv_begin; t0 < end; t0 += kMmaKeys) {
      __syncthreads();  // the query fragments are loaded / the previous tile is no longer read
      if (threadIdx.x < kMmaKeys) {
        const int64_t k = t0 + threadIdx.x;
        tile_rows[threadIdx.x] = k < end ? L.row_index(table[k >> L.page_shift], h, k & (L.page_size - 1)) : -1;
      }
      __syncthreads();
      stage_rows<kMmaKeys>(a, static_cast<const KT*>(a.k_cache), a.k_scale, true, h, tile_rows, ks[0].v);
      stage_rows<kMmaKeys>(a, static_cast<const VT*>(a.v_cache), a.v_scale, false, h, tile_rows, vs[0].v);
      __syncthreads();
      if (t0 > last) continue;  // no row of this warp sees these keys (the warp still joins the barriers)
      // S = Q K^T; the head_dim guard (uniform) outside the loop over the key n-tiles, so that it branches once
      // per k-step, not once per MMA
      float s[kKeyTiles][4] = {};  // C fragments of S: n-tile j holds keys t0 + [8 j, 8 j + 8)
#pragma unroll
      for (int kk = 0; kk < kSteps; ++kk) {
        if (kk * 16 >= D) break;
#pragma unroll
        for (int j = 0; j < kKeyTiles; j += 2) {
          // K^T's blocks for n-tiles j and j + 1: matrix m = lane / 8 is keys 8 (j + m / 2) + [0, 8), dims
          // kk 16 + 8 (m % 2) + [0, 8)
          uint32_t b[4];
          ldmatrix(b, &ks[0].v[8 * j + 8 * (lane / 16) + lane % 8][kk * 16 + 8 * ((lane / 8) % 2)]);
          const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
          mma_m16n8k16<In>(s[j], qa[kk], b0, s[j]);
          mma_m16n8k16<In>(s[j + 1], qa[kk], b1, s[j + 1]);
        }
      }
      // scale and soft cap (one branch per tile, not per score)
      if (a.softcap > 0.f) {
#pragma unroll
        for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
          for (int c = 0; c < 4; ++c) s[j][c] = a.softcap * tanhf(s[j][c] * a.scale * inv_cap);
        }
      } else {
#pragma unroll
        for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
          for (int c = 0; c < 4; ++c) s[j][c] *= a.scale;
        }
      }
      // mask; the tile's max per row over the quad (the 4 lanes holding a row). Each row sees the tile's
      // columns [first, last] and those below `sinks` (32-bit, relative to t0: no 64-bit compares per score)
      int first_col[2], last_col[2];
      const int sinks = static_cast<int>(min(max(a.sink_tokens - t0, int64_t(0)), int64_t(kMmaKeys)));
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int64_t last_key = min(row[i].pos, end - 1);  // pos is -1 for a row past the task's
        last_col[i] = static_cast<int>(min(max(last_key - t0, int64_t(-1)), int64_t(kMmaKeys - 1)));
        first_col[i] = static_cast<int>(min(max(row[i].lo - t0, int64_t(0)), int64_t(kMmaKeys)));
      }
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int col = 8 * j + 2 * tq + (c & 1), i = c / 2;
          const float x = col <= last_col[i] && (col >= first_col[i] || col < sinks) ? s[j][c] : -INFINITY;
          s[j][c] = x;
          tile_max[i] = fmaxf(tile_max[i], x);
        }
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
        tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
      }
      float base[2];  // one rescale per row and tile
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float m_new = fmaxf(m[i], tile_max[i]);
        base[i] = m_new == -INFINITY ? 0.f : m_new;  // no key seen yet: every p below is 0
        const float alpha = __expf(m[i] - base[i]);  // 0 when m was -inf
        m[i] = m_new;
        l[i] *= alpha;
#pragma unroll
        for (int n = 0; n < 2 * kSteps; ++n) {
          o[n][2 * i] *= alpha;
          o[n][2 * i + 1] *= alpha;
        }
      }
      // P in the query's dtype: S's fragments of n-tiles 2 kk and 2 kk + 1 are P's A fragment for keys
      // [16 kk, 16 kk + 16)
      uint32_t pa[kKeyTiles / 2][4];
#pragma unroll
      for (int kk = 0; kk < kKeyTiles / 2; ++kk) {
        float p[2][4];
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            p[jj][c] = __expf(s[2 * kk + jj][c] - base[c / 2]);
            l[c / 2] += p[jj][c];
          }
        }
        pa[kk][0] = pack_pair(from_float<In>(p[0][0]), from_float<In>(p[0][1]));
        pa[kk][1] = pack_pair(from_float<In>(p[0][2]), from_float<In>(p[0][3]));
        pa[kk][2] = pack_pair(from_float<In>(p[1][0]), from_float<In>(p[1][1]));
        pa[kk][3] = pack_pair(from_float<In>(p[1][2]), from_float<In>(p[1][3]));
      }
      // O += P V; the head_dim guard outside the loop over the keys
#pragma unroll
      for (int n = 0; n < 2 * kSteps; n += 2) {
        if (n * 8 >= D) break;
#pragma unroll
        for (int kk = 0; kk < kKeyTiles / 2; ++kk) {
          uint32_t b[4];  // V's 16 x 16 block (keys x dims), transposed: b for n-tiles n and n + 1
          ldmatrix_trans(b, &vs[0].v[16 * kk + lane % 16][8 * n + 8 * (lane / 16)]);
          const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
          mma_m16n8k16<In>(o[n], pa[kk], b0, o[n]);
          mma_m16n8k16<In>(o[n + 1], pa[kk], b1, o[n + 1]);
        }
      }
    }
    // l over the quad, then normalize and write (dims 8 n + 2 tq, + 1 of rows g and g + 8)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
      l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
      if (!row[i].valid) continue;
      const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
      const float lse = l[i] > 0.f ? m[i] + logf(l[i]) : -INFINITY;
      const int64_t slot_row = t.partial * partial.rows_per_slot + r0 + g + 8 * i;
#pragma unroll
      for (int n = 0; n < 2 * kSteps; ++n) {
        if (n * 8 >= D) continue;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t d = 8 * n + 2 * tq + e;
          const float v = o[n][2 * i + e] * inv;
          if (t.partial < 0) {
            store_any(a.out, row[i].out_row * D + d, a.q_dtype, v);
          } else {
            partial.o[slot_row * D + d] = v;
          }
        }
      }
      if (tq == 0) {
        if (t.partial < 0) {
          if (a.lse != nullptr) a.lse[row[i].out_row] = lse;
        } else {
          partial.lse[slot_row] = lse;
        }
      }
    }
  }
}

/// Folds the partial states of each split (sequence, head range) into out/lse. One CTA per split.
__global__ void __launch_bounds__(kThreads) merge_partials_kernel(AttentionArgs a, const AttentionPlan::Split* splits,
                                                                  PartialStates partial) {
  const AttentionPlan::Split sp = splits[blockIdx.x];
  const int64_t D = a.layout.head_dim, G = a.group;
  const int64_t q_start = a.cu_q_lens[sp.seq], q_len = a.cu_q_lens[sp.seq + 1] - q_start;
  const int64_t per_head = q_len * G;
  const int64_t rows = int64_t(sp.head_end - sp.head_begin) * per_head;
  for (int64_t r = threadIdx.x / 32; r < rows; r += kWarps) {
    const int lane = threadIdx.x % 32;
    // Merge weights depend only on the lse values: every lane recomputes them (cheap, no sync).
    float acc_lse = -INFINITY;
    float acc[kMaxPerLane] = {};
    for (int64_t s = 0; s < sp.num_slots; ++s) {
      const int64_t slot_row = (sp.first_slot + s) * partial.rows_per_slot + r;
      const MergeWeights w = merge_weights(acc_lse, partial.lse[slot_row]);
#pragma unroll
      for (int k = 0; k < kMaxPerLane; ++k) {
        const int64_t d = lane + 32 * k;
        if (d < D) acc[k] = w.w_a * acc[k] + w.w_b * partial.o[slot_row * D + d];
      }
      acc_lse = w.lse;
    }
    // 32-bit index arithmetic (a split's rows and a GQA group are small): no 64-bit division calls
    const unsigned r32 = static_cast<unsigned>(r), per_head32 = static_cast<unsigned>(per_head);
    const unsigned local = r32 % per_head32, G32 = static_cast<unsigned>(G);
    const int64_t h = sp.head_begin + r32 / per_head32;
    const int64_t row = (q_start + local / G32) * a.q_heads + h * G + local % G32;
#pragma unroll
    for (int k = 0; k < kMaxPerLane; ++k) {
      const int64_t d = lane + 32 * k;
      if (d < D) store_any(a.out, row * D + d, a.q_dtype, acc[k]);
    }
    if (a.lse != nullptr && lane == 0) a.lse[row] = acc_lse;
  }
}

/// merge_states: one CTA per row (token, head) of contiguous v tensors, its threads striding over head_dim
/// (a row per CTA: no 64-bit division of an element index by the runtime head_dim).
__global__ void merge_states_kernel(const void* v_a, const float* lse_a, const void* v_b, const float* lse_b,
                                    void* v_out, float* lse_out, int64_t D, DType dtype) {
  const int64_t r = blockIdx.x;
  const MergeWeights w = merge_weights(lse_a[r], lse_b[r]);
  // (a 32-bit dim: with a 64-bit one the compiler's trip count was a 64-bit division)
  for (unsigned d = threadIdx.x; d < static_cast<unsigned>(D); d += blockDim.x) {
    const int64_t i = r * D + d;
    store_any(v_out, i, dtype, w.w_a * load_any(v_a, i, dtype) + w.w_b * load_any(v_b, i, dtype));
  }
  if (threadIdx.x == 0) lse_out[r] = w.lse;
}

/// The element type of a stored kind (core/kv_format.h: with_kv_kinds), for keys (kKey) or values.
template <class S, bool kKey>
struct CodeFor;
template <bool kKey>
struct CodeFor<Stored<KVKind::kFull, DType::kFloat32>, kKey> { using type = float; };
template <bool kKey>
struct CodeFor<Stored<KVKind::kFull, DType::kFloat16>, kKey> { using type = __half; };
template <bool kKey>
struct CodeFor<Stored<KVKind::kFull, DType::kBFloat16>, kKey> { using type = __nv_bfloat16; };
template <bool kKey>
struct CodeFor<Stored<KVKind::kInt8>, kKey> { using type = int8_t; };
template <bool kKey>
struct CodeFor<Stored<KVKind::kFp8E4M3>, kKey> { using type = Fp8E4M3; };
template <bool kKey>
struct CodeFor<Stored<KVKind::kFp8E5M2>, kKey> { using type = Fp8E5M2; };
template <bool kKey>
struct CodeFor<Stored<KVKind::kInt4>, kKey> { using type = Int4; };
template <bool kKey>
struct CodeFor<Stored<KVKind::kKivi4>, kKey> { using type = Kivi<4, kKey>; };
template <bool kKey>
struct CodeFor<Stored<KVKind::kKivi2>, kKey> { using type = Kivi<2, kKey>; };

template <template <typename, typename> class Kernel>
cudaError_t launch_by_kv(const AttentionArgs& a, const AttentionTask* tasks, int64_t n, const PartialStates& p,
                         cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(n));
  with_kv_kinds(a.k_kind, a.v_kind, a.kv_dtype, [&](auto sk, auto sv) {
    using KT = typename CodeFor<decltype(sk), true>::type;
    using VT = typename CodeFor<decltype(sv), false>::type;
    Kernel<KT, VT>::launch(grid, stream, a, tasks, p);
  });
  return cudaGetLastError();
}

/// prefill_mma_kernel's instances: the query's dtype for full-precision pages, bf16 for quantized ones
/// (mma_prefill); none for fp32 pages.
template <typename KT, typename VT>
struct PrefillMma {
  static void launch(dim3 grid, cudaStream_t s, const AttentionArgs& a, const AttentionTask* t, const PartialStates& p) {
    if constexpr (std::is_same_v<KT, __half>) {
      KVC_LAUNCH(grid, kThreads, s, prefill_mma_kernel<KT, VT, __half>)(a, t, p);
    } else if constexpr (!std::is_same_v<KT, float>) {
      KVC_LAUNCH(grid, kThreads, s, prefill_mma_kernel<KT, VT, __nv_bfloat16>)(a, t, p);
    }
  }
};

template <typename KT, typename VT>
struct Attention {
  static void launch(dim3 grid, cudaStream_t s, const AttentionArgs& a, const AttentionTask* t, const PartialStates& p) {
    KVC_LAUNCH(grid, kThreads, s, attention_kernel<KT, VT>)(a, t, p);
  }
};

}  // namespace

int64_t max_head_dim() { return kMaxPerLane * 32; }

int64_t attention_ctas_per_sm(const AttentionArgs& a) {
  int64_t n = 1;
  with_kv_kinds(a.k_kind, a.v_kind, a.kv_dtype, [&](auto sk, auto sv) {
    using KT = typename CodeFor<decltype(sk), true>::type;
    using VT = typename CodeFor<decltype(sv), false>::type;
    static const int ctas = kvc_ctas_per_sm(attention_kernel<KT, VT>, kThreads);  // once per instantiation
    n = ctas;
  });
  return n;
}

PlanOptions cuda_plan_options(const AttentionArgs& a, int64_t multiprocessors) {
  PlanOptions opt;
  opt.parallelism = multiprocessors;
  opt.tasks_per_worker = attention_ctas_per_sm(a);  // every SM filled up to its resident-CTA limit
  opt.fill_waves = true;
  // Up to 64 query rows per KV head is decode (a task takes them in passes of kRowsPerCta over its keys):
  // such a sequence is split along its keys, down to a single page when the batch is small.
  opt.decode_rows = 64;
  opt.min_split_keys = std::max<int64_t>(a.layout.page_size, kTile);
  // Prefill tasks go first, to prefill_mma_kernel: kMmaRows rows each when its shapes allow (the query's
  // dtype is not known to a step plan: with an fp32 query, attention_kernel takes such a task in passes).
  opt.prefill_first = true;
  opt.prefill_rows = mma_prefill_shape(a) ? kMmaRows : kRowsPerCta;  // kRowsPerCta: one pass of attention_kernel
  return opt;
}

AttentionPlan plan_cuda_attention(const AttentionArgs& a, const AttentionHostInfo& host, int64_t multiprocessors) {
  return make_attention_plan(a, host, cuda_plan_options(a, multiprocessors));
}

cudaError_t launch_attention(const AttentionArgs& a, const AttentionTask* tasks, int64_t num_tasks, int64_t num_prefill,
                             const AttentionPlan::Split* splits, int64_t num_splits, const PartialStates& partial,
                             cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  if (num_prefill > 0 && mma_prefill(a)) {  // the prefill tasks on tensor cores, the rest on CUDA cores
    err = launch_by_kv<PrefillMma>(a, tasks, num_prefill, partial, stream);
    if (err != cudaSuccess) return err;
    tasks += num_prefill;
    num_tasks -= num_prefill;
  }
  err = launch_by_kv<Attention>(a, tasks, num_tasks, partial, stream);
  if (err != cudaSuccess) return err;
  if (num_splits > 0) {
    KVC_LAUNCH(static_cast<unsigned>(num_splits), kThreads, stream, merge_partials_kernel)(a, splits, partial);
    err = cudaGetLastError();
  }
  return err;
}

cudaError_t launch_merge_states(const void* v_a, const float* lse_a, const void* v_b, const float* lse_b, void* v_out,
                                float* lse_out, int64_t rows, int64_t head_dim, DType dtype, cudaStream_t stream) {
  if (rows == 0 || head_dim == 0) return cudaSuccess;
  if (rows > INT32_MAX) return cudaErrorInvalidConfiguration;  // one CTA per row: grid.x < 2^31
  KVC_LAUNCH(static_cast<unsigned>(rows), kMergeThreads, stream, merge_states_kernel)(v_a, lse_a, v_b, lse_b, v_out,
                                                                                      lse_out, head_dim, dtype);
  return cudaGetLastError();
}

}  // namespace kvcache::cuda
