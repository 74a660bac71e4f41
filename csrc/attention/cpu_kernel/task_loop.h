// The task loop: tiles of 16 keys over a task's key ranges, masks, online softmax, a score policy
// and a P.V policy per register block of query rows; and the scalar loop for any head_dim.
// Part of the CPU attention kernel (see attention/attention_cpu_kernel.h), compiled once per instruction set.
#pragma once

#ifndef KVC_ISA
#error "define KVC_ISA (the namespace of this instruction-set build) before including this header"
#endif

#include "attention/cpu_kernel/policies_16lane.h"
#include "attention/cpu_kernel/policies_avx2.h"

namespace kvcache::cpu::KVC_ISA {

/// Per-token multipliers of a tile's scores (K) or probabilities (V): the quantization scales.
/// Lane j reads the scale of key tok[j] (a masked lane reads a visible key's: never an unwritten slot's).
inline void tile_scales(KVKind kind, const float* scales, float factor, const PagedLayout& L, const int32_t* table,
                        int64_t h, int64_t t0, const int64_t* tok, bool tile_in_page, float out[kTile]) {
  if (kind != KVKind::kInt8) {
    for (int j = 0; j < kTile; ++j) out[j] = scales[h] * factor;
  } else if (tile_in_page) {
    // NOTE: the rows of a tile inside one page are consecutive, and so are their scales: one copy. (GCC
    // turned the per-key lookup into two vgatherqps, ~10% of an int8 step on Zen 4.) The visible keys
    // are one run, so masked lanes can only be at the tile's ends.
    const float* src = scales + L.row_index(table[t0 >> L.page_shift], h, t0 & (L.page_size - 1));
    std::memcpy(out, src, sizeof(float) * kTile);
    if (tok[0] != t0 || tok[kTile - 1] != t0 + kTile - 1) {
      for (int j = 0; j < kTile; ++j) out[j] = src[tok[j] - t0];
    }
  } else {
    for (int j = 0; j < kTile; ++j) out[j] = scales[L.row_index(table[tok[j] >> L.page_shift], h, tok[j] & (L.page_size - 1))];
  }
}

template <class Read>
constexpr float read_factor() {
  if constexpr (requires { Read::kFactor; }) {
    return Read::kFactor;
  } else {
    return 1.f;
  }
}

/// Floats of a query row in the scratch buffer: D, or what a score policy asks for: ScoreKivi keeps per-page
/// state there, which is why Score::scores gets its rows writable.
template <class Score>
int64_t query_row_floats(int64_t D) {
  if constexpr (requires { Score::row_floats(D); }) {
    return Score::row_floats(D);
  } else {
    return D;
  }
}

/// Position of output dim d in a P.V policy's accumulators (a policy whose order depends on head_dim
/// takes D too).
template <class Pv>
int64_t pv_storage(int64_t d, int64_t D) {
  if constexpr (requires { Pv::storage(d, D); }) {
    return Pv::storage(d, D);
  } else {
    return Pv::storage(d);
  }
}

template <class ReadK, class ReadV, class Score, class Pv>
void run_task_vec(const AttentionArgs& a, const AttentionTask& t, const PartialStates& partial, Scratch& s) {
  static_assert(Score::kRows == Pv::kRows, "the score and P.V policies must agree on rows per block");
  constexpr int kRows = Score::kRows;  // query rows per block (1-4)
  using KElem = typename ReadK::Elem;
  using VElem = typename ReadV::Elem;
  const PagedLayout& L = a.layout;
  const int64_t D = L.head_dim, G = a.group;
  const int64_t kv_len = a.kv_lens[t.seq];
  const int64_t q_start = a.cu_q_lens[t.seq], q_len = a.cu_q_lens[t.seq + 1] - q_start;
  const TaskRows tr(t, G, kRows);
  const int64_t padded = tr.heads * tr.padded;
  const int64_t q_floats = query_row_floats<Score>(D);

  s.q.assign(padded * q_floats, 0.f);
  s.o.assign(padded * D, 0.f);
  s.l_lanes.assign(padded * kLanes, 0.f);
  s.rows.resize(padded);
  int64_t max_pos = -1, min_lo = INT64_MAX;
  for (int64_t r = 0; r < padded; ++r) {
    RowState& st = s.rows[r];
    const int64_t hb = r / tr.padded, local = r % tr.padded;
    st.m = -INFINITY;
    st.l = 0.f;
    if (local >= tr.per_head) {  // padding rows see nothing
      st.pos = -1;
      st.lo = 0;
      continue;
    }
    const int64_t i = t.tok_begin + local / G, hq = (t.head_begin + hb) * G + local % G;
    st.pos = kv_len - q_len + i;
    st.lo = a.window_left >= 0 ? std::max<int64_t>(0, st.pos - a.window_left) : 0;
    max_pos = std::max(max_pos, st.pos);
    min_lo = std::min(min_lo, st.lo);
    Score::load_query(a, (q_start + i) * a.q_strides[0] + hq * a.q_strides[1], &s.q[r * q_floats]);
  }

  const KElem* kc = static_cast<const KElem*>(a.k_cache);
  const VElem* vc = static_cast<const VElem*>(a.v_cache);
  // per-key multipliers (int8 rows, fp8 heads); int4 dequantizes per chunk instead
  const bool k_scaled = has_token_scales(a.k_kind) || has_head_scales(a.k_kind);
  const bool v_scaled = has_token_scales(a.v_kind) || has_head_scales(a.v_kind);
  const int32_t* table = a.block_tables + t.seq * a.table_stride;
  // Keys any row of the task can see: the sinks, then the windows; nothing past the last query.
  const int64_t end = std::min<int64_t>(t.kv_end, max_pos + 1);
  const int64_t sink_end = std::min<int64_t>(end, a.sink_tokens);
  const int64_t ranges[2][2] = {{t.kv_begin, sink_end},
                                {std::max<int64_t>(t.kv_begin, std::max<int64_t>(min_lo, sink_end)), end}};
  constexpr int64_t kdiv = dims_per_elem<ReadK>(), vdiv = dims_per_elem<ReadV>();
  const int64_t k_row_bytes = D / kdiv * int64_t(sizeof(KElem)), v_row_bytes = D / vdiv * int64_t(sizeof(VElem));
  const int64_t row_bytes = std::max(k_row_bytes, v_row_bytes);  // prefetch: the wider of the two
  const int64_t prefetch_keys =
      kTile * std::clamp<int64_t>(kPrefetchBytes / (2 * tr.heads * kTile * row_bytes), 1, kPrefetchTiles);
  // int4 and kivi value rows carry (scale, zero) fp16 pairs, one per 32 dims: [rows, D / 32, 2]; kivi
  // keys carry 2 D fp16 per (block, head) page: row r of the pool reads the metadata of page r / P.
  const bool grouped_k = a.k_kind == KVKind::kInt4 || is_kivi(a.k_kind);
  const uint16_t* k_meta = grouped_k ? reinterpret_cast<const uint16_t*>(a.k_scale) : nullptr;
  const uint16_t* v_meta = a.v_kind == KVKind::kInt4 || is_kivi(a.v_kind) ? reinterpret_cast<const uint16_t*>(a.v_scale) : nullptr;
  const bool kivi_k = is_kivi(a.k_kind);
  auto k_meta_of = [&](int64_t off) { return kivi_k ? k_meta + off / (L.page_size * D) * 2 * D : k_meta + off / 32 * 2; };
  const uint16_t* kmeta[kTile] = {};
  const uint16_t* vmeta[kTile] = {};
  alignas(64) float p[kRows][kTile];
  alignas(64) float kscale[kTile], vscale[kTile];
  int64_t tok_of[kTile];
  const KElem* krow[kTile];
  const VElem* vrow[kTile];
  vf iota;
  for (int i = 0; i < kLanes; ++i) iota[i] = float(i);

  // Tiles are aligned to multiples of kTile, so with pages of >= kTile tokens a tile lies in one page
  // and its rows are consecutive: one block-table lookup per tile and head.
  const bool tile_in_page = L.page_size >= kTile;

  for (const auto& range : ranges) {
    // An empty range must not run its (aligned-down) first tile: its masked lanes would read key
    // range[0], which may lie past the sequence (e.g. sinks covering every key: range [kv_len, kv_len)).
    if (range[0] >= range[1]) continue;
    for (int64_t t0 = range[0] & ~int64_t(kTile - 1); t0 < range[1]; t0 += kTile) {
      // Keys [k_lo, k_hi) of this tile belong to the range; the other lanes are masked and point at
      // key k_lo, so they never read a slot that holds no token.
      const int64_t k_lo = std::max(t0, range[0]), k_hi = std::min(t0 + kTile, range[1]);
      if (!tile_in_page && t0 + kTile < range[1]) {
        // NOTE: prefetch the next tile into L2: one (sequence, head) stream reads short runs and jumps,
        // which the hardware prefetcher does not follow. (Inline: GCC deletes calls to a function
        // that only prefetches.) Pages of >= kTile tokens prefetch from inside the P.V loop instead.
        for (int64_t h = t.head_begin; h < t.head_end; ++h) {
          for (int64_t tok = t0 + kTile; tok < std::min(range[1], t0 + 2 * kTile); ++tok) {
            const int64_t off = L.token_offset(table[tok >> L.page_shift], h, tok);
            for (int64_t b = 0; b < row_bytes; b += 64) {
              __builtin_prefetch(reinterpret_cast<const char*>(kc + off / kdiv) + b, 0, 2);
              __builtin_prefetch(reinterpret_cast<const char*>(vc + off / vdiv) + b, 0, 2);
            }
          }
        }
      }
      for (int64_t hb = 0; hb < tr.heads; ++hb) {
        const int64_t h = t.head_begin + hb;
        Prefetcher pf;
        if (tile_in_page && t0 + prefetch_keys < range[1]) {
          const int64_t ahead = t0 + prefetch_keys;
          const int64_t next = L.token_offset(table[ahead >> L.page_shift], h, ahead);
          // (K and V rows have the same width, so one line count serves both)
          pf = {reinterpret_cast<const char*>(kc + next / kdiv), reinterpret_cast<const char*>(vc + next / vdiv),
                kTile * row_bytes / 64};
          // The tile's scales and metadata are a stream of their own: int8 rows' scales (64 bytes a tile),
          // int4 / KIVI values' (scale, zero) pairs, KIVI keys' per-channel page metadata. Unfetched, each
          // was a DRAM miss per tile (int8 decode from DRAM took 1.6x its time from cache).
          const int64_t row = next / D;  // the tile's first row of the pool
          const auto prefetch = [](const void* p, int64_t bytes) {
            for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, 2);
          };
          if (a.k_kind == KVKind::kInt8) prefetch(a.k_scale + row, kTile * 4);
          if (a.v_kind == KVKind::kInt8) prefetch(a.v_scale + row, kTile * 4);
          if (k_meta) prefetch(k_meta_of(next), kivi_k ? 4 * D : kTile * (D / 32) * 4);
          if (v_meta) prefetch(v_meta + next / 32 * 2, kTile * (D / 32) * 4);
        }
        if (tile_in_page) {
          const int64_t base = L.token_offset(table[t0 >> L.page_shift], h, t0);
          // KIVI keys: the tile's rows share their page's metadata. NOTE: found once per tile; per key, its
          // 64-bit division (by page_size x head_dim, no constant) cost ~10% of a kivi2 decode step (Zen 5,
          // from cache: 19.2 -> 17.4 ns per key and KV head).
          const uint16_t* page_meta = kivi_k ? k_meta_of(base) : nullptr;
          for (int64_t j = 0; j < kTile; ++j) {
            tok_of[j] = t0 + j >= k_lo && t0 + j < k_hi ? t0 + j : k_lo;
            const int64_t off = base + (tok_of[j] - t0) * D;
            krow[j] = kc + off / kdiv;
            vrow[j] = vc + off / vdiv;
            if (k_meta) kmeta[j] = kivi_k ? page_meta : k_meta_of(off);
            if (v_meta) vmeta[j] = v_meta + off / 32 * 2;
          }
        } else {
          for (int64_t j = 0; j < kTile; ++j) {
            const int64_t tok = t0 + j >= k_lo && t0 + j < k_hi ? t0 + j : k_lo;
            tok_of[j] = tok;
            const int64_t off = L.token_offset(table[tok >> L.page_shift], h, tok);
            krow[j] = kc + off / kdiv;
            vrow[j] = vc + off / vdiv;
            if (k_meta) kmeta[j] = k_meta_of(off);
            if (v_meta) vmeta[j] = v_meta + off / 32 * 2;
          }
        }
        if (k_scaled) tile_scales(a.k_kind, a.k_scale, read_factor<ReadK>(), L, table, h, t0, tok_of, tile_in_page, kscale);
        if (v_scaled) tile_scales(a.v_kind, a.v_scale, read_factor<ReadV>(), L, table, h, t0, tok_of, tile_in_page, vscale);
        for (int64_t rc = hb * tr.padded; rc < (hb + 1) * tr.padded; rc += kRows) {
          RowState* st = &s.rows[rc];
          bool any = false;
          for (int r = 0; r < kRows; ++r) {
            any |= st[r].pos >= k_lo && (k_hi - 1 >= st[r].lo || k_lo < a.sink_tokens);
          }
          if (!any) continue;
          vf sc_rows[kRows];
          Score::scores(&s.q[rc * q_floats], D, krow, kmeta, a.scale, sc_rows);
          if (k_scaled) {
            const vf ks = loadv(kscale);
            for (int r = 0; r < kRows; ++r) sc_rows[r] *= ks;
          }
          // ---- mask, soft-cap, online softmax ----
          const vf key = iota + float(t0);
          for (int r = 0; r < kRows; ++r) {
#if defined(__AVX2__) && !defined(__AVX512F__)
            // NOTE: the common case (every key of the tile visible, no soft-cap) in 8-lane halves: GCC
            // keeps the 16-lane vectors of the general form below on the stack in AVX2 builds (SmolLM2's
            // layer, fp32 pages, in cache: 47.5 -> 43.9 ns per key and KV head).
            if (a.softcap <= 0.f && k_lo == t0 && k_hi == t0 + kTile && k_hi - 1 <= st[r].pos &&
                (t0 >= st[r].lo || k_hi <= a.sink_tokens)) {
              const __m256 s0 = lo8(sc_rows[r]), s1 = hi8(sc_rows[r]);
              float* lr = &s.l_lanes[(rc + r) * kLanes];
              if (any_above(sc_rows[r], st[r].m)) {
                const float mx = hmax8(_mm256_max_ps(s0, s1));
                const __m256 alpha = _mm256_set1_ps(std::exp(st[r].m - mx));  // 0 on the first visible tile
                _mm256_storeu_ps(lr, _mm256_mul_ps(_mm256_loadu_ps(lr), alpha));
                _mm256_storeu_ps(lr + 8, _mm256_mul_ps(_mm256_loadu_ps(lr + 8), alpha));
                float* o = &s.o[(rc + r) * D];
                for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), alpha));
                st[r].m = mx;
              }
              const __m256 m = _mm256_set1_ps(st[r].m);
              __m256 p0 = vexp8(_mm256_sub_ps(s0, m)), p1 = vexp8(_mm256_sub_ps(s1, m));
              _mm256_storeu_ps(lr, _mm256_add_ps(_mm256_loadu_ps(lr), p0));
              _mm256_storeu_ps(lr + 8, _mm256_add_ps(_mm256_loadu_ps(lr + 8), p1));
              if (v_scaled) {  // V's per-token scale rides on p
                p0 = _mm256_mul_ps(p0, _mm256_load_ps(vscale));
                p1 = _mm256_mul_ps(p1, _mm256_load_ps(vscale + 8));
              }
              _mm256_store_ps(p[r], p0);
              _mm256_store_ps(p[r] + 8, p1);
              continue;
            }
#endif
            vf sc = sc_rows[r];
            if (a.softcap > 0.f) sc = vsoftcap(sc, a.softcap);
            const bool all_visible = k_lo == t0 && k_hi == t0 + kTile && k_hi - 1 <= st[r].pos &&
                                     (t0 >= st[r].lo || k_hi <= a.sink_tokens);
            if (!all_visible) {
              const vi visible = (key >= float(k_lo)) & (key < float(k_hi)) & (key <= float(st[r].pos)) &
                                 ((key >= float(st[r].lo)) | (key < float(a.sink_tokens)));
              sc = visible ? sc : splat(-INFINITY);
            }
            // NOTE: the sums stay in lanes (one horizontal sum per task, not per tile), and the tile's max
            // is folded only when a lane passes the running max (rare after the first tiles): two horizontal
            // reductions per row and tile less (Zen 4, int8 8 x 32k from cache: tiles + softmax 6.6 -> 5.5 ns
            // per key and KV head, the step 0.95x; bf16 0.95x).
            float* lr = &s.l_lanes[(rc + r) * kLanes];
            if (any_above(sc, st[r].m)) {
              const float mx = hmax(sc);
              const float alpha = std::exp(st[r].m - mx);  // 0 on the first visible tile
              storev(lr, loadv(lr) * alpha);
              float* o = &s.o[(rc + r) * D];
              for (int64_t d = 0; d < D; d += kLanes) storev(o + d, loadv(o + d) * alpha);
              st[r].m = mx;
            } else if (st[r].m == -INFINITY) {  // nothing visible yet, nor in this tile
              storev(p[r], vf{});
              continue;
            }
            const vf pr = vexp(sc - st[r].m);
            storev(lr, loadv(lr) + pr);
            storev(p[r], v_scaled ? pr * loadv(vscale) : pr);  // V's per-token scale rides on p
          }
          Pv::accumulate(&s.o[rc * D], D, p, vrow, vmeta, kTile, pf);
        }
      }
    }
  }
  for (int64_t r = 0; r < padded; ++r) s.rows[r].l = hsum(loadv(&s.l_lanes[r * kLanes]));
  finish_task(a, t, partial, s, tr, q_start, [D](int64_t d) { return pv_storage<Pv>(d, D); });
}

