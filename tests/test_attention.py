"""paged_attention and merge_states against kvcache.reference, on every CPU instruction-set build.

Tolerance (FlashAttention's rule): the kernel's error against an fp32 reference is at most twice the
error of the same computation done by PyTorch in the input precision, plus the dtype's rounding noise.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import kvcache
from kvcache import reference as ref

from conftest import DEVICES, DTYPES, HAS_CUDA_EMULATION, SUPPORTED_ISAS, make_paged_batch

def cu_from(q_lens: list[int], device="cpu") -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device=device)


def run_and_check(pb, q, cu, *, window_left=-1, sink_tokens=0, softcap=0.0, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = kvcache.paged_attention(q, pb.k_cache, pb.v_cache, pb.block_tables, pb.seq_lens, cu, scale,
                                       window_left=window_left, sink_tokens=sink_tokens, softcap=softcap,
                                       return_lse=True)
    args = (q, pb.k_cache, pb.v_cache, pb.block_tables, pb.seq_lens, cu, scale, window_left, sink_tokens, softcap)
    # ground truth in float64 (the output keeps q's dtype, so compare before rounding: q.double())
    out64 = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse32 = torch.full(q.shape[:2], float("-inf"), device=q.device)
    ref.paged_attention(q.double(), *args[1:], out64, lse32, compute_dtype=torch.float64)
    out_pt = torch.zeros_like(q)
    ref.paged_attention(*args, out_pt, None, compute_dtype=q.dtype)
    if q.numel():
        pt_err = (out_pt.double() - out64).abs().max().item()
        noise = 2 * (out64.to(q.dtype).double() - out64).abs().max().item()  # rounding to q's dtype
        err = (out.double() - out64).abs().max().item()
        assert err <= 2 * pt_err + noise, f"error {err:.3g} > 2 x PyTorch's {pt_err:.3g} + rounding {noise:.3g}"
    finite = torch.isfinite(lse32)
    assert torch.equal(torch.isfinite(lse), finite), "queries without visible keys must give lse = -inf"
    assert torch.allclose(lse[finite], lse32[finite], rtol=1e-4, atol=1e-4 if q.dtype == torch.float32 else 2e-3)
    assert not out.isnan().any(), "output has NaNs: most likely read out of bounds (poisoned pages)"
    return out, lse


@pytest.mark.parametrize("head_dim", [64, 128, 256, 96, 40])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_and_prefill_mixed(isa, dtype, head_dim):
    # decode (1 query), chunked prefill over a cached prefix, a full prefill, a one-token sequence
    kv_lens, q_lens = [300, 57, 33, 1], [1, 20, 33, 1]
    pb = make_paged_batch(kv_lens, 16, 2, head_dim, dtype)
    q = torch.randn(sum(q_lens), 8, head_dim).to(dtype)
    run_and_check(pb, q, cu_from(q_lens))


@pytest.mark.parametrize("page_size", [1, 2, 8, 16, 32, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_page_boundaries(isa, dtype, page_size):
    rng = random.Random(page_size)
    kv_lens = [page_size, page_size + 1, 3 * page_size - 1, rng.randint(1, 200)]
    q_lens = [1, 2, min(5, kv_lens[2]), 1]
    pb = make_paged_batch(kv_lens, page_size, 2, 64, dtype)
    q = torch.randn(sum(q_lens), 4, 64).to(dtype)
    run_and_check(pb, q, cu_from(q_lens))


# groups of 1, 2, 3, 4, 6 and 8 (MQA): the AVX2 kernel blocks a task's rows (query tokens x group) by
# 1-4 rows, whichever pads least, so every block size is reached by a decode step or a prefill chunk;
# a group of 32 is wider than the 16 rows of a CUDA CTA's pass over the keys
@pytest.mark.parametrize("q_heads, kv_heads",
                         [(4, 4), (6, 3), (9, 3), (8, 2), (16, 2), (12, 2), (8, 1), (12, 3), (32, 1)])
def test_gqa_and_mqa(isa, q_heads, kv_heads):
    kv_lens, q_lens = [130, 40], [1, 17]
    pb = make_paged_batch(kv_lens, 16, kv_heads, 128, torch.bfloat16)
    q = torch.randn(sum(q_lens), q_heads, 128).to(torch.bfloat16)
    run_and_check(pb, q, cu_from(q_lens))


@pytest.mark.parametrize("window_left, sink_tokens", [(0, 0), (1, 0), (15, 0), (16, 4), (31, 1), (100, 16), (-1, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_and_sinks(isa, dtype, window_left, sink_tokens):
    kv_lens, q_lens = [200, 77, 40], [1, 30, 40]
    pb = make_paged_batch(kv_lens, 16, 2, 64, dtype)
    q = torch.randn(sum(q_lens), 4, 64).to(dtype)
    run_and_check(pb, q, cu_from(q_lens), window_left=window_left, sink_tokens=sink_tokens)


@pytest.mark.parametrize("window_left, sink_tokens", [(-1, 0), (150, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_chunked_prefill(isa, dtype, window_left, sink_tokens):
    # prefill over prefixes of several hundred keys: the CPU kernel's BLAS path takes keys 128 at a
    # time, so the online softmax carries each row's state from block to block
    kv_lens, q_lens = [700, 300], [40, 300]
    pb = make_paged_batch(kv_lens, 16, 2, 128, dtype)
    q = torch.randn(sum(q_lens), 8, 128).to(dtype)
    run_and_check(pb, q, cu_from(q_lens), window_left=window_left, sink_tokens=sink_tokens)


@pytest.mark.parametrize("softcap, window_left, sink_tokens", [(0.0, -1, 0), (20.0, -1, 0), (0.0, 70, 3), (30.0, 45, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_blocks_with_softcap_window_and_sinks(isa, dtype, softcap, window_left, sink_tokens):
    # 16-bit prefill in blocks of 64 query rows (on CUDA, tensor cores: prefill_mma_kernel) with each masking
    # feature: a chunk after a cached prefix, block and 64-key tile tails, a decode row beside them
    kv_lens, q_lens = [250, 131, 5], [150, 131, 1]
    pb = make_paged_batch(kv_lens, 16, 2, 64, dtype)
    q = (2 * torch.randn(sum(q_lens), 8, 64)).to(dtype)  # scores large enough for the cap to matter
    run_and_check(pb, q, cu_from(q_lens), window_left=window_left, sink_tokens=sink_tokens, softcap=softcap)


@pytest.mark.parametrize("softcap", [5.0, 30.0])
def test_softcap(isa, softcap):
    pb = make_paged_batch([90, 33], 16, 2, 64, torch.float32)
    q = 3 * torch.randn(1 + 33, 4, 64)  # large scores, so the cap matters
    run_and_check(pb, q, cu_from([1, 33]), softcap=softcap)


@pytest.mark.parametrize("softcap", [30.0, 50.0])
def test_softcap_of_small_scores_keeps_fp32_accuracy(isa, softcap):
    # scores far below the cap: tanh as 1 - 2 / (exp(2y) + 1) cancelled there (~30 ulp at y = 0.03), over
    # the rule in fp32 (a fuzzer found it); decode, and a prefill long enough for the AVX2 build's GEMM path
    for seed in range(4):
        torch.manual_seed(seed)
        pb = make_paged_batch([61, 90, 40], 16, 2, 32, torch.float32)
        q = 0.5 * torch.randn(1 + 40 + 40, 4, 32)
        run_and_check(pb, q, cu_from([1, 40, 40]), softcap=softcap)


def test_empty_sequences_and_queries(isa):
    # a sequence with no tokens, one with tokens but no queries, and a normal one
    pb = make_paged_batch([0, 50, 20], 16, 2, 64, torch.float16)
    q = torch.randn(3, 4, 64).to(torch.float16)
    out, _ = run_and_check(pb, q, cu_from([0, 0, 3]))
    assert out.shape == (3, 4, 64)
    empty = torch.empty(0, 4, 64, dtype=torch.float16)
    out, lse = kvcache.paged_attention(empty, pb.k_cache, pb.v_cache, pb.block_tables, pb.seq_lens,
                                       cu_from([0, 0, 0]), return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


@pytest.mark.parametrize("kv_len", [4, 5, 20])
def test_sinks_covering_every_key_read_nothing_past_the_sequence(isa, kv_len):
    """Sinks that cover every visible key leave the window range empty ([kv_len, kv_len)); the kernel once ran
    that empty range's aligned-down tile, reading an int8 row scale through the table entry after the
    sequence's last page (found by the fuzzer: a segfault). Entries past the pages must never be read."""
    page = 4
    pages = -(-kv_len // page)
    pool = kvcache.KVPool.allocate(8, page, 2, 32, "int8")
    x = torch.randn(1, 2, 32, 32).to(torch.bfloat16)
    pool.append(x, torch.randn_like(x), torch.arange(32).view(1, 32))
    table = torch.full((1, pages + 2), 2**31 - 1, dtype=torch.int32)  # poison: never read
    table[0, :pages] = torch.arange(pages, dtype=torch.int32).flip(0)
    lens, cu = torch.tensor([kv_len], dtype=torch.int32), cu_from([3])
    q = torch.randn(3, 4, 32).to(torch.bfloat16)
    out = pool.attention(q, table, lens, cu, sink_tokens=kv_len + 4)
    k = ref.dequantize_pool(pool.k, pool.k_scale, pool.format.k.kernel_id)
    v = ref.dequantize_pool(pool.v, pool.v_scale, pool.format.v.kernel_id)
    want = torch.empty(3, 4, 32)
    ref.paged_attention(q.float(), k, v, table, lens, cu, 32 ** -0.5, -1, kv_len + 4, 0.0, want)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


def test_long_context_split_k_matches(isa):
    # batch 1, MQA: the planner splits the keys across tasks and merges their states
    pb = make_paged_batch([5000], 16, 1, 128, torch.bfloat16)
    q = torch.randn(1, 8, 128).to(torch.bfloat16)
    run_and_check(pb, q, cu_from([1]))
    pb32 = make_paged_batch([3001], 32, 1, 64, torch.float32)
    run_and_check(pb32, torch.randn(1, 2, 64), cu_from([1]), window_left=1000, sink_tokens=4)


def test_long_decode_reads_every_head_of_a_page(isa):
    # >= 4096 keys: a CPU decode task reads as many KV heads as make a 32 KiB run of a page (here all 8 at
    # head_dim 64, bf16), so one task serves 8 heads x 4 query rows; two sequences of unequal lengths, then
    # with a window and sinks
    pb = make_paged_batch([4100, 4133], 16, 8, 64, torch.bfloat16)
    q = torch.randn(2, 32, 64).to(torch.bfloat16)
    run_and_check(pb, q, cu_from([1, 1]))
    run_and_check(pb, q, cu_from([1, 1]), window_left=3000, sink_tokens=4)


def test_non_contiguous_query(isa):
    pb = make_paged_batch([64, 9], 16, 2, 64, torch.bfloat16)
    base = torch.randn(2 + 9, 64, 8).to(torch.bfloat16)
    q = base.transpose(1, 2)  # [tokens, heads, d] with stride 1 on heads
    assert not q.is_contiguous()
    run_and_check(pb, q, cu_from([2, 9]))


def test_deterministic(isa):
    pb = make_paged_batch([700, 30], 16, 2, 128, torch.bfloat16)
    q = torch.randn(1 + 30, 8, 128).to(torch.bfloat16)
    cu = cu_from([1, 30])
    a = kvcache.paged_attention(q, pb.k_cache, pb.v_cache, pb.block_tables, pb.seq_lens, cu)
    b = kvcache.paged_attention(q, pb.k_cache, pb.v_cache, pb.block_tables, pb.seq_lens, cu)
    assert torch.equal(a, b)


def test_query_dtype_independent_of_cache_dtype(isa):
    pb = make_paged_batch([100], 16, 2, 64, torch.bfloat16)
    q = torch.randn(3, 4, 64)  # fp32 queries over a bf16 cache
    run_and_check(pb, q, cu_from([3]))


def test_cascade_merge_equals_full_attention():
    # Attention over a shared prefix and over the own suffix, merged by their lse = attention over all.
    torch.manual_seed(0)
    layout = kvcache.PageLayout(16, 16, 2, 64, torch.float32)
    k_cache, v_cache = (torch.randn(layout.shape) for _ in range(2))
    table = torch.arange(8, dtype=torch.int32).view(1, 8)
    q = torch.randn(1, 4, 64)
    one = torch.tensor([0, 1], dtype=torch.int32)
    full = kvcache.paged_attention(q, k_cache, v_cache, table, torch.tensor([128], dtype=torch.int32), one)
    prefix = kvcache.paged_attention(q, k_cache, v_cache, table[:, :5], torch.tensor([80], dtype=torch.int32), one,
                                     return_lse=True)
    suffix = kvcache.paged_attention(q, k_cache, v_cache, table[:, 5:].contiguous(),
                                     torch.tensor([48], dtype=torch.int32), one, return_lse=True)
    merged, lse = kvcache.merge_states(prefix[0], prefix[1], suffix[0], suffix[1])
    torch.testing.assert_close(merged, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_states_matches_reference(dtype):
    v_a, v_b = torch.randn(5, 3, 64).to(dtype), torch.randn(5, 3, 64).to(dtype)
    lse_a, lse_b = torch.randn(5, 3), torch.randn(5, 3)
    lse_a[0, 0] = float("-inf")                        # one side empty
    lse_a[1, 1] = lse_b[1, 1] = float("-inf")          # both empty -> 0, -inf
    v, lse = kvcache.merge_states(v_a, lse_a, v_b, lse_b)
    v_ref, lse_ref = torch.empty_like(v_a, dtype=torch.float32), torch.empty_like(lse_a)
    ref.merge_states(v_a, lse_a, v_b, lse_b, v_ref, lse_ref)
    torch.testing.assert_close(v.float(), v_ref, rtol=0, atol={torch.float32: 1e-6}.get(dtype, 1e-2))
    torch.testing.assert_close(lse, lse_ref)
    assert v[1, 1].eq(0).all() and lse[1, 1] == float("-inf")


def test_reference_holds_where_the_log_sum_exp_is_large():
    """The reference is the spec (and the "PyTorch error" of the tests' rule): where the lse is large it normalized
    by exp(lse_x - lse) in float32, whose weights stopped summing to 1. Two equal states at lse 1e8 merged to v_a + v_b
    (twice the truth), and attention with scores ~1e8 over 4 equal keys gave 4x the mean of v (the log 4 rounded
    away). Checked against the closed forms, and the kernels against the same."""
    v_a, v_b = torch.tensor([[[1.0, 2.0]]]), torch.tensor([[[3.0, -2.0]]])
    for value in (-1e30, 1e8, 3e7):
        lse = torch.full((1, 1), value)
        v_ref, lse_ref = torch.empty_like(v_a), torch.empty_like(lse)
        ref.merge_states(v_a, lse, v_b, lse, v_ref, lse_ref)
        v, _ = kvcache.merge_states(v_a, lse, v_b, lse)
        want = (v_a + v_b) / 2
        assert torch.equal(v_ref, want) and torch.equal(v, want), value
    q = torch.full((1, 1, 4), 100.0)
    k = torch.full((4, 1, 4), 100.0)
    v = torch.arange(16.0).view(4, 1, 4)
    out, lse = ref.attention(q, k, v, scale=2500.0)  # scores 1e8, all equal
    torch.testing.assert_close(out[0, 0], v[:, 0].mean(0))
    assert lse[0, 0] == torch.tensor(1e8)  # (1e8 + log 4 rounds to 1e8 in float32)


def test_merge_states_keeps_a_nan_state_nan():
    # A NaN lse (a state computed from NaN scores) makes its merged row NaN, in the kernel and the reference
    # alike: the reference's nan_to_num, meant for two empty sets, turned it into zeros (an outside-in probe).
    v_a, v_b = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    lse_a, lse_b = torch.randn(3, 2), torch.randn(3, 2)
    lse_a[0, 1] = float("nan")
    lse_a[2, 0] = lse_b[2, 0] = float("-inf")
    v, lse = kvcache.merge_states(v_a, lse_a, v_b, lse_b)
    v_ref, lse_ref = torch.empty_like(v_a), torch.empty_like(lse_a)
    ref.merge_states(v_a, lse_a, v_b, lse_b, v_ref, lse_ref)
    assert v[0, 1].isnan().all() and v_ref[0, 1].isnan().all() and lse[0, 1].isnan() and lse_ref[0, 1].isnan()
    assert v[2, 0].eq(0).all() and v_ref[2, 0].eq(0).all()
    torch.testing.assert_close(v, v_ref, rtol=0, atol=1e-6, equal_nan=True)


# ---- opcheck ------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_paged_attention(dtype, with_lse, device):
    pb = make_paged_batch([40, 9], 16, 2, 64, dtype, device)
    q = torch.randn(1 + 9, 4, 64, device=device).to(dtype)
    out = torch.empty_like(q)
    lse = torch.empty(10, 4, device=device) if with_lse else None
    torch.library.opcheck(torch.ops.kvcache.paged_attention.default,
                          (q, pb.k_cache, pb.v_cache, pb.block_tables, pb.seq_lens, cu_from([1, 9], device),
                           0.125, -1, 0, 0.0, out, lse))


@pytest.mark.skipif(not HAS_CUDA_EMULATION, reason="built without KVCACHE_CUDA_EMULATION=ON")
@pytest.mark.parametrize("with_lse", [True, False])
def test_opcheck_cuda_emulated(with_lse):
    # the CUDA host code and kernels honour the schemas: they write nothing but out, lse and v_out/lse_out
    ops = torch.ops.kvcache_cuda_emulation
    pb = make_paged_batch([300, 9], 16, 2, 64, torch.bfloat16)
    q = torch.randn(1 + 9, 8, 64).to(torch.bfloat16)
    lse = torch.empty(10, 8) if with_lse else None
    torch.library.opcheck(ops.paged_attention.default, (q, pb.k_cache, pb.v_cache, pb.block_tables, pb.seq_lens,
                                                        cu_from([1, 9]), 0.125, -1, 0, 0.0, torch.empty_like(q), lse))
    v_a, v_b = torch.randn(4, 2, 32), torch.randn(4, 2, 32)
    lse_a, lse_b = torch.randn(4, 2), torch.randn(4, 2)
    torch.library.opcheck(ops.merge_states.default,
                          (v_a, lse_a, v_b, lse_b, torch.empty_like(v_a), torch.empty_like(lse_a)))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_merge_states(device):
    v_a, v_b = torch.randn(4, 2, 32, device=device), torch.randn(4, 2, 32, device=device)
    lse_a, lse_b = torch.randn(4, 2, device=device), torch.randn(4, 2, device=device)
    torch.library.opcheck(torch.ops.kvcache.merge_states.default,
                          (v_a, lse_a, v_b, lse_b, torch.empty_like(v_a), torch.empty_like(lse_a)))


def test_compiles_fullgraph():
    pb = make_paged_batch([40], 16, 2, 64, torch.float32)

    def f(q, k_cache, v_cache, table, lens, cu):
        out, lse = kvcache.paged_attention(q, k_cache, v_cache, table, lens, cu, return_lse=True)
        return out.sum() + lse.sum()

    q = torch.randn(2, 4, 64)
    args = (q, pb.k_cache, pb.v_cache, pb.block_tables, pb.seq_lens, cu_from([2]))
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(*args), f(*args))


# ---- bad input --------------------------------------------------------------------------------------
def test_bad_attention_arguments_leave_out_untouched():
    pb = make_paged_batch([40, 9], 16, 2, 64, torch.float32)
    q = torch.randn(10, 4, 64)
    cu = cu_from([1, 9])

    def call(**kw):
        a = dict(query=q, k_cache=pb.k_cache, v_cache=pb.v_cache, block_tables=pb.block_tables,
                 seq_lens=pb.seq_lens, cu_q_lens=cu, scale=0.1, window_left=-1, sink_tokens=0, softcap=0.0,
                 out=torch.full_like(q, 7.0), lse=None)
        a.update(kw)
        out = a["out"]
        try:
            torch.ops.kvcache.paged_attention.default(*a.values())
        finally:
            assert out.eq(7.0).all() or out.shape != q.shape, "a rejected call wrote its output"

    cases = [
        (dict(seq_lens=torch.tensor([40, 5], dtype=torch.int32)), IndexError,
         r"sequence 1 has 9 queries \(cu_q_lens\) but seq_lens\[1\] = 5; .* q_len <= seq_len"),
        (dict(cu_q_lens=cu_from([2, 9])), IndexError, r"cu_q_lens\[2\] = 11 must equal query.shape\[0\]"),
        (dict(query=torch.randn(10, 3, 64)), ValueError, r"query has 3 heads, which must be a positive multiple of the cache's num_kv_heads = 2"),
        (dict(query=torch.randn(10, 4, 32)), ValueError, r"query.shape\[2\] = 32 must equal head_dim of the cache = 64"),
        (dict(query=torch.randn(10, 4, 64).double()), TypeError, r"query has dtype Double"),
        (dict(out=torch.full((10, 4, 64), 7.0, dtype=torch.float16)), TypeError, r"out must have dtype Float but has Half"),
        (dict(lse=torch.empty(10, 3)), ValueError, r"lse has shape \[10, 3\] but must be \[total_q, q_heads\] = \[10, 4\]"),
        (dict(window_left=-2), ValueError, r"window_left = -2 must be -1"),
        (dict(sink_tokens=-1), ValueError, r"sink_tokens = -1 must be >= 0"),
        (dict(softcap=-1.0), ValueError, r"softcap = -1 must be 0"),
        # finite as a double but not as the float32 the kernels compute in: inf (1e39) or 0, turning the cap off
        (dict(softcap=1e39), ValueError, r"softcap = 1e\+39 must be 0 \(off\) or positive, in \[1.17549e-38, 3.40282e\+38\]"),
        (dict(softcap=1e-50), ValueError, r"softcap = 1e-50 must be 0 \(off\) or positive, in \["),
        (dict(scale=1e39), ValueError, r"scale = 1e\+39 must be finite, and finite as float32 \(\|scale\| <= 3.40282e\+38\)"),
        (dict(scale=-4e38), ValueError, r"scale = -4e\+38 must be finite, and finite as float32"),
        (dict(seq_lens=torch.tensor([40, 9], dtype=torch.int64)), TypeError, r"seq_lens must have dtype Int"),
        (dict(block_tables=torch.full_like(pb.block_tables, 999)), IndexError, r"block_tables\[0, 0\] = 999 is not a block id"),
        (dict(seq_lens=torch.tensor([40, 900], dtype=torch.int32)), IndexError, r"seq_lens\[1\] = 900 needs 57 blocks"),
    ]
    for kwargs, exc, match in cases:
        with pytest.raises(exc, match=match):
            call(**kwargs)


def test_bad_merge_states_arguments():
    v, lse = torch.randn(4, 2, 8), torch.randn(4, 2)
    with pytest.raises(ValueError, match=r"lse tensors must be \[tokens, heads\] = \[4, 2\] but got \[4, 3\]"):
        kvcache.merge_states(v, lse, v, torch.randn(4, 3))
    with pytest.raises(TypeError, match=r"must share a dtype"):
        kvcache.merge_states(v, lse, v.double(), lse)
    with pytest.raises(TypeError, match=r"lse tensors must be float32"):
        kvcache.merge_states(v, lse.double(), v, lse)


def test_bf16_gemm_prefill_is_the_default_only_where_the_cpu_has_amx():
    """The avx512bf16 build hands a bf16 prefill to MKL's bf16 GEMM by default on CPUs with AMX-BF16 (tile units
    the register kernel does not use: 5x its prefill on a Xeon with AMX) and keeps its own elsewhere (on Zen 5
    its bf16 dot products outran torch's BLAS). The tests' "avx512bf16+bf16gemm" build runs it on any CPU."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    amx = "amx_bf16" in cpuinfo.read_text().split()
    c = kvcache._C
    assert c.cpu_bf16_gemm() == (amx and c.cpu_bf16_gemm_available())
    try:
        c.set_cpu_bf16_gemm("off")
        assert not c.cpu_bf16_gemm()
        c.set_cpu_bf16_gemm("on")
        assert c.cpu_bf16_gemm() == c.cpu_bf16_gemm_available()
    finally:
        c.set_cpu_bf16_gemm("auto")
    assert c.cpu_bf16_gemm() == (amx and c.cpu_bf16_gemm_available())
    with pytest.raises(ValueError, match="unknown mode 'fast'; use auto, on or off"):
        c.set_cpu_bf16_gemm("fast")


def test_cpu_isa_names_the_kernel_build_in_use():
    before = kvcache.cpu_isa()
    assert before == SUPPORTED_ISAS[-1]  # the best this CPU supports, chosen at import
    try:
        for name in SUPPORTED_ISAS:
            kvcache._C.set_cpu_isa(name)
            assert kvcache.cpu_isa() == name
    finally:
        kvcache._C.set_cpu_isa(before)


def test_bf16_dot_products_are_the_default_except_on_intel_cores():
    """The avx512bf16 build reads bf16 and fp8 pages with a bf16 query through vdpbf16ps by default, except on
    Intel cores, where that instruction retires one per two cycles against two 16-lane FMAs per cycle and the
    fp32 FMAs of the avx512 build are faster on the same pages. The tests' "avx512bf16+fma" build runs those."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to read the CPU's vendor from")
    intel = "GenuineIntel" in cpuinfo.read_text().split()
    c = kvcache._C
    assert c.cpu_bf16_dot() == (not intel)
    try:
        c.set_cpu_bf16_dot("off")
        assert not c.cpu_bf16_dot()
        c.set_cpu_bf16_dot("on")
        assert c.cpu_bf16_dot()
    finally:
        c.set_cpu_bf16_dot("auto")
    assert c.cpu_bf16_dot() == (not intel)
    with pytest.raises(ValueError, match="unknown mode 'fast'; use auto, on or off"):
        c.set_cpu_bf16_dot("fast")


@pytest.mark.skipif("avx512bf16" not in SUPPORTED_ISAS, reason="needs a CPU with AVX-512 BF16")
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("q_len", [1, 40])
def test_bf16_build_without_dot_products_is_the_avx512_builds_fma_path(fmt, q_len):
    """With bf16 dot products off, the avx512bf16 build runs the avx512 build's fp32 FMA policies on bf16 and
    fp8 pages: the same outputs bit for bit, decode and prefill. With them on, P is rounded to bf16 for
    vdpbf16ps, so the outputs differ (which shows that the switch is what chose the path)."""
    g = torch.Generator().manual_seed(3)
    page, heads, dim, lens = 16, 2, 128, [300, 77]
    pool = kvcache.KVPool.allocate(64, page, heads, dim, fmt)
    table = torch.randperm(64, generator=g)[:2 * 20].view(2, 20).to(torch.int32)
    for b, n in enumerate(lens):
        k = torch.randn(1, heads, n, dim, generator=g).to(torch.bfloat16)
        v = torch.randn(1, heads, n, dim, generator=g).to(torch.bfloat16)
        pool.append(k, v, pool.layout.token_slots(table[b], torch.arange(n)).view(1, n))
    q_lens = [min(q_len, n) for n in lens]
    q = torch.randn(sum(q_lens), heads * 4, dim, generator=g).to(torch.bfloat16)
    cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    c = kvcache._C
    before = c.cpu_isa()
    outs = {}
    try:
        c.set_cpu_bf16_gemm("off")
        for build, dot in (("avx512", "auto"), ("avx512bf16", "off"), ("avx512bf16", "on")):
            c.set_cpu_isa(build)
            c.set_cpu_bf16_dot(dot)
            outs[build, dot] = pool.attention(q, table, seq_lens, cu, return_lse=True)
    finally:
        c.set_cpu_isa(before)
        c.set_cpu_bf16_dot("auto")
        c.set_cpu_bf16_gemm("auto")
    fma, off, on = outs["avx512", "auto"], outs["avx512bf16", "off"], outs["avx512bf16", "on"]
    assert torch.equal(off[0], fma[0]) and torch.equal(off[1], fma[1])
    assert not torch.equal(on[1], fma[1]) or not torch.equal(on[0], fma[0])
