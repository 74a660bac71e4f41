// Decode attention alone, in C++: the CPU kernel of one instruction-set build on a Llama-3-8B layer
// (8 KV heads, head_dim 128, pages of 16 in shuffled order), timed without Python or torch, next to a
// streaming read of the same bytes. For A/B tests of the kernel whose few-percent effects the Python
// benchmark's noise hides, and for the per-phase breakdown of a step: each phase is switched off in
// turn (its policy replaced by one that does nothing) and the step timed from DRAM and from L2.
//
//   build/bench-native/decode_attention [kind] [batch] [context] [group] [head_dim] [threads]
//   kind: bf16 (default), fp16, int8, fp8, int4, kivi4, kivi2
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <sys/mman.h>

#define KVC_ISA bench
#include "attention/attention_cpu_kernel.h"
#include "attention/attention_plan.h"

using namespace kvcache;
using namespace kvcache::cpu::bench;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

/// Pool memory: 2 MiB aligned and advised to transparent huge pages before the first touch, as
/// PageLayout.allocate does (with 4 KiB pages most jumps between pages are TLB misses: bf16 from DRAM
/// ~10% slower on Zen 5). KVC_BENCH_SMALL_PAGES=1: 64-byte aligned with no advice, as torch allocates
/// without it (at malloc's 16-byte offset every row would straddle one more cache line: ~30% slower).
template <class T>
struct PoolAlloc {
  using value_type = T;
  PoolAlloc() = default;
  template <class U>
  PoolAlloc(const PoolAlloc<U>&) {}
  static bool small_pages() {
    static const bool small = std::getenv("KVC_BENCH_SMALL_PAGES") != nullptr;
    return small;
  }
  T* allocate(size_t n) {
    if (small_pages()) return Aligned64<T>().allocate(n);
    const size_t bytes = (n * sizeof(T) + (2u << 20) - 1) / (2u << 20) * (2u << 20);
    void* p = std::aligned_alloc(2u << 20, bytes);
    madvise(p, bytes, MADV_HUGEPAGE);
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) {
    if (small_pages()) return Aligned64<T>().deallocate(p, n);
    std::free(p);
  }
  template <class U>
  bool operator==(const PoolAlloc<U>&) const { return true; }
};

struct Pool {
  std::vector<uint8_t, PoolAlloc<uint8_t>> k, v;
  std::vector<float> k_scale, v_scale;  // int8 rows, fp8 heads, int4/kivi fp16 metadata
};

KVKind kind_of(const std::string& s) {
  if (s == "int8") return KVKind::kInt8;
  if (s == "fp8") return KVKind::kFp8E4M3;
  if (s == "int4") return KVKind::kInt4;
  if (s == "kivi4") return KVKind::kKivi4;
  if (s == "kivi2") return KVKind::kKivi2;
  return KVKind::kFull;
}

