"""Pools whose K and V rows differ in width (PageLayout.v_head_dim; MLA latents: a kv_lora_rank-wide key, a
qk_rope_head_dim-wide value): every storage op against kvcache.reference, in full precision (bitwise) and in
every quantized format that can take the widths, on the CPU kernels and on the CUDA kernels under the
emulator; opcheck; the refusals (paged_attention, widths a format cannot take) name the side, the widths and
the format, and leave everything untouched."""

from __future__ import annotations

import random

import pytest
import torch

import kvcache
from kvcache import reference as ref
from kvcache.pool import format_id

from conftest import DTYPES, HAS_CUDA_EMULATION

WIDTHS = [(16, 8), (8, 24), (40, 1)]  # (K, V): narrower, wider, a single dim


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(bits(a), bits(b))


def hf_style(batch, heads, q_len, dim, dtype, generator=None):
    """[batch, heads, q_len, dim] viewed from [batch, q_len, heads, dim]: non-contiguous, like HF's K/V."""
    return torch.randn(batch, q_len, heads, dim, generator=generator).to(dtype).transpose(1, 2)


def paged_batch(lens, page, heads, k_dim, v_dim, dtype, seed=0):
    """Pools with the sequences' pages at shuffled block ids, unused blocks NaN, and their tables."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in lens]
    layout = kvcache.PageLayout(sum(pages) + 3, page, heads, k_dim, dtype, v_head_dim=v_dim)
    k_cache, v_cache = layout.allocate(fill=float("nan"))
    perm = torch.randperm(layout.num_blocks, generator=g)
    table = torch.full((len(lens), max(pages) + 1), -1, dtype=torch.int32)
    start = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[start:start + p].to(torch.int32)
        start += p
    used = perm[:start]
    k_cache[used] = torch.randn((len(used), *layout.shape[1:]), generator=g).to(dtype)
    v_cache[used] = torch.randn((len(used), *layout.v_shape[1:]), generator=g).to(dtype)
    return layout, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32)


# ---- the layout ---------------------------------------------------------------------------------------
def test_layout_owns_both_widths():
    layout = kvcache.PageLayout(8, 16, 1, 512, torch.bfloat16, v_head_dim=64)
    assert layout.shape == (8, 1, 16, 512) and layout.v_shape == (8, 1, 16, 64)
    assert not layout.equal_widths and layout.dim("k") == 512 and layout.dim("v") == 64
    assert layout.bytes_per_block == 16 * (512 + 64) * 2
    k, v = layout.allocate(fill=0.0)
    assert k.shape == layout.shape and v.shape == layout.v_shape
    assert kvcache.PageLayout.of(k, v) == layout and kvcache.PageLayout.of(k).v_head_dim == 512
    same = kvcache.PageLayout(8, 16, 1, 512, torch.bfloat16)
    assert same.v_head_dim == 512 and same.equal_widths and same.v_shape == same.shape
    with pytest.raises(ValueError, match=r"v_head_dim=0 must be a positive int"):
        kvcache.PageLayout(8, 16, 1, 512, v_head_dim=0)
    with pytest.raises(ValueError, match=r"v_cache has shape \(8, 2, 16, 64\) but k_cache has \(8, 1, 16, 512\)"):
        kvcache.PageLayout.of(k, torch.zeros(8, 2, 16, 64))


# ---- full precision: bitwise against the reference ---------------------------------------------------
@pytest.mark.parametrize("widths", WIDTHS, ids=str)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_append_matches_reference(backend, dtype, page_size, widths):
    k_dim, v_dim = widths
    rng = random.Random(page_size + k_dim)
    batch, heads, q_len = rng.randint(1, 3), rng.choice([1, 2]), rng.randint(2, 9)
    layout = kvcache.PageLayout(-(-batch * q_len // page_size) + 2, page_size, heads, k_dim, dtype, v_head_dim=v_dim)
    key, value = hf_style(batch, heads, q_len, k_dim, dtype), hf_style(batch, heads, q_len, v_dim, dtype)
    slots = torch.randperm(layout.num_slots)[: batch * q_len].view(batch, q_len)
    slots[0, 0] = -1
    k_cache, v_cache = torch.randn(layout.shape).to(dtype), torch.randn(layout.v_shape).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kvcache.append(key, value, k_cache, v_cache, slots)
    ref.append(key, value, k_ref, v_ref, slots)
    assert_bitwise_equal(k_cache, k_ref)
    assert_bitwise_equal(v_cache, v_ref)


@pytest.mark.parametrize("widths", WIDTHS, ids=str)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gathers_match_reference(backend, dtype, page_size, widths):
    lens = [0, 1, page_size, 3 * page_size + 1, 2 * page_size - 1]
    layout, k_cache, v_cache, table, seq_lens = paged_batch(lens, page_size, 2, *widths, dtype, seed=page_size)
    k, v = kvcache.paged_gather(k_cache, v_cache, table, seq_lens, max(lens) + 2)
    assert k.shape[-1] == widths[0] and v.shape[-1] == widths[1]
    k_ref, v_ref = torch.full_like(k, 7), torch.full_like(v, 7)
    ref.paged_gather(k_cache, v_cache, table, seq_lens, k_ref, v_ref)
    assert_bitwise_equal(k, k_ref)
    assert_bitwise_equal(v, v_ref)
    assert not k.isnan().any() and not v.isnan().any(), "read a poisoned (unused) block"
    cu = torch.nn.functional.pad(seq_lens.cumsum(0), (1, 0)).to(torch.int32)
    kr, vr = kvcache.paged_gather_ragged(k_cache, v_cache, table, cu)
    kr_ref, vr_ref = torch.empty_like(kr), torch.empty_like(vr)
    ref.paged_gather_ragged(k_cache, v_cache, table, cu, kr_ref, vr_ref)
    assert_bitwise_equal(kr, kr_ref)
    assert_bitwise_equal(vr, vr_ref)


def test_append_then_gather_round_trips_with_plans(backend):
    # a cache's path: plan the step (slots validated once), append per layer, gather back
    layout = kvcache.PageLayout(8, 4, 1, 16, torch.bfloat16, v_head_dim=8)
    k_cache, v_cache = layout.allocate(fill=float("nan"))
    table = torch.tensor([[6, 1, 4, 0]], dtype=torch.int32)
    keys, values = hf_style(1, 1, 12, 16, torch.bfloat16), hf_style(1, 1, 12, 8, torch.bfloat16)
    slots = layout.token_slots(table[0], torch.arange(12)).view(1, 12)
    kvcache.append(keys[:, :, :9], values[:, :, :9], k_cache, v_cache, slots[:, :9])
    for t in range(9, 12):
        plan = kvcache.plan_step(k_cache, v_cache, table, torch.tensor([t + 1], dtype=torch.int32),
                                 torch.tensor([0, 1], dtype=torch.int32), slots[:, t:t + 1], q_heads=4)
        kvcache.append_planned(plan, keys[:, :, t:t + 1], values[:, :, t:t + 1], k_cache, v_cache)
    k, v = kvcache.paged_gather(k_cache, v_cache, table, torch.tensor([12], dtype=torch.int32))
    assert torch.equal(k, keys) and torch.equal(v, values)
    # a plan remembers both widths: pools of other V rows are refused
    other_v = torch.zeros(8, 1, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"V rows: v_head_dim 16 in the pools, 8 in the plan"):
        kvcache.append_planned(plan, keys[:, :, :1], keys[:, :, :1], k_cache, other_v)


@pytest.mark.parametrize("widths", WIDTHS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_and_swap_blocks_match_reference(backend, dtype, widths):
    layout = kvcache.PageLayout(12, 4, 2, widths[0], dtype, v_head_dim=widths[1])
    k_cache, v_cache = torch.randn(layout.shape).to(dtype), torch.randn(layout.v_shape).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    mapping = torch.tensor([[0, 5], [3, 7], [11, 1]])
    kvcache.copy_blocks(k_cache, v_cache, mapping)
    ref.copy_blocks(k_ref, v_ref, mapping)
    assert_bitwise_equal(k_cache, k_ref)
    assert_bitwise_equal(v_cache, v_ref)
    host = kvcache.PageLayout(6, 4, 2, widths[0], dtype, v_head_dim=widths[1])
    k_dst, v_dst = torch.randn(host.shape).to(dtype), torch.randn(host.v_shape).to(dtype)
    k_dref, v_dref = k_dst.clone(), v_dst.clone()
    to_host = torch.tensor([[11, 0], [2, 5], [7, 3]])
    kvcache.swap_blocks(k_cache, v_cache, k_dst, v_dst, to_host)
    ref.swap_blocks(k_cache, v_cache, k_dref, v_dref, to_host)
    assert_bitwise_equal(k_dst, k_dref)
    assert_bitwise_equal(v_dst, v_dref)
    assert torch.equal(v_dst[0], v_cache[11]) and torch.equal(k_dst[5], k_cache[2])


# ---- quantized formats ---------------------------------------------------------------------------------
QUANTIZED = [  # (format, K width, V width): every format with widths it can take
    ("int8", 24, 8), ("fp8_e4m3", 8, 40), ("fp8_e5m2", 24, 8), ("int4", 64, 32), ("int4", 32, 96),
    ("k=int8,v=int4", 8, 32), ("k=int4,v=fp8_e4m3", 64, 8), ("k=fp32,v=int8", 24, 8), ("k=int8,v=fp32", 24, 8),
    ("int8(hadamard)", 64, 16), ("k=int4(hadamard),v=int8", 32, 8), ("k=int8,v=fp8_e5m2(hadamard)", 24, 32),
    ("k=int8,v=fp8_e4m3(hadamard)", 512, 64),  # a latent wider than a rotated row: the CUDA gather's other path
    ("kivi4", 64, 32), ("kivi2", 32, 64), ("k=kivi2,v=kivi4", 96, 32),
]


def _zeroed(pool):
    """The pool with its full-precision side zeroed (allocated uninitialized): every slot compares."""
    for t in (pool.k, pool.v):
        if t.is_floating_point():
            t.zero_()
    return pool


def filled_pool(fmt, k_dim, v_dim, lens, page=16, heads=2, in_dtype=torch.float32, seed=0):
    """A pool of `fmt` holding `lens` tokens per sequence (K rows k_dim wide, V rows v_dim), appended as a
    prefill and, unless KIVI (whole pages), a decode token; plus the K/V that went in."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in lens]
    pool = _zeroed(kvcache.KVPool.allocate(sum(pages) + 2, page, heads, k_dim, fmt, v_head_dim=v_dim))
    kivi = "kivi" in fmt
    perm = torch.randperm(pool.num_blocks, generator=g)
    table = torch.full((len(lens), max(pages) + 1), -1, dtype=torch.int32)
    start = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[start:start + p].to(torch.int32)
        start += p
    keys, values = [], []
    for b, n in enumerate(lens):
        k = (hf_style(1, heads, n, k_dim, torch.float32, g) * 2).to(in_dtype)
        v = hf_style(1, heads, n, v_dim, torch.float32, g).to(in_dtype)
        slots = pool.layout.token_slots(table[b], torch.arange(n)).view(1, n)
        cut = n if kivi else n - 1
        pool.append(k[:, :, :cut], v[:, :, :cut], slots[:, :cut])
        if cut < n:
            pool.append(k[:, :, cut:], v[:, :, cut:], slots[:, cut:])
        keys.append(k)
        values.append(v)
    return pool, table, torch.tensor(lens, dtype=torch.int32), keys, values


