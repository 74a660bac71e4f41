// The CPU kernel of absorbed MLA attention: one MlaTask at a time, online softmax, fp32 accumulation.
// Compiled once per instruction set by mla_cpu_{avx512bf16,avx512,avx2,generic}.cpp (each with its flags and
// namespace KVC_ISA, for the exp and reductions of attention/cpu_kernel/simd.h); mla_cpu.cpp picks one.
//
// NOTE: absorbed MLA is bound by arithmetic, not by memory: every query head of a kv head (128 in
// DeepSeek-V3) reads the same latent rows, so one cached token feeds 128 x (576 + 512) multiply-adds. A task
// therefore runs as matrix products: a block of keys is dequantized once into an fp32 tile
// [keys, latent_dim + rope_dim] (the formats' own decoding, cache/quant_rows.h), the scores are S = Q . tile^T
// (BLAS sgemm, handed in as GemmF32), the online softmax runs over S, then O += P . tile[:, :latent_dim].
#pragma once

#ifndef KVC_ISA
#error "define KVC_ISA (the namespace of this instruction-set build) before including this header"
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "attention/attention_cpu_gemm.h"
#include "attention/cpu_kernel/simd.h"
#include "cache/quant_rows.h"
#include "mla/mla_args.h"
#include "mla/mla_cpu.h"

namespace kvcache::cpu::KVC_ISA::mla {

constexpr int64_t kKeys = 128;  // keys per block: S, the tile and 128 rows of Q and O stay in L2

/// One side's row (latent or rope) of token `pos` of `block`, kv head h, as fp32 in out[0, D).
inline void load_row(const void* pool, const float* scales, KVKind kind, DType dtype, const PagedLayout& L,
                     bool latent_side, int64_t block, int64_t h, int64_t pos, float* out) {
  const int64_t D = L.head_dim, off = L.offset(block, h, pos);
  if (kind == KVKind::kFull) {
    if (dtype == DType::kFloat32) {
      std::memcpy(out, static_cast<const float*>(pool) + off, static_cast<size_t>(D) * sizeof(float));
    } else if (dtype == DType::kBFloat16) {
      const uint16_t* src = static_cast<const uint16_t*>(pool) + off;
      for (int64_t d = 0; d < D; ++d) {
        const uint32_t bits = uint32_t(src[d]) << 16;
        std::memcpy(&out[d], &bits, 4);
      }
    } else {
      const uint16_t* src = static_cast<const uint16_t*>(pool) + off;
      for (int64_t d = 0; d < D; ++d) out[d] = fp16_to_float(src[d]);
    }
    return;
  }
  if (kind == KVKind::kInt8) {  // the common quantized case: a plain loop the compiler vectorizes
    const int8_t* codes = static_cast<const int8_t*>(pool) + off;
    const float s = scales[L.row_index(block, h, pos)];
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(codes[d]) * s;
    return;
  }
  const RowRef r = row_ref(const_cast<void*>(pool), const_cast<float*>(scales), kind, L, block, h, pos);
  if (is_kivi(kind)) {  // the latent side is the pool's K side: per-channel page metadata
    const uint16_t* meta = latent_side ? kivi_key_meta(scales, L, block, h) : reinterpret_cast<const uint16_t*>(r.scale);
    for (int64_t d = 0; d < D; ++d) out[d] = dequantize_kivi(r.codes, meta, d, kivi_bits(kind), latent_side);
  } else if (kind == KVKind::kInt4) {
    for (int64_t d = 0; d < D; ++d) out[d] = dequantize_int4(r.codes, r.scale, d);
  } else {
    for (int64_t d = 0; d < D; ++d) out[d] = dequantize(r.codes, d, kind, *r.scale);
  }
}

/// C = A . op(B) + beta C without BLAS (a torch built without sgemm): plain loops, correct and slow.
inline void gemm_fallback(bool b_transposed, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0.f;
      for (int64_t p = 0; p < k; ++p) acc += a[i * lda + p] * (b_transposed ? b[j * ldb + p] : b[p * ldb + j]);
      c[i * ldc + j] = acc + (beta == 0.f ? 0.f : beta * c[i * ldc + j]);
    }
  }
}

/// Online-softmax step of one row over a block of `nk` scores (storage padded to a multiple of kLanes), of
/// which the first `visible` are keys the row may see: row <- exp(row - m_new) (0 for the rest), o *= alpha.
inline void softmax_block(float* row, int64_t nk, int64_t visible, float& m, float& l, float* o, int64_t D) {
  const int64_t padded = (nk + kLanes - 1) / kLanes * kLanes;
  if (visible <= 0) {  // nothing visible in this block: P = 0
    std::fill(row, row + padded, 0.f);
    return;
  }
  std::fill(row + visible, row + padded, -INFINITY);
  vf mx = splat(-INFINITY);
  for (int64_t c = 0; c < padded; c += kLanes) mx = vmax(mx, loadv(row + c));
  const float block_max = hmax(mx);
  if (block_max > m) {
    const float alpha = std::exp(m - block_max);  // 0 on the first visible block
    l *= alpha;
    for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
    m = block_max;
  }
  vf sum = vf{};
  for (int64_t c = 0; c < padded; c += kLanes) {
    const vf p = vexp(loadv(row + c) - m);
    storev(row + c, p);
    sum += p;
  }
  l += hsum(sum);
}

