// Chunked prefill through BLAS sgemm (non-AVX-512 builds): Q.K^T and P.V of a task's rows as
// matrix products over blocks of keys, with the online softmax between them.
// Part of the CPU attention kernel (see attention/attention_cpu_kernel.h), compiled once per instruction set.
#pragma once

#ifndef KVC_ISA
#error "define KVC_ISA (the namespace of this instruction-set build) before including this header"
#endif

#include "attention/cpu_kernel/task_loop.h"

namespace kvcache::cpu::KVC_ISA {

// ---- chunked prefill through BLAS ----------------------------------------------------------------
// NOTE: a prefill task has many query rows per KV head, so its two products (Q.K^T over a block of
// keys, then P.V) are matrix products: BLAS's register-blocked sgemm runs them at ~100% of the FMA
// peak on Zen 1 (AVX2), the per-row-block register kernel at ~60%. Each block of keys is widened to
// fp32 once per task and the online softmax runs between the two products. Full-precision pools only;
// quantized ones keep the register kernel. AVX-512 builds keep their register kernel for fp32 GEMMs
// (on Zen 5 its bf16 dot products ran prefill at 190% of sgemm's rate); the bf16 build hands bf16 pages
// with a bf16 query to MKL's bf16 GEMM where bf16_gemm() offers it (AMX-BF16 CPUs: run_task_gemm_bf16).
constexpr int64_t kGemmKeys = 128;    // keys per block: Q, O (128 rows), S, K and V blocks fit a 512 KiB L2
constexpr int64_t kGemmMinRows = 16;  // rows per KV head from which the products pay off

/// A full-precision row as fp32, natural order.
template <class Read>
inline void widen_row(const typename Read::Elem* row, int64_t D, float* out) {
  if constexpr (std::is_same_v<Read, ReadF32>) {
    std::memcpy(out, row, static_cast<size_t>(D) * sizeof(float));
  } else if constexpr (std::is_same_v<Read, ReadBF16>) {
    int64_t d = 0;
#if defined(__AVX2__)
    for (; d + 8 <= D; d += 8) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), _mm256_slli_epi32(w, 16));
    }
#endif
    for (; d < D; ++d) {
      const uint32_t bits = uint32_t(row[d]) << 16;
      std::memcpy(&out[d], &bits, 4);
    }
  } else {
    int64_t d = 0;
#if defined(__F16C__)
    for (; d + 8 <= D; d += 8) {
      _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d))));
    }
#endif
    for (; d < D; ++d) out[d] = fp16_to_float(row[d]);
  }
}

// Row passes of the online softmax over a block of scores (`n` of them; the row's storage runs on to
// a multiple of 16, and those lanes are masked). NOTE: 8-lane intrinsics on AVX2: GCC spills the
// 16-lane generic vectors there (AVX-512 builds take the 16-lane ones).
#if defined(__AVX2__) && !defined(__AVX512F__)
/// Keys outside [lo, hi) -> -inf, soft-cap the rest; returns the row's max.
inline float mask_and_max(float* row, int64_t n, float lo, float hi, float softcap) {
  if (lo == 0.f && hi == float(n) && n % 8 == 0 && softcap <= 0.f) {  // every key visible: only the max
    __m256 mx = _mm256_loadu_ps(row);
    for (int64_t c = 8; c < n; c += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(row + c));
    return hmax8(mx);
  }
  const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), lo8 = _mm256_set1_ps(lo), hi8 = _mm256_set1_ps(hi);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  __m256 mx = ninf;
  for (int64_t c = 0; c < n; c += 8) {
    __m256 sc = _mm256_loadu_ps(row + c);
    if (softcap > 0.f) {  // cap * tanh(s / cap): as vsoftcap, the series near 0, 1 - 2 / (exp(2y) + 1) else
      const __m256 y = _mm256_min_ps(_mm256_mul_ps(sc, _mm256_set1_ps(2.f / softcap)), _mm256_set1_ps(80.f));
      const __m256 t = _mm256_sub_ps(_mm256_set1_ps(1.f),
                                     _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(vexp8(y), _mm256_set1_ps(1.f))));
      const __m256 h = _mm256_mul_ps(sc, _mm256_set1_ps(1.f / softcap));
      const __m256 near0 = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), h), _mm256_set1_ps(kTanhSeriesBound),
                                         _CMP_LT_OQ);
      sc = _mm256_mul_ps(_mm256_blendv_ps(t, tanh_series(h), near0), _mm256_set1_ps(softcap));
    }
    const __m256 key = _mm256_add_ps(iota, _mm256_set1_ps(float(c)));
    const __m256 in = _mm256_and_ps(_mm256_cmp_ps(key, lo8, _CMP_GE_OQ), _mm256_cmp_ps(key, hi8, _CMP_LT_OQ));
    sc = _mm256_blendv_ps(ninf, sc, in);
    _mm256_storeu_ps(row + c, sc);
    mx = _mm256_max_ps(mx, sc);
  }
  return hmax8(mx);
}
/// row = exp(row - m) (masked lanes: 0); returns the sum.
inline float exp_and_sum(float* row, int64_t n, float m) {
  const __m256 m8 = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t c = 0; c < n; c += 8) {
    const __m256 p = vexp8(_mm256_sub_ps(_mm256_loadu_ps(row + c), m8));
    _mm256_storeu_ps(row + c, p);
    sum = _mm256_add_ps(sum, p);
  }
  return hsum8(sum);
}
#else
inline float mask_and_max(float* row, int64_t n, float lo, float hi, float softcap) {
  vf iota, mx = splat(-INFINITY);
  for (int i = 0; i < kLanes; ++i) iota[i] = float(i);
  for (int64_t c = 0; c < n; c += kLanes) {
    const vf key = iota + float(c);
    vf sc = loadv(row + c);
    if (softcap > 0.f) sc = vsoftcap(sc, softcap);
    sc = (key >= lo) & (key < hi) ? sc : splat(-INFINITY);
    storev(row + c, sc);
    mx = vmax(mx, sc);
  }
  return hmax(mx);
}
inline float exp_and_sum(float* row, int64_t n, float m) {
  vf sum = vf{};
  for (int64_t c = 0; c < n; c += kLanes) {
    const vf p = vexp(loadv(row + c) - m);
    storev(row + c, p);
    sum += p;
  }
  return hsum(sum);
}
#endif

