"""KIVI formats (kivi4, kivi2) in the kernels and kvcache.KIVIPool: keys quantized per channel over a
page (written whole), values per token; codes bit-identical to the reference, exact dequantizing gather,
attention within the FlashAttention tolerance, and KIVIPool's sealed + residual attention exact."""

from __future__ import annotations

import re

import pytest
import torch

import kvcache
from kvcache import quant
from kvcache import reference as ref
from kvcache.pool import format_id

from conftest import DEVICES, SUPPORTED_ISAS, assert_lse_rule, attention_vs_reference

FORMATS = ["kivi4", "kivi2", "k=kivi4,v=kivi2", "k=kivi2,v=kivi4"]


def kivi_pool(fmt: str, pages: list[int], page: int, heads: int, dim: int, in_dtype: torch.dtype, device="cpu",
              seed: int = 0):
    """A kivi KVPool holding whole pages of len(pages) sequences through shuffled block tables (written in
    two appends per sequence, the second a single page), plus the K/V that went in."""
    g = torch.Generator().manual_seed(seed)
    pool = kvcache.KVPool.allocate(sum(pages) + 2, page, heads, dim, fmt, device)
    perm = torch.randperm(pool.num_blocks, generator=g)
    table = torch.full((len(pages), max(pages) + 1), -1, dtype=torch.int32)
    start = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[start:start + p].to(torch.int32)
        start += p
    keys, values = [], []
    for b, p in enumerate(pages):
        n = p * page
        k = (torch.randn(1, n, heads, dim, generator=g) * 2).to(in_dtype).transpose(1, 2)
        k[..., 3] += 10.0                                              # an outlier channel, as real keys have
        v = torch.randn(1, n, heads, dim, generator=g).to(in_dtype).transpose(1, 2)
        slots = pool.layout.token_slots(table[b], torch.arange(n)).view(1, n)
        cut = n - page
        if cut:
            pool.append(k[:, :, :cut].to(device), v[:, :, :cut].to(device), slots[:, :cut].to(device))
        pool.append(k[:, :, cut:].to(device), v[:, :, cut:].to(device), slots[:, cut:].to(device))
        keys.append(k)
        values.append(v)
    lens = torch.tensor([p * page for p in pages], dtype=torch.int32)
    return pool, table.to(device), lens.to(device), keys, values


