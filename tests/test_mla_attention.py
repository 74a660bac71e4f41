"""kvcache.mla_attention (absorbed multi-head latent attention over latent pages) against the float64 reference,
on every CPU build and on the CUDA kernel under the emulator; every storage format; opcheck; bad input."""

from __future__ import annotations

import pytest
import torch

import kvcache
from kvcache import reference as ref
from conftest import HAS_CUDA_EMULATION

# (format, latent width, rope width): DeepSeek-V3's is 512 / 64 (test_mla_attention_at_deepseek_v3_widths)
FORMATS = [
    (torch.float32, 64, 16), (torch.bfloat16, 64, 16), (torch.float16, 32, 8),
    ("int8", 64, 16), ("fp8_e4m3", 64, 16), ("fp8_e5m2", 32, 8), ("int4", 64, 32),
    ("k=int8,v=bf16", 64, 16), ("kivi4", 64, 32), ("k=kivi2,v=kivi4", 32, 32),
]


def cu_from(q_lens: list[int]) -> torch.Tensor:
    return torch.nn.functional.pad(torch.tensor(q_lens).cumsum(0), (1, 0)).to(torch.int32)


def mla_pool(lens: list[int], fmt, latent: int, rope: int, *, page: int = 16, kv_heads: int = 1,
             generator: torch.Generator | None = None):
    """A pool of latents (K rows) and rotary keys (V rows) holding `lens` tokens on shuffled pages; returns
    (pool, block_tables, seq_lens, dequantized K, dequantized V)."""
    pages = [-(-n // page) for n in lens]
    pool = kvcache.KVPool.allocate(sum(pages) + 3, page, kv_heads, latent, fmt, v_head_dim=rope)
    _poison(pool, slice(None), slice(None))  # blocks no sequence uses: NaN wherever the format can hold one
    perm = torch.randperm(pool.num_blocks, generator=generator)
    table = torch.zeros(len(lens), max(pages, default=0) + 1, dtype=torch.int32)
    start = 0
    for b, (n, p) in enumerate(zip(lens, pages)):
        table[b, :p] = perm[start:start + p].to(torch.int32)
        start += p
        if n == 0:
            continue
        padded = p * page  # whole pages (KIVI keys are written a page at a time); the tail is not read
        slots = (table[b, :p].to(torch.int64).view(-1, 1) * page + torch.arange(page)).view(1, -1)
        full = [t.dtype for t in (pool.k, pool.v) if t.is_floating_point()]  # K and V come in one dtype
        dtype = full[0] if full else torch.float32
        c = torch.randn(1, kv_heads, padded, latent, generator=generator).to(dtype)
        k_rope = torch.randn(1, kv_heads, padded, rope, generator=generator).to(dtype)
        pool.append(c, k_rope, slots)
        _poison(pool, table[b, p - 1].item(), slice(n - (p - 1) * page, None))  # past the sequence's end
    deq_k = ref.dequantize_pool(pool.k, pool.k_scale, pool.format.k.kernel_id)
    deq_v = ref.dequantize_pool(pool.v, pool.v_scale, pool.format.v.kernel_id)
    return pool, table, torch.tensor(lens, dtype=torch.int32), deq_k, deq_v


def _poison(pool, blocks, positions) -> None:
    """NaN into the rows (blocks, positions) of full-precision sides and the scales of int8 sides: a kernel that
    reads a row it should not turns its output NaN."""
    for role in ("k", "v"):
        codes, scale = getattr(pool, role), getattr(pool, f"{role}_scale")
        if codes.is_floating_point():
            codes[blocks, :, positions] = float("nan")
        elif getattr(pool.format, role).kind == "int8":
            scale[blocks, :, positions] = float("nan")


def check(pool, table, lens, q_lens, deq_k, deq_v, *, q_heads: int, dtype: torch.dtype, scale: float = 0.2,
          generator=None, strided: bool = False):
    """mla_attention vs float64 on the dequantized pages by the FlashAttention rule: at most twice the error of
    PyTorch in the query's dtype, plus the output's rounding; lse within fp32 rounding of float64's."""
    total = sum(q_lens)
    cu = cu_from(q_lens)
    q_latent = torch.randn(total, q_heads, pool.head_dim, generator=generator).to(dtype)
    q_rope = torch.randn(total, q_heads, pool.v_head_dim, generator=generator).to(dtype)
    if strided:  # the adapter's q_latent is a transposed bmm result; q_rope a slice of the model's query
        q_latent = q_latent.transpose(0, 1).contiguous().transpose(0, 1)
        q_rope = torch.cat([q_rope, q_rope], dim=-1)[..., : pool.v_head_dim]
    out, lse = pool.mla_attention(q_latent, q_rope, table, lens, cu, scale, return_lse=True)
    out64, lse64 = torch.zeros(q_latent.shape, dtype=torch.float64), torch.zeros(total, q_heads)
    ref.mla_attention(q_latent.double(), q_rope.double(), deq_k.double(), deq_v.double(), table, lens, cu, scale,
                      out64, lse64, compute_dtype=torch.float64)
    out_pt, lse_pt = torch.zeros_like(q_latent), torch.zeros(total, q_heads)
    ref.mla_attention(q_latent, q_rope, deq_k.to(dtype), deq_v.to(dtype), table, lens, cu, scale, out_pt, lse_pt,
                      compute_dtype=dtype)
    pt_err = (out_pt.double() - out64).abs().max().item() if total else 0.0
    noise = 2 * (out64.to(dtype).double() - out64).abs().max().item() if total else 0.0
    err = (out.double() - out64).abs().max().item() if total else 0.0
    assert err <= 2 * pt_err + noise + 1e-6, f"error {err:.3g} > 2 x {pt_err:.3g} + {noise:.3g}"
    torch.testing.assert_close(lse, lse64.float(), atol=1e-4 * max(1.0, lse64.abs().max().item()), rtol=1e-5)
    return out


@pytest.mark.parametrize("fmt,latent,rope", FORMATS, ids=[str(f[0]) for f in FORMATS])
def test_decode_and_prefill_mixed_every_format(isa, fmt, latent, rope):
    g = torch.Generator().manual_seed(1)
    kivi = "kivi" in str(fmt)
    lens = [48, 32, 64] if kivi else [37, 5, 70]
    pool, table, seq_lens, dk, dv = mla_pool(lens, fmt, latent, rope, generator=g)
    dtype = fmt if isinstance(fmt, torch.dtype) else torch.bfloat16 if "bf16" in str(fmt) else torch.float32
    check(pool, table, seq_lens, [1, 5, 20], dk, dv, q_heads=8, dtype=dtype, generator=g)


@pytest.mark.parametrize("page", [1, 4, 64])
@pytest.mark.parametrize("q_heads,kv_heads", [(16, 1), (8, 2), (3, 3)])
def test_pages_and_head_groups(isa, page, q_heads, kv_heads):
    g = torch.Generator().manual_seed(2)
    pool, table, lens, dk, dv = mla_pool([29, 66], torch.float32, 32, 16, page=page, kv_heads=kv_heads, generator=g)
    check(pool, table, lens, [3, 1], dk, dv, q_heads=q_heads, dtype=torch.float32, generator=g)


def test_long_decode_is_split_over_keys_and_merged(isa):
    # one sequence, 1,500 keys, one query: the CPU plan splits the keys over the threads (merge_weights)
    g = torch.Generator().manual_seed(3)
    pool, table, lens, dk, dv = mla_pool([1500], torch.bfloat16, 64, 16, generator=g)
    check(pool, table, lens, [1], dk, dv, q_heads=16, dtype=torch.bfloat16, generator=g)


def test_long_chunked_prefill(isa):
    g = torch.Generator().manual_seed(4)
    pool, table, lens, dk, dv = mla_pool([300, 257], torch.float32, 64, 16, generator=g)
    check(pool, table, lens, [140, 257], dk, dv, q_heads=4, dtype=torch.float32, generator=g)


def test_strided_queries_empty_sequences_and_empty_batch(isa):
    g = torch.Generator().manual_seed(5)
    pool, table, lens, dk, dv = mla_pool([20, 0, 9], torch.float16, 32, 8, generator=g)
    check(pool, table, lens, [2, 0, 9], dk, dv, q_heads=4, dtype=torch.float16, generator=g, strided=True)
    empty = pool.mla_attention(torch.empty(0, 4, 32, dtype=torch.float16), torch.empty(0, 4, 8, dtype=torch.float16),
                               table, lens, torch.zeros(4, dtype=torch.int32), 0.3)
    assert empty.shape == (0, 4, 32)


def test_deepseek_v3_widths(isa):
    # kv_lora_rank 512, qk_rope_head_dim 64, 16 of the 128 heads: the shapes the absorbed path runs in the model
    g = torch.Generator().manual_seed(6)
    for fmt in (torch.bfloat16, "int8"):
        pool, table, lens, dk, dv = mla_pool([300], fmt, 512, 64, page=64, generator=g)
        check(pool, table, lens, [1], dk, dv, q_heads=16, dtype=torch.bfloat16, scale=192 ** -0.5, generator=g)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("latent,rope,q_heads,kv_heads,strided", [(512, 64, 20, 1, False), (256, 32, 32, 2, True),
                                                                  (192, 48, 5, 1, False), (64, 16, 16, 1, True)])
def test_tensor_core_shapes(isa, dtype, latent, rope, q_heads, kv_heads, strided):
    """The calls the CUDA build runs on tensor cores (mla_mma_kernel: bf16 / fp16 pools of the query's dtype,
    latent a multiple of 64 up to 512, rope of 16 up to 64): head tiles of 16 (20 heads: a full tile and one of
    4), decode and chunked prefill, lengths off the 16-key stages, NaN past every sequence's end."""
    g = torch.Generator().manual_seed(10)
    pool, table, lens, dk, dv = mla_pool([37, 1, 80, 16], dtype, latent, rope, kv_heads=kv_heads, generator=g)
    check(pool, table, lens, [1, 1, 24, 16], dk, dv, q_heads=q_heads, dtype=dtype, scale=(latent + rope) ** -0.5,
          generator=g, strided=strided)


@pytest.mark.parametrize("fmt,latent,rope", [(torch.bfloat16, 576, 72), ("int8", 640, 96), (torch.float32, 33, 7),
                                              ("int8", 40, 8), ("fp8_e5m2", 520, 24)])
def test_wide_and_odd_rows(isa, fmt, latent, rope):
    """Rows wider than DeepSeek-V3's 512 / 64 (the CUDA kernel's wide shape: 1 head per warp, 4 keys per stage),
    odd widths and rows that are not whole 16-byte units (the CUDA kernel stages them value by value, padded to an
    even width), with more query heads than a CTA takes (12: a tile of 8 and a tile of 4)."""
    g = torch.Generator().manual_seed(9)
    pool, table, lens, dk, dv = mla_pool([21, 40], fmt, latent, rope, generator=g)
    dtype = fmt if isinstance(fmt, torch.dtype) else torch.bfloat16
    check(pool, table, lens, [1, 3], dk, dv, q_heads=12, dtype=dtype, generator=g)


def test_equals_the_expanded_attention_of_the_model():
    # the identity the adapter relies on: folding W_UK into the query and W_UV after the output gives the
    # attention of the expanded heads, k = [W_UK c | k_rope] and v = W_UV c
    g = torch.Generator().manual_seed(7)
    heads, nope, v_dim, rank, rope, n = 4, 16, 12, 32, 8, 23
    pool, table, lens, dk, dv = mla_pool([n], torch.float32, rank, rope, generator=g)
    c, k_rope = ref._gather_one(dk, dv, table[0], n)                       # [n, 1, rank], [n, 1, rope]
    w_uk, w_uv = torch.randn(heads, nope, rank, generator=g), torch.randn(heads, v_dim, rank, generator=g)
    q_nope, q_rope = torch.randn(1, heads, nope, generator=g), torch.randn(1, heads, rope, generator=g)
    q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
    o_latent = pool.mla_attention(q_latent, q_rope, table, lens, cu_from([1]), 0.25)
    got = torch.einsum("thr,hvr->thv", o_latent, w_uv)
    keys = torch.cat([torch.einsum("hnr,jr->jhn", w_uk, c[:, 0]), k_rope.expand(n, heads, rope)], dim=-1)
    values = torch.einsum("hvr,jr->jhv", w_uv, c[:, 0])
    want, _ = ref.attention(torch.cat([q_nope, q_rope], dim=-1), keys, values, 0.25, compute_dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_deterministic_and_isa_builds_agree():
    g = torch.Generator().manual_seed(8)
    pool, table, lens, _, _ = mla_pool([200, 40], torch.bfloat16, 64, 16, generator=g)
    q_l, q_r = torch.randn(3, 8, 64).bfloat16(), torch.randn(3, 8, 16).bfloat16()
    cu = cu_from([1, 2])
    first = pool.mla_attention(q_l, q_r, table, lens, cu, 0.2)
    assert torch.equal(first, pool.mla_attention(q_l, q_r, table, lens, cu, 0.2))


# ---- opcheck / compile -------------------------------------------------------------------------------
def _op_args(pool, table, lens, with_lse, q_heads=4):
    q_l = torch.randn(1 + 9, q_heads, pool.head_dim).to(torch.bfloat16)
    q_r = torch.randn(1 + 9, q_heads, pool.v_head_dim).to(torch.bfloat16)
    lse = torch.empty(10, q_heads) if with_lse else None
    kw = pool.op_kwargs()
    return (q_l, q_r, pool.k, pool.v, table, lens, cu_from([1, 9]), 0.125, torch.empty_like(q_l), lse,
            kw["k_scale"], kw["v_scale"], kw["k_format"], kw["v_format"])


@pytest.mark.parametrize("fmt", [torch.bfloat16, "int8"])
@pytest.mark.parametrize("with_lse", [False, True])
def test_opcheck(fmt, with_lse):
    pool, table, lens, _, _ = mla_pool([300, 9], fmt, 32, 16)
    torch.library.opcheck(torch.ops.kvcache.mla_attention.default, _op_args(pool, table, lens, with_lse))


@pytest.mark.skipif(not HAS_CUDA_EMULATION, reason="built without KVCACHE_CUDA_EMULATION=ON")
@pytest.mark.parametrize("with_lse", [False, True])
def test_opcheck_cuda_emulated(with_lse):
    pool, table, lens, _, _ = mla_pool([150, 9], "int8", 32, 16)
    torch.library.opcheck(torch.ops.kvcache_cuda_emulation.mla_attention.default,
                          _op_args(pool, table, lens, with_lse))


def test_compiles_fullgraph():
    pool, table, lens, _, _ = mla_pool([40], torch.float32, 32, 16)

    def f(q_l, q_r, k, v, table, lens, cu):
        out, lse = kvcache.mla_attention(q_l, q_r, k, v, table, lens, cu, 0.3, return_lse=True)
        return out.sum() + lse.sum()

    args = (torch.randn(2, 4, 32), torch.randn(2, 4, 16), pool.k, pool.v, table, lens, cu_from([2]))
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(*args), f(*args))


# ---- bad input -----------------------------------------------------------------------------------------
def test_bad_arguments_are_refused_and_leave_out_untouched(backend):
    pool, table, lens, _, _ = mla_pool([40, 9], "int8", 32, 16)
    q_l, q_r = torch.randn(10, 4, 32), torch.randn(10, 4, 16)
    cu = cu_from([1, 9])
    rotated = kvcache.KVPool.allocate(pool.num_blocks, 16, 1, 32, "int8(hadamard)", v_head_dim=16)

    def call(**kw):
        a = dict(q_latent=q_l, q_rope=q_r, k_cache=pool.k, v_cache=pool.v, block_tables=table, seq_lens=lens,
                 cu_q_lens=cu, scale=0.1, out=torch.full_like(q_l, 7.0), lse=None, **pool.op_kwargs())
        a.update(kw)
        out = a["out"]
        try:
            kvcache.ops._ops.mla_attention.default(*a.values())
        finally:
            assert out is q_l or out.eq(7.0).all() or out.shape != q_l.shape, "a rejected call wrote its output"

    cases = [
        (dict(seq_lens=torch.tensor([40, 5], dtype=torch.int32)), IndexError,
         r"sequence 1 has 9 queries \(cu_q_lens\) but seq_lens\[1\] = 5"),
        (dict(cu_q_lens=cu_from([2, 9])), IndexError, r"cu_q_lens\[2\] = 11 must equal q_latent.shape\[0\]"),
        (dict(q_latent=torch.randn(10, 4, 24)), ValueError,
         r"q_latent.shape\[2\] = 24 must equal the latent width of k_cache \(kv_lora_rank\) = 32"),
        (dict(q_rope=torch.randn(10, 4, 8)), ValueError,
         r"q_rope.shape\[2\] = 8 must equal the row width of v_cache \(qk_rope_head_dim\) = 16"),
        (dict(q_rope=torch.randn(9, 4, 16)), ValueError, r"q_rope has shape \[9, 4, 16\] but q_latent has \[10, 4, 32\]"),
        (dict(q_rope=torch.randn(10, 4, 16).double()), TypeError, r"q_rope must have dtype Float but has Double"),
        (dict(q_latent=torch.randn(10, 4, 32).double(), q_rope=torch.randn(10, 4, 16).double(),
              out=torch.full((10, 4, 32), 7.0, dtype=torch.float64)), TypeError, r"q_latent has dtype Double"),
        (dict(out=torch.full((10, 4, 16), 7.0)), ValueError, r"out has shape \[10, 4, 16\] but must be \[total_q, q_heads, kv_lora_rank\] = \[10, 4, 32\]"),
        (dict(out=torch.full((10, 4, 32), 7.0, dtype=torch.float16)), TypeError, r"out must have dtype Float but has Half"),
        (dict(out=q_l), ValueError, r"must not share memory with its inputs"),
        (dict(lse=torch.empty(10, 3)), ValueError, r"lse has shape \[10, 3\] but must be \[total_q, q_heads\] = \[10, 4\]"),
        (dict(scale=float("nan")), ValueError, r"scale = nan must be finite"),
        (dict(scale=1e39), ValueError, r"scale = 1e\+39 must be finite, and finite as float32"),
        (dict(k_format=0), TypeError, r"k_cache has dtype Char; a full-precision pool holds"),
        (dict(k_cache=rotated.k, v_cache=rotated.v, **rotated.op_kwargs()), ValueError,
         r"mla_attention does not read Hadamard-rotated pools; got k_format = 17"),
        (dict(seq_lens=torch.tensor([40, 9], dtype=torch.int64)), TypeError, r"seq_lens must have dtype Int"),
        (dict(block_tables=torch.full_like(table, 999)), IndexError, r"block_tables\[0, 0\] = 999 is not a block id"),
        (dict(seq_lens=torch.tensor([40, 900], dtype=torch.int32)), IndexError, r"seq_lens\[1\] = 900 needs 57 blocks"),
    ]
    for kwargs, exc, match in cases:
        with pytest.raises(exc, match=match):
            call(**kwargs)
    q3 = torch.randn(10, 3, 32), torch.randn(10, 3, 16)
    fmt_pool = kvcache.KVPool.allocate(4, 16, 2, 32, "int8", v_head_dim=16)
    with pytest.raises(ValueError, match=r"q_latent has 3 heads, which must be a positive multiple of the cache's num_kv_heads = 2"):
        kvcache.ops._ops.mla_attention.default(*q3, fmt_pool.k, fmt_pool.v, table[:, :2].clamp(max=3), lens.clamp(max=32), cu,
                                               0.1, torch.empty(10, 3, 32), None, **fmt_pool.op_kwargs())