/// Starts the `n` rows of KV head `h` of a GEMM task: each row's position, window start and empty softmax
/// state, its query handed to `load_query(r, base)` (base: the query row's offset); fills the two key ranges
/// that run_task_vec walks too (the sinks, then the windows).
template <class LoadQuery>
inline void start_head_rows(const AttentionArgs& a, const AttentionTask& t, int64_t h, int64_t n, RowState* st,
                            LoadQuery load_query, int64_t ranges[2][2]) {
  const int64_t G = a.group, kv_len = a.kv_lens[t.seq];
  const int64_t q_start = a.cu_q_lens[t.seq], q_len = a.cu_q_lens[t.seq + 1] - q_start;
  int64_t max_pos = -1, min_lo = INT64_MAX;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t i = t.tok_begin + r / G, hq = h * G + r % G;
    st[r].pos = kv_len - q_len + i;
    st[r].lo = a.window_left >= 0 ? std::max<int64_t>(0, st[r].pos - a.window_left) : 0;
    st[r].m = -INFINITY;
    st[r].l = 0.f;
    max_pos = std::max(max_pos, st[r].pos);
    min_lo = std::min(min_lo, st[r].lo);
    load_query(r, (q_start + i) * a.q_strides[0] + hq * a.q_strides[1]);
  }
  const int64_t end = std::min<int64_t>(t.kv_end, max_pos + 1);
  const int64_t sink_end = std::min<int64_t>(end, a.sink_tokens);
  ranges[0][0] = t.kv_begin;
  ranges[0][1] = sink_end;
  ranges[1][0] = std::max<int64_t>(t.kv_begin, std::max<int64_t>(min_lo, sink_end));
  ranges[1][1] = end;
}

/// The keys [lo, hi) of the block [k0, k1) that a row sees: causal, and inside its window unless the block
/// is of the sinks (range 0). False when it sees none.
inline bool visible_in_block(const RowState& st, int range, int64_t k0, int64_t k1, int64_t& lo, int64_t& hi) {
  lo = range == 0 ? k0 : std::max(k0, st.lo);
  hi = std::min(k1, st.pos + 1);
  return lo < hi;
}

/// Raises a row's running max to `mx` where that is larger, rescaling its sum and output row by exp(old - new).
inline void raise_max(RowState& st, float mx, float* o_row, int64_t D) {
  if (mx <= st.m) return;
  const float alpha = std::exp(st.m - mx);  // 0 on the first visible block
  st.l *= alpha;
  for (int64_t d = 0; d < D; ++d) o_row[d] *= alpha;
  st.m = mx;
}

