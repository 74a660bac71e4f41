"""Shared machinery of the property-based fuzz tests (test_fuzz_*.py, issue #21).

A fuzz case is a *recipe*: plain data (ints, strings, a seed) drawn by hypothesis, from which the tensors are
built deterministically. Distinct recipes are distinct cases; each test records its recipes per op, and the
terminal summary (conftest.pytest_terminal_summary) prints how many distinct cases each op ran, also written
as JSON to ``<pytest basetemp>/fuzz_counts.json`` (and to ``$KVCACHE_FUZZ_COUNTS`` if set).

Profiles: the default run takes ``max_examples`` per test from ``KVCACHE_FUZZ_EXAMPLES`` (default
:data:`DEFAULT_EXAMPLES`), derandomized and without a database, so CI is reproducible; a long run is
``KVCACHE_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz_*.py``.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import kvcache
from kvcache import reference as ref
from kvcache.formats import CacheFormat

from conftest import CUDA_EMULATED, HAS_CUDA_EMULATION

DEFAULT_EXAMPLES = 300
EXAMPLES = int(os.environ.get("KVCACHE_FUZZ_EXAMPLES", DEFAULT_EXAMPLES))

settings.register_profile(
    "kvcache-fuzz", max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
FUZZ = settings.get_profile("kvcache-fuzz")

BACKENDS = ("ops",) + ((CUDA_EMULATED,) if HAS_CUDA_EMULATION else ())
FULL = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
IN_DTYPES = ("fp32", "fp16", "bf16")
QUANT = ("int8", "fp8_e4m3", "fp8_e5m2", "int4", "kivi4", "kivi2",
         "int8(hadamard)", "fp8_e4m3(hadamard)", "fp8_e5m2(hadamard)", "int4(hadamard)")
PAGE_SIZES = tuple(2**i for i in range(9))
BAD_FORMAT_IDS = (-1, 7, 8, 15, 16, 21, 22, 23, 32, 1000)

# ---- distinct-case counting ---------------------------------------------------------------------------
CASES: dict[str, dict[str, str]] = defaultdict(dict)  # op -> recipe key -> what it exercised


TRACE = os.environ.get("KVCACHE_FUZZ_TRACE")  # a file that holds the case being run (to find a crash's case)


def record(op: str, recipe: dict, outcome: str) -> None:
    """Counts a case of `op` (distinct by its recipe) and what it exercised ("valid" or the mutation)."""
    key = repr(sorted(recipe.items()))
    if TRACE:
        with open(TRACE, "w") as f:
            f.write(f"{op} {outcome} {recipe!r}\n")
    CASES[op].setdefault(key, outcome)


def export() -> dict:
    """This process's cases, for the pytest-xdist controller (plain dicts of strings travel between processes)."""
    return {op: dict(cases) for op, cases in CASES.items()}


def absorb(cases: dict) -> None:
    """Adds a worker's export(): a case two workers both ran counts once."""
    for op, keyed in cases.items():
        for key, outcome in keyed.items():
            CASES[op].setdefault(key, outcome)


def summary() -> dict:
    out = {}
    for op in sorted(CASES):
        outcomes: dict[str, int] = defaultdict(int)
        for outcome in CASES[op].values():
            outcomes[outcome] += 1
        out[op] = {"distinct_cases": len(CASES[op]), "by_outcome": dict(sorted(outcomes.items()))}
    return out


def report(terminalreporter) -> None:
    if not CASES:
        return
    data = summary()
    total = sum(v["distinct_cases"] for v in data.values())
    tr = terminalreporter
    tr.write_sep("-", f"kvcache fuzz: {total} distinct cases (KVCACHE_FUZZ_EXAMPLES={EXAMPLES} per test)")
    for op, v in data.items():
        valid = v["by_outcome"].get("valid", 0)
        tr.write_line(f"  {op:26s} {v['distinct_cases']:6d} distinct ({valid} valid, "
                      f"{v['distinct_cases'] - valid} invalid in {len(v['by_outcome']) - (valid > 0)} kinds)")
    paths = []
    factory = getattr(tr.config, "_tmp_path_factory", None)
    if factory is not None:
        paths.append(Path(factory.getbasetemp()) / "fuzz_counts.json")
    if os.environ.get("KVCACHE_FUZZ_COUNTS"):
        paths.append(Path(os.environ["KVCACHE_FUZZ_COUNTS"]))
    for p in paths:
        p.write_text(json.dumps({"examples_per_test": EXAMPLES, "total": total, "ops": data}, indent=1))
        tr.write_line(f"  counts written to {p}")


# ---- backends -------------------------------------------------------------------------------------------
def op_namespace(backend: str):
    return torch.ops.kvcache_cuda_emulation if backend == CUDA_EMULATED else torch.ops.kvcache