# inputs in float32 and bfloat16; a full-precision side takes its pool's dtype (float32 here)
QUANTIZED_CALLS = [(f, k, v, dt) for f, k, v in QUANTIZED for dt in (torch.float32, torch.bfloat16)
                   if dt == torch.float32 or "fp32" not in f]


@pytest.mark.parametrize("fmt, k_dim, v_dim, in_dtype", QUANTIZED_CALLS, ids=lambda x: str(x))
def test_quantized_append_codes_and_gathers_match_reference(backend, fmt, k_dim, v_dim, in_dtype):
    lens = [48, 16] if "kivi" in fmt else [37, 5]
    pool, table, lens_t, keys, values = filled_pool(fmt, k_dim, v_dim, lens, in_dtype=in_dtype)
    assert pool.v.shape[-1] * pool.format.v.dims_per_code == v_dim
    expect = _zeroed(kvcache.KVPool.allocate(pool.num_blocks, 16, 2, k_dim, fmt, v_head_dim=v_dim))
    for t_exp, t_got in ((expect.k_scale, pool.k_scale), (expect.v_scale, pool.v_scale)):
        if t_exp is not None and t_exp.dim() == 1:
            t_exp.copy_(t_got)  # fp8: the same per-head scale (taken from the first tokens)
    for b, n in enumerate(lens):
        slots = pool.layout.token_slots(table[b], torch.arange(n)).view(1, n)
        ref.append_quantized(keys[b], values[b], expect.k, expect.v, slots, expect.k_scale, expect.v_scale,
                             format_id(pool.format.k), format_id(pool.format.v))
    used = table[table >= 0].long()
    assert torch.equal(pool.k[used], expect.k[used]), "K codes differ from the reference"
    assert torch.equal(pool.v[used], expect.v[used]), "V codes differ from the reference"
    for got, exp in ((pool.k_scale, expect.k_scale), (pool.v_scale, expect.v_scale)):
        if exp is not None and exp.dim() >= 3:
            assert torch.equal(got[used], exp[used])
    # gathers dequantize exactly what the reference dequantizes, each side at its width
    k, v = pool.gather(table, lens_t, max_len=max(lens) + 1)
    deq_k = ref.dequantize_pool(pool.k, pool.k_scale, format_id(pool.format.k))
    deq_v = ref.dequantize_pool(pool.v, pool.v_scale, format_id(pool.format.v))
    k_ref, v_ref = torch.empty_like(k), torch.empty_like(v)
    ref.paged_gather(deq_k, deq_v, table, lens_t, k_ref, v_ref)
    assert k.shape[-1] == k_dim and v.shape[-1] == v_dim
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    tol = 0.5 if "kivi2" in fmt else 0.2  # of the largest magnitude: quantization error only
    for b, n in enumerate(lens):
        assert (k[b, :, :n] - keys[b][0].float()).abs().max() <= tol * keys[b].float().abs().max()
        assert (v[b, :, :n] - values[b][0].float()).abs().max() <= tol * values[b].float().abs().max()
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    kr, vr = kvcache.paged_gather_ragged(pool.k, pool.v, table, cu, **pool.op_kwargs())
    assert torch.equal(kr[:lens[0]], k_ref[0, :, :lens[0]].transpose(0, 1))
    assert torch.equal(vr[lens[0]:], v_ref[1, :, :lens[1]].transpose(0, 1))