/// The key blocks of a head's two ranges (sinks, then the rest), kGemmKeys keys at most: copy(i, off) for the
/// block's i-th key at pool offset `off`, then block(range, k0, k1) once the block's rows are copied.
template <class Copy, class Block>
void for_each_key_block(const AttentionArgs& a, int64_t h, const int64_t (&ranges)[2][2], const int32_t* table,
                        Copy&& copy, Block&& block) {
  const PagedLayout& L = a.layout;
  for (int range = 0; range < 2; ++range) {
    for (int64_t k0 = ranges[range][0]; k0 < ranges[range][1]; k0 += kGemmKeys) {
      const int64_t k1 = std::min(ranges[range][1], k0 + kGemmKeys);
      for (int64_t j = k0; j < k1; ++j) copy(j - k0, L.token_offset(table[j >> L.page_shift], h, j));
      block(range, k0, k1);
    }
  }
}

#if !defined(__AVX512F__)
template <class Read>
void run_task_gemm(const AttentionArgs& a, const AttentionTask& t, const PartialStates& partial, Scratch& s,
                   GemmF32 gemm) {
  using Elem = typename Read::Elem;
  const PagedLayout& L = a.layout;
  const int64_t D = L.head_dim, G = a.group;
  const int64_t q_start = a.cu_q_lens[t.seq];
  const TaskRows tr(t, G, 1);
  const int64_t n = tr.per_head;
  s.q.assign(tr.heads * n * D, 0.f);
  s.o.assign(tr.heads * n * D, 0.f);
  s.rows.resize(tr.heads * n);
  thread_local FloatBuffer kbuf, vbuf, sbuf;
  kbuf.resize(kGemmKeys * D);
  vbuf.resize(kGemmKeys * D);
  sbuf.resize(n * kGemmKeys);
  const Elem* kc = static_cast<const Elem*>(a.k_cache);
  const Elem* vc = static_cast<const Elem*>(a.v_cache);
  const int32_t* table = a.block_tables + t.seq * a.table_stride;

  for (int64_t hb = 0; hb < tr.heads; ++hb) {
    const int64_t h = t.head_begin + hb;
    RowState* st = &s.rows[hb * n];
    float* q = &s.q[hb * n * D];
    float* o = &s.o[hb * n * D];
    int64_t ranges[2][2];
    start_head_rows(a, t, h, n, st, [&](int64_t r, int64_t base) { load_query_f32(a, base, q + r * D); },  // scaled
                    ranges);
    const auto copy = [&](int64_t i, int64_t off) {
      widen_row<Read>(kc + off, D, &kbuf[i * D]);
      widen_row<Read>(vc + off, D, &vbuf[i * D]);
    };
    for_each_key_block(a, h, ranges, table, copy, [&](int range, int64_t k0, int64_t k1) {
      const int64_t nk = k1 - k0;
      gemm(true, n, nk, D, q, D, kbuf.data(), D, 0.f, sbuf.data(), kGemmKeys);  // S = Q . K^T
      for (int64_t r = 0; r < n; ++r) {
        float* srow = &sbuf[r * kGemmKeys];
        int64_t vis_lo, vis_hi;
        if (!visible_in_block(st[r], range, k0, k1, vis_lo, vis_hi)) {
          std::fill(srow, srow + nk, 0.f);
          continue;
        }
        raise_max(st[r], mask_and_max(srow, nk, float(vis_lo - k0), float(vis_hi - k0), a.softcap), o + r * D, D);
        st[r].l += exp_and_sum(srow, nk, st[r].m);
      }
      gemm(false, n, D, nk, sbuf.data(), kGemmKeys, vbuf.data(), D, 1.f, o, D);  // O += P . V
    });
  }
  finish_task(a, t, partial, s, tr, q_start, [](int64_t d) { return d; });
}
#endif

#ifdef __AVX512BF16__
/// Row pass 1 of the bf16 GEMM's softmax: the raw q.k of `n` keys scaled (and capped), keys outside [lo, hi)
/// -inf; returns the row's max. (One pass where the fp32 path's query comes scaled.)
inline float scale_mask_and_max(float* row, int64_t n, float lo, float hi, float scale, float softcap) {
  vf iota, mx = splat(-INFINITY);
  for (int i = 0; i < kLanes; ++i) iota[i] = float(i);
  for (int64_t c = 0; c < n; c += kLanes) {
    const vf key = iota + float(c);
    vf sc = loadv(row + c) * scale;
    if (softcap > 0.f) sc = vsoftcap(sc, softcap);
    sc = (key >= lo) & (key < hi) ? sc : splat(-INFINITY);
    storev(row + c, sc);
    mx = vmax(mx, sc);
  }
  return hmax(mx);
}

