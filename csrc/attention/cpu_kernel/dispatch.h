// Picks the kernel of a task: reader and policies by KV format and dtype, register-block size by
// rows per KV head, the BLAS path for prefill; run_task is what the ISA builds export.
// Part of the CPU attention kernel (see attention/attention_cpu_kernel.h), compiled once per instruction set.
#pragma once

#ifndef KVC_ISA
#error "define KVC_ISA (the namespace of this instruction-set build) before including this header"
#endif

#include <type_traits>

#include "attention/cpu_kernel/prefill_gemm.h"

namespace kvcache::cpu::KVC_ISA {

/// The reader of a stored kind (core/kv_format.h: with_kv_kinds), for keys (kKey) or values.
template <class S, bool kKey>
struct ReaderFor;
template <bool kKey>
struct ReaderFor<Stored<KVKind::kFull, DType::kFloat32>, kKey> { using type = ReadF32; };
template <bool kKey>
struct ReaderFor<Stored<KVKind::kFull, DType::kFloat16>, kKey> { using type = ReadF16; };
template <bool kKey>
struct ReaderFor<Stored<KVKind::kFull, DType::kBFloat16>, kKey> { using type = ReadBF16; };
template <bool kKey>
struct ReaderFor<Stored<KVKind::kInt8>, kKey> { using type = ReadI8; };
template <bool kKey>
struct ReaderFor<Stored<KVKind::kFp8E4M3>, kKey> { using type = ReadFp8<true>; };
template <bool kKey>
struct ReaderFor<Stored<KVKind::kFp8E5M2>, kKey> { using type = ReadFp8<false>; };
template <bool kKey>
struct ReaderFor<Stored<KVKind::kInt4>, kKey> { using type = ReadI4; };
template <bool kKey>
struct ReaderFor<Stored<KVKind::kKivi4>, kKey> { using type = ReadKivi<4, kKey>; };
template <bool kKey>
struct ReaderFor<Stored<KVKind::kKivi2>, kKey> { using type = ReadKivi<2, kKey>; };

/// Query rows per register block of the 16-lane policies (1, 2 or 4) for a task with `rows` rows per KV head.
inline int rows_per_block16(int64_t rows) { return rows <= 1 ? 1 : (rows == 2 ? 2 : 4); }

/// Calls fn(std::integral_constant<int, R>{}) for R in {1, 2, 4}.
template <class Fn>
void with_rows16(int rows, Fn&& fn) {
  switch (rows) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    default: return fn(std::integral_constant<int, 4>{});
  }
}

#ifdef KVC_AVX2_POLICIES
/// Query rows per register block for a task with `rows` rows per KV head: the least padding (ties
/// to the larger block). A decode step has rows = the GQA group, often 1-3; prefill rows are many.
inline int rows_per_block(int64_t rows) {
  if (rows <= 4) return static_cast<int>(std::max<int64_t>(rows, 1));
  const int64_t pad4 = (4 - rows % 4) % 4, pad3 = (3 - rows % 3) % 3;
  return pad3 < pad4 ? 3 : 4;
}