# ---- opcheck ----------------------------------------------------------------------------------------------
def _sample_calls(ops, dtype):
    layout, k_cache, v_cache, table, lens = paged_batch([5, 0, 9], 4, 2, 16, 8, dtype)
    k_cache.nan_to_num_(0.0), v_cache.nan_to_num_(0.0)  # opcheck compares outputs with NaN != NaN
    key, value = hf_style(2, 2, 3, 16, dtype), hf_style(2, 2, 3, 8, dtype)
    slots = torch.tensor([[0, 1, -1], [7, 8, 9]])
    cu = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    other = kvcache.PageLayout(5, 4, 2, 16, dtype, v_head_dim=8).allocate(fill=0.0)
    q = kvcache.KVPool.allocate(layout.num_blocks, 4, 2, 64, "k=int8,v=int4", v_head_dim=32)
    q_key, q_value = hf_style(2, 2, 3, 64, dtype), hf_style(2, 2, 3, 32, dtype)
    fmt = q.op_kwargs()
    return {
        "append": (ops.append.default, (key, value, k_cache, v_cache, slots)),
        "append_quantized": (ops.append.default, (q_key, q_value, q.k, q.v, slots, fmt["k_scale"], fmt["v_scale"],
                                                  fmt["k_format"], fmt["v_format"])),
        "paged_gather": (ops.paged_gather.default,
                         (k_cache, v_cache, table, lens, torch.empty(3, 2, 10, 16, dtype=dtype),
                          torch.empty(3, 2, 10, 8, dtype=dtype))),
        "paged_gather_quantized": (ops.paged_gather.default,
                                   (q.k, q.v, table, lens, torch.empty(3, 2, 10, 64), torch.empty(3, 2, 10, 32),
                                    fmt["k_scale"], fmt["v_scale"], fmt["k_format"], fmt["v_format"])),
        "paged_gather_ragged": (ops.paged_gather_ragged.default,
                                (k_cache, v_cache, table, cu, torch.empty(14, 2, 16, dtype=dtype),
                                 torch.empty(14, 2, 8, dtype=dtype))),
        "copy_blocks": (ops.copy_blocks.default, (k_cache, v_cache, torch.tensor([[0, 3], [1, 4]]))),
        "swap_blocks": (ops.swap_blocks.default, (k_cache, v_cache, other[0], other[1], torch.tensor([[0, 3], [1, 4]]))),
    }