/// Any head_dim, any dtype: the plain loop, for head dims that are not a multiple of 32.
inline void run_task_scalar(const AttentionArgs& a, const AttentionTask& t, const PartialStates& partial, Scratch& s) {
  const PagedLayout& L = a.layout;
  const int64_t D = L.head_dim, G = a.group;
  const int64_t kv_len = a.kv_lens[t.seq];
  const int64_t q_start = a.cu_q_lens[t.seq], q_len = a.cu_q_lens[t.seq + 1] - q_start;
  const TaskRows tr(t, G, 1);
  const int32_t* table = a.block_tables + t.seq * a.table_stride;
  s.q.assign(tr.heads * tr.padded * D, 0.f);
  s.o.assign(tr.heads * tr.padded * D, 0.f);
  s.rows.resize(tr.heads * tr.padded);
  for (int64_t r = 0; r < tr.heads * tr.padded; ++r) {
    RowState& st = s.rows[r];
    const int64_t hb = r / tr.padded, local = r % tr.padded, h = t.head_begin + hb;
    const int64_t i = t.tok_begin + local / G, hq = h * G + local % G;
    st.pos = kv_len - q_len + i;
    st.lo = a.window_left >= 0 ? std::max<int64_t>(0, st.pos - a.window_left) : 0;
    st.m = -INFINITY;
    st.l = 0.f;
    const int64_t base = (q_start + i) * a.q_strides[0] + hq * a.q_strides[1];
    float* q = &s.q[r * D];
    if (a.k_rot) {
      load_query_f32(a, base, q);
    } else {
      for (int64_t d = 0; d < D; ++d) q[d] = a.scale * load_as_float(a.query, base + d * a.q_strides[2], a.q_dtype);
    }
    float* o = &s.o[r * D];
    const int64_t end = std::min<int64_t>(t.kv_end, st.pos + 1);
    for (int64_t j = t.kv_begin; j < end; ++j) {
      if (j < st.lo && j >= a.sink_tokens) continue;
      const int64_t block = table[j >> L.page_shift], pos = j & (L.page_size - 1);
      const int64_t off = L.offset(block, h, pos);
      auto value = [&](KVKind kind, const void* pool, const float* scales, int64_t d) {
        if (kind == KVKind::kFull) return load_as_float(pool, off + d, a.kv_dtype);
        const RowRef r = row_ref(const_cast<void*>(pool), const_cast<float*>(scales), kind, L, block, h, pos);
        return kind == KVKind::kInt4 ? dequantize_int4(r.codes, r.scale, d) : dequantize(r.codes, d, kind, *r.scale);
      };
      float sc = 0.f;
      for (int64_t d = 0; d < D; ++d) sc += q[d] * value(a.k_kind, a.k_cache, a.k_scale, d);
      if (a.softcap > 0.f) sc = a.softcap * std::tanh(sc / a.softcap);
      if (sc > st.m) {
        const float alpha = std::exp(st.m - sc);
        st.l *= alpha;
        for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
        st.m = sc;
      }
      const float pj = std::exp(sc - st.m);
      st.l += pj;
      for (int64_t d = 0; d < D; ++d) o[d] += pj * value(a.v_kind, a.v_cache, a.v_scale, d);
    }
  }
  finish_task(a, t, partial, s, tr, q_start, [](int64_t d) { return d; });
}

}  // namespace kvcache::cpu::KVC_ISA
