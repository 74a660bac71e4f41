// What a task keeps while it runs: its query rows (loaded, scaled, rotated), per-row softmax state,
// the prefetcher of the next tiles, per-thread scratch, and the final normalization and write.
// Part of the CPU attention kernel (see attention/attention_cpu_kernel.h), compiled once per instruction set.
#pragma once

#ifndef KVC_ISA
#error "define KVC_ISA (the namespace of this instruction-set build) before including this header"
#endif

#include "attention/cpu_kernel/kv_readers.h"

namespace kvcache::cpu::KVC_ISA {

/// Calls put(d, value) for the D values of the query row at element offset `base` (strided), the dtype
/// switch taken once per row (NOTE: per element it was a visible cost of short decodes).
template <class Put>
inline void load_query_as(const AttentionArgs& a, int64_t base, Put put) {
  const int64_t D = a.layout.head_dim, stride = a.q_strides[2];
  switch (a.q_dtype) {
    case DType::kFloat32: {
      const float* q = static_cast<const float*>(a.query) + base;
      for (int64_t d = 0; d < D; ++d) put(d, q[d * stride]);
      break;
    }
    case DType::kFloat16: {
      const uint16_t* q = static_cast<const uint16_t*>(a.query) + base;
      for (int64_t d = 0; d < D; ++d) put(d, fp16_to_float(q[d * stride]));
      break;
    }
    default: {
      const uint16_t* q = static_cast<const uint16_t*>(a.query) + base;
      for (int64_t d = 0; d < D; ++d) put(d, bf16_to_float(q[d * stride]));
    }
  }
}

/// Query row `base` of a.query as fp32 in natural order, times a.scale; with Hadamard-rotated keys,
/// rotated like them (quant::rotate, then 1 / (c^2 D)) so that its dot products with the codes are q.k.
inline void load_query_f32(const AttentionArgs& a, int64_t base, float* q) {
  const int64_t D = a.layout.head_dim;
  load_query_as(a, base, [&](int64_t d, float x) { q[d] = x; });
  if (a.k_rot) {
    quant::rotate(q, D);
    const float s = quant::rot_query_scale(D);
    for (int64_t d = 0; d < D; ++d) q[d] *= s;
  }
  for (int64_t d = 0; d < D; ++d) q[d] *= a.scale;
}

/// The query row as load_query_f32 makes it, stored at q_row[index(d)] (a score policy's K order).
template <class Index>
inline void load_query_scattered(const AttentionArgs& a, int64_t base, float* q_row, Index index) {
  const int64_t D = a.layout.head_dim;
  if (a.k_rot) {  // Hadamard-rotated keys: rotated (and scaled) like them
    float q[kMaxRotatedDim];
    load_query_f32(a, base, q);
    for (int64_t d = 0; d < D; ++d) q_row[index(d)] = q[d];
    return;
  }
  const float scale = a.scale;
  load_query_as(a, base, [&](int64_t d, float x) { q_row[index(d)] = scale * x; });
}

/// Per-row bookkeeping of a task.
struct RowState {
  int64_t pos;   // position of the query (-1: padding row, sees nothing)
  int64_t lo;    // first key of the window
  float m, l;    // running max and sum of the online softmax
};

/// Prefetches the next tile's K and V rows a few lines at a time, from inside the P.V loop: spread
/// out, the prefetches overlap with the arithmetic; issued as one burst per tile they stall it (measured
/// ~10% slower on a Zen 4 core). Lines go to L2 (locality 2); closer hints evict the current tile.
struct Prefetcher {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t lines = 0;  // left to prefetch in each of k and v
  void step(int count) {
    for (int i = 0; i < count && lines > 0; ++i, --lines, k += 64, v += 64) {
      __builtin_prefetch(k, 0, 2);
      __builtin_prefetch(v, 0, 2);
    }
  }
};

/// The Prefetcher a P.V loop advances: a copy in registers, written back when the loop is done. NOTE:
/// advanced through the caller's reference, every step stored and reloaded its pointers and count (a
/// store-forwarding chain, 32 steps a tile, seen in the disassembly of the bf16 P.V loop).
struct LocalPrefetcher : Prefetcher {
  Prefetcher& home;
  explicit LocalPrefetcher(Prefetcher& p) : Prefetcher(p), home(p) {}
  LocalPrefetcher(const LocalPrefetcher&) = delete;
  ~LocalPrefetcher() { home = static_cast<const Prefetcher&>(*this); }
};

/// A cache-line-aligned allocator. NOTE: BLAS may pick its code path by the alignment of its
/// operands, so the buffers the GEMM path hands it are always 64-byte aligned: the same call gives
/// the same bits whatever addresses the heap returns.
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <class U>
  bool operator==(const Aligned64<U>&) const { return true; }
};
using FloatBuffer = std::vector<float, Aligned64<float>>;