/// Row pass 2: p = exp(s - m) for `n` keys, written as bf16 bits rounded to nearest even (as PvDp rounds
/// P); returns the sum of the fp32 p (the softmax's denominator, as in the register kernel).
inline float exp_sum_to_bf16(const float* row, int64_t n, float m, uint16_t* out) {
  vf sum = vf{};
  for (int64_t c = 0; c < n; c += kLanes) {
    const vf p = vexp(loadv(row + c) - m);  // (lanes past n: -inf or stale, masked below and never summed)
    const __mmask16 k = n - c >= kLanes ? __mmask16(0xffff) : __mmask16((1u << (n - c)) - 1);
    const __m512 pm = _mm512_maskz_mov_ps(k, (__m512)p);
    sum += (vf)pm;
    _mm256_mask_storeu_epi16(out + c, k, (__m256i)_mm512_cvtneps_pbh(pm));
  }
  return hsum(sum);
}

/// Chunked prefill over bf16 pages with a bf16 query through a bf16 GEMM (MKL; AMX where the CPU has it):
/// S = Q.K^T with the query's own bf16 values, scaled after (as ScoreDp), the online softmax in fp32, then
/// O += P.V with P rounded to bf16 (as PvDp). Products are exact and sums fp32 in both, as in the register
/// kernel: only the order of the sums differs.
inline void run_task_gemm_bf16(const AttentionArgs& a, const AttentionTask& t, const PartialStates& partial,
                               Scratch& s, GemmBf16 gemm) {
  const PagedLayout& L = a.layout;
  const int64_t D = L.head_dim, G = a.group;
  const int64_t q_start = a.cu_q_lens[t.seq];
  const TaskRows tr(t, G, 1);
  const int64_t n = tr.per_head;
  s.o.assign(tr.heads * n * D, 0.f);
  s.rows.resize(tr.heads * n);
  thread_local std::vector<uint16_t> qbuf, kbuf, vbuf, pbuf;
  thread_local FloatBuffer sbuf;
  qbuf.resize(n * D);
  kbuf.resize(kGemmKeys * D);
  vbuf.resize(kGemmKeys * D);
  pbuf.resize(n * kGemmKeys);
  sbuf.resize(n * kGemmKeys);
  const uint16_t* kc = static_cast<const uint16_t*>(a.k_cache);
  const uint16_t* vc = static_cast<const uint16_t*>(a.v_cache);
  const uint16_t* query = static_cast<const uint16_t*>(a.query);
  const int32_t* table = a.block_tables + t.seq * a.table_stride;

  for (int64_t hb = 0; hb < tr.heads; ++hb) {
    const int64_t h = t.head_begin + hb;
    RowState* st = &s.rows[hb * n];
    float* o = &s.o[hb * n * D];
    int64_t ranges[2][2];
    start_head_rows(a, t, h, n, st, [&](int64_t r, int64_t base) {  // the query's own bf16 values, unscaled
      for (int64_t d = 0; d < D; ++d) qbuf[r * D + d] = query[base + d * a.q_strides[2]];
    }, ranges);
    const auto copy = [&](int64_t i, int64_t off) {
      std::memcpy(&kbuf[i * D], kc + off, static_cast<size_t>(D) * sizeof(uint16_t));
      std::memcpy(&vbuf[i * D], vc + off, static_cast<size_t>(D) * sizeof(uint16_t));
    };
    for_each_key_block(a, h, ranges, table, copy, [&](int range, int64_t k0, int64_t k1) {
      const int64_t nk = k1 - k0;
      gemm(true, n, nk, D, qbuf.data(), D, kbuf.data(), D, 0.f, sbuf.data(), kGemmKeys);  // S = Q . K^T
      for (int64_t r = 0; r < n; ++r) {
        float* srow = &sbuf[r * kGemmKeys];
        int64_t vis_lo, vis_hi;
        if (!visible_in_block(st[r], range, k0, k1, vis_lo, vis_hi)) {
          std::fill(&pbuf[r * kGemmKeys], &pbuf[r * kGemmKeys] + nk, uint16_t(0));
          continue;
        }
        raise_max(st[r], scale_mask_and_max(srow, nk, float(vis_lo - k0), float(vis_hi - k0), a.scale, a.softcap),
                  o + r * D, D);
        st[r].l += exp_sum_to_bf16(srow, nk, st[r].m, &pbuf[r * kGemmKeys]);
      }
      gemm(false, n, D, nk, pbuf.data(), kGemmKeys, vbuf.data(), D, 1.f, o, D);  // O += P . V
    });
  }
  finish_task(a, t, partial, s, tr, q_start, [](int64_t d) { return d; });
}
#endif

}  // namespace kvcache::cpu::KVC_ISA