inline void run_task(const MlaArgs& a, const MlaTask& t, const MlaPartials& part, GemmF32 gemm) {
  const PagedLayout& L = a.layout;
  const PagedLayout Ll = L.side(false), Lr = L.side(true);
  const int64_t Dl = a.latent_dim(), Dr = a.rope_dim(), Dk = Dl + Dr, G = a.group;
  const int64_t kv_len = a.kv_lens[t.seq];
  const int64_t q_start = a.cu_q_lens[t.seq], q_len = a.cu_q_lens[t.seq + 1] - q_start;
  const int64_t n = int64_t(t.tok_end - t.tok_begin) * G;
  if (gemm == nullptr) gemm = gemm_fallback;

  thread_local std::vector<float> q, o, s, tile, m, l;
  thread_local std::vector<int64_t> pos;
  q.resize(n * Dk);
  o.assign(n * Dl, 0.f);
  s.resize(n * kKeys);
  tile.resize(kKeys * Dk);
  m.assign(n, -INFINITY);
  l.assign(n, 0.f);
  pos.resize(n);
  for (int64_t r = 0; r < n; ++r) {  // scaled queries: [q_latent | q_rope] rows against [c | k_rope] rows
    const int64_t i = t.tok_begin + r / G, hq = t.head * G + r % G, row = q_start + i;
    pos[r] = kv_len - q_len + i;
    for (int64_t d = 0; d < Dl; ++d) {
      q[r * Dk + d] = a.scale * load_as_float(a.q_latent, row * a.ql_strides[0] + hq * a.ql_strides[1] + d * a.ql_strides[2], a.q_dtype);
    }
    for (int64_t d = 0; d < Dr; ++d) {
      q[r * Dk + Dl + d] = a.scale * load_as_float(a.q_rope, row * a.qr_strides[0] + hq * a.qr_strides[1] + d * a.qr_strides[2], a.q_dtype);
    }
  }
  const int32_t* table = a.block_tables + t.seq * a.table_stride;
  const int64_t end = std::min<int64_t>(t.kv_end, pos[n - 1] + 1);  // rows are token-major: the last sees most
  for (int64_t j0 = t.kv_begin; j0 < end; j0 += kKeys) {
    const int64_t nk = std::min(kKeys, end - j0);
    for (int64_t j = j0; j < j0 + nk; ++j) {
      const int64_t block = table[j >> L.page_shift], p = j & (L.page_size - 1);
      float* dst = &tile[(j - j0) * Dk];
      load_row(a.latent_cache, a.latent_scale, a.latent_kind, a.latent_dtype, Ll, true, block, t.head, p, dst);
      load_row(a.rope_cache, a.rope_scale, a.rope_kind, a.rope_dtype, Lr, false, block, t.head, p, dst + Dl);
    }
    gemm(true, n, nk, Dk, q.data(), Dk, tile.data(), Dk, 0.f, s.data(), kKeys);  // S = Q . tile^T
    for (int64_t r = 0; r < n; ++r) {
      softmax_block(&s[r * kKeys], nk, std::min(nk, pos[r] + 1 - j0), m[r], l[r], &o[r * Dl], Dl);
    }
    gemm(false, n, Dl, nk, s.data(), kKeys, tile.data(), Dk, 1.f, o.data(), Dl);  // O += P . latents
  }
  for (int64_t r = 0; r < n; ++r) {
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    const float lse = l[r] > 0.f ? m[r] + std::log(l[r]) : -INFINITY;
    const int64_t i = t.tok_begin + r / G, hq = t.head * G + r % G;
    float* orow = &o[r * Dl];
    for (int64_t d = 0; d < Dl; ++d) orow[d] *= inv;
    if (t.partial >= 0) {
      std::memcpy(part.o + (t.partial * part.rows_per_slot + r) * Dl, orow, static_cast<size_t>(Dl) * sizeof(float));
      part.lse[t.partial * part.rows_per_slot + r] = lse;
    } else {
      const int64_t row = (q_start + i) * a.q_heads + hq;
      store_row_from_float(a.out, row * Dl, a.q_dtype, orow, Dl);
      if (a.lse != nullptr) a.lse[row] = lse;
    }
  }
}

}  // namespace kvcache::cpu::KVC_ISA::mla
