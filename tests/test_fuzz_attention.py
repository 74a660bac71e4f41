"""Property-based fuzzing of the attention ops (issue #21): paged_attention, plan_step, paged_attention_planned,
append_planned and merge_states, on the CPU kernels and the CUDA kernels under the emulator.

Properties as in test_fuzz_ops.py: an invalid call raises the library's error class naming the broken
argument and writes no pool and no output; a valid call matches kvcache.reference (attention within the
tolerance of tests/test_attention.py and conftest.attention_vs_reference: at most twice PyTorch's error in
the query's dtype, plus rounding), writes nothing to the pools, and the planned ops are bit-identical to the
one-call ops (and append_planned to append, hence to the reference).
"""

from __future__ import annotations

import os

import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcache import reference as ref
from kvcache.formats import CacheFormat

from conftest import CUDA_EMULATED, HAS_CUDA_EMULATION
from fuzz_support import (FORMAT_MUTATIONS, FULL, FUZZ, IN_DTYPES, QUANT, STRIDES, assert_unchanged, build_pool,
                          clone_pool, dequantized, expect_error, fmt_ids, format_kwargs, make_pool, mutate_formats,
                          op_namespace, pool_recipe, pool_tensors, record, same_bytes, snapshot, strided)

INDEX_MUTATIONS = ("table_high", "table_neg", "len_neg", "len_table", "q_gt_len", "cu_first", "cu_decreasing",
                   "cu_total", "cu_size", "table_dtype", "lens_dtype", "cu_dtype", "batch", "table_stride",
                   "lens_noncontig", "cu_noncontig")
CALL_MUTATIONS = ("q_heads", "q_dim", "q_dtype", "q_2d", "scale_nan", "window", "sinks", "softcap", "out_shape",
                  "out_dtype", "out_noncontig", "lse_shape", "lse_dtype", "lse_noncontig", "mixed_pool")
ATTENTION_MUTATIONS = INDEX_MUTATIONS + CALL_MUTATIONS + FORMAT_MUTATIONS


@st.composite
def attention_recipe(draw, mutations=ATTENTION_MUTATIONS, valid_weight=14):
    r = draw(pool_recipe(attention=True, max_slots=256, dims=(8, 24, 32, 40, 64)))
    r["batch"] = draw(st.integers(0, 3))
    r["cols"] = draw(st.integers(1, 3))
    r["lens"] = [draw(st.integers(0, r["cols"] * r["page"])) for _ in range(r["batch"])]
    r["q_lens"] = [draw(st.integers(0, min(n, 4))) for n in r["lens"]]
    r["group"] = draw(st.integers(1, 3))
    r["q_dtype"] = draw(st.sampled_from(IN_DTYPES))
    r["q_stride"] = draw(st.sampled_from(STRIDES))
    r["window"] = draw(st.sampled_from([-1, -1, 0, 1, 5, 40]))
    r["sinks"] = draw(st.sampled_from([0, 0, 1, 4]))
    fmt = CacheFormat.parse(r["fmt"].replace("full", r["full_dtype"]))
    r["softcap"] = draw(st.sampled_from([0.0, 0.0, 5.0, 30.0]))
    r["scale"] = draw(st.sampled_from([None, None, 0.05, 0.5, 2.0]))
    r["lse"] = draw(st.booleans())
    r["table_stride"] = draw(st.sampled_from(("contiguous", "offset", "outer")))
    r["mutation"] = draw(st.sampled_from(("valid",) * valid_weight + mutations))
    r["role"] = draw(st.sampled_from("kv"))
    r["pick"] = draw(st.integers(0, 2**16))
    return r