CALLS = ["append", "append_quantized", "paged_gather", "paged_gather_quantized", "paged_gather_ragged",
         "copy_blocks", "swap_blocks"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CALLS)
def test_opcheck(name, dtype):
    op, args = _sample_calls(torch.ops.kvcache, dtype)[name]
    torch.library.opcheck(op, args)


@pytest.mark.skipif(not HAS_CUDA_EMULATION, reason="built without KVCACHE_CUDA_EMULATION=ON")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CALLS)
def test_opcheck_cuda_emulated(name, dtype):
    op, args = _sample_calls(torch.ops.kvcache_cuda_emulation, dtype)[name]
    torch.library.opcheck(op, args)


def test_compiles_fullgraph_with_two_widths():
    layout = kvcache.PageLayout(4, 4, 1, 16, torch.float32, v_head_dim=8)

    def step(key, value, k_cache, v_cache, slots, table, lens):
        kvcache.append(key, value, k_cache, v_cache, slots)
        k, v = kvcache.paged_gather(k_cache, v_cache, table, lens, 8)
        return (k * 2).sum() + v.sum()

    def inputs():
        k_cache, v_cache = layout.allocate(fill=0.0)
        g = torch.Generator().manual_seed(1)
        key, value = torch.randn(1, 1, 6, 16, generator=g), torch.randn(1, 1, 6, 8, generator=g)
        return (key, value, k_cache, v_cache, torch.tensor([[8, 9, 10, 11, 0, 1]]),
                torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32))

    eager_args, compiled_args = inputs(), inputs()
    expected = step(*eager_args)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*compiled_args)
    assert torch.equal(expected, got) and torch.equal(eager_args[3], compiled_args[3])