/// Calls fn(std::integral_constant<int, R>{}) for rows per block R in 1-4.
template <class Fn>
void with_rows(int rows, Fn&& fn) {
  switch (rows) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    default: return fn(std::integral_constant<int, 4>{});
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
/// The dot-product policies of a quantized reader, for a bf16 query (AVX-512 VNNI): byte dot products for
/// int8 and int4 codes and KIVI values, 16-bit ones for KIVI keys; bf16 ones for fp8 (its values widen to
/// bf16 exactly).
template <class Read, int R>
struct FastPolicies {
  using Score = ScoreDp<Read, R>;
  using Pv = PvDp<Read, R>;
};
template <int R>
struct FastPolicies<ReadI8, R> {
  using Score = ScoreB8<R>;
  using Pv = PvB8<R>;
};
template <int R>
struct FastPolicies<ReadI4, R> {
  using Score = ScoreB4<R>;
  using Pv = PvB4<R>;
};
#ifdef __AVX512VBMI__
template <bool kE4M3, int R>
struct FastPolicies<ReadFp8<kE4M3>, R> {  // byte lookups, 64 codes per shuffle (Fp8ByteTables)
  using Score = ScoreFp8Bytes<kE4M3, R>;
  using Pv = PvFp8Bytes<kE4M3, R>;
};
#endif
template <int kBits, bool kKey, int R>
struct FastPolicies<ReadKivi<kBits, kKey>, R> {
  using Score = ScoreKivi<kBits, R>;
  using Pv = PvB4<R, KiviCodes<kBits>>;
};

template <class Read>
constexpr bool is_kivi_reader = false;
template <int kBits, bool kKey>
constexpr bool is_kivi_reader<ReadKivi<kBits, kKey>> = true;

/// Whether FastPolicies of a reader take byte or 16-bit integer dot products (else vdpbf16ps: bf16, fp8).
template <class Read>
constexpr bool takes_integer_dots = std::is_same_v<Read, ReadI8> || std::is_same_v<Read, ReadI4> || is_kivi_reader<Read>;

/// FastPolicies with bf16 dot products off (CpuPaths::bf16_dot, by default on Intel cores): the readers
/// FastPolicies sends to vdpbf16ps take the fp32 FMAs of the avx512 build; the integer formats keep theirs.
template <class Read, int R>
struct FastPoliciesFma {
  using Score = std::conditional_t<takes_integer_dots<Read>, typename FastPolicies<Read, R>::Score, ScoreFma<Read, R>>;
  using Pv = std::conditional_t<takes_integer_dots<Read>, typename FastPolicies<Read, R>::Pv, PvFma<Read, R>>;
};

/// Whether a task with quantized K (RK) and V (RV) runs FastPolicies on both sides: a bf16 query (an fp32
/// or fp16 one keeps the exact fp32 path), head dims the byte policies take (int8 and int4 keys: multiples
/// of 64, int8 values 64, int4 values 128; KIVI keys and values: 64 or multiples of 128), and for fp8 keys
/// an unrotated query (a rotated one is no bf16 value any more). KIVI keys (always with KIVI values) also
/// need pages of at least a tile, so that a tile's keys share one page's metadata (ScoreKivi).
template <class RK, class RV>
bool fast_quantized_pair(const AttentionArgs& a) {
  const int64_t D = a.layout.head_dim;
  if (a.q_dtype != DType::kBFloat16) return false;
  if constexpr (is_kivi_reader<RK>) {
    return (D == 64 || D % 128 == 0) && a.layout.page_size >= kTile;
  }
  const bool byte_k = std::is_same_v<RK, ReadI8> || std::is_same_v<RK, ReadI4>;
  if (byte_k ? D % 64 != 0 : a.k_rot) return false;
  if (std::is_same_v<RV, ReadI8> && D % 64 != 0) return false;
  if (std::is_same_v<RV, ReadI4> && D % 128 != 0) return false;
  return true;
}
#endif

/// Runs one task with the kernel that fits its KV dtype and head_dim.
inline void run_task(const AttentionArgs& a, const AttentionTask& t, const PartialStates& partial, const CpuPaths& paths) {
  thread_local Scratch scratch;
#if !defined(__AVX512F__)
  if (const GemmF32 gemm = paths.f32;
      gemm && a.k_kind == KVKind::kFull && int64_t(t.tok_end - t.tok_begin) * a.group >= kGemmMinRows) {
    switch (a.kv_dtype) {
      case DType::kFloat32: return run_task_gemm<ReadF32>(a, t, partial, scratch, gemm);
      case DType::kFloat16: return run_task_gemm<ReadF16>(a, t, partial, scratch, gemm);
      default: return run_task_gemm<ReadBF16>(a, t, partial, scratch, gemm);
    }
  }
#endif
#ifdef __AVX512BF16__
  if (a.k_kind == KVKind::kFull && a.v_kind == KVKind::kFull && a.kv_dtype == DType::kBFloat16 &&
      a.q_dtype == DType::kBFloat16 && !a.k_rot && int64_t(t.tok_end - t.tok_begin) * a.group >= kGemmMinRows) {
    if (paths.bf16) return run_task_gemm_bf16(a, t, partial, scratch, paths.bf16);
  }
#endif
  if (a.layout.head_dim % 32 != 0) return run_task_scalar(a, t, partial, scratch);
  const int64_t rows = int64_t(t.tok_end - t.tok_begin) * a.group;
  with_kv_kinds(a.k_kind, a.v_kind, a.kv_dtype, [&]<class SK, class SV>(SK, SV) {
    using RK = typename ReaderFor<SK, true>::type;
    using RV = typename ReaderFor<SV, false>::type;
#ifdef KVC_AVX2_POLICIES
    with_rows(rows_per_block(rows), [&]<int R>(std::integral_constant<int, R>) {
      // int8, int4 and KIVI keys with a bf16 query: 16-bit integer dot products (Avx2Score); an fp32 or
      // fp16 query keeps the exact fp32 path, as on AVX-512.
      if (a.q_dtype == DType::kBFloat16 && Avx2Score<RK, R>::fits(a)) {
        return run_task_vec<RK, RV, typename Avx2Score<RK, R>::type, PvAvx2<RV, R>>(a, t, partial, scratch);
      }
      run_task_vec<RK, RV, ScoreAvx2<RK, R>, PvAvx2<RV, R>>(a, t, partial, scratch);
    });
#else
    // 16-lane builds: register blocks of 1, 2 or 4 query rows (a GQA group of 1 or 2 pads nothing).
    with_rows16(rows_per_block16(rows), [&]<int R>(std::integral_constant<int, R>) {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
      // Quantized pages with a bf16 query take dot products on both sides when both can
      // (fast_quantized_pair), fp32 FMAs otherwise: two kernels per pair of formats, not one per mix.
      if constexpr (is_quantized(SK::kind)) {
        if (fast_quantized_pair<RK, RV>(a)) {
          if constexpr (!takes_integer_dots<RK> || !takes_integer_dots<RV>) {
            if (!paths.bf16_dot) {
              return run_task_vec<RK, RV, typename FastPoliciesFma<RK, R>::Score,
                                  typename FastPoliciesFma<RV, R>::Pv>(a, t, partial, scratch);
            }
          }
          return run_task_vec<RK, RV, typename FastPolicies<RK, R>::Score, typename FastPolicies<RV, R>::Pv>(
              a, t, partial, scratch);
        }
      }
#endif
#ifdef __AVX512BF16__
      // bf16 pages: bf16 dot products only when the query is bf16 too (rounding an fp32 query would lose
      // precision), and where they are the faster path (CpuPaths::bf16_dot).
      if constexpr (std::is_same_v<RK, ReadBF16>) {
        if (a.q_dtype == DType::kBFloat16 && paths.bf16_dot) {
          return run_task_vec<ReadBF16, ReadBF16, ScoreDp<ReadBF16, R>, PvDp<ReadBF16, R>>(a, t, partial, scratch);
        }
      }
#endif
      run_task_vec<RK, RV, ScoreFma<RK, R>, PvFma<RV, R>>(a, t, partial, scratch);
    });
#endif
  });
}

}  // namespace kvcache::cpu::KVC_ISA