def attention_inputs(r, pool):
    """table, seq_lens, cu_q_lens, query, out, lse of a recipe (valid), and the query's scale."""
    g = torch.Generator().manual_seed(r["seed"] + 11)
    table = torch.randint(0, pool.num_blocks, (r["batch"], r["cols"]), generator=g, dtype=torch.int32)
    for b, n in enumerate(r["lens"]):
        table[b, -(-n // r["page"]):] = torch.tensor([-1, pool.num_blocks, 2**31 - 1])[b % 3]  # never read
    lens = torch.tensor(r["lens"], dtype=torch.int32)
    cu = torch.tensor([0] + list(torch.tensor(r["q_lens"], dtype=torch.int64).cumsum(0).tolist()), dtype=torch.int32)
    q_heads = r["heads"] * r["group"]
    q = strided(torch.randn(int(cu[-1]), q_heads, r["dim"], generator=g).to(FULL[r["q_dtype"]]), r["q_stride"])
    out = torch.full(q.shape, 3.0, dtype=q.dtype)
    lse = torch.full(q.shape[:2], 3.0) if r["lse"] else None
    scale = r["scale"] if r["scale"] is not None else r["dim"] ** -0.5
    return table, lens, cu, q, out, lse, scale


def mutate_indices(m, r, pool, table, lens, cu, pick):
    """Breaks one index tensor in place or by replacement; returns (table, lens, cu, exc, names) or None."""
    batch, page = r["batch"], r["page"]
    cells = [(b, c) for b, n in enumerate(r["lens"]) for c in range(-(-n // page))]
    with_q = [b for b in range(batch) if r["q_lens"][b] > 0]
    if m == "table_high" and cells:
        table[cells[pick % len(cells)]] = pool.num_blocks + pick % 3
        return table, lens, cu, IndexError, ["block_tables"]
    if m == "table_neg" and cells:
        table[cells[pick % len(cells)]] = -1 - pick % 3
        return table, lens, cu, IndexError, ["block_tables"]
    if m == "len_neg" and batch:
        lens[pick % batch] = -1 - pick % 3
        return table, lens, cu, IndexError, ["seq_lens"]
    if m == "len_table" and batch:
        lens[pick % batch] = r["cols"] * page + 1 + pick % 3
        return table, lens, cu, IndexError, ["seq_lens"]
    if m == "q_gt_len" and with_q:
        b = with_q[pick % len(with_q)]
        lens[b] = r["q_lens"][b] - 1
        return table, lens, cu, IndexError, ["seq_lens", "cu_q_lens"]
    if m == "cu_first":
        cu = cu.clone()
        cu[0] = 1 + pick % 3
        return table, lens, cu, IndexError, ["cu_q_lens"]
    if m == "cu_decreasing" and batch >= 2 and int(cu[1]) > 0:
        cu = cu.clone()
        cu[2] = cu[1] - 1
        return table, lens, cu, IndexError, ["cu_q_lens"]
    if m == "cu_total" and batch:
        cu = cu.clone()
        cu[-1] += 1 + pick % 2
        return table, lens, cu, IndexError, ["cu_q_lens"]
    if m == "cu_size":
        cu = torch.cat([cu, cu[-1:]]) if pick % 2 or batch == 0 else cu[:-1]
        return table, lens, cu, ValueError, ["cu_q_lens"]
    if m == "table_dtype":
        return table.long(), lens, cu, TypeError, ["block_tables"]
    if m == "lens_dtype":
        return table, lens.long(), cu, TypeError, ["seq_lens"]
    if m == "cu_dtype":
        return table, lens, cu.long(), TypeError, ["cu_q_lens"]
    if m == "batch":
        return torch.cat([table, table[:1] if batch else table.new_zeros(1, r["cols"])]), lens, cu, ValueError, \
            ["block_tables"]
    if m == "table_stride" and r["cols"] >= 2 and batch >= 1:
        return strided(table, "sliced"), lens, cu, ValueError, ["block_tables"]
    return None


def check_attention(r, pool, table, lens, cu, q, out, lse, scale):
    """out / lse against float64 attention over the values the pool stands for (conftest's rule)."""
    deq_k, deq_v = dequantized(pool)
    window, sinks, softcap = r["window"], r["sinks"], r["softcap"]
    out64, lse64 = torch.zeros(q.shape, dtype=torch.float64), torch.full(q.shape[:2], float("-inf"))
    ref.paged_attention(q.double(), deq_k.double(), deq_v.double(), table, lens, cu, scale, window, sinks, softcap,
                        out64, lse64, compute_dtype=torch.float64)
    out_pt, lse_pt = torch.zeros_like(q), torch.full(q.shape[:2], float("-inf"))
    ref.paged_attention(q, deq_k.to(q.dtype), deq_v.to(q.dtype), table, lens, cu, scale, window, sinks, softcap,
                        out_pt, lse_pt, compute_dtype=q.dtype)
    assert not out.isnan().any(), "NaN in the output: a read out of bounds?"
    if q.numel():
        pt_err = (out_pt.double() - out64).abs().max().item()
        noise = 2 * (out64.to(q.dtype).double() - out64).abs().max().item()
        err = (out.double() - out64).abs().max().item()
        # + the fp32 rounding of the Hadamard rotation of the query and output (test_quantized.py's 2e-5)
        # and of codes dequantized in registers in another order than the reference's (fp32: ~2e-6 seen)
        slack = 2e-5 if pool.format.k.hadamard or pool.format.v.hadamard else 1e-5 if pool.format.k.quantized else 1e-6
        assert err <= 2 * pt_err + noise + slack, \
            f"attention error {err:.3g} > 2 x PyTorch's {pt_err:.3g} + {noise:.3g} + {slack:g}"
    if lse is not None and lse.numel():
        finite = torch.isfinite(lse64)
        assert torch.equal(torch.isfinite(lse), finite), "lse is -inf exactly where no key is visible"
        lse_err = (lse[finite].double() - lse64[finite].double()).abs().max().item() if finite.any() else 0.0
        lse_pt_err = (lse_pt[finite].double() - lse64[finite].double()).abs().max().item() if finite.any() else 0.0
        assert lse_err <= 2 * lse_pt_err + 2e-3, f"lse error {lse_err:.3g} > 2 x {lse_pt_err:.3g} + 2e-3"


def mutate_call(m, r, pool, q, out, lse, scale, kw, pick):
    """Breaks one non-index argument of an attention call; returns (changes dict, exc, names) or None."""
    window, sinks, softcap = r["window"], r["sinks"], r["softcap"]
    d = {}
    if m == "q_heads":
        bad = r["heads"] * r["group"] + 1 if r["heads"] > 1 else 0
        d["q"] = torch.randn(q.shape[0], bad, q.shape[2]).to(q.dtype)
        d["out"] = torch.zeros(d["q"].shape, dtype=q.dtype)
        d["lse"] = torch.zeros(d["q"].shape[:2]) if lse is not None else None
        return d, ValueError, ["query"]
    if m == "q_dim":
        d["q"] = torch.randn(q.shape[0], q.shape[1], q.shape[2] + 1).to(q.dtype)
        d["out"] = torch.zeros(d["q"].shape, dtype=q.dtype)
        return d, ValueError, ["query"]
    if m == "q_dtype":
        d["q"], d["out"] = q.double(), out.double()
        return d, TypeError, ["query"]
    if m == "q_2d":
        d["q"] = q[..., 0]
        return d, ValueError, ["query"]
    if m == "scale_nan":
        d["scale"] = [float("nan"), float("inf"), -float("inf")][pick % 3]
        return d, ValueError, ["scale"]
    if m == "window":
        d["window"] = -2 - pick % 5
        return d, ValueError, ["window_left"]
    if m == "sinks":
        d["sinks"] = -1 - pick % 5
        return d, ValueError, ["sink_tokens"]
    if m == "softcap":
        d["softcap"] = [-1.0, float("inf"), float("nan")][pick % 3]
        return d, ValueError, ["softcap"]
    if m == "out_shape":
        d["out"] = torch.zeros(q.shape[0] + 1, *q.shape[1:], dtype=q.dtype)
        return d, ValueError, ["out"]
    if m == "out_dtype":
        d["out"] = out.to(torch.float32 if out.dtype != torch.float32 else torch.bfloat16)
        return d, TypeError, ["out"]
    if m == "out_noncontig" and not strided(out, "sliced").is_contiguous():
        d["out"] = strided(out, "sliced")
        return d, ValueError, ["out"]
    if m == "lse_shape":
        d["lse"] = torch.zeros(q.shape[0], q.shape[1] + 1)
        return d, ValueError, ["lse"]
    if m == "lse_dtype":
        d["lse"] = torch.zeros(q.shape[:2], dtype=torch.float64)
        return d, TypeError, ["lse"]
    if m == "lse_noncontig" and not strided(torch.zeros(q.shape[:2]), "sliced").is_contiguous():
        d["lse"] = strided(torch.zeros(q.shape[:2]), "sliced")
        return d, ValueError, ["lse"]
    if m == "mixed_pool":
        fmt = CacheFormat.parse(r["fmt"].replace("full", r["full_dtype"]))
        if fmt.k.kind.startswith("kivi"):
            other = "int8"  # kivi K with per-row V
        elif fmt.k.quantized:
            other = "full"
        else:
            other = QUANT[pick % 4]
        text = f"k={r['fmt'] if not fmt.k.quantized else str(fmt.k)},v={other}"
        bad = make_pool(text, pool.num_blocks, pool.page_size, pool.num_kv_heads, pool.head_dim, 1, r["full_dtype"])
        d["pool"] = bad
        d["kw"] = bad.op_kwargs()
        return d, ValueError, ["k_format", "v_format"]
    if m in FORMAT_MUTATIONS:
        res = mutate_formats(m, r["role"], pool, kw, lambda lo, hi: lo + pick % (hi - lo + 1))
        if res is not None:
            d["k_cache"], d["v_cache"], d["kw"], exc, names = res
            return d, exc, names
    return None


@FUZZ
@given(attention_recipe())
def test_fuzz_paged_attention(r):
    pool = build_pool(r)
    kw = format_kwargs(pool)
    table, lens, cu, q, out, lse, scale = attention_inputs(r, pool)
    m, pick = r["mutation"], r["pick"]
    window, sinks, softcap = r["window"], r["sinks"], r["softcap"]
    k_cache, v_cache = pool.k, pool.v
    expected = None
    if m in INDEX_MUTATIONS:
        res = mutate_indices(m, r, pool, table, lens, cu, pick)
        if res is not None:
            table, lens, cu, exc, names = res
            expected = exc, names
        elif m == "lens_noncontig" and r["batch"] >= 2:
            lens = strided(lens, "sliced")
            expected = ValueError, ["seq_lens"]
        elif m == "cu_noncontig" and r["batch"] >= 1:  # cu_q_lens of one element is contiguous at any stride
            cu = strided(cu, "sliced")
            expected = ValueError, ["cu_q_lens"]
    else:
        res = mutate_call(m, r, pool, q, out, lse, scale, kw, pick)
        if res is not None:
            d, exc, names = res
            q, out, lse, scale = d.get("q", q), d.get("out", out), d.get("lse", lse), d.get("scale", scale)
            window, sinks, softcap = d.get("window", window), d.get("sinks", sinks), d.get("softcap", softcap)
            if "pool" in d:
                pool = d["pool"]
                k_cache, v_cache = pool.k, pool.v
            k_cache, v_cache, kw = d.get("k_cache", k_cache), d.get("v_cache", v_cache), d.get("kw", kw)
            expected = exc, names
    table_v = strided(table, r["table_stride"]) if table.stride(-1) == 1 or table.shape[-1] <= 1 else table
    op = op_namespace(r["backend"]).paged_attention.default
    args = (q, k_cache, v_cache, table_v, lens, cu, scale, window, sinks, softcap, out, lse, kw["k_scale"],
            kw["v_scale"], kw["k_format"], kw["v_format"])
    tensors = pool_tensors(pool) + [k_cache, v_cache, out, lse]
    if expected is not None:
        record("paged_attention", r, m)
        with expect_error(*expected, tensors):
            op(*args)
        return
    record("paged_attention", {**r, "mutation": "valid"}, "valid")
    before = snapshot(pool_tensors(pool))
    op(*args)
    assert_unchanged(pool_tensors(pool), before, "paged_attention wrote its pool:")
    check_attention(r, pool, table, lens, cu, q, out, lse, scale)


# ---- plan_step, paged_attention_planned, append_planned ---------------------------------------------------
PLAN_MUTATIONS = INDEX_MUTATIONS[:-2] + ("q_heads_arg", "slot_high", "slot_dup", "slot_dtype", "slot_kivi")
PLANNED_MUTATIONS = ("plan_query", "plan_page", "plan_dim", "plan_heads", "plan_format", "plan_blocks",
                     "plan_host_cut", "plan_host_dtype", "plan_device_cut", "plan_backend", "plan_no_slots",
                     "plan_key_shape", "plan_corrupt") + CALL_MUTATIONS[:-1]


def step_slots(r, pool, table, lens):
    """The slot_mapping [batch, q_len] of each sequence's last q_len tokens (the step's own): -1 past q_len."""
    width = max(r["q_lens"], default=0)
    page = r["page"]
    slots = torch.full((r["batch"], width), -1, dtype=torch.int64)
    for b, (n, ql) in enumerate(zip(r["lens"], r["q_lens"])):
        for i, pos in enumerate(range(n - ql, n)):
            slots[b, i] = int(table[b, pos // page]) * page + pos % page
    return slots


@st.composite
def plan_recipe(draw):
    r = draw(attention_recipe(mutations=PLAN_MUTATIONS + PLANNED_MUTATIONS, valid_weight=10))
    r["with_slots"] = draw(st.booleans())
    r["index_stride"] = draw(st.sampled_from(STRIDES))
    return r


def distinct_blocks_table(r, pool, g):
    """A table whose rows use distinct blocks (a step's appends must not write one slot twice)."""
    table = torch.full((r["batch"], r["cols"]), -1, dtype=torch.int32)
    free = torch.randperm(pool.num_blocks, generator=g).tolist()
    for b, n in enumerate(r["lens"]):
        for c in range(-(-n // r["page"])):
            table[b, c] = free.pop() if free else -1
    return table


@FUZZ
@given(plan_recipe())
def test_fuzz_plan_step_and_planned_ops(r):
    g = torch.Generator().manual_seed(r["seed"] + 12)
    pages_needed = sum(-(-n // r["page"]) for n in r["lens"])
    if pages_needed > r["blocks"]:  # the step's rows need their own blocks: grow the pool
        r = {**r, "blocks": pages_needed}
    pool = build_pool(r)
    kw = format_kwargs(pool)
    _, lens, cu, q, out, lse, scale = attention_inputs(r, pool)
    table = distinct_blocks_table(r, pool, g)
    kivi = pool.format.k.kind.startswith("kivi")
    slots = step_slots(r, pool, table, lens) if r["with_slots"] and not kivi else None
    if kivi and r["with_slots"]:
        # kivi keys are written whole pages: each sequence appends its last whole page (if it has one)
        page = r["page"]
        slots = torch.full((r["batch"], page), -1, dtype=torch.int64)
        for b, n in enumerate(r["lens"]):
            if n >= page and n % page == 0:
                slots[b] = int(table[b, n // page - 1]) * page + torch.arange(page)
    m, pick = r["mutation"], r["pick"]
    ns = op_namespace(r["backend"])
    q_heads = q.shape[1]
    window, sinks, softcap = r["window"], r["sinks"], r["softcap"]
    plan_tensors = pool_tensors(pool)

    # -- plan_step itself
    expected = None
    if m in PLAN_MUTATIONS:
        res = mutate_indices(m, r, pool, table, lens, cu, pick)
        if res is not None:
            table, lens, cu, exc, names = res
            if m == "cu_total":  # plan_step takes the step's query count from cu_q_lens: valid, unless...
                res = None
            else:
                expected = exc, names
        elif m == "q_heads_arg":
            q_heads = [0, -r["heads"], r["heads"] * r["group"] + 1 if r["heads"] > 1 else 0][pick % 3]
            expected = ValueError, ["q_heads"]
        elif m == "slot_high" and slots is not None and slots.numel():
            slots.view(-1)[pick % slots.numel()] = pool.num_blocks * r["page"] + pick % 3
            expected = IndexError, ["slot_mapping"]
        elif m == "slot_dup" and slots is not None and int((slots >= 0).sum()) >= 1 and slots.numel() >= 2 \
                and not kivi:
            flat = slots.view(-1)
            i = int((flat >= 0).nonzero()[pick % int((flat >= 0).sum())])
            flat[(i + 1) % flat.numel()] = flat[i]
            expected = IndexError, ["slot_mapping"]
        elif m == "slot_dtype" and slots is not None:
            slots = slots.int()
            expected = TypeError, ["slot_mapping"]
        elif m == "slot_kivi" and slots is not None and kivi and r["page"] > 1 and int((slots >= 0).sum()):
            flat = slots.view(-1)
            flat[int((flat >= 0).nonzero()[0])] = -1
            expected = ValueError, ["slot_mapping"]
    # plan_step reads the indices on the host once: any strides
    idx = [strided(t, r["index_stride"]) if t is not None and t.dim() >= 1 else t for t in (lens, cu)]
    table_v = strided(table, r["table_stride"]) if table.stride(-1) == 1 or table.shape[-1] <= 1 else table
    slots_v = strided(slots, r["index_stride"]) if slots is not None else None
    plan_args = (pool.k, pool.v, table_v, idx[0], idx[1], slots_v, q_heads, kw["k_scale"], kw["v_scale"],
                 kw["k_format"], kw["v_format"])
    if expected is not None:
        record("plan_step", r, m)
        with expect_error(*expected, plan_tensors):
            ns.plan_step.default(*plan_args)
        return
    if m == "cu_total":
        return  # changed the step's query count (valid for plan_step, but not this recipe's query)
    before = snapshot(plan_tensors)
    plan_host, plan_device = ns.plan_step.default(*plan_args)
    assert_unchanged(plan_tensors, before, "plan_step wrote a pool:")
    record("plan_step", {**r, "mutation": "valid" if m not in PLAN_MUTATIONS else m}, "valid")

    # -- the planned ops, on that plan
    key = torch.randn(*(slots.shape[:1] if slots is not None else (0,)), r["heads"],
                      slots.shape[1] if slots is not None else 0, r["dim"], generator=g)
    key = key.to(pool.k.dtype if pool.k.is_floating_point() else FULL[r["q_dtype"]])
    value = torch.randn(key.shape, generator=g).to(key.dtype)
    k_cache, v_cache = pool.k, pool.v
    ph, pd = plan_host, plan_device
    target = "paged_attention_planned"
    expected = None
    if m in PLANNED_MUTATIONS:
        res = None
        if m == "plan_query" and q.shape[0] >= 0:
            q = torch.randn(q.shape[0] + 1, *q.shape[1:]).to(q.dtype)
            out = torch.zeros(q.shape, dtype=q.dtype)
            lse = torch.zeros(q.shape[:2]) if lse is not None else None
            expected = ValueError, ["query"]
        elif m in ("plan_page", "plan_dim", "plan_heads", "plan_blocks"):
            page = r["page"] * 2 if r["page"] < 256 else 128
            dims = {"plan_page": (pool.num_blocks, page, pool.num_kv_heads, pool.head_dim),
                    "plan_dim": (pool.num_blocks, pool.page_size, pool.num_kv_heads, pool.head_dim * 2),
                    "plan_heads": (pool.num_blocks, pool.page_size, pool.num_kv_heads + 1, pool.head_dim),
                    "plan_blocks": (0, pool.page_size, pool.num_kv_heads, pool.head_dim)}[m]
            need = plan_needs_blocks(table, lens, slots, r["page"])
            if m != "plan_blocks" or need > 0:
                other = make_pool(r["fmt"], *dims, r["seed"], r["full_dtype"])
                if m == "plan_blocks":
                    other = make_pool(r["fmt"], need - 1, *dims[1:], r["seed"], r["full_dtype"])
                if m == "plan_heads":
                    q = torch.randn(q.shape[0], other.num_kv_heads * r["group"], q.shape[2]).to(q.dtype)
                    out = torch.zeros(q.shape, dtype=q.dtype)
                    lse = torch.zeros(q.shape[:2]) if lse is not None else None
                if m == "plan_dim":
                    q = torch.randn(*q.shape[:2], other.head_dim).to(q.dtype)
                    out = torch.zeros(q.shape, dtype=q.dtype)
                target = "append_planned" if pick % 2 and slots is not None and m != "plan_heads" else target
                if target == "append_planned":
                    key = torch.randn(*key.shape[:3], other.head_dim).to(key.dtype)
                    value = key.clone()
                pool, k_cache, v_cache, kw = other, other.k, other.v, other.op_kwargs()
                expected = (IndexError if m == "plan_blocks" else ValueError), ["pools"]
        elif m == "plan_format":
            fmt = CacheFormat.parse(r["fmt"].replace("full", r["full_dtype"]))
            if fmt.k.quantized and not fmt.k.kind.startswith("kivi") and r["dim"] & (r["dim"] - 1) == 0:
                other_text = "int8(hadamard)" if str(fmt.k) != "int8(hadamard)" else "int8"
                other_text = f"k={other_text},v={fmt.v}"
                other = make_pool(other_text, pool.num_blocks, r["page"], r["heads"], r["dim"], 3)
                if other.k.shape == pool.k.shape and other.v.shape == pool.v.shape:
                    pool, k_cache, v_cache, kw = other, other.k, other.v, other.op_kwargs()
                    expected = ValueError, ["k_format"]
        elif m == "plan_host_cut":
            ph = plan_host[:-8] if pick % 2 else plan_host[:8]
            expected = ValueError, ["plan_host"]
        elif m == "plan_host_dtype":
            ph = plan_host.to(torch.int32)
            expected = ValueError, ["plan_host"]
        elif m == "plan_device_cut" and plan_device.numel():
            pd = plan_device[:-1]
            expected = ValueError, ["plan_device"]
        elif m == "plan_backend" and HAS_CUDA_EMULATION:
            other_ns = op_namespace("ops" if r["backend"] == CUDA_EMULATED else CUDA_EMULATED)
            ph, pd = other_ns.plan_step.default(*plan_args)
            expected = ValueError, ["plan"]
        elif m == "plan_no_slots" and slots is not None and key.shape[0] * key.shape[2] > 0:
            ph, pd = ns.plan_step.default(pool.k, pool.v, table_v, idx[0], idx[1], None, q_heads, kw["k_scale"],
                                          kw["v_scale"], kw["k_format"], kw["v_format"])
            target = "append_planned"
            expected = ValueError, ["slot_mapping"]
        elif m == "plan_key_shape" and slots is not None:
            key = torch.randn(key.shape[0] + 1, *key.shape[1:]).to(key.dtype)
            value = key.clone()
            target = "append_planned"
            expected = ValueError, ["key"]
        elif m == "plan_corrupt":
            ph = plan_host.clone()
            ph[:8] = 0
            expected = ValueError, ["plan_host"]
        elif m in CALL_MUTATIONS:
            res = mutate_call(m, r, pool, q, out, lse, scale, kw, pick)
            if res is not None:
                d, exc, names = res
                q, out, lse, scale = d.get("q", q), d.get("out", out), d.get("lse", lse), d.get("scale", scale)
                window, sinks, softcap = d.get("window", window), d.get("sinks", sinks), d.get("softcap", softcap)
                k_cache, v_cache, kw = d.get("k_cache", k_cache), d.get("v_cache", v_cache), d.get("kw", kw)
                if m in FORMAT_MUTATIONS and pick % 2 and slots is not None:
                    target = "append_planned"
                # a format or pool change is also a plan mismatch: named as the format or the pools
                names = names + (["pools", "plan"] if m in FORMAT_MUTATIONS else [])
                expected = exc, names
        if expected is not None and m == "plan_query" and slots is not None and pick % 2:
            target = "append_planned"
            expected = None  # the query is not an argument of append_planned: that call is valid
            q, out, lse = q[:-1], out[:-1], (lse[:-1] if lse is not None else None)
    attend = lambda: ns.paged_attention_planned.default(  # noqa: E731
        q, k_cache, v_cache, ph, pd, scale, window, sinks, softcap, out, lse, kw["k_scale"], kw["v_scale"],
        kw["k_format"], kw["v_format"])
    append = lambda: ns.append_planned.default(  # noqa: E731
        key, value, k_cache, v_cache, ph, pd, kw["k_scale"], kw["v_scale"], kw["k_format"], kw["v_format"])
    tensors = pool_tensors(pool) + [k_cache, v_cache, out, lse]
    if expected is not None:
        record(target, r, m)
        with expect_error(*expected, tensors):
            (append if target == "append_planned" else attend)()
        return
    # valid: planned attention is bit-identical to the one-call op, which matches the reference
    record("paged_attention_planned", {**r, "mutation": "valid"}, "valid")
    before = snapshot(pool_tensors(pool))
    attend()
    assert_unchanged(pool_tensors(pool), before, "paged_attention_planned wrote its pool:")
    want_out = torch.full(q.shape, 3.0, dtype=q.dtype)
    want_lse = torch.full(q.shape[:2], 3.0) if lse is not None else None
    ns.paged_attention.default(q, pool.k, pool.v, table, lens.contiguous(), cu.contiguous(), scale, window, sinks,
                               softcap, want_out, want_lse, kw["k_scale"], kw["v_scale"], kw["k_format"],
                               kw["v_format"])
    assert same_bytes(out, want_out), "paged_attention_planned differs from paged_attention"
    assert same_bytes(lse, want_lse), "paged_attention_planned's lse differs from paged_attention's"
    check_attention(r, pool, table, lens, cu, q, out, lse, scale)
    if slots is None:
        return
    record("append_planned", {**r, "mutation": "valid"}, "valid")
    want = clone_pool(pool)
    ks, vs = fmt_ids(pool.format)
    ref.append_quantized(key, value, want.k, want.v, slots, want.k_scale, want.v_scale, ks, vs)
    append()
    for name, got, exp in zip(("k", "v", "k_scale", "v_scale"), pool_tensors(pool), pool_tensors(want)):
        assert same_bytes(got, exp), f"append_planned wrote {name} differently from the reference"


def plan_needs_blocks(table, lens, slots, page) -> int:
    need = 0
    for b, n in enumerate(lens.tolist()):
        for c in range(-(-max(n, 0) // page)):
            need = max(need, int(table[b, c]) + 1)
    if slots is not None and (slots >= 0).any():
        need = max(need, int(slots[slots >= 0].max()) // page + 1)
    return need


# ---- merge_states -----------------------------------------------------------------------------------------
MERGE_MUTATIONS = ("v_b_shape", "lse_shape", "v_dtype", "lse_dtype", "v_a_2d", "v_a_f64", "out_alias",
                   "lse_out_alias", "out_noncontig", "lse_out_noncontig", "out_dtype")


@st.composite
def merge_recipe(draw):
    return {"backend": draw(st.sampled_from(("ops", CUDA_EMULATED) if HAS_CUDA_EMULATION else ("ops",))),
            "tokens": draw(st.integers(0, 5)), "heads": draw(st.integers(1, 4)),
            "dim": draw(st.sampled_from([1, 3, 8, 32, 64, 128])), "dtype": draw(st.sampled_from(IN_DTYPES)),
            "neg_inf": draw(st.sampled_from([0.0, 0.3, 1.0])), "lse_scale": draw(st.sampled_from([1.0, 30.0])),
            "strides": draw(st.sampled_from(STRIDES)), "mutation": draw(st.sampled_from(("valid",) * 6 + MERGE_MUTATIONS)),
            "pick": draw(st.integers(0, 2**16)), "seed": draw(st.integers(0, 2**20))}


@FUZZ
@given(merge_recipe())
def test_fuzz_merge_states(r):
    g = torch.Generator().manual_seed(r["seed"])
    dtype = FULL[r["dtype"]]
    shape = (r["tokens"], r["heads"], r["dim"])
    v_a, v_b = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    lse_a, lse_b = (torch.randn(shape[:2], generator=g) * r["lse_scale"] for _ in range(2))
    for lse in (lse_a, lse_b):
        lse[torch.rand(shape[:2], generator=g) < r["neg_inf"] / 2] = float("-inf")
    v_a, v_b, lse_a, lse_b = (strided(t, r["strides"]) for t in (v_a, v_b, lse_a, lse_b))
    v_out, lse_out = torch.full(shape, 3.0, dtype=dtype), torch.full(shape[:2], 3.0)
    m, pick = r["mutation"], r["pick"]
    expected = None
    if m == "v_b_shape":
        v_b = torch.randn(shape[0], shape[1], shape[2] + 1).to(dtype)
        expected = ValueError, ["v_b"]
    elif m == "lse_shape":
        lse_b = torch.randn(shape[0], shape[1] + 1)
        expected = ValueError, ["lse"]
    elif m == "v_dtype":
        v_b = v_b.to(torch.float32 if dtype != torch.float32 else torch.float16)
        expected = TypeError, ["v_b", "dtype"]
    elif m == "lse_dtype":
        lse_a = lse_a.double()
        expected = TypeError, ["lse"]
    elif m == "v_a_2d":
        v_a = v_a[..., 0]
        expected = ValueError, ["v_a"]
    elif m == "v_a_f64":
        v_a, v_b, v_out = v_a.double(), v_b.double(), v_out.double()
        expected = TypeError, ["v_a"]
    elif m == "out_alias" and v_a.is_contiguous():
        v_out = v_a
        expected = ValueError, ["v_out"]
    elif m == "lse_out_alias" and lse_b.is_contiguous():
        lse_out = lse_b
        expected = ValueError, ["lse_out"]
    elif m == "out_noncontig" and not strided(v_out, "sliced").is_contiguous():
        v_out = strided(v_out, "sliced")
        expected = ValueError, ["v_out"]
    elif m == "lse_out_noncontig" and not strided(lse_out, "sliced").is_contiguous():
        lse_out = strided(lse_out, "sliced")
        expected = ValueError, ["lse_out"]
    elif m == "out_dtype":
        v_out = v_out.to(torch.float32 if dtype != torch.float32 else torch.bfloat16)
        expected = TypeError, ["v_out", "dtype"]
    op = op_namespace(r["backend"]).merge_states.default
    if expected is not None:
        record("merge_states", r, m)
        with expect_error(*expected, [v_out, lse_out, v_a, v_b, lse_a, lse_b]):
            op(v_a, lse_a, v_b, lse_b, v_out, lse_out)
        return
    record("merge_states", {**r, "mutation": "valid"}, "valid")
    inputs = snapshot([v_a, v_b, lse_a, lse_b])
    v_ref, lse_ref = torch.empty(shape), torch.empty(shape[:2])
    ref.merge_states(v_a, lse_a, v_b, lse_b, v_ref, lse_ref)
    op(v_a, lse_a, v_b, lse_b, v_out, lse_out)
    assert_unchanged([v_a, v_b, lse_a, lse_b], inputs, "merge_states wrote an input:")
    rtol = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    torch.testing.assert_close(v_out.float(), v_ref, rtol=rtol, atol=1e-5)
    torch.testing.assert_close(lse_out, lse_ref, rtol=1e-5, atol=1e-5)