# ---- refusals -----------------------------------------------------------------------------------------------
def _unchanged(tensors, exc, match, fn):
    before = [t.clone() for t in tensors]
    with pytest.raises(exc, match=match):
        fn()
    for t, b in zip(tensors, before):
        assert torch.equal(bits(t), bits(b)), "a rejected call modified its arguments"


def test_paged_attention_refuses_two_widths(backend):
    layout, k_cache, v_cache, table, lens = paged_batch([5], 4, 1, 16, 8, torch.float32)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    out = torch.zeros(1, 4, 16)
    match = r"paged_attention reads K and V rows of one width, but k_cache holds rows of head_dim = 16 and v_cache " \
            r"rows of head_dim = 8"
    _unchanged([out], ValueError, match, lambda: kvcache.paged_attention(torch.randn(1, 4, 16), k_cache, v_cache,
                                                                          table, lens, cu, out=out))
    plan = kvcache.plan_step(k_cache, v_cache, table, lens, cu, q_heads=4)  # planning the storage side is fine
    _unchanged([out], ValueError, match, lambda: kvcache.paged_attention_planned(plan, torch.randn(1, 4, 16), k_cache,
                                                                                  v_cache, out=out))
    pool = kvcache.KVPool.allocate(4, 4, 1, 64, "int8", v_head_dim=32)
    with pytest.raises(ValueError, match=r"head_dim = 64 and v_cache rows of head_dim = 32"):
        pool.attention(torch.randn(1, 4, 64), table[:, :1], torch.tensor([1], dtype=torch.int32), cu)