/// A pool of random contents in `kind` (codes in range, scales positive).
Pool make_pool(KVKind kind, DType dt, const PagedLayout& L, std::mt19937& rng) {
  Pool p;
  const int64_t rows = L.num_blocks * L.num_kv_heads * L.page_size, D = L.head_dim;
  const int64_t row_bytes = kind == KVKind::kFull ? D * (dt == DType::kFloat32 ? 4 : 2) : D / dims_per_code(kind);
  std::uniform_int_distribution<int> byte(0, 255);
  auto fill = [&](std::vector<uint8_t, PoolAlloc<uint8_t>>& x) {
    x.resize(rows * row_bytes);
    if (kind == KVKind::kFull && dt != DType::kFloat32) {
      std::normal_distribution<float> n;
      uint16_t* h = reinterpret_cast<uint16_t*>(x.data());
      for (int64_t i = 0; i < rows * D; ++i) h[i] = dt == DType::kBFloat16 ? float_to_bf16(n(rng)) : float_to_fp16(n(rng));
      return;
    }
    for (auto& b : x) {
      b = static_cast<uint8_t>(byte(rng));
      if (kind == KVKind::kFp8E4M3 && (b & 0x7f) == 0x7f) b ^= 1;  // no NaN codes
    }
  };
  fill(p.k);
  fill(p.v);
  auto scales = [&](std::vector<float>& s, bool key) {
    switch (kind) {
      case KVKind::kInt8: s.assign(rows, 0.01f); break;
      case KVKind::kFp8E4M3: s.assign(L.num_kv_heads, 0.01f); break;
      case KVKind::kInt4:
      case KVKind::kKivi4:
      case KVKind::kKivi2: {
        const int64_t halfs = is_kivi(kind) && key ? L.num_blocks * L.num_kv_heads * 2 * D : rows * D / 32 * 2;
        s.assign((halfs + 1) / 2, 0.f);
        uint16_t* h = reinterpret_cast<uint16_t*>(s.data());
        for (int64_t i = 0; i < halfs; ++i) h[i] = float_to_fp16(i % 2 == 0 ? 0.1f : -0.7f);
        if (is_kivi(kind) && key) {  // per chunk: 32 scales, then 32 zeros
          for (int64_t i = 0; i < halfs; ++i) h[i] = float_to_fp16((i / 32) % 2 == 0 ? 0.1f : -0.7f);
        }
        break;
      }
      default: break;
    }
  };
  scales(p.k_scale, true);
  scales(p.v_scale, false);
  return p;
}

// Policies that stand in for a phase that is switched off: no loads, no arithmetic.
template <class Read, int R>
struct ScoreNone {
  static constexpr int kRows = R;
  static void load_query(const AttentionArgs&, int64_t, float*) {}
  static void scores(const float*, int64_t, const typename Read::Elem* const*, const uint16_t* const*, float, vf rows[R]) {
    for (int r = 0; r < R; ++r) rows[r] = vf{} + float(r);
  }
};
template <class Read, int R>
struct PvNone {
  static constexpr int kRows = R;
  static int64_t storage(int64_t d) { return d; }
  static void accumulate(float* o, int64_t, const float (*p)[kTile], const typename Read::Elem* const*,
                         const uint16_t* const*, int64_t, Prefetcher&) {
    o[0] += p[0][0];  // keeps the softmax's output alive
  }
};

/// Bytes of a stored row (int4 and KIVI pack several dims per byte: reading D bytes, the loads-only floor
/// read the next row too).
template <class Read>
int64_t row_bytes(int64_t D) {
  return D / dims_per_elem<Read>() * int64_t(sizeof(typename Read::Elem));
}

/// One 64-byte line as a vector (any ISA build: GCC splits it into the machine's widest loads).
inline vu load_line(const char* p) {
  vu v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

/// K rows touched a cache line at a time (one OR per line), no arithmetic: with PvLoads, the step's
/// floor for this traversal of scattered pages (tile setup, softmax and the prefetcher kept).
template <class Read, int R>
struct ScoreLoads {
  static constexpr int kRows = R;
  static void load_query(const AttentionArgs&, int64_t, float*) {}
  static void scores(const float*, int64_t D, const typename Read::Elem* const* krow, const uint16_t* const*, float,
                     vf rows[R]) {
    vu acc{};
    for (int j = 0; j < kTile; ++j) {
      for (int64_t b = 0; b < row_bytes<Read>(D); b += 64) acc |= load_line(reinterpret_cast<const char*>(krow[j]) + b);
    }
    for (int r = 0; r < R; ++r) rows[r] = (vf)(acc & 0u) + float(r);
  }
};
template <class Read, int R>
struct PvLoads {
  static constexpr int kRows = R;
  static int64_t storage(int64_t d) { return d; }
  static void accumulate(float* o, int64_t D, const float (*p)[kTile], const typename Read::Elem* const* vrow,
                         const uint16_t* const*, int64_t, Prefetcher& pf_state) {
    LocalPrefetcher pf(pf_state);
    vu acc{};
    for (int j = 0; j < kTile; ++j) {
      pf.step(int(std::max<int64_t>(1, row_bytes<Read>(D) / 64)));
      for (int64_t b = 0; b < row_bytes<Read>(D); b += 64) acc |= load_line(reinterpret_cast<const char*>(vrow[j]) + b);
    }
    o[0] += p[0][0] + float(acc[0] & 1u);
  }
};

/// One decode step: its arguments and everything they point to (each step owns its own).
struct Step {
  AttentionArgs a;
  AttentionPlan plan;
  std::vector<int32_t> table, lens, cu;
  std::vector<uint16_t> q, out;
  std::vector<float> part_o, part_lse;
  PartialStates partial;
};

template <class Fn>
double run_threads(int threads, int64_t n, Fn fn) {
  std::atomic<int64_t> next{0};
  const double t0 = now();
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w) {
    pool.emplace_back([&] {
      for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
    });
  }
  for (auto& t : pool) t.join();
  return now() - t0;
}