# ---- checksums ------------------------------------------------------------------------------------------
def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor (NaN-safe exact comparison), as a fresh uint8 tensor in its logical order."""
    return t.detach().clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def snapshot(tensors) -> list:
    return [None if t is None else raw(t) for t in tensors]


def same_bytes(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


def assert_unchanged(tensors, before, what="a pool") -> None:
    for i, (t, b) in enumerate(zip(tensors, before)):
        if t is not None:
            assert torch.equal(raw(t), b), f"{what} tensor #{i} changed on a call that raised"


@contextmanager
def expect_error(exc, names, tensors):
    """The call raises `exc` naming one of `names` in its message, and no tensor of `tensors` changes."""
    before = snapshot(tensors)
    with pytest.raises(exc) as info:
        yield info
    msg = str(info.value)
    assert any(re.search(n, msg) for n in names), f"the error does not name any of {names}: {type(info.value).__name__}: {msg}"
    assert_unchanged(tensors, before)


# ---- pools ----------------------------------------------------------------------------------------------
def fmt_ids(fmt: CacheFormat) -> tuple[int, int]:
    return fmt.k.kernel_id, fmt.v.kernel_id


def needs_multiple_of_32(fmt: CacheFormat) -> bool:
    return any(f.grouped or f.hadamard for f in (fmt.k, fmt.v))


def make_pool(fmt_text: str, num_blocks: int, page: int, heads: int, dim: int, seed: int, full_dtype: str = "bf16"):
    """A KVPool of `fmt_text` whose every slot holds reference-quantized random K/V (codes and scales written by
    kvcache.reference, never by the kernel under test). Full-precision pools are `full_dtype`."""
    g = torch.Generator().manual_seed(seed)
    text = fmt_text.replace("full", full_dtype)
    pool = kvcache.KVPool.allocate(num_blocks, page, heads, dim, text)
    for scale, f in ((pool.k_scale, pool.format.k), (pool.v_scale, pool.format.v)):
        if f.kind.startswith("fp8"):
            scale.copy_(torch.rand(heads, generator=g) * 0.05 + 0.01)
    if pool.k.is_floating_point():
        pool.k.copy_(torch.randn(pool.k.shape, generator=g).to(pool.k.dtype))
    if pool.v.is_floating_point():
        pool.v.copy_(torch.randn(pool.v.shape, generator=g).to(pool.v.dtype))
    n = num_blocks * page
    if n and (pool.format.k.quantized or pool.format.v.quantized):
        key = torch.randn(1, heads, n, dim, generator=g) * 2  # as tests/test_quantized.py's keys
        if pool.format.k.kind.startswith("kivi"):
            key[..., 0] += 10.0  # an outlier channel, as tests/test_kivi.py's keys
        value = torch.randn(1, heads, n, dim, generator=g)
        slots = torch.arange(n).view(1, n)
        ks, vs = fmt_ids(pool.format)
        # full-precision sides keep their random contents: write them back after the reference append
        k_keep, v_keep = pool.k.clone(), pool.v.clone()
        ref.append_quantized(key.to(pool.k.dtype) if ks == 0 else key, value.to(pool.v.dtype) if vs == 0 else value,
                             pool.k, pool.v, slots, pool.k_scale, pool.v_scale, ks, vs)
        if ks == 0:
            pool.k.copy_(k_keep)
        if vs == 0:
            pool.v.copy_(v_keep)
    return pool


def pool_tensors(pool) -> list:
    return [pool.k, pool.v, pool.k_scale, pool.v_scale]


def clone_pool(pool):
    twin = kvcache.KVPool(pool.num_blocks, pool.page_size, pool.num_kv_heads, pool.head_dim, pool.format,
                          k=pool.k.clone(), v=pool.v.clone(),
                          k_scale=None if pool.k_scale is None else pool.k_scale.clone(),
                          v_scale=None if pool.v_scale is None else pool.v_scale.clone())
    return twin


def dequantized(pool) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 K/V the pool stands for."""
    k_id, v_id = fmt_ids(pool.format)
    return ref.dequantize_pool(pool.k, pool.k_scale, k_id), ref.dequantize_pool(pool.v, pool.v_scale, v_id)


# ---- strided views --------------------------------------------------------------------------------------
def strided(t: torch.Tensor, kind: str) -> torch.Tensor:
    """The same values as `t` laid out in memory as `kind`: 'contiguous', 'transposed' (stored with its last
    two dims swapped, as HF's [b, q, h, d] -> [b, h, q, d]), 'sliced' (every other element of a buffer twice as
    wide in the last dim, poison between), 'offset' (a view starting inside a larger buffer), 'outer' (rows
    padded: stride(0) larger than the rest of the tensor)."""
    if kind == "contiguous" or t.dim() == 0:
        return t.clone()
    if kind == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "sliced":
        wide = torch.full((*t.shape[:-1], 2 * t.shape[-1]), 77, dtype=t.dtype)  # poison between the elements
        wide[..., ::2] = t
        return wide[..., ::2]
    if kind == "offset":
        flat = torch.empty(t.numel() + 3, dtype=t.dtype)
        return flat[3:].view(t.shape).copy_(t) if t.numel() else t.clone()
    if kind == "outer" and t.dim() >= 2:  # every row padded: strides larger than the sizes
        big = torch.zeros(t.shape[0], *t.shape[1:-1], t.shape[-1] + 2, dtype=t.dtype)
        big[..., : t.shape[-1]] = t
        return big[..., : t.shape[-1]]
    return t.clone()


