"""Bad values in K/V (issue #21): NaN, +-Inf and huge finite values handed to a quantizing append.

The contract (README, "Bad values"): a scale or zero point shared with other tokens is computed from
the finite values only, so every other token of the page, head or channel is stored bit for bit as if the bad
values were absent (as if they were 0 wherever a range holds both signs, as in most tests here); NaN stays NaN where the format can say so (fp8's NaN code; the token's own int8 row scale or
int4 / KIVI-value group scale), else it is stored as the code nearest 0 (KIVI keys); +-Inf saturates to the
largest code of its sign; huge finite values enter the scales, which never overflow their dtype. CPU kernel,
CUDA kernel (under the emulator) and reference agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import kvcache
from kvcache import quant
from kvcache import reference as ref
from kvcache.pool import format_id

P, H, D = 16, 2, 64
T, HEAD, DIMS = 5, 1, [3, 40]   # the bad elements: token T of the page, kv head HEAD, dims DIMS (groups 0 and 1)
BAD = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2", "int4", "kivi4", "kivi2", "k=kivi2,v=kivi4", "k=int8,v=int4",
           "int8(hadamard)", "int4(hadamard)", "fp8_e5m2(scale=0.01,hadamard)"]


def page_kv(in_dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """K and V of one page, [2, batch 1, H, P, D], signs in a checkerboard over (token, dim): every row, every
    group of 32 dims and every channel holds both signs, so replacing a value by 0 changes no range."""
    g = torch.Generator().manual_seed(seed)
    t, d = torch.arange(P).view(P, 1), torch.arange(D).view(1, D)
    sign = 1.0 - 2.0 * ((t + d) % 2).float()
    return ((torch.randn(2, 1, H, P, D, generator=g).abs() + 0.05) * sign).to(in_dtype)


def with_values(x: torch.Tensor, value: float) -> torch.Tensor:
    y = x.clone()
    y[:, 0, HEAD, T, DIMS] = value
    return y


def codes_of(pool: kvcache.KVPool, role: str) -> torch.Tensor:
    """The stored codes of K or V unpacked to one per dim: [blocks, heads, page, dim]."""
    f, t = getattr(pool.format, role), getattr(pool, role)
    if f.kind == "int4":
        return quant.unpack(t, 4)
    if f.kind.startswith("kivi"):
        return quant.unpack_planar(t, f.bits)
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so that NaN == NaN."""
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(bits(a.cpu()), bits(b.cpu()))


def filled(fmt: str, x: torch.Tensor, device: str = "cpu") -> kvcache.KVPool:
    """A 2-block pool with the page x in block 1 (block 0 stays unwritten)."""
    pool = kvcache.KVPool.allocate(2, P, H, D, fmt, device)
    pool.append(x[0].to(device), x[1].to(device), (P + torch.arange(P)).view(1, P).to(device))
    return pool


def reference_of(pool: kvcache.KVPool, x: torch.Tensor) -> kvcache.KVPool:
    """The same append by kvcache.reference (fp8: with the pool's per-head scales)."""
    expect = kvcache.KVPool.allocate(2, P, H, D, pool.format)
    for role in ("k", "v"):
        if getattr(expect, f"{role}_scale").dim() == 1:
            getattr(expect, f"{role}_scale").copy_(getattr(pool, f"{role}_scale").cpu())
    ref.append_quantized(x[0], x[1], expect.k, expect.v, (P + torch.arange(P)).view(1, P), expect.k_scale,
                         expect.v_scale, format_id(pool.format.k), format_id(pool.format.v))
    return expect