@pytest.mark.parametrize("fmt, side, name, width, kind", [
    ("int4", "V", "v_head_dim", 24, "int4"), ("k=int4,v=int8", "K", "head_dim", 48, "int4"),
    ("kivi2", "V", "v_head_dim", 24, "kivi2"), ("k=kivi4,v=kivi2", "K", "head_dim", 48, "kivi4"),
])
def test_widths_a_format_cannot_take_are_refused(fmt, side, name, width, kind):
    k_dim, v_dim = (width, 32) if side == "K" else (64, width)
    with pytest.raises(ValueError, match=rf"{side} rows: {name}={width} must be a multiple of 32 for {kind} "
                                         rf"\({side.lower()}_format={kind} keeps its scales per 32 dims\)"):
        kvcache.KVPool.allocate(4, 16, 1, k_dim, fmt, v_head_dim=v_dim)
    with pytest.raises(ValueError, match=r"V rows: v_head_dim=24 cannot take v_format=int8\(hadamard\): "
                                         r"head_dim=24 must be a power of two"):
        kvcache.KVPool.allocate(4, 16, 1, 64, "k=int8,v=int8(hadamard)", v_head_dim=24)


def test_ops_name_the_side_width_and_format_of_bad_pools(backend):
    # the kernels' own checks, for callers that build pools themselves
    k_cache = torch.zeros(4, 1, 16, 32, dtype=torch.uint8)     # int4 K rows of 64 dims
    v_cache = torch.zeros(4, 1, 16, 12, dtype=torch.uint8)     # int4 V rows of 24 dims
    k_scale, v_scale = torch.zeros(4, 1, 16, 2, 2, dtype=torch.float16), torch.zeros(4, 1, 16, 1, 2, dtype=torch.float16)
    key, value = torch.randn(1, 1, 1, 64), torch.randn(1, 1, 1, 24)
    _unchanged([k_cache, v_cache, k_scale, v_scale], ValueError,
               r"v_cache holds head_dim = 24 \(2 x 12\), which int4 needs to be a multiple of 32",
               lambda: kvcache.append(key, value, k_cache, v_cache, torch.tensor([[0]]), k_scale=k_scale,
                                      v_scale=v_scale, k_format=4, v_format=4))
    rot_k, rot_v = torch.zeros(4, 1, 16, 64, dtype=torch.int8), torch.zeros(4, 1, 16, 24, dtype=torch.int8)
    scales = (torch.zeros(4, 1, 16), torch.zeros(4, 1, 16))
    _unchanged([rot_k, rot_v, *scales], ValueError,
               r"v_cache: head_dim = 24 must be a power of two \(2 to 1024\) for Hadamard-rotated formats \(v_format\)",
               lambda: kvcache.append(key, value, rot_k, rot_v, torch.tensor([[0]]), k_scale=scales[0],
                                      v_scale=scales[1], k_format=1, v_format=17))