/// Scratch memory of one thread, reused across its tasks.
struct Scratch {
  FloatBuffer q, o;
  FloatBuffer l_lanes;  // the vector loop's softmax sums, kLanes per row, folded into RowState::l at the end
  std::vector<RowState> rows;
};

/// Rows of a task: `per_head` real rows (query tokens x group) for each of `heads` KV heads, each
/// head's block padded to a multiple of kRows in the scratch buffers.
struct TaskRows {
  int64_t heads, per_head, padded;
  TaskRows(const AttentionTask& t, int64_t group, int64_t align)
      : heads(t.head_end - t.head_begin), per_head(int64_t(t.tok_end - t.tok_begin) * group),
        padded((per_head + align - 1) / align * align) {}
};

/// o[d] = so[order[d]] * inv (restrict: so that the loop vectorizes, as a gather).
inline void scaled_in_order(float* __restrict o, const float* __restrict so, const int32_t* __restrict order, float inv,
                            int64_t D) {
  for (int64_t d = 0; d < D; ++d) o[d] = so[order[d]] * inv;
}

/// Normalizes the rows of a finished task and writes them: the final output, or its partial state.
template <class Index>
void finish_task(const AttentionArgs& a, const AttentionTask& t, const PartialStates& partial, const Scratch& s,
                 const TaskRows& tr, int64_t q_start, Index storage) {
  const int64_t D = a.layout.head_dim, G = a.group;
  thread_local std::vector<float> obuf;
  thread_local std::vector<int32_t> order;
  obuf.resize(D);
  order.resize(D);
  float* o = obuf.data();
  // NOTE: the storage order once per task, not per element: per element (and the dtype switch per element
  // when storing) these loops took ~40% of a short decode (17 keys, 8 KV heads: ~14 us per call, Zen 4).
  for (int64_t d = 0; d < D; ++d) order[d] = static_cast<int32_t>(storage(d));
  const int32_t* idx = order.data();
  for (int64_t hb = 0; hb < tr.heads; ++hb) {
    for (int64_t local = 0; local < tr.per_head; ++local) {
      const int64_t r = hb * tr.padded + local;
      const RowState& st = s.rows[r];
      const float inv = st.l > 0.f ? 1.f / st.l : 0.f;
      const float lse = st.l > 0.f ? st.m + std::log(st.l) : -INFINITY;
      const float* so = &s.o[r * D];
      scaled_in_order(o, so, idx, inv, D);
      // Rotated V: the state is linear in V, so unrotating here (partial states too) is exact.
      if (a.v_rot) quant::unrotate(o, D);
      if (t.partial < 0) {
        const int64_t i = t.tok_begin + local / G, hq = (t.head_begin + hb) * G + local % G;
        const int64_t row = (q_start + i) * a.q_heads + hq;
        store_row_from_float(a.out, row * D, a.q_dtype, o, D);
        if (a.lse) a.lse[row] = lse;
      } else {
        const int64_t slot_row = t.partial * partial.rows_per_slot + hb * tr.per_head + local;
        float* po = partial.o + slot_row * D;
        for (int64_t d = 0; d < D; ++d) po[d] = o[d];
        partial.lse[slot_row] = lse;
      }
    }
  }
}

}  // namespace kvcache::cpu::KVC_ISA