/// The step's tasks (not the merge of split states: it is the same for every kernel) with `task`.
/// `repeat` times over (each thread runs its tasks that often: the threads start once), per step.
template <class Task>
double time_step(Step& s, int threads, Task task, int repeat = 1) {
  const int64_t n = int64_t(s.plan.tasks.size());
  return run_threads(threads, n, [&](int64_t i) {
    for (int r = 0; r < repeat; ++r) task(s.a, s.plan.tasks[i], s.partial);
  }) / repeat;
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

/// Streaming read of `bytes` (float sum), on `threads` threads: the machine's read rate now. The buffer lives on
/// the pools' kind of memory (PoolAlloc: huge pages): on 4 KiB pages the same read was ~1.25x slower (Xeon
/// family 6 model 167), which made the step look closer to the roof than it is.
template <class Buf>
double read_probe(const Buf& buf, int threads) {
  std::vector<double> sums(threads);
  const int64_t n = int64_t(buf.size()), per = n / threads;
  const double t = run_threads(threads, threads, [&](int64_t w) {
    vf acc[4] = {};
    const float* p = buf.data() + w * per;
    for (int64_t i = 0; i + 64 <= per; i += 64) {
      for (int j = 0; j < 4; ++j) acc[j] += loadv(p + i + 16 * j);
    }
    sums[w] = hsum(acc[0] + acc[1] + acc[2] + acc[3]);
  });
  if (sums[0] == 12345.f) std::puts("");
  return double(buf.size()) * 4 / t;
}

#if (defined(__AVX512BF16__) && defined(__AVX512VNNI__)) || defined(KVC_AVX2_POLICIES)
/// Per-phase breakdown: the decode kernel with one phase at a time replaced by a policy that does
/// nothing (ScoreNone: no K loads, no q.k; PvNone: no V loads, no p.V); what the step loses is that
/// phase's cost. "tiles" is what is left with both off: tile setup, mask and online softmax.
template <class RK, class RV, class Sc, class Pv, class PerKey>
void phases(const char* name, Step& big, Step& small, int threads, PerKey per_key_ns, int64_t batch, int64_t ctx,
            int64_t small_ctx) {
  using Sn = ScoreNone<RK, 4>;
  using Pn = PvNone<RV, 4>;
  auto variant = [&](auto score, auto pv) {
    using S = decltype(score);
    using V = decltype(pv);
    return [](const AttentionArgs& a, const AttentionTask& t, const PartialStates& p) {
      thread_local Scratch sc;
      run_task_vec<RK, RV, S, V>(a, t, p, sc);
    };
  };
  using TaskFn = void (*)(const AttentionArgs&, const AttentionTask&, const PartialStates&);
  const TaskFn fns[5] = {variant(Sc{}, Pv{}), variant(Sc{}, Pn{}), variant(Sn{}, Pv{}), variant(Sn{}, Pn{}),
                         variant(ScoreLoads<RK, 4>{}, PvLoads<RV, 4>{})};
  std::vector<double> cold[5], warm[5];
  for (int round = 0; round < 5; ++round) {
    int i = 0;
    for (TaskFn fn : fns) {
      cold[i].push_back(per_key_ns(time_step(big, threads, fn), batch, ctx));
      double h = 1e9;
      for (int r = 0; r < 3; ++r) h = std::min(h, time_step(small, threads, fn, 50));
      warm[i++].push_back(per_key_ns(h, 1, small_ctx));
    }
  }
  double c[5], w[5];
  for (int i = 0; i < 5; ++i) c[i] = median(cold[i]), w[i] = median(warm[i]);
  std::printf("phases of %s, ns per key per KV head per core (from DRAM / from cache):\n"
              "  step %.2f / %.2f\n  q.k (K loads, dot products, reduction): %.2f / %.2f\n"
              "  p.V (V loads, pairing, dot products): %.2f / %.2f\n  tiles + mask + online softmax: %.2f / %.2f\n",
              name, c[0], w[0], c[0] - c[2], w[0] - w[2], c[0] - c[1], w[0] - w[1], c[3], w[3]);
  std::printf("  K and V loads only (every line touched, no arithmetic; tiles, softmax, prefetch kept): %.2f / %.2f\n",
              c[4], w[4]);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const std::string kind_name = argc > 1 ? argv[1] : "bf16";
  const int64_t batch = argc > 2 ? std::atoll(argv[2]) : 8;
  const int64_t ctx = argc > 3 ? std::atoll(argv[3]) : 32768;
  const int64_t group = argc > 4 ? std::atoll(argv[4]) : 4;
  const int64_t D = argc > 5 ? std::atoll(argv[5]) : 128;
  const int threads = argc > 6 ? std::atoi(argv[6]) : 2;
  const int64_t H = 8, P = 16;
  const KVKind kind = kind_of(kind_name);
  const DType dt = kind_name == "fp16" ? DType::kFloat16 : DType::kBFloat16;
  std::mt19937 rng(0);

  auto make_step = [&](int64_t b, int64_t n, Pool& pool) {
    Step s;
    const int64_t blocks = b * n / P;
    PagedLayout L(blocks, P, H, D);
    pool = make_pool(kind, dt, L, rng);
    std::vector<int32_t>& table = s.table;
    table.resize(blocks);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng);
    s.lens.assign(b, int32_t(n));
    s.cu.resize(b + 1);
    for (int64_t i = 0; i <= b; ++i) s.cu[i] = int32_t(i);
    s.q.resize(b * H * group * D);
    std::normal_distribution<float> nd;
    for (auto& x : s.q) x = float_to_bf16(nd(rng));
    s.out.resize(s.q.size());
    AttentionArgs& a = s.a;
    a.query = s.q.data();
    a.q_strides[0] = H * group * D;
    a.q_strides[1] = D;
    a.q_strides[2] = 1;
    a.q_dtype = DType::kBFloat16;
    a.k_cache = pool.k.data();
    a.v_cache = pool.v.data();
    a.kv_dtype = dt;
    a.k_kind = a.v_kind = kind;
    a.k_scale = pool.k_scale.empty() ? nullptr : pool.k_scale.data();
    a.v_scale = pool.v_scale.empty() ? nullptr : pool.v_scale.data();
    a.layout = L;
    a.block_tables = table.data();
    a.table_stride = n / P;
    a.kv_lens = s.lens.data();
    a.cu_q_lens = s.cu.data();
    a.batch = b;
    a.q_heads = H * group;
    a.group = group;
    a.scale = 1.f / std::sqrt(float(D));
    a.out = s.out.data();
    AttentionHostInfo host;
    host.kv_lens.assign(b, n);
    host.q_lens.assign(b, 1);
    PlanOptions opt;
    opt.parallelism = threads;
    // as paged_attention_cpu (env KVC_BENCH_DECODE_HEADS overrides)
    const int64_t row = code_row_bytes(kind, D, dt);
    opt.decode_heads = decode_heads_per_page(L, row, row);
    if (const char* e = std::getenv("KVC_BENCH_DECODE_HEADS")) opt.decode_heads = std::atoll(e);
    s.plan = make_attention_plan(a, host, opt);
    s.part_o.assign(std::max<int64_t>(1, s.plan.num_slots * s.plan.rows_per_slot * D), 0.f);
    s.part_lse.assign(std::max<int64_t>(1, s.plan.num_slots * s.plan.rows_per_slot), 0.f);
    s.partial = {s.part_o.data(), s.part_lse.data(), s.plan.rows_per_slot};
    return s;
  };

  Pool big_pool, small_pool;
  Step big = make_step(batch, ctx, big_pool);
  // From cache: one sequence of 1k tokens, run many times over.
  // 4 MiB of bf16 K+V: in L3 (and mostly L2). KVC_BENCH_SMALL_CTX overrides (a shared host's L3 may not
  // keep 4 MiB: 128 tokens keep bf16 K+V within a Zen 3 core's 512 KiB L2)
  const int64_t small_ctx = std::getenv("KVC_BENCH_SMALL_CTX") ? std::atoll(std::getenv("KVC_BENCH_SMALL_CTX")) : 1024;
  Step small = make_step(1, small_ctx, small_pool);
  const double kv_bytes = double(big_pool.k.size() + big_pool.v.size());

  auto per_key_ns = [&](double t, int64_t b, int64_t n) { return t * 1e9 * threads / double(b * n * H); };
  // bf16 and fp8 pages: vdpbf16ps or fp32 FMAs as the library chooses (attention_cpu.cpp, bf16_dot: FMAs on Intel
  // cores); KVC_BENCH_BF16_DOT=1 or 0 forces one
  kvcache::cpu::CpuPaths paths;
  __builtin_cpu_init();
  paths.bf16_dot = !__builtin_cpu_is("intel");
  if (const char* e = std::getenv("KVC_BENCH_BF16_DOT")) paths.bf16_dot = std::atoi(e) != 0;
  auto full = [paths](const AttentionArgs& a, const AttentionTask& t, const PartialStates& p) { run_task(a, t, p, paths); };

  std::printf("kind %s, batch %lld x %lld tokens, group %lld, head_dim %lld, %d threads, K+V %.2f GiB%s\n",
              kind_name.c_str(), (long long)batch, (long long)ctx, (long long)group, (long long)D, threads,
              kv_bytes / (1 << 30), paths.bf16_dot ? "" : ", bf16 dot products off");
  if (std::getenv("KVC_BENCH_HOT_ONLY")) {  // for a profiler: only the step from cache, many times
    const double t0 = now();
    int64_t steps = 0;
    while (now() - t0 < 5) time_step(small, threads, full, 100), steps += 100;
    std::printf("%lld steps from cache\n", (long long)steps);
    return 0;
  }
  std::vector<float, PoolAlloc<float>> probe_buf((1ll << 30) / 4, 1.f);
  std::vector<double> probe, step, hot;
  for (int round = 0; round < 7; ++round) {
    probe.push_back(read_probe(probe_buf, threads));
    step.push_back(time_step(big, threads, full));
    double h = 1e9;
    for (int i = 0; i < 5; ++i) h = std::min(h, time_step(small, threads, full, 50));
    hot.push_back(h);
  }
  const double t = median(step), roof = median(probe);
  std::printf("step %.3f ms, %.1f GB/s = %.0f%% of the read probe (%.1f GB/s); ns per key per KV head per core: "
              "from DRAM %.2f, from cache %.2f\n",
              t * 1e3, kv_bytes / t / 1e9, 100 * kv_bytes / t / roof, roof / 1e9, per_key_ns(t, batch, ctx),
              per_key_ns(median(hot), 1, small_ctx));
#ifdef KVC_AVX2_POLICIES
  // AVX2: the policies a bf16 query takes (8-lane register tiles; int8, int4 and KIVI keys: 16-bit integer
  // dot products, then the fp32 FMAs they replace)
  if (group == 4 && !std::getenv("KVC_BENCH_NO_PHASES")) {
    with_kv_kinds(kind, kind, dt, [&]<class SK, class SV>(SK, SV) {
      using RK = typename ReaderFor<SK, true>::type;
      using RV = typename ReaderFor<SV, false>::type;
      using Score = typename Avx2Score<RK, 4>::type;
      if constexpr (!std::is_same_v<Score, ScoreAvx2<RK, 4>>) {
        phases<RK, RV, Score, PvAvx2<RV, 4>>("AVX2 16-bit integer dot products", big, small, threads, per_key_ns,
                                             batch, ctx, small_ctx);
      }
      phases<RK, RV, ScoreAvx2<RK, 4>, PvAvx2<RV, 4>>("AVX2 fp32 FMAs", big, small, threads, per_key_ns, batch, ctx,
                                                     small_ctx);
    });
  }
#endif
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  if (group == 4 && !std::getenv("KVC_BENCH_NO_PHASES")) {
    if (kind == KVKind::kFull && dt == DType::kBFloat16) {
      phases<ReadBF16, ReadBF16, ScoreDp<ReadBF16, 4>, PvDp<ReadBF16, 4>>("bf16 dot products", big, small, threads,
                                                                        per_key_ns, batch, ctx, small_ctx);
      phases<ReadBF16, ReadBF16, ScoreFma<ReadBF16, 4>, PvFma<ReadBF16, 4>>("fp32 FMAs (bf16 dot products off)", big,
                                                                          small, threads, per_key_ns, batch, ctx,
                                                                          small_ctx);
    } else if (kind == KVKind::kInt8) {
      phases<ReadI8, ReadI8, ScoreB8<4>, PvB8<4>>("byte dot products", big, small, threads, per_key_ns, batch, ctx,
                                                  small_ctx);
    } else if (kind == KVKind::kFp8E4M3) {
      phases<ReadFp8<true>, ReadFp8<true>, ScoreDp<ReadFp8<true>, 4>, PvDp<ReadFp8<true>, 4>>(
          "bf16 dot products (fp8 read as bf16 by table)", big, small, threads, per_key_ns, batch, ctx, small_ctx);
      phases<ReadFp8<true>, ReadFp8<true>, ScoreFma<ReadFp8<true>, 4>, PvFma<ReadFp8<true>, 4>>(
          "fp32 FMAs (fp8 widened through fp16; bf16 dot products off)", big, small, threads, per_key_ns, batch, ctx,
          small_ctx);
    } else if (kind == KVKind::kInt4) {
      phases<ReadI4, ReadI4, ScoreB4<4>, PvB4<4>>("byte dot products", big, small, threads, per_key_ns, batch, ctx,
                                                  small_ctx);
    } else if (is_kivi(kind)) {  // the dot products, then the fp32 FMAs (fp32 and fp16 queries) they replace
      const auto both = [&]<int kBits>(std::integral_constant<int, kBits>) {
        using RK = ReadKivi<kBits, true>;
        using RV = ReadKivi<kBits, false>;
        phases<RK, RV, ScoreKivi<kBits, 4>, PvB4<4, KiviCodes<kBits>>>("dot products (K 16-bit, V bytes)", big, small,
                                                                       threads, per_key_ns, batch, ctx, small_ctx);
        phases<RK, RV, ScoreFma<RK, 4>, PvFma<RV, 4>>("fp32 FMAs", big, small, threads, per_key_ns, batch, ctx,
                                                      small_ctx);
      };
      if (kind == KVKind::kKivi4) both(std::integral_constant<int, 4>{});
      else both(std::integral_constant<int, 2>{});
    }
  }
#endif
  return 0;
}