STRIDES = ("contiguous", "transposed", "sliced", "offset", "outer")


# ---- shared recipe parts ------------------------------------------------------------------------------
@st.composite
def pool_recipe(draw, attention=False, full_only=False, max_slots=512, dims=(4, 8, 24, 32, 40)):
    """Format, geometry and seed of a pool. `attention`: formats paged_attention reads (K and V both full
    precision, both quantized per row, or both kivi)."""
    r = {"backend": draw(st.sampled_from(BACKENDS))}
    kinds = ["full"] if full_only else ["full", "quant", "quant"] + (["kivi"] if attention else ["mixed"])
    kind = draw(st.sampled_from(kinds))
    r["full_dtype"] = draw(st.sampled_from(IN_DTYPES))
    if kind == "full":
        r["fmt"] = "full"
    elif kind in ("quant", "kivi"):
        choices = [q for q in QUANT if not attention or q.startswith("kivi") == (kind == "kivi")]
        k, v = draw(st.sampled_from(choices)), draw(st.sampled_from(choices))
        r["fmt"] = k if k == v else f"k={k},v={v}"
    else:
        q = draw(st.sampled_from(QUANT))
        r["fmt"] = draw(st.sampled_from([f"k=full,v={q}", f"k={q},v=full"]))
    r["page"] = draw(st.sampled_from(PAGE_SIZES))
    r["blocks"] = draw(st.integers(1, max(1, min(6, max_slots // r["page"]))))
    r["heads"] = draw(st.integers(1, 3))
    fmt = CacheFormat.parse(r["fmt"].replace("full", r["full_dtype"]))
    r["dim"] = draw(st.sampled_from([32, 64] if needs_multiple_of_32(fmt) else list(dims)))
    r["seed"] = draw(st.integers(0, 2**20))
    return r


def build_pool(r):
    return make_pool(r["fmt"], r["blocks"], r["page"], r["heads"], r["dim"], r["seed"], r["full_dtype"])


def format_kwargs(pool) -> dict:
    return pool.op_kwargs()


FORMAT_MUTATIONS = ("k_format_bad", "v_format_bad", "scale_missing", "scale_extra", "scale_dtype", "scale_shape",
                    "scale_noncontig", "format_kind", "pool_noncontig")


def mutate_formats(mutation: str, role: str, pool, kw: dict, draw_int):
    """Breaks one format argument of `kw` (the op_kwargs of `pool`) or a pool. Returns (k_cache, v_cache, kw,
    exc, names) or None when the mutation does not apply to this pool."""
    k_cache, v_cache = pool.k, pool.v
    kw = dict(kw)
    f = getattr(pool.format, role)
    scale_key, cache_name = f"{role}_scale", f"{role}_cache"
    if mutation in ("k_format_bad", "v_format_bad"):
        kw[mutation[:8]] = BAD_FORMAT_IDS[draw_int(0, len(BAD_FORMAT_IDS) - 1)]
        return k_cache, v_cache, kw, ValueError, [mutation[:8]]
    if mutation == "scale_missing" and f.quantized:
        kw[scale_key] = None
        return k_cache, v_cache, kw, ValueError, [scale_key]
    if mutation == "scale_extra" and not f.quantized:
        kw[scale_key] = torch.ones(pool.num_blocks, pool.num_kv_heads, pool.page_size)
        return k_cache, v_cache, kw, ValueError, [scale_key]
    if mutation == "scale_dtype" and f.quantized:
        kw[scale_key] = kw[scale_key].double()
        return k_cache, v_cache, kw, TypeError, [scale_key]
    if mutation == "scale_shape" and f.quantized:
        s = kw[scale_key]
        kw[scale_key] = torch.zeros(*s.shape[:-1], s.shape[-1] + 1, dtype=s.dtype)
        return k_cache, v_cache, kw, ValueError, [scale_key]
    if mutation == "scale_noncontig" and f.quantized and kw[scale_key].shape[-1] > 1:
        kw[scale_key] = strided(kw[scale_key], "sliced")
        return k_cache, v_cache, kw, ValueError, [scale_key]
    if mutation == "format_kind":
        fid = kw[f"{role}_format"]
        choices = [i for i in (0, 1, 2, 4, 5, 6, 17, 20) if (i == 0) != (fid == 0)]
        kw[f"{role}_format"] = choices[draw_int(0, len(choices) - 1)]
        # the kind of the codes no longer matches: named as the pool, its format or its scales
        return k_cache, v_cache, kw, (TypeError, ValueError), [cache_name, f"{role}_format", f"{role}_scale", "pools"]
    if mutation == "pool_noncontig" and not strided(pool.k if role == "k" else pool.v, "outer").is_contiguous():
        bad = strided(pool.k if role == "k" else pool.v, "outer")
        return (bad, v_cache, kw, ValueError, [cache_name]) if role == "k" else (k_cache, bad, kw, ValueError, [cache_name])
    return None