def assert_same_as_reference(pool: kvcache.KVPool, x: torch.Tensor) -> None:
    expect = reference_of(pool, x)
    for name in ("k", "v", "k_scale", "v_scale"):
        assert same(getattr(pool, name), getattr(expect, name)), f"{name} differs from the reference"


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_bad_token_leaves_the_others_bit_identical(backend, fmt, bad, in_dtype):
    x = page_kv(in_dtype)
    poisoned, clean = filled(fmt, with_values(x, BAD[bad])), filled(fmt, with_values(x, 0.0))
    assert_same_as_reference(poisoned, with_values(x, BAD[bad]))
    for role in ("k", "v"):
        f = getattr(poisoned.format, role)
        got, exp = codes_of(poisoned, role), codes_of(clean, role)
        got_s, exp_s = getattr(poisoned, f"{role}_scale"), getattr(clean, f"{role}_scale")
        # every other token, every other head: codes and metadata bit-identical (KIVI keys: the page's
        # per-channel scales and zeros; fp8: the per-head scales taken from this first append)
        others = torch.ones(P, dtype=torch.bool)
        others[T] = False
        assert torch.equal(got[1][:, others], exp[1][:, others]), f"{role}: another token's codes changed"
        assert torch.equal(got[1, 1 - HEAD], exp[1, 1 - HEAD])
        if f.kind.startswith("kivi") and role == "k" or f.kind.startswith("fp8"):
            assert same(got_s, exp_s), f"{role}: a shared scale changed"
        else:
            assert same(got_s[1][:, others], exp_s[1][:, others]) and same(got_s[1, 1 - HEAD], exp_s[1, 1 - HEAD])
        if f.hadamard:
            continue  # the bad token's own row is rotated: its NaN / Inf spreads over all its dims
        # the bad token itself: its other dims as if the bad values were 0, the bad ones as the contract says
        row_got, row_exp = got[1, HEAD, T], exp[1, HEAD, T]
        keep = torch.ones(D, dtype=torch.bool)
        keep[DIMS] = False
        assert torch.equal(row_got[keep], row_exp[keep])
        levels = (1 << f.bits) - 1
        if f.kind == "int8":
            want = {"nan": 0, "+inf": 127, "-inf": -127}[bad]
        elif f.kind.startswith("fp8"):
            top = 0x7E if f.kind == "fp8_e4m3" else 0x7B
            want = {"nan": 0x7F, "+inf": top, "-inf": 0x80 | top}[bad]
        else:
            want = {"+inf": levels, "-inf": 0}.get(bad)
            if want is None:  # NaN: the code nearest 0, i.e. the clean token's code
                want = int(row_exp[DIMS[0]])
                assert int(row_exp[DIMS[1]]) == int(row_got[DIMS[1]])
        assert int(row_got[DIMS[0]]) == want, f"{role}: {bad} stored as code {int(row_got[DIMS[0]])}, not {want}"
        if f.kind.startswith("fp8") or role == "k" and f.kind.startswith("kivi"):
            continue  # (their scales: checked above)
        s_got, s_exp = got_s[1, HEAD, T], exp_s[1, HEAD, T]
        if f.kind == "int8":  # the row's own scale: NaN for a NaN (the row reads back NaN), else unchanged
            assert s_got.isnan().item() if bad == "nan" else same(s_got, s_exp)
        else:  # int4, KIVI values: [groups, (scale, zero)]: the bad groups' scales NaN for a NaN
            groups = sorted({d // 32 for d in DIMS})
            assert same(s_got[:, 1], s_exp[:, 1])                     # zero points: the finite minimum
            for g in range(D // 32):
                if g in groups and bad == "nan":
                    assert s_got[g, 0].isnan()
                else:
                    assert same(s_got[g, 0], s_exp[g, 0])


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_bad_value_is_as_if_absent_where_a_range_excludes_0(backend, fmt, bad):
    """Values of one sign (every KIVI key channel's range excludes 0): the other tokens are stored as if the
    bad values were absent, i.e. bit for bit as with any finite values inside the others' range in their place
    (here: the next token's), not as if they were 0 (an outside-in probe: kivi2 / kivi4 keys)."""
    x = page_kv(torch.float32).abs() + 0.5
    inside = x.clone()
    inside[:, 0, HEAD, T, DIMS] = x[:, 0, HEAD, T + 1, DIMS]
    poisoned, clean = filled(fmt, with_values(x, BAD[bad])), filled(fmt, inside)
    others = torch.ones(P, dtype=torch.bool)
    others[T] = False
    for role in ("k", "v"):
        f = getattr(poisoned.format, role)
        got, exp = codes_of(poisoned, role), codes_of(clean, role)
        got_s, exp_s = getattr(poisoned, f"{role}_scale"), getattr(clean, f"{role}_scale")
        assert torch.equal(got[1][:, others], exp[1][:, others]), f"{role}: another token's codes changed"
        if f.kind.startswith("kivi") and role == "k" or f.kind.startswith("fp8"):
            assert same(got_s, exp_s), f"{role}: a shared scale changed"
        else:
            assert same(got_s[1][:, others], exp_s[1][:, others])


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "int4", "kivi4", "kivi2", "k=int8,v=int4"])
def test_gather_and_attention_over_the_other_tokens_unchanged(isa, fmt, bad):
    # (isa: every CPU attention build and the emulated CUDA kernels; append and gather run there too)
    x = page_kv(torch.float32, seed=1)
    rest = page_kv(torch.float32, seed=2)
    pools = []
    for value in (BAD[bad], 0.0):
        pool = filled(fmt, with_values(x, value))
        pool.append(rest[0], rest[1], torch.arange(P).view(1, P))   # block 0: a clean second page
        pools.append(pool)
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    lens = torch.tensor([2 * P], dtype=torch.int32)
    (kp, vp), (kc, vc) = (p.gather(table, lens) for p in pools)
    others = torch.ones(2 * P, dtype=torch.bool)
    others[T] = False
    assert same(kp[0, :, others], kc[0, :, others]) and same(vp[0, :, others], vc[0, :, others])
    assert same(kp[0, 1 - HEAD], kc[0, 1 - HEAD]) and same(vp[0, 1 - HEAD], vc[0, 1 - HEAD])
    if bad == "nan" and not fmt.startswith("kivi"):
        assert kp[0, HEAD, T].isnan().any()   # a NaN key stays NaN (int8: its row; int4: its group; fp8: itself)
    if bad != "nan":
        assert torch.isfinite(kp).all() and torch.isfinite(vp).all()   # +-Inf saturates
    # attention that cannot see the bad token: seq_len cut before it, and a decode query whose window starts after it
    q = torch.randn(1, 4, D)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    for lens, window in ((torch.tensor([T], dtype=torch.int32), -1), (lens, 2 * P - T - 2)):
        out_p, lse_p = pools[0].attention(q, table, lens, cu, window_left=window, return_lse=True)
        out_c, lse_c = pools[1].attention(q, table, lens, cu, window_left=window, return_lse=True)
        assert same(out_p, out_c) and same(lse_p, lse_c), f"attention with seq_len {lens.item()}, window {window}"


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3(hadamard)"])
def test_fp8_scale_from_the_first_tokens_ignores_bad_values(backend, fmt):
    x = page_kv(torch.float32, seed=3)
    pool = filled(fmt, with_values(x, float("nan")))
    assert torch.isfinite(pool.k_scale).all() and torch.isfinite(pool.v_scale).all()
    bad = with_values(x, float("inf"))
    pool_inf = filled(fmt, bad)
    assert torch.isfinite(pool_inf.k_scale).all()
    if "hadamard" not in fmt:   # (a rotated row with a bad value is bad all over, and so left out whole)
        clean = filled(fmt, with_values(x, 0.0))
        assert same(pool.k_scale, clean.k_scale) and same(pool_inf.v_scale, clean.v_scale)
    assert_same_as_reference(pool_inf, bad)
    if "hadamard" not in fmt:
        assert same(quant.fp8_scale_for(bad[0], fmt[4:8], dim=(0, 2, 3)), pool_inf.k_scale)


@pytest.mark.parametrize("bad", ["nan", "+inf", "-inf"])
@pytest.mark.parametrize("fmt", ["int8(hadamard)", "int4(hadamard)", "fp8_e4m3(hadamard)"])
def test_a_rotated_row_with_a_bad_value_reads_back_as_the_readme_says(backend, fmt, bad):
    """README, "Bad values", hadamard: a NaN row reads back NaN; a +-Inf row reads back as zeros (int8, int4: no
    finite value is left to scale it) or, for fp8, as a spike of the Inf's sign at its dim (an outside-in probe
    found the README claiming NaN for both)."""
    x = page_kv(torch.float32, seed=8)
    x[:, 0, HEAD, T, DIMS[0]] = BAD[bad]
    pool = filled(fmt, x)
    k, v = pool.gather(torch.tensor([[1]], dtype=torch.int32), torch.tensor([P], dtype=torch.int32))
    for got in (k[0, HEAD, T], v[0, HEAD, T]):
        if bad == "nan":
            assert got.isnan().all()
        elif fmt.startswith("fp8"):
            sign = 1.0 if bad == "+inf" else -1.0
            others = torch.ones(D, dtype=torch.bool)
            others[DIMS[0]] = False
            assert sign * got[DIMS[0]] > 10 * got[others].abs().max()
        else:
            assert torch.equal(got, torch.zeros_like(got))
    # every other token of the page reads back finite
    rest = torch.ones(P, dtype=torch.bool)
    rest[T] = False
    assert torch.isfinite(k[0, :, rest]).all() and torch.isfinite(v[0, :, rest]).all()


# ---- huge finite values --------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2", "int4", "kivi4", "kivi2", "int8(hadamard)"])
@pytest.mark.parametrize("in_dtype, huge", [(torch.float32, 3e38), (torch.float32, 1e6), (torch.bfloat16, 3e38),
                                            (torch.float16, 6e4), (torch.float16, 65504.0)])
def test_huge_values_enter_the_scales_without_overflow(backend, fmt, in_dtype, huge):
    x = page_kv(torch.float32, seed=4)
    x[:, 0, HEAD, T, DIMS[0]] = huge
    x[:, 0, HEAD, T + 1, DIMS[0]] = -huge
    x = x.to(in_dtype)
    assert torch.isfinite(x).all()
    pool = filled(fmt, x)
    assert_same_as_reference(pool, x)
    for role in ("k", "v"):
        s = getattr(pool, f"{role}_scale")
        assert torch.isfinite(s).all(), f"{role} scale overflowed: {s[~torch.isfinite(s)][:4].tolist()}"
    if "hadamard" in fmt:
        return  # (un)rotating a row sums its D values in fp32 first: values near FLT_MAX overflow there, not in a scale
    k, v = pool.gather(torch.tensor([[1]], dtype=torch.int32), torch.tensor([P], dtype=torch.int32))
    assert torch.isfinite(k).all() and torch.isfinite(v).all()
    f = pool.format.k
    h = float(x[0, 0, HEAD, T, DIMS[0]])
    # the huge value is real data: it sets the scale (fp16 metadata saturates at 65504: int4 and KIVI groups
    # hold values up to 65504 and saturate beyond; int8 and fp8 scales are float32)
    cap = h if not f.grouped else min(h, 65504.0)
    got = float(k[0, HEAD, T, DIMS[0]])
    tol = {"int8": 0.01, "fp8_e4m3": 0.07, "fp8_e5m2": 0.13}.get(f.kind, 0.01)
    assert abs(got - cap) <= tol * cap, f"{fmt}: {h:g} read back as {got:g}"
    if f.kind == "int8":
        assert pool.k_scale[1, HEAD, T].item() == pytest.approx(h / 127, rel=1e-6)


# ---- the residual window: pages sealed later ------------------------------------------------------------
@pytest.mark.parametrize("bad", ["nan", "+inf"])
@pytest.mark.parametrize("fmt", ["int8", "int4", "kivi4", "kivi2", "fp8_e4m3"])
def test_sealing_a_page_with_a_bad_token(backend, fmt, bad):
    # full-precision residual pages hold the bad value as given; when its page ages out of the window and is
    # sealed (quantized), the page's other tokens come out exactly as if the bad token held 0
    pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(7)
    total = 3 * P + 5
    t, d = torch.arange(total).view(total, 1), torch.arange(D).view(1, D)
    sign = 1.0 - 2.0 * ((t + d) % 2).float()   # a checkerboard over (token, dim), as page_kv's
    kv = (torch.randn(2, 1, H, total, D, generator=g).abs() + 0.05) * sign
    dense = []
    for value in (BAD[bad], 0.0):
        x = kv.clone()
        x[:, 0, HEAD, T, DIMS] = value
        cache = kvcache.PagedCache(kv_format=fmt, page_size=P, num_layers=1, residual_length=P)
        cache.update(x[0, :, :, :2 * P + 3], x[1, :, :, :2 * P + 3], 0)      # prefill: everything in full precision
        assert cache.store.residual.sealed_pages(cache.rows[0].blocks.tolist(), 2 * P + 3) == 0
        cache.update(x[0, :, :, 2 * P + 3:], x[1, :, :, 2 * P + 3:], 0)      # seals page 0, the bad token's
        assert cache.store.residual.sealed_pages(cache.rows[0].blocks.tolist(), total) == 1
        dense.append(cache._dense(0, torch.float32))
    (kp, vp), (kc, vc) = dense
    others = torch.ones(total, dtype=torch.bool)
    others[T] = False
    assert same(kp[0][:, others], kc[0][:, others]) and same(vp[0][:, others], vc[0][:, others])
    assert same(kp[0, 1 - HEAD], kc[0, 1 - HEAD])
    if bad == "nan" and fmt in ("int8", "int4", "fp8_e4m3"):
        assert kp[0, HEAD, T, DIMS].isnan().all() and vp[0, HEAD, T, DIMS].isnan().all()
    if bad != "nan":
        assert torch.isfinite(kp).all() and torch.isfinite(vp).all()


@pytest.mark.parametrize("fmt", ["kivi4", "kivi2"])
def test_kivi_pool_seals_a_page_with_a_nan_key(backend, fmt):
    # kvcache.KIVIPool: the open page in full precision keeps the NaN; sealed, the page's per-channel key scales
    # are the finite ones, so the NaN costs the other 15 tokens of its channels nothing
    x = page_kv(torch.float32, seed=5)
    stored = []
    for value in (float("nan"), 0.0):
        pool = kvcache.KIVIPool.allocate(4, P, H, D, fmt, dtype=torch.float32, residual_blocks=3)
        table = torch.arange(4, dtype=torch.int32).view(1, 4)
        y = with_values(x, value)
        pool.append(y[0], y[1], table, torch.tensor([P], dtype=torch.int32))
        k_open, _ = pool.gather(table, torch.tensor([P], dtype=torch.int32))
        assert k_open[0, HEAD, T, DIMS].isnan().all() == (value != value)
        one = torch.zeros(1, H, 1, D)
        pool.append(one, one, table, torch.tensor([P + 1], dtype=torch.int32))
        pool.append(one, one, table, torch.tensor([P + 2], dtype=torch.int32))   # seals page 0
        assert pool.sealed_pages(table, torch.tensor([P + 2], dtype=torch.int32)) == [1]
        stored.append((pool.sealed.k[0].clone(), pool.sealed.k_scale[0].clone(), pool.sealed.v[0].clone(),
                       pool.sealed.v_scale[0].clone()))
    (kp, ksp, vp, vsp), (kc, ksc, vc, vsc) = stored
    assert same(ksp, ksc), "the NaN entered the page's per-channel key scales"
    assert same(kp, kc)   # NaN keys are stored as the code nearest 0: the clean token's code
    keep = torch.ones(P, dtype=torch.bool)
    keep[T] = False
    assert same(vp[:, keep], vc[:, keep]) and same(vsp[:, keep], vsc[:, keep])
    assert vsp[HEAD, T, 0, 0].isnan() and vsp[HEAD, T, 1, 0].isnan()   # the value groups that held the NaN


# ---- full precision: stored as given -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_full_precision_stores_bad_values_as_given(backend, dtype):
    x = page_kv(dtype, seed=6)
    x[:, 0, HEAD, T, 0:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), torch.finfo(dtype).max])
    pool = filled(dtype, x)
    assert same(pool.k[1], x[0, 0]) and same(pool.v[1], x[1, 0])
