// Chunked prefill through BLAS sgemm (non-AVX-512 builds): Q.K^T and P.V of a task's rows as
// matrix products over blocks of keys, with the online softmax between them.
// Part of the CPU attention kernel (see attention/attention_cpu_kernel.h), compiled once per instruction set.
#pragma once

#ifndef KVC_ISA
#error "define KVC_ISA (the namespace of this instruction-set build) before including this header"
#endif

#include "attention/cpu_kernel/task_loop.h"

namespace kvcache::cpu::KVC_ISA {

#if !defined(__AVX512F__)
// ---- chunked prefill through BLAS ----------------------------------------------------------------
// NOTE: a prefill task has many query rows per KV head, so its two products (Q.K^T over a block of
// keys, then P.V) are matrix products: BLAS's register-blocked sgemm runs them at ~100% of the FMA
// peak here (Zen 1, AVX2), the per-row-block register kernel above at ~60%. Each block of keys is
// widened to fp32 once per task and the online softmax runs between the two products. Full-precision
// pools only; quantized ones keep the register kernel. (AVX-512 builds keep theirs: not measured.)
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
// 16-lane generic vectors there.
#if defined(__AVX2__)
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

template <class Read>
void run_task_gemm(const AttentionArgs& a, const AttentionTask& t, const PartialStates& partial, Scratch& s,
                   GemmF32 gemm) {
  using Elem = typename Read::Elem;
  const PagedLayout& L = a.layout;
  const int64_t D = L.head_dim, G = a.group;
  const int64_t kv_len = a.kv_lens[t.seq];
  const int64_t q_start = a.cu_q_lens[t.seq], q_len = a.cu_q_lens[t.seq + 1] - q_start;
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
    int64_t max_pos = -1, min_lo = INT64_MAX;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t i = t.tok_begin + r / G, hq = h * G + r % G;
      st[r].pos = kv_len - q_len + i;
      st[r].lo = a.window_left >= 0 ? std::max<int64_t>(0, st[r].pos - a.window_left) : 0;
      st[r].m = -INFINITY;
      st[r].l = 0.f;
      max_pos = std::max(max_pos, st[r].pos);
      min_lo = std::min(min_lo, st[r].lo);
      load_query_f32(a, (q_start + i) * a.q_strides[0] + hq * a.q_strides[1], q + r * D);  // scaled
    }
    // the same two key ranges as run_task_vec: the sinks, then the windows
    const int64_t end = std::min<int64_t>(t.kv_end, max_pos + 1);
    const int64_t sink_end = std::min<int64_t>(end, a.sink_tokens);
    const int64_t ranges[2][2] = {{t.kv_begin, sink_end},
                                  {std::max<int64_t>(t.kv_begin, std::max<int64_t>(min_lo, sink_end)), end}};
    for (int range = 0; range < 2; ++range) {
      for (int64_t k0 = ranges[range][0]; k0 < ranges[range][1]; k0 += kGemmKeys) {
        const int64_t k1 = std::min(ranges[range][1], k0 + kGemmKeys), nk = k1 - k0;
        for (int64_t j = k0; j < k1; ++j) {
          const int64_t off = L.token_offset(table[j >> L.page_shift], h, j);
          widen_row<Read>(kc + off, D, &kbuf[(j - k0) * D]);
          widen_row<Read>(vc + off, D, &vbuf[(j - k0) * D]);
        }
        gemm(true, n, nk, D, q, D, kbuf.data(), D, 0.f, sbuf.data(), kGemmKeys);  // S = Q . K^T
        for (int64_t r = 0; r < n; ++r) {
          float* srow = &sbuf[r * kGemmKeys];
          // visible keys of this row in the block: causal, and inside the window unless sinks
          const int64_t vis_lo = range == 0 ? k0 : std::max(k0, st[r].lo);
          const int64_t vis_hi = std::min(k1, st[r].pos + 1);
          if (vis_lo >= vis_hi) {
            std::fill(srow, srow + nk, 0.f);
            continue;
          }
          const float mx = mask_and_max(srow, nk, float(vis_lo - k0), float(vis_hi - k0), a.softcap);
          if (mx > st[r].m) {
            const float alpha = std::exp(st[r].m - mx);  // 0 on the first visible block
            st[r].l *= alpha;
            for (int64_t d = 0; d < D; ++d) o[r * D + d] *= alpha;
            st[r].m = mx;
          }
          st[r].l += exp_and_sum(srow, nk, st[r].m);
        }
        gemm(false, n, D, nk, sbuf.data(), kGemmKeys, vbuf.data(), D, 1.f, o, D);  // O += P . V
      }
    }
  }
  finish_task(a, t, partial, s, tr, q_start, [](int64_t d) { return d; });
}
#endif

}  // namespace kvcache::cpu::KVC_ISA