def test_bad_shapes_name_both_widths(backend):
    layout = kvcache.PageLayout(4, 4, 2, 16, torch.float16, v_head_dim=8)
    k_cache, v_cache = layout.allocate(fill=0.0)
    key, value = torch.randn(1, 2, 3, 16).half(), torch.randn(1, 2, 3, 8).half()
    slots = torch.tensor([[0, 1, 2]])
    pools = [k_cache, v_cache]
    _unchanged(pools, ValueError, r"value.shape\[3\] = 16 must equal v_head_dim of the cache \(v_cache's rows\) = 8",
               lambda: kvcache.append(key, key, k_cache, v_cache, slots))
    _unchanged(pools, ValueError, r"key.shape\[3\] = 8 must equal head_dim of the cache = 16",
               lambda: kvcache.append(value, value, k_cache, v_cache, slots))
    _unchanged(pools, ValueError, r"value has shape \[1, 2, 2, 8\] but key has shape \[1, 2, 3, 16\]",
               lambda: kvcache.append(key, value[:, :, :2], k_cache, v_cache, slots))
    table, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    k_out, v_out = torch.full((1, 2, 4, 16), 5.0).half(), torch.full((1, 2, 4, 16), 5.0).half()
    _unchanged([k_out, v_out], ValueError,
               r"v_out.shape\[3\] = 16 must equal v_head_dim of the cache \(v_cache's rows\) = 8",
               lambda: kvcache.paged_gather(k_cache, v_cache, table, lens, out=(k_out, v_out)))
    _unchanged([k_out, v_out], ValueError, r"k_out has shape \[1, 2, 4, 16\] but v_out has shape \[1, 2, 3, 8\]",
               lambda: kvcache.paged_gather(k_cache, v_cache, table, lens,
                                            out=(k_out, torch.zeros(1, 2, 3, 8).half())))
    other_heads = torch.zeros(4, 1, 4, 8).half()
    _unchanged(pools, ValueError, r"k_cache has shape \[4, 2, 4, 16\] but v_cache has shape \[4, 1, 4, 8\]; the K "
                                  r"and V pools must match in \[num_blocks, num_kv_heads, page_size\]",
               lambda: kvcache.append(key, value[:, :1], k_cache, other_heads, slots))
    host = kvcache.PageLayout(4, 4, 2, 16, torch.float16, v_head_dim=16).allocate(fill=1.0)
    _unchanged(list(host), ValueError, r"src pools have V blocks of shape \[2, 4, 8\] but dst pools have V blocks "
                                       r"of shape \[2, 4, 16\]",
               lambda: kvcache.swap_blocks(k_cache, v_cache, *host, torch.tensor([[0, 1]])))


def test_prefix_cache_host_tier_moves_blocks_of_two_widths():
    alloc = kvcache.BlockAllocator(4, 4)
    device = kvcache.PageLayout(4, 4, 1, 16, torch.float32, v_head_dim=8).allocate(fill=0.0)
    host = kvcache.PageLayout(8, 4, 1, 16, torch.float32, v_head_dim=8).allocate(fill=0.0)
    cache = kvcache.PrefixCache(alloc, host_pools=host, device_pools=device)
    seq = alloc.sequence()
    alloc.append(seq, 8)
    device[0][seq.blocks.long()] = torch.randn(2, 1, 4, 16)
    device[1][seq.blocks.long()] = torch.randn(2, 1, 4, 8)
    k_saved, v_saved = device[0][seq.blocks.long()].clone(), device[1][seq.blocks.long()].clone()
    tokens = list(range(1, 9))
    cache.insert(tokens, seq)
    alloc.release(seq)
    cache.evict(4)  # to the host tier: the device blocks are free (and overwritten below)
    for t in device:
        t.fill_(-1.0)
    m = cache.match(tokens)
    assert m.length == 8
    assert torch.equal(device[0][m.blocks.long()], k_saved) and torch.equal(device[1][m.blocks.long()], v_saved)
    wrong = kvcache.PageLayout(8, 4, 1, 16, torch.float32, v_head_dim=16).allocate()
    with pytest.raises(ValueError, match=r"layer 0: V block shape \[1, 4, 16\] differs from \[1, 4, 8\]"):
        kvcache.PrefixCache(kvcache.BlockAllocator(4, 4), host_pools=wrong, device_pools=device)
