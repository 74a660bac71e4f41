"""Property-based fuzzing of the storage ops (issue #21): append, paged_gather, paged_gather_ragged,
copy_blocks, swap_blocks, on the CPU kernels and the CUDA kernels under the emulator.

Each case is a valid call, or a valid call with one argument broken (a "mutation"). Properties:
  1. an invalid call raises the library's error class (ValueError for shapes/layouts, TypeError for dtypes,
     IndexError for index values) and the message names the broken argument;
  2. a valid call matches kvcache.reference exactly (codes, scales and full-precision values);
  3. a call that raises changes no byte of any pool (codes and scales) or output; a valid call writes
     nothing outside what it names (the whole pool is compared with the reference's, not just the slots).
Attention, plan_step and merge_states are fuzzed in test_fuzz_attention.py; counts: fuzz_support.py.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcache import reference as ref
from kvcache.formats import CacheFormat

from fuzz_support import (FORMAT_MUTATIONS, FULL, FUZZ, IN_DTYPES, STRIDES, assert_unchanged, build_pool,
                          clone_pool, dequantized, expect_error, fmt_ids, format_kwargs, make_pool, mutate_formats,
                          op_namespace, pool_recipe, pool_tensors, record, same_bytes, snapshot, strided)


# ---- append -------------------------------------------------------------------------------------------
APPEND_MUTATIONS = ("slot_high", "slot_low", "slot_dup", "slot_int32", "slot_shape", "slot_1d", "key_dtype",
                    "value_dtype", "value_shape", "key_heads", "key_dim", "key_3d", "kivi_partial_page",
                    "kivi_qlen", "pool_f64") + FORMAT_MUTATIONS


@st.composite
def append_recipe(draw):
    r = draw(pool_recipe())
    fmt = CacheFormat.parse(r["fmt"].replace("full", r["full_dtype"]))
    any_full = not fmt.k.quantized or not fmt.v.quantized
    r["in_dtype"] = r["full_dtype"] if any_full else draw(st.sampled_from(IN_DTYPES))
    r["batch"] = draw(st.integers(0, 3))
    if fmt.k.kind.startswith("kivi"):
        r["q_len"] = r["page"] * draw(st.integers(0, 2))
    else:
        r["q_len"] = draw(st.integers(0, 7))
    r["skip"] = draw(st.sampled_from([0.0, 0.0, 0.3, 1.0]))
    r["key_stride"] = draw(st.sampled_from(STRIDES))
    r["value_stride"] = draw(st.sampled_from(STRIDES))
    r["slot_stride"] = draw(st.sampled_from(STRIDES))
    r["mutation"] = draw(st.sampled_from(("valid",) * 12 + APPEND_MUTATIONS))
    r["role"] = draw(st.sampled_from("kv"))
    r["pick"] = draw(st.integers(0, 2**16))
    return r


def append_slots(r, pool, g) -> torch.Tensor:
    """slot_mapping [batch, q_len]: distinct slots (whole pages in order for kivi keys), some -1."""
    batch, q_len, page = r["batch"], r["q_len"], r["page"]
    slots = torch.full((batch, q_len), -1, dtype=torch.int64)
    if pool.format.k.kind.startswith("kivi"):
        blocks = torch.randperm(pool.num_blocks, generator=g).tolist()
        for b in range(batch):
            for t0 in range(0, q_len, page):
                if blocks and torch.rand(1, generator=g).item() >= r["skip"]:
                    slots[b, t0:t0 + page] = blocks.pop() * page + torch.arange(page)
        return slots
    free = torch.randperm(pool.num_blocks * page, generator=g)
    n = min(batch * q_len, free.numel())
    flat = slots.view(-1)
    pos = torch.randperm(batch * q_len, generator=g)[:n]
    flat[pos] = free[:n]
    skip = torch.rand(batch * q_len, generator=g) < r["skip"]
    flat[skip] = -1
    return slots


def pick_index(slots: torch.Tensor, pick: int, want_valid=True):
    flat = slots.reshape(-1)
    idx = (flat >= 0).nonzero().view(-1) if want_valid else torch.arange(flat.numel())
    if idx.numel() == 0:
        return None
    return int(idx[pick % idx.numel()])


@FUZZ
@given(append_recipe())
def test_fuzz_append(r):
    g = torch.Generator().manual_seed(r["seed"] + 1)
    pool = build_pool(r)
    kw = format_kwargs(pool)
    dtype = FULL[r["in_dtype"]]
    shape = (r["batch"], r["heads"], r["q_len"], r["dim"])
    key = strided((torch.randn(shape, generator=g) * 2).to(dtype), r["key_stride"])
    value = strided(torch.randn(shape, generator=g).to(dtype), r["value_stride"])
    slots = append_slots(r, pool, g)
    k_cache, v_cache = pool.k, pool.v
    m, pick = r["mutation"], r["pick"]
    draw_int = lambda lo, hi: lo + pick % (hi - lo + 1)  # noqa: E731
    n_valid = int((slots >= 0).sum())
    num_slots = pool.num_blocks * r["page"]
    expected = None
    kivi = pool.format.k.kind.startswith("kivi")
    if m == "slot_high" and slots.numel():
        slots.view(-1)[pick_index(slots, pick, False)] = num_slots + pick % 5
        expected = IndexError, ["slot_mapping"]
    elif m == "slot_low" and slots.numel():
        slots.view(-1)[pick_index(slots, pick, False)] = -2 - pick % 1000
        expected = IndexError, ["slot_mapping"]
    elif m == "slot_dup" and n_valid >= 1 and slots.numel() >= 2:
        i = pick_index(slots, pick)
        j = (i + 1 + pick % (slots.numel() - 1)) % slots.numel()
        slots.view(-1)[j] = slots.view(-1)[i]
        expected = IndexError, ["slot_mapping"]
    elif m == "slot_int32":
        slots = slots.int()
        expected = TypeError, ["slot_mapping"]
    elif m == "slot_shape":
        slots = torch.cat([slots, torch.full((1, slots.shape[1]), -1)]) if pick % 2 else \
            torch.cat([slots, torch.full((slots.shape[0], 1), -1)], dim=1)
        expected = ValueError, ["slot_mapping"]
    elif m == "slot_1d":
        slots = slots.reshape(-1)
        expected = ValueError, ["slot_mapping"]
    elif m == "key_dtype":
        other = [d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64) if d != dtype]
        key = key.to(other[pick % 3] if not pool.format.k.quantized else torch.float64)
        expected = TypeError, ["key"]
    elif m == "value_dtype":
        other = [d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64) if d != dtype]
        value = value.to(other[pick % 3])
        expected = TypeError, ["value"]
    elif m == "value_shape":
        value = torch.randn(*shape[:3], shape[3] + 1).to(dtype) if pick % 2 else torch.randn(shape[0] + 1, *shape[1:]).to(dtype)
        expected = ValueError, ["value"]
    elif m == "key_heads":
        key = torch.randn(shape[0], shape[1] + 1, *shape[2:]).to(dtype)
        value = key.clone()
        expected = ValueError, ["key"]
    elif m == "key_dim":
        key = torch.randn(*shape[:3], shape[3] * 2).to(dtype)
        value = key.clone()
        expected = ValueError, ["key"]
    elif m == "key_3d":
        key, value = key.select(0, 0) if shape[0] else key.sum(0), value.select(0, 0) if shape[0] else value.sum(0)
        expected = ValueError, ["key"]
    elif m == "kivi_partial_page" and kivi and n_valid >= 2 and r["page"] > 1:
        i = pick_index(slots, pick)
        slots.view(-1)[i] = -1
        expected = ValueError, ["slot_mapping"]
    elif m == "kivi_qlen" and kivi and r["page"] > 1 and r["q_len"] > 0:
        key, value, slots = key[:, :, :-1], value[:, :, :-1], slots[:, :-1]
        expected = ValueError, ["key", "slot_mapping", "q_len"]
    elif m == "pool_f64" and not pool.format.k.quantized and not pool.format.v.quantized:
        k_cache, v_cache = pool.k.double(), pool.v.double()
        key, value = key.double(), value.double()
        expected = TypeError, ["k_cache"]
    elif m in FORMAT_MUTATIONS:
        out = mutate_formats(m, r["role"], pool, kw, draw_int)
        if out is not None:
            k_cache, v_cache, kw, exc, names = out
            expected = exc, names
    op = op_namespace(r["backend"]).append.default
    args = (key, value, k_cache, v_cache, slots, kw["k_scale"], kw["v_scale"], kw["k_format"], kw["v_format"])
    tensors = pool_tensors(pool) + [k_cache, v_cache, kw["k_scale"], kw["v_scale"]]
    if expected is not None:
        record("append", r, m)
        with expect_error(*expected, tensors):
            op(*args)
        return
    record("append", {**r, "mutation": "valid"}, "valid")
    want = clone_pool(pool)
    ks, vs = fmt_ids(pool.format)
    ref.append_quantized(key, value, want.k, want.v, slots, want.k_scale, want.v_scale, ks, vs)
    op(*args)
    for name, got, exp in zip(("k", "v", "k_scale", "v_scale"), pool_tensors(pool), pool_tensors(want)):
        assert same_bytes(got, exp), f"append wrote {name} differently from the reference (or outside its slots)"


# ---- paged_gather / paged_gather_ragged -----------------------------------------------------------------
GATHER_MUTATIONS = ("table_high", "table_neg", "len_neg", "len_table", "len_out", "table_dtype", "lens_dtype",
                    "batch", "table_stride", "out_dtype", "out_heads", "out_dim", "out_batch", "out_noncontig",
                    "out_mismatch", "lens_2d", "lens_noncontig") + FORMAT_MUTATIONS
RAGGED_MUTATIONS = ("table_high", "table_neg", "cu_first", "cu_decreasing", "cu_total", "len_table", "table_dtype",
                    "cu_dtype", "batch", "table_stride", "out_dtype", "out_heads", "out_dim", "out_noncontig",
                    "out_mismatch", "cu_empty", "lens_noncontig") + FORMAT_MUTATIONS


@st.composite
def gather_recipe(draw, ragged=False):
    r = draw(pool_recipe())
    r["batch"] = draw(st.integers(0, 3))
    r["cols"] = draw(st.integers(0, 3))
    r["lens"] = [draw(st.integers(0, r["cols"] * r["page"])) for _ in range(r["batch"])]
    r["extra_len"] = draw(st.integers(0, 2))
    fmt = CacheFormat.parse(r["fmt"].replace("full", r["full_dtype"]))
    any_full = not fmt.k.quantized or not fmt.v.quantized
    r["out_dtype"] = r["full_dtype"] if any_full else draw(st.sampled_from(IN_DTYPES))
    r["table_stride"] = draw(st.sampled_from(("contiguous", "offset", "outer")))
    r["lens_stride"] = draw(st.sampled_from(("contiguous", "offset")))
    r["mutation"] = draw(st.sampled_from(("valid",) * 12 + (RAGGED_MUTATIONS if ragged else GATHER_MUTATIONS)))
    r["role"] = draw(st.sampled_from("kv"))
    r["pick"] = draw(st.integers(0, 2**16))
    return r


def block_table(r, pool, g) -> torch.Tensor:
    """[batch, cols] int32: random block ids where the lengths need them (sharing allowed), garbage elsewhere
    (-1, ids past the pool, huge values): the ops must never read past a sequence's pages."""
    batch, cols = r["batch"], r["cols"]
    table = torch.randint(0, pool.num_blocks, (batch, cols), generator=g, dtype=torch.int32)
    junk = torch.tensor([-1, -7, pool.num_blocks, 2**31 - 1], dtype=torch.int32)
    for b, n in enumerate(r["lens"]):
        used = -(-n // r["page"])
        for c in range(used, cols):
            table[b, c] = junk[int(torch.randint(0, 4, (1,), generator=g))]
    return table


def needed_entry(r, pick):
    """(row, col) of a block-table entry some length needs, or None."""
    cells = [(b, c) for b, n in enumerate(r["lens"]) for c in range(-(-n // r["page"]))]
    return cells[pick % len(cells)] if cells else None


def check_gather_outputs(pool, r, table, lens_or_cu, k_out, v_out, ragged):
    deq_k, deq_v = dequantized(pool)
    k_ref, v_ref = torch.full_like(k_out, 7.0), torch.full_like(v_out, 7.0)
    if ragged:
        ref.paged_gather_ragged(deq_k, deq_v, table, lens_or_cu, k_ref, v_ref)
    else:
        ref.paged_gather(deq_k, deq_v, table, lens_or_cu, k_ref, v_ref)
    assert same_bytes(k_out, k_ref), "gathered K differs from the reference"
    assert same_bytes(v_out, v_ref), "gathered V differs from the reference"


def run_gather(r, ragged):
    g = torch.Generator().manual_seed(r["seed"] + 2)
    pool = build_pool(r)
    kw = format_kwargs(pool)
    k_cache, v_cache = pool.k, pool.v
    table = block_table(r, pool, g)
    lens = torch.tensor(r["lens"], dtype=torch.int32)
    cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
    out_dtype = FULL[r["out_dtype"]]
    max_len = max(r["lens"], default=0) + r["extra_len"]
    heads, dim, batch = r["heads"], r["dim"], r["batch"]
    out_shape = (int(cu[-1]), heads, dim) if ragged else (batch, heads, max_len, dim)
    k_out = torch.full(out_shape, 5.0, dtype=out_dtype)
    v_out = torch.full(out_shape, 5.0, dtype=out_dtype)
    m, pick = r["mutation"], r["pick"]
    draw_int = lambda lo, hi: lo + pick % (hi - lo + 1)  # noqa: E731
    expected = None
    cell = needed_entry(r, pick)
    if m == "table_high" and cell:
        table[cell] = pool.num_blocks + pick % 3
        expected = IndexError, ["block_tables"]
    elif m == "table_neg" and cell:
        table[cell] = -1 - pick % 3
        expected = IndexError, ["block_tables"]
    elif m == "len_neg" and batch:
        lens[pick % batch] = -1 - pick % 4
        expected = IndexError, ["seq_lens"]
    elif m == "len_table" and batch:
        b = pick % batch
        n = r["cols"] * r["page"] + 1 + pick % 3
        if ragged:
            lens[b] = n
            cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
            k_out = torch.full((int(cu[-1]), heads, dim), 5.0, dtype=out_dtype)
            v_out = k_out.clone()
            expected = IndexError, ["block_tables", "cu_seq_lens", "sequence lengths"]
        else:
            lens[b] = n
            k_out = torch.full((batch, heads, max(n, max_len), dim), 5.0, dtype=out_dtype)
            v_out = k_out.clone()
            expected = IndexError, ["seq_lens"]
    elif m == "len_out" and batch and max(r["lens"]) > 0:
        k_out, v_out = k_out[:, :, : max(r["lens"]) - 1].contiguous(), v_out[:, :, : max(r["lens"]) - 1].contiguous()
        expected = IndexError, ["seq_lens", "k_out", "max_len"]
    elif m == "table_dtype":
        table = table.long()
        expected = TypeError, ["block_tables"]
    elif m == "lens_dtype":
        lens = lens.long()
        expected = TypeError, ["seq_lens"]
    elif m == "cu_dtype":
        cu = cu.long()
        expected = TypeError, ["cu_seq_lens"]
    elif m == "batch":
        table = torch.cat([table, table[:1] if batch else torch.zeros(1, r["cols"], dtype=torch.int32)])
        expected = ValueError, ["block_tables"]
    elif m == "table_stride" and r["cols"] >= 2 and batch >= 1:
        table = strided(table, "sliced")
        expected = ValueError, ["block_tables"]
    elif m == "out_dtype":
        other = torch.float64 if pool.format.k.quantized and pool.format.v.quantized else \
            [d for d in (torch.float32, torch.float16, torch.bfloat16) if d != out_dtype][pick % 2]
        k_out, v_out = k_out.to(other), v_out.to(other)
        expected = TypeError, ["k_out"]
    elif m == "out_heads":
        k_out = torch.zeros(*out_shape[:-2], heads + 1, dim, dtype=out_dtype) if ragged else \
            torch.zeros(batch, heads + 1, max_len, dim, dtype=out_dtype)
        v_out = k_out.clone()
        expected = ValueError, ["k_out"]
    elif m == "out_dim":
        k_out = torch.zeros(*out_shape[:-1], dim + 1, dtype=out_dtype)
        v_out = k_out.clone()
        expected = ValueError, ["k_out"]
    elif m == "out_batch":
        k_out = torch.zeros(batch + 1, *out_shape[1:], dtype=out_dtype)
        v_out = k_out.clone()
        expected = ValueError, ["k_out"]
    elif m == "out_noncontig":
        bad = strided(k_out, "sliced")
        if not bad.is_contiguous():
            k_out, v_out = (bad, v_out) if pick % 2 else (k_out, strided(v_out, "sliced"))
            expected = ValueError, ["k_out", "v_out"]
    elif m == "out_mismatch":
        v_out = torch.zeros(*out_shape[:-1], dim + 1, dtype=out_dtype)
        expected = ValueError, ["v_out", "k_out"]
    elif m == "lens_2d":
        lens = lens.view(1, -1)
        expected = ValueError, ["seq_lens"]
    elif m == "cu_first":
        cu = cu + 1 + pick % 3
        expected = IndexError, ["cu_seq_lens"]
    elif m == "cu_decreasing" and batch >= 2 and max(r["lens"][:-1]) > 0:
        b = next(i for i in range(batch - 1) if r["lens"][i] > 0) + 1  # cu[b] > 0: make cu[b + 1] smaller
        cu[b + 1] = cu[b] - 1 - pick % 2
        k_out = torch.full((max(int(cu[-1]), 0), heads, dim), 5.0, dtype=out_dtype)
        v_out = k_out.clone()
        expected = IndexError, ["cu_seq_lens"]
    elif m == "cu_total":
        k_out = torch.zeros(out_shape[0] + 1 + pick % 2, heads, dim, dtype=out_dtype)
        v_out = k_out.clone()
        expected = IndexError, ["cu_seq_lens", "k_out"]
    elif m == "lens_noncontig" and batch >= (1 if ragged else 2):  # (a view of one element is contiguous)
        expected = ValueError, ["cu_seq_lens" if ragged else "seq_lens"]  # strided below
    elif m == "cu_empty":
        cu = cu[:0]
        expected = ValueError, ["cu_seq_lens"]
    elif m in FORMAT_MUTATIONS:
        out = mutate_formats(m, r["role"], pool, kw, draw_int)
        if out is not None:
            k_cache, v_cache, kw, exc, names = out
            expected = exc, names
    table_v = strided(table, r["table_stride"]) if table.stride(-1) == 1 or table.shape[-1] <= 1 else table
    index = strided(cu if ragged else lens, "sliced" if m == "lens_noncontig" else r["lens_stride"])
    ns = op_namespace(r["backend"])
    op = (ns.paged_gather_ragged if ragged else ns.paged_gather).default
    args = (k_cache, v_cache, table_v, index, k_out, v_out, kw["k_scale"], kw["v_scale"], kw["k_format"],
            kw["v_format"])
    name = "paged_gather_ragged" if ragged else "paged_gather"
    tensors = pool_tensors(pool) + [k_out, v_out]
    if expected is not None:
        record(name, r, m)
        with expect_error(*expected, tensors):
            op(*args)
        return
    record(name, {**r, "mutation": "valid"}, "valid")
    before = snapshot(pool_tensors(pool))
    op(*args)
    assert_unchanged(pool_tensors(pool), before, "a gather wrote its pool:")
    check_gather_outputs(pool, r, table, cu if ragged else lens, k_out, v_out, ragged)


@FUZZ
@given(gather_recipe())
def test_fuzz_paged_gather(r):
    run_gather(r, ragged=False)


@FUZZ
@given(gather_recipe(ragged=True))
def test_fuzz_paged_gather_ragged(r):
    run_gather(r, ragged=True)


# ---- copy_blocks / swap_blocks -----------------------------------------------------------------------------
COPY_MUTATIONS = ("src_high", "src_neg", "dst_high", "dst_neg", "dst_dup", "dst_is_src", "mapping_int32",
                  "mapping_cols", "mapping_1d", "quantized_pool", "pool_noncontig", "kv_shape", "kv_dtype",
                  "page_size")
SWAP_MUTATIONS = ("src_high", "src_neg", "dst_high", "dst_neg", "dst_dup", "mapping_int32", "mapping_cols",
                  "mapping_1d", "alias", "block_shape", "pool_dtype", "dst_noncontig")


@st.composite
def copy_recipe(draw, swap=False):
    r = draw(pool_recipe(full_only=True))
    r["dst_blocks"] = draw(st.integers(1, 6)) if swap else r["blocks"]
    r["n"] = draw(st.integers(0, 4))
    r["mapping_stride"] = draw(st.sampled_from(("contiguous", "transposed", "offset")))
    r["mutation"] = draw(st.sampled_from(("valid",) * 8 + (SWAP_MUTATIONS if swap else COPY_MUTATIONS)))
    r["pick"] = draw(st.integers(0, 2**16))
    return r


def block_mapping(r, g, swap) -> torch.Tensor:
    """[n, 2] int64 (src, dst): distinct destinations; within one pool no destination is also a source."""
    if swap:
        dst = torch.randperm(r["dst_blocks"], generator=g)[: r["n"]]
        src = torch.randint(0, r["blocks"], (dst.numel(),), generator=g)
    else:
        perm = torch.randperm(r["blocks"], generator=g)
        n = min(r["n"], r["blocks"] // 2 if r["blocks"] > 1 else 0)
        dst, pool_of_src = perm[:n], perm[n:]
        src = pool_of_src[torch.randint(0, max(pool_of_src.numel(), 1), (n,), generator=g)] if n else perm[:0]
    return torch.stack([src, dst], dim=1).long() if dst.numel() else torch.zeros(0, 2, dtype=torch.long)


def mutate_mapping(m, mapping, r, pick, swap):
    """``(mapping, expected error)`` for a block_mapping mutation of copy_blocks / swap_blocks (the mapping is
    changed in place or replaced), or ``(mapping, None)`` when ``m`` is not one."""
    n = mapping.shape[0]
    dst_blocks = r["dst_blocks"]
    bad_index = IndexError, ["block_mapping"]
    if m == "src_high" and n:
        mapping[pick % n, 0] = r["blocks"] + pick % 3
        return mapping, bad_index
    if m == "src_neg" and n:
        mapping[pick % n, 0] = -1 - pick % 3
        return mapping, bad_index
    if m == "dst_high" and n:
        mapping[pick % n, 1] = dst_blocks + pick % 3
        return mapping, bad_index
    if m == "dst_neg" and n:
        mapping[pick % n, 1] = -1 - pick % 3
        return mapping, bad_index
    if m == "dst_dup" and n >= 2:
        i = pick % n
        mapping[(i + 1) % n, 1] = mapping[i, 1]
        return mapping, bad_index
    if m == "dst_is_src" and n >= 1 and not swap:
        i = pick % n
        mapping[(i + 1) % n, 0] = mapping[i, 1]
        return mapping, bad_index
    if m == "mapping_int32":
        return mapping.int(), (TypeError, ["block_mapping"])
    if m == "mapping_cols":
        return torch.cat([mapping, mapping[:, :1]], dim=1), (ValueError, ["block_mapping"])
    if m == "mapping_1d":
        return mapping.reshape(-1), (ValueError, ["block_mapping"])
    return mapping, None


@FUZZ
@given(copy_recipe())
def test_fuzz_copy_blocks(r):
    g = torch.Generator().manual_seed(r["seed"] + 3)
    pool = build_pool(r)
    k_cache, v_cache = pool.k, pool.v
    mapping = block_mapping(r, g, swap=False)
    m, pick = r["mutation"], r["pick"]
    mapping, expected = mutate_mapping(m, mapping, r, pick, swap=False)
    if expected is None:
        if m == "quantized_pool":
            k_cache = torch.zeros(k_cache.shape, dtype=torch.int8)
            v_cache = torch.zeros(v_cache.shape, dtype=torch.int8)
            expected = TypeError, ["k_cache"]
        elif m == "pool_noncontig" and not strided(k_cache, "outer").is_contiguous():
            if pick % 2:
                k_cache = strided(k_cache, "outer")
                expected = ValueError, ["k_cache"]
            else:
                v_cache = strided(v_cache, "outer")
                expected = ValueError, ["v_cache"]
        elif m == "kv_shape":
            v_cache = torch.zeros(v_cache.shape[0] + 1, *v_cache.shape[1:], dtype=v_cache.dtype)
            expected = ValueError, ["v_cache"]
        elif m == "kv_dtype":
            v_cache = v_cache.to(torch.float32 if v_cache.dtype != torch.float32 else torch.float16)
            expected = TypeError, ["v_cache"]
        elif m == "page_size" and r["page"] > 1:
            k_cache, v_cache = k_cache[:, :, :-1].contiguous(), v_cache[:, :, :-1].contiguous()
            if (r["page"] - 1) & (r["page"] - 2):  # not a power of two
                expected = ValueError, ["page_size"]
    op = op_namespace(r["backend"]).copy_blocks.default
    mapping_v = strided(mapping, r["mapping_stride"])
    tensors = pool_tensors(pool) + [k_cache, v_cache]
    if expected is not None:
        record("copy_blocks", r, m)
        with expect_error(*expected, tensors):
            op(k_cache, v_cache, mapping_v)
        return
    if k_cache is not pool.k or v_cache is not pool.v:
        return  # a mutation that turned out valid (page 2 -> 1): nothing to compare with
    record("copy_blocks", {**r, "mutation": "valid"}, "valid")
    want = clone_pool(pool)
    ref.copy_blocks(want.k, want.v, mapping)
    op(k_cache, v_cache, mapping_v)
    assert same_bytes(pool.k, want.k) and same_bytes(pool.v, want.v), "copy_blocks differs from the reference"


@FUZZ
@given(copy_recipe(swap=True))
def test_fuzz_swap_blocks(r):
    g = torch.Generator().manual_seed(r["seed"] + 4)
    src = build_pool(r)
    dst = make_pool("full", r["dst_blocks"], r["page"], r["heads"], r["dim"], r["seed"] + 5, r["full_dtype"])
    k_src, v_src, k_dst, v_dst = src.k, src.v, dst.k, dst.v
    mapping = block_mapping(r, g, swap=True)
    m, pick = r["mutation"], r["pick"]
    mapping, expected = mutate_mapping(m, mapping, r, pick, swap=True)
    if expected is None:
        if m == "alias":
            k_dst, v_dst = (k_src, v_src) if pick % 2 else (k_dst, v_src)
            expected = ValueError, ["source and destination pools"]
        elif m == "block_shape":
            k_dst = torch.zeros(k_dst.shape[0], k_dst.shape[1] + 1, *k_dst.shape[2:], dtype=k_dst.dtype)
            v_dst = k_dst.clone()
            expected = ValueError, ["dst pools"]
        elif m == "pool_dtype":
            other = torch.float32 if k_dst.dtype != torch.float32 else torch.bfloat16
            k_dst, v_dst = k_dst.to(other), v_dst.to(other)
            expected = TypeError, ["dst pools"]
        elif m == "dst_noncontig" and not strided(k_dst, "outer").is_contiguous():
            k_dst = strided(k_dst, "outer")
            expected = ValueError, ["k_dst"]
    op = op_namespace(r["backend"]).swap_blocks.default
    mapping_v = strided(mapping, r["mapping_stride"])
    tensors = pool_tensors(src) + pool_tensors(dst) + [k_dst, v_dst]
    if expected is not None:
        record("swap_blocks", r, m)
        with expect_error(*expected, tensors):
            op(k_src, v_src, k_dst, v_dst, mapping_v)
        return
    record("swap_blocks", {**r, "mutation": "valid"}, "valid")
    want = clone_pool(dst)
    ref.swap_blocks(src.k, src.v, want.k, want.v, mapping)
    before = snapshot(pool_tensors(src))
    op(k_src, v_src, k_dst, v_dst, mapping_v)
    assert_unchanged(pool_tensors(src), before, "swap_blocks wrote its source:")
    assert same_bytes(dst.k, want.k) and same_bytes(dst.v, want.v), "swap_blocks differs from the reference"