def dequantized(pool):
    return [ref.dequantize_pool(t.cpu(), s.cpu(), format_id(f)) for t, s, f in
            ((pool.k, pool.k_scale, pool.format.k), (pool.v, pool.v_scale, pool.format.v))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_append_codes_bit_identical_to_reference(backend, fmt, in_dtype, page, device):
    pool, table, lens, keys, values = kivi_pool(fmt, [3, 1], page, 2, 64, in_dtype, device)
    expect = kvcache.KVPool.allocate(pool.num_blocks, page, 2, 64, fmt)
    for b, n in enumerate(lens.tolist()):
        slots = pool.layout.token_slots(table[b].cpu(), torch.arange(n)).view(1, n)
        ref.append_quantized(keys[b], values[b], expect.k, expect.v, slots, expect.k_scale, expect.v_scale,
                             format_id(pool.format.k), format_id(pool.format.v))
    used = table[table >= 0].long().cpu()
    for got, exp in ((pool.k, expect.k), (pool.v, expect.v), (pool.k_scale, expect.k_scale), (pool.v_scale, expect.v_scale)):
        assert torch.equal(got.cpu()[used], exp[used])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gather_dequantizes_exactly(backend, fmt, device):
    pool, table, lens, keys, values = kivi_pool(fmt, [3, 2], 16, 2, 64, torch.float32, device)
    k, v = pool.gather(table, lens, max_len=50)
    deq_k, deq_v = dequantized(pool)
    k_ref, v_ref = torch.empty_like(k.cpu()), torch.empty_like(v.cpu())
    ref.paged_gather(deq_k, deq_v, table.cpu(), lens.cpu(), k_ref, v_ref)
    assert torch.equal(k.cpu(), k_ref) and torch.equal(v.cpu(), v_ref)
    # per-channel keys: the outlier channel costs the other channels nothing
    bits = pool.format.k.bits
    err = (k[0, :, :48].cpu() - keys[0][0]).abs().amax(dim=(0, 1))          # per channel
    span = keys[0][0].amax(dim=1) - keys[0][0].amin(dim=1)                  # [heads, dim] over all tokens
    assert (err <= span.amax(0) / (2 ** bits - 1) * 0.51 + 1e-2).all()
    kr, _ = kvcache.paged_gather_ragged(pool.k, pool.v, table, torch.tensor([0, 48, 80], dtype=torch.int32, device=device),
                                        **pool.op_kwargs())
    assert torch.equal(kr[:48].cpu(), k_ref[0, :, :48].transpose(0, 1))


def check_attention(pool, table, lens, q, cu):
    lse, lse64, lse_pt = attention_vs_reference(pool, dequantized(pool), table, lens, cu, q)
    if q.dtype == torch.float32:
        assert torch.allclose(lse, lse64, atol=2e-3, rtol=1e-4)
    else:  # the CUDA prefill multiplies keys dequantized to the query's dtype: the FlashAttention rule
        assert_lse_rule(lse, lse64, lse_pt)


@pytest.mark.parametrize("q_heads", [8, 6, 2])  # groups of 4, 3, 1: row blocks of 4, 3 and 1 rows on AVX2
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_reads_codes_in_registers(isa, fmt, q_dtype, q_heads):
    pool, table, lens, _, _ = kivi_pool(fmt, [19, 3], 16, 2, 128, torch.bfloat16)
    q_lens = [1, 20]
    q = torch.randn(sum(q_lens), q_heads, 128).to(q_dtype)
    cu = torch.tensor([0, 1, 21], dtype=torch.int32)
    check_attention(pool, table, lens, q, cu)


@pytest.mark.parametrize("fmt", FORMATS)
def test_long_decode_reads_several_heads_per_task(isa, fmt):
    # >= 4096 keys: a CPU decode task reads as many KV heads as make an 8 KiB run of a page, split along
    # the keys and merged; each head's rows must still see only their own keys
    pool, table, lens, _, _ = kivi_pool(fmt, [270, 3, 258], 16, 4, 128, torch.bfloat16, seed=5)
    q = torch.randn(3, 8, 128).to(torch.bfloat16)
    cu = torch.arange(4, dtype=torch.int32)
    check_attention(pool, table, lens, q, cu)


# (format, GQA group, head_dim, page): every format, group and head_dim at page 16, larger pages, and a page
# smaller than a tile, where bf16 queries keep the fp32 path
BF16_DECODES = ([(f, g, d, 16) for f in ("kivi4", "kivi2", "k=kivi2,v=kivi4") for g in (1, 4, 8) for d in (64, 128)] +
                [("kivi4", 4, 128, 64), ("kivi2", 8, 64, 64), ("k=kivi4,v=kivi2", 1, 128, 32), ("kivi2", 4, 128, 8)])


@pytest.mark.parametrize("fmt, group, dim, page", BF16_DECODES)
def test_bf16_query_long_decode(isa, fmt, group, dim, page):
    # bf16 queries on the avx512bf16 build: dot products on both sides (ScoreKivi: 16-bit; PvB4 with KIVI
    # codes: bytes), over many pages, with several heads per task and the keys split across tasks (>= 4096)
    pool, table, lens, _, _ = kivi_pool(fmt, [4160 // page, 640 // page], page, 2, dim, torch.bfloat16, seed=group)
    q = torch.randn(2, 2 * group, dim).to(torch.bfloat16)
    check_attention(pool, table, lens, q, torch.arange(3, dtype=torch.int32))


@pytest.mark.skipif("avx512bf16" not in SUPPORTED_ISAS, reason="the dot-product paths need AVX-512 BF16 and VNNI")
@pytest.mark.parametrize("fmt", ["kivi4", "kivi2"])
def test_bf16_query_takes_the_dot_product_paths(fmt):
    # The avx512bf16 build quantizes a bf16 query (its results differ from the fp32 FMAs of the avx512 build),
    # except where a tile spans pages; fp32 queries stay on the exact path, bit-identical on both builds.
    before = kvcache._C.cpu_isa()
    try:
        for page, q_dtype, same in ((16, torch.bfloat16, False), (8, torch.bfloat16, True), (16, torch.float32, True)):
            pool, table, lens, _, _ = kivi_pool(fmt, [8, 3], page, 2, 128, torch.bfloat16)
            q = torch.randn(2, 8, 128).to(q_dtype)
            cu = torch.arange(3, dtype=torch.int32)
            results = []
            for build in ("avx512bf16", "avx512"):
                kvcache._C.set_cpu_isa(build)
                results.append(pool.attention(q, table, lens, cu, return_lse=True))
            assert (torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])) == same
    finally:
        kvcache._C.set_cpu_isa(before)


@pytest.mark.parametrize("fmt", ["kivi4", "kivi2"])
def test_bf16_query_takes_the_integer_paths_where_they_fit(integer_build, fmt):
    # A bf16 query is quantized for 16-bit dot products against KIVI keys (its lse then differs from that of
    # the same query as fp32, which keeps the exact fp32 path) only where the build's policy fits: pages of
    # >= 16 tokens (a tile in one page) and head_dim 64 or 128 (both builds); at page 8 or head_dim 96 the
    # bf16 query takes the fp32 path too and its lse is bit-identical.
    for page, dim, integer in ((16, 128, True), (32, 64, True), (8, 128, False), (16, 96, False)):
        pool, table, lens, _, _ = kivi_pool(fmt, [128 // page, 32 // page], page, 2, dim, torch.bfloat16)
        q = torch.randn(2, 8, dim).to(torch.bfloat16)
        cu = torch.arange(3, dtype=torch.int32)
        lse_bf16 = pool.attention(q, table, lens, cu, return_lse=True)[1]
        lse_fp32 = pool.attention(q.float(), table, lens, cu, return_lse=True)[1]
        assert torch.equal(lse_bf16, lse_fp32) != integer, (page, dim)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_kivi(device):
    pool, table, lens, _, _ = kivi_pool("kivi2", [2, 1], 16, 2, 64, torch.float32, device)
    kw = pool.op_kwargs()
    key = torch.randn(1, 2, 16, 64, device=device)
    free = int(torch.tensor([b for b in range(pool.num_blocks) if b not in table.cpu().tolist()[0] + table.cpu().tolist()[1]])[0])
    slots = (free * 16 + torch.arange(16, device=device)).view(1, 16)
    torch.library.opcheck(torch.ops.kvcache.append.default,
                          (key, key.clone(), pool.k, pool.v, slots, kw["k_scale"], kw["v_scale"], kw["k_format"],
                           kw["v_format"]))
    out = torch.empty(2, 2, 32, 64, device=device)
    torch.library.opcheck(torch.ops.kvcache.paged_gather.default,
                          (pool.k, pool.v, table, lens, out, out.clone(), kw["k_scale"], kw["v_scale"],
                           kw["k_format"], kw["v_format"]))
    q = torch.randn(2, 4, 64, device=device)
    torch.library.opcheck(torch.ops.kvcache.paged_attention.default,
                          (q, pool.k, pool.v, table, lens, torch.tensor([0, 1, 2], dtype=torch.int32, device=device),
                           0.125, -1, 0, 0.0, torch.empty_like(q), None, kw["k_scale"], kw["v_scale"],
                           kw["k_format"], kw["v_format"]))


def test_bad_kivi_arguments_write_nothing(backend):
    pool = kvcache.KVPool.allocate(4, 16, 2, 64, "kivi4")
    assert pool.k.shape == (4, 2, 16, 32) and pool.k_scale.shape == (4, 2, 2, 2, 32)
    assert pool.v_scale.shape == (4, 2, 16, 2, 2)
    before = [t.clone() for t in (pool.k, pool.v, pool.k_scale, pool.v_scale)]
    key = torch.randn(1, 2, 16, 64)
    page = torch.arange(16).view(1, 16)
    cases = [
        (key[:, :, :8], page[:, :8], {}, ValueError, r"written whole pages at a time, but key has q_len = 8, which is "
                                                     r"not a multiple of page_size = 16"),
        (key, page + 1, {}, ValueError, r"slot_mapping\[0, 0\] = 1 but a kivi key pool is written whole pages"),
        (key, page[:, [0, 2, 1] + list(range(3, 16))], {}, ValueError, r"slot_mapping\[0, 1\] = 2 but a kivi key pool"),
        (key, page, {"k_scale": pool.v_scale}, ValueError, r"k_scale has shape \[4, 2, 16, 2, 2\] but kivi keys keep a "
                                                            r"scale and a zero per channel per page: \[4, 2, 2, 2, 32\]"),
        (key, page, {"v_scale": pool.k_scale}, ValueError, r"v_scale has shape .* but kivi values keep"),
        (key, page, {"k_scale": pool.k_scale.float()}, TypeError, r"k_scale must have dtype Half"),
    ]
    for k, slots, override, exc, match in cases:
        with pytest.raises(exc, match=match):
            kvcache.append(k, k, pool.k, pool.v, slots, **(pool.op_kwargs() | override))
        assert all(torch.equal(a, b) for a, b in zip((pool.k, pool.v, pool.k_scale, pool.v_scale), before))
    with pytest.raises(ValueError, match=r"reads kivi keys only with kivi values"):
        kvcache.paged_attention(torch.randn(1, 4, 64), pool.k, pool.v, torch.tensor([[0]], dtype=torch.int32),
                                torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                                **(pool.op_kwargs() | {"v_format": 1, "v_scale": torch.zeros(4, 2, 16)}))
    with pytest.raises(ValueError, match=r"head_dim=48 must be a multiple of 32 for kivi2"):
        kvcache.KVPool.allocate(4, 16, 2, 48, "kivi2")


# ---- KIVIPool --------------------------------------------------------------------------------------------
def effective_kv(keys: torch.Tensor, values: torch.Tensor, fmt: str, page: int, sealed_pages: int, sink_pages: int):
    """What a KIVIPool stands for: K/V [tokens, heads, d] with pages [sink, sink + sealed) quantized as the
    reference quantizes them (keys per channel over each page, values per token) and the rest exact."""
    f = kvcache.CacheFormat.parse(fmt)
    k, v = keys.float().clone(), values.float().clone()
    lo, hi = sink_pages * page, (sink_pages + sealed_pages) * page
    if hi > lo:
        pk = k[lo:hi].reshape(sealed_pages, page, *k.shape[1:])
        codes, s, z = quant.uint_quantize(pk, f.k.bits, dim=1)
        k[lo:hi] = quant.uint_dequantize(codes, s.half().float(), z.half().float(), dim=1).reshape(-1, *k.shape[1:])
        codes, s, z = quant.group_quantize(v[lo:hi], f.v.bits, 32)
        v[lo:hi] = quant.group_dequantize(codes, s.half().float(), z.half().float(), 32)
    return k, v


@pytest.mark.parametrize("window, sink_pages", [(0, 0), (20, 0), (0, 1), (40, 2)])
@pytest.mark.parametrize("fmt", ["kivi4", "kivi2"])
def test_kivi_pool_streams_exactly(isa, fmt, window, sink_pages):
    # A prefill, a few chunks and decode steps for two sequences; after every append, attention and gather
    # match the reference on what the pool stands for (sealed pages quantized, the rest exact).
    g = torch.Generator().manual_seed(window + sink_pages)
    page, heads, dim = 16, 2, 64
    pool = kvcache.KIVIPool.allocate(24, page, heads, dim, fmt, dtype=torch.float32, residual_blocks=16,
                                     window=window, sink_pages=sink_pages)
    table = torch.tensor([list(range(0, 12)), list(range(12, 24))], dtype=torch.int32)
    total = 150
    keys = torch.randn(2, total, heads, dim, generator=g) * 2
    keys[..., 7] += 8.0
    values = torch.randn(2, total, heads, dim, generator=g)
    n = 0
    for step in (37, 5, 1, 1, 30, 1, 16, 1):
        lens = torch.tensor([n + step] * 2, dtype=torch.int32)
        pool.append(keys[:, n:n + step].transpose(1, 2), values[:, n:n + step].transpose(1, 2), table, lens)
        n += step
        q = torch.randn(2 * step, 4, dim, generator=g)
        cu = torch.tensor([0, step, 2 * step], dtype=torch.int32)
        out, lse = pool.attention(q, table, lens, cu, return_lse=True)
        k_hat, v_hat = pool.gather(table, lens)
        sealed = pool.sealed_pages(table, lens)
        for b in range(2):
            ek, ev = effective_kv(keys[b, :n], values[b, :n], fmt, page, sealed[b], sink_pages)
            assert torch.equal(k_hat[b].transpose(0, 1), ek) and torch.equal(v_hat[b].transpose(0, 1), ev)
            o64, l64 = ref.attention(q[b * step:(b + 1) * step].double(), ek.double(), ev.double(), dim ** -0.5,
                                     compute_dtype=torch.float64)
            assert (out[b * step:(b + 1) * step].double() - o64).abs().max() < 1e-5
            assert (lse[b * step:(b + 1) * step].double() - l64.double()).abs().max() < 1e-4
        # every page older than the window (and past the sinks) is sealed, before this append's tokens
        before = n - step
        assert sealed == [max(0, (before - window) // page - sink_pages)] * 2


def test_kivi_pool_release_and_out_of_residual_blocks():
    pool = kvcache.KIVIPool.allocate(8, 16, 1, 32, "kivi4", dtype=torch.float32, residual_blocks=2)
    table = torch.arange(8, dtype=torch.int32).view(1, 8)
    x = torch.randn(1, 1, 40, 32)
    with pytest.raises(RuntimeError, match=r"out of residual blocks: this append needs 3, 2 are free"):
        pool.append(x, x, table, torch.tensor([40], dtype=torch.int32))
    assert pool.pages.slot_of == {} and pool.pages.num_slots == 0   # nothing taken
    pool.append(x[:, :, :20], x[:, :, :20], table, torch.tensor([20], dtype=torch.int32))
    pool.append(x[:, :, 20:21], x[:, :, 20:21], table, torch.tensor([21], dtype=torch.int32))  # seals page 0
    assert pool.sealed_pages(table, torch.tensor([21], dtype=torch.int32)) == [1]
    assert list(pool.pages.slot_of) == [1]                          # page 1 (block 1) is the open one
    pool.release(table[0])
    assert pool.pages.slot_of == {} and sorted(pool.pages._free) == [0, 1]
    assert pool.nbytes == pool.sealed.nbytes + pool.residual.nbytes


@pytest.mark.parametrize("fmt", ["kivi4", "kivi2", "k=kivi2,v=kivi4"])
def test_pool_bytes_match_the_format_accounting(fmt):
    # kvcache.formats (and so kvcache.memory) count codes + per-page key metadata + per-token value metadata
    blocks, page, heads, dim = 6, 16, 2, 128
    pool = kvcache.KVPool.allocate(blocks, page, heads, dim, fmt)
    assert pool.nbytes == blocks * page * heads * kvcache.CacheFormat.parse(fmt).bytes_per_token_head(dim, page)


def _kivi_pool_with_a_sealed_page():
    pool = kvcache.KIVIPool.allocate(8, 8, 2, 64, "kivi2", dtype=torch.float32, residual_blocks=8)
    table = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    x = torch.randn(1, 2, 12, 64, generator=torch.Generator().manual_seed(0))
    pool.append(x, x, table, torch.tensor([12], dtype=torch.int32))
    return pool, table


@pytest.mark.parametrize("bad", ["head_dim", "kv_heads", "integer", "short seq_lens", "block id", "table rows"])
def test_refused_kivi_append_seals_nothing(bad):
    # A refused append must leave both pools and the residual bookkeeping as they were: checked before the
    # page that the call would seal (page 0, complete and past the window) is quantized.
    pool, table = _kivi_pool_with_a_sealed_page()
    lens = torch.tensor([13], dtype=torch.int32)
    x = torch.randn(1, 2, 1, 64)
    args = {"head_dim": (torch.randn(1, 2, 1, 32),) * 2 + (table, lens),
            "kv_heads": (torch.randn(1, 4, 1, 64),) * 2 + (table, lens),
            "integer": (torch.ones(1, 2, 1, 64, dtype=torch.int32),) * 2 + (table, lens),
            "short seq_lens": (torch.randn(1, 2, 4, 64),) * 2 + (table, torch.tensor([3], dtype=torch.int32)),
            "block id": (x, x, torch.tensor([[0, 9, 2, 3]], dtype=torch.int32), lens),
            "table rows": (x, x, torch.cat([table, table]), lens)}[bad]
    bits = lambda t: t.view(torch.uint8).clone()  # noqa: E731  (bitwise: unwritten full-precision slots may hold NaN)
    k, v = bits(pool.sealed.k), bits(pool.residual.k)
    slots = dict(pool.pages.slot_of)
    with pytest.raises((ValueError, TypeError, IndexError)) as err:
        pool.append(*args)
    assert {"head_dim": "head_dim = 32", "kv_heads": "kv_heads = 4", "integer": "floating point",
            "short seq_lens": "seq_lens[0] = 3", "block id": "block_tables[0][1] = 9",
            "table rows": "2 rows"}[bad] in str(err.value)
    assert torch.equal(bits(pool.sealed.k), k) and torch.equal(bits(pool.residual.k), v) and pool.pages.slot_of == slots
    assert pool.sealed_pages(table, torch.tensor([12], dtype=torch.int32)) == [0]


def test_kivi_append_takes_key_and_value_of_any_float_dtypes():
    """A value of another dtype than its key (the pool's float32 here, a bfloat16 value) was refused by the op after
    the call had sealed page 0 and moved the bookkeeping (the pool's first 8 tokens then read 0.59 off). Each is now
    stored in the pool's dtype, as the key already was: the same pool as with both cast by the caller."""
    got, table = _kivi_pool_with_a_sealed_page()
    want, _ = _kivi_pool_with_a_sealed_page()
    x = torch.randn(1, 2, 1, 64, generator=torch.Generator().manual_seed(1))
    lens = torch.tensor([13], dtype=torch.int32)
    got.append(x, x.to(torch.bfloat16), table, lens)
    want.append(x, x.to(torch.bfloat16).float(), table, lens)
    assert got.pages.slot_of == want.pages.slot_of
    for a, b in zip(got.gather(table, lens), want.gather(table, lens)):
        assert torch.equal(a, b)


def test_kivi_attention_and_gather_name_the_bad_argument():
    pool, table = _kivi_pool_with_a_sealed_page()
    q, cu = torch.randn(1, 4, 64), torch.tensor([0, 1], dtype=torch.int32)
    lens = lambda n: torch.tensor([n], dtype=torch.int32)  # noqa: E731
    for call in (lambda t, n: pool.attention(q, t, lens(n), cu), lambda t, n: pool.gather(t, lens(n))):
        with pytest.raises(IndexError, match=r"seq_lens\[0\] = 40 needs 5 blocks but block_tables has 4 columns"):
            call(table, 40)
        with pytest.raises(IndexError, match=r"block_tables\[0\]\[1\] = -1 is not a block .* seq_lens\[0\] = 12"):
            call(torch.tensor([[0, -1, 2, 3]], dtype=torch.int32), 12)
        with pytest.raises(ValueError, match=r"seq_lens\[0\] = -3 must be >= 0"):
            call(table, -3)
    with pytest.raises(ValueError, match=r"cu_q_lens gives sequence 0 13 queries, but it must have 0 .. seq_lens"):
        pool.attention(torch.randn(13, 4, 64), table, lens(12), torch.tensor([0, 13], dtype=torch.int32))
    with pytest.raises(TypeError, match=r"seq_lens must be a 1-D integer tensor"):
        pool.gather(table, torch.tensor([12.0]))


def test_kivi_release_takes_a_block_table_and_refuses_other_ids():
    pool = kvcache.KIVIPool.allocate(8, 16, 1, 32, "kivi4", dtype=torch.float32, residual_blocks=4)
    table = torch.arange(3, dtype=torch.int32).view(1, 3)
    x = torch.randn(1, 1, 20, 32)
    pool.append(x, x, table, torch.tensor([20], dtype=torch.int32))   # pages 0, 1 open: residual slots
    held = dict(pool.pages.slot_of)
    assert sorted(held) == [0, 1]
    for bad, shown in (([0, 99], "block_ids[1] = 99"), ([-1], "block_ids[0] = -1"),
                       (torch.tensor([[0, 8]]), "block_ids[1] = 8")):
        with pytest.raises(IndexError, match=re.escape(shown) + r" is not a block of this pool \(0 .. 7\)"):
            pool.release(bad)
        assert pool.pages.slot_of == held                            # checked whole before anything is freed
    with pytest.raises(TypeError, match=r"block_ids\[0\]=0.5 must be an int"):
        pool.release([0.5])
    pool.release(table)                                              # a [1, n] block table, as the ops take
    assert pool.pages.slot_of == {}
    pool.append(x[:, :, :5], x[:, :, :5], table, torch.tensor([5], dtype=torch.int32))
    assert torch.equal(pool.gather(table, torch.tensor([5], dtype=torch.int32))[0][0, :, :5], x[0, :, :5])


def test_kivi_pool_integer_arguments():
    for name, value in (("window", 2.5), ("sink_pages", 1.0), ("residual_blocks", True)):
        with pytest.raises(TypeError, match=rf"{name}={value!r} must be an int"):
            kvcache.KIVIPool.allocate(4, 16, 1, 32, "kivi4", dtype=torch.float32,
                                      **{"residual_blocks": 2, name: value})


@pytest.mark.parametrize("fmt", ["kivi2", "k=kivi4,v=kivi2"])
@pytest.mark.parametrize("dim", [1024, 1088])
def test_gather_of_wide_rows(fmt, dim):
    # The CPU gather widens a key page's fp16 metadata once per page into a buffer of 1,024 dims' worth; a
    # wider row dequantizes its keys value by value instead. Both exact against the reference.
    pool, table, lens, _, _ = kivi_pool(fmt, [2, 1], 16, 2, dim, torch.float32)
    k, v = pool.gather(table, lens, max_len=40)
    deq_k, deq_v = dequantized(pool)
    k_ref, v_ref = torch.empty_like(k), torch.empty_like(v)
    ref.paged_gather(deq_k, deq_v, table, lens, k_ref, v_ref)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
