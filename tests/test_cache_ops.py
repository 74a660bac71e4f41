"""append / paged_gather / paged_gather_ragged / copy_blocks / swap_blocks against kvcache.reference.

Data movement is exact: every comparison is bitwise.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcache
from kvcache import reference as ref

from conftest import (CUDA_EMULATED, CUDA_EMULATION_LIBRARY, DEVICES, DTYPES, HAS_CUDA_EMULATION, PAGE_SIZES,
                      make_paged_batch, ops_backend)

# Every backend, for the property tests (hypothesis runs one function over many shapes: the row widths of
# 1-40 dims take both the CUDA kernels' 16-byte and their element-wise paths).
BACKENDS = ("ops",) + ((CUDA_EMULATED,) if HAS_CUDA_EMULATION else ())


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a float tensor, so NaN poison compares equal to itself."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(bits(a), bits(b))


def random_slots(batch: int, q_len: int, num_slots: int, skip: float = 0.2) -> torch.Tensor:
    """[batch, q_len] distinct slots, about `skip` of them -1."""
    slots = torch.randperm(num_slots)[: batch * q_len].view(batch, q_len)
    slots[torch.rand(batch, q_len) < skip] = -1
    return slots


def hf_style(batch: int, heads: int, q_len: int, dim: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """[batch, heads, q_len, dim] viewed from [batch, q_len, heads, dim]: non-contiguous, like HF's K/V."""
    return torch.randn(batch, q_len, heads, dim, device=device).to(dtype).transpose(1, 2)


# ---- append -----------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_append_matches_reference(backend, dtype, page_size, device):
    rng = random.Random(page_size)
    batch, heads, q_len, dim = rng.randint(1, 3), rng.choice([2, 4]), rng.randint(2, 9), rng.choice([8, 64])
    layout = kvcache.PageLayout(-(-batch * q_len // page_size) + 2, page_size, heads, dim, dtype)
    key = hf_style(batch, heads, q_len, dim, dtype, device)
    value = hf_style(batch, heads, q_len, dim, dtype, device)
    assert not key.is_contiguous()
    slots = random_slots(batch, q_len, layout.num_slots).to(device)
    k_cache, v_cache = (torch.randn(layout.shape, device=device).to(dtype) for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    kvcache.append(key, value, k_cache, v_cache, slots)
    ref.append(key, value, k_ref, v_ref, slots)
    assert_bitwise_equal(k_cache, k_ref)
    assert_bitwise_equal(v_cache, v_ref)


@pytest.mark.parametrize("device", DEVICES)
def test_append_honours_arbitrary_strides(backend, device):
    # Every dimension strided, including head_dim (stride 2): the kernel may not assume contiguity.
    base_k = torch.randn(2, 6, 3, 32, device=device)
    base_v = torch.randn(2, 6, 3, 32, device=device)
    key = base_k.permute(0, 2, 1, 3)[:, :, ::2, ::2]      # [2, 3, 3, 16], strides all non-trivial
    value = base_v.permute(0, 2, 1, 3)[:, :, 1::2, ::2]
    layout = kvcache.PageLayout(4, 4, 3, 16, torch.float32)
    k_cache, v_cache = layout.allocate(device, fill=0.0)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([[0, 5, 10], [15, -1, 3]], device=device)
    kvcache.append(key, value, k_cache, v_cache, slots)
    ref.append(key, value, k_ref, v_ref, slots)
    assert_bitwise_equal(k_cache, k_ref)
    assert_bitwise_equal(v_cache, v_ref)
    # and the value at slot 5 is key[0, :, 1] (block 1, offset 1)
    assert torch.equal(k_cache[1, :, 1], key[0, :, 1])


@pytest.mark.parametrize("device", DEVICES)
def test_append_of_nothing_is_a_no_op(backend, device):
    layout = kvcache.PageLayout(2, 4, 2, 8, torch.float16)
    k_cache, v_cache = layout.allocate(device, fill=1.0)
    empty = torch.empty(0, 2, 3, 8, dtype=torch.float16, device=device)
    kvcache.append(empty, empty, k_cache, v_cache, torch.empty(0, 3, dtype=torch.int64, device=device))
    all_skipped = torch.zeros(1, 2, 3, 8, dtype=torch.float16, device=device)
    kvcache.append(all_skipped, all_skipped, k_cache, v_cache, torch.full((1, 3), -1, device=device))
    assert bool((k_cache == 1).all()) and bool((v_cache == 1).all())


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(0, 3), heads=st.integers(1, 4), q_len=st.integers(0, 12), dim=st.integers(1, 40),
       page_shift=st.integers(0, 8), dtype=st.sampled_from(DTYPES), spare=st.integers(0, 3),
       seed=st.integers(0, 2**16))
def test_append_random_shapes(batch, heads, q_len, dim, page_shift, dtype, spare, seed):
    torch.manual_seed(seed)
    page_size = 2**page_shift
    layout = kvcache.PageLayout(-(-batch * q_len // page_size) + spare, page_size, heads, dim, dtype)
    key, value = hf_style(batch, heads, q_len, dim, dtype, "cpu"), hf_style(batch, heads, q_len, dim, dtype, "cpu")
    slots = random_slots(batch, q_len, layout.num_slots) if batch * q_len else torch.empty(batch, q_len, dtype=torch.int64)
    k_pool, v_pool = (torch.randn(layout.shape).to(dtype) for _ in range(2))
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    ref.append(key, value, k_ref, v_ref, slots)
    for name in BACKENDS:
        k_cache, v_cache = k_pool.clone(), v_pool.clone()
        with ops_backend(name):
            kvcache.append(key, value, k_cache, v_cache, slots)
        assert_bitwise_equal(k_cache, k_ref)
        assert_bitwise_equal(v_cache, v_ref)


# ---- paged_gather (padded and ragged) ------------------------------------------------------------
def random_lens(rng: random.Random, page_size: int) -> list[int]:
    # empty, one token, exact page multiples and ragged ends
    return [0, 1, page_size, 3 * page_size, rng.randint(1, 4 * page_size + 3)][: rng.randint(2, 5)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_gather_matches_reference(backend, dtype, page_size, device):
    rng = random.Random(page_size * 7 + DTYPES.index(dtype))
    pb = make_paged_batch(random_lens(rng, page_size), page_size, rng.choice([1, 2, 4]), rng.choice([8, 64]),
                          dtype, device)
    max_len = int(pb.seq_lens.max()) + 3
    k, v = kvcache.paged_gather(pb.k_cache, pb.v_cache, pb.block_tables, pb.seq_lens, max_len)
    k_ref, v_ref = torch.empty_like(k).fill_(7), torch.empty_like(v).fill_(7)
    ref.paged_gather(pb.k_cache, pb.v_cache, pb.block_tables, pb.seq_lens, k_ref, v_ref)
    assert_bitwise_equal(k, k_ref)
    assert_bitwise_equal(v, v_ref)
    assert not k.isnan().any() and not v.isnan().any(), "read a poisoned (unused) block"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_gather_ragged_matches_reference(backend, dtype, page_size, device):
    rng = random.Random(page_size * 11 + DTYPES.index(dtype))
    pb = make_paged_batch(random_lens(rng, page_size), page_size, rng.choice([1, 3]), rng.choice([16, 128]),
                          dtype, device)
    k, v = kvcache.paged_gather_ragged(pb.k_cache, pb.v_cache, pb.block_tables, pb.cu_seq_lens)
    assert k.shape[0] == int(pb.seq_lens.sum())
    k_ref, v_ref = torch.empty_like(k), torch.empty_like(v)
    ref.paged_gather_ragged(pb.k_cache, pb.v_cache, pb.block_tables, pb.cu_seq_lens, k_ref, v_ref)
    assert_bitwise_equal(k, k_ref)
    assert_bitwise_equal(v, v_ref)
    assert not k.isnan().any() and not v.isnan().any()


@pytest.mark.parametrize("device", DEVICES)
def test_append_then_gather_round_trips(backend, device):
    # The path a cache takes: prefill 9 tokens, decode 3 one at a time, gather everything back.
    layout = kvcache.PageLayout(8, 4, 2, 16, torch.bfloat16)
    k_cache, v_cache = layout.allocate(device, fill=float("nan"))
    table = torch.tensor([[6, 1, 4, 0]], dtype=torch.int32, device=device)
    keys = hf_style(1, 2, 12, 16, torch.bfloat16, device)
    values = hf_style(1, 2, 12, 16, torch.bfloat16, device)
    positions = torch.arange(12, device=device)
    slots = layout.token_slots(table[0], positions).view(1, 12)
    kvcache.append(keys[:, :, :9], values[:, :, :9], k_cache, v_cache, slots[:, :9])
    for t in range(9, 12):
        kvcache.append(keys[:, :, t:t + 1], values[:, :, t:t + 1], k_cache, v_cache, slots[:, t:t + 1])
    k, v = kvcache.paged_gather(k_cache, v_cache, table, torch.tensor([12], dtype=torch.int32, device=device))
    assert torch.equal(k, keys) and torch.equal(v, values)


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(0, 70), min_size=1, max_size=5), heads=st.integers(1, 3),
       dim=st.integers(1, 33), page_shift=st.integers(0, 8), dtype=st.sampled_from(DTYPES),
       extra=st.integers(0, 4), seed=st.integers(0, 2**16))
def test_gathers_random_shapes(lens, heads, dim, page_shift, dtype, extra, seed):
    g = torch.Generator().manual_seed(seed)
    pb = make_paged_batch(lens, 2**page_shift, heads, dim, dtype, generator=g)
    for name in BACKENDS:
        with ops_backend(name):
            k, v = kvcache.paged_gather(pb.k_cache, pb.v_cache, pb.block_tables, pb.seq_lens, max(lens) + extra)
            kr, vr = kvcache.paged_gather_ragged(pb.k_cache, pb.v_cache, pb.block_tables, pb.cu_seq_lens)
        k_ref, v_ref = torch.empty_like(k), torch.empty_like(v)
        ref.paged_gather(pb.k_cache, pb.v_cache, pb.block_tables, pb.seq_lens, k_ref, v_ref)
        assert_bitwise_equal(k, k_ref)
        assert_bitwise_equal(v, v_ref)
        # the ragged rows are the padded rows with the padding dropped
        for b, n in enumerate(lens):
            start = int(pb.cu_seq_lens[b])
            assert_bitwise_equal(kr[start:start + n], k[b, :, :n].transpose(0, 1))
            assert_bitwise_equal(vr[start:start + n], v[b, :, :n].transpose(0, 1))


# ---- copy_blocks / swap_blocks -------------------------------------------------------------------
def random_mapping(num_src: int, num_dst: int, n: int, disjoint: bool) -> torch.Tensor:
    if disjoint:  # one pool: sources and destinations must not overlap
        ids = torch.randperm(num_src)
        src, dst = ids[:n], ids[n:2 * n]
    else:
        src, dst = torch.randint(0, num_src, (n,)), torch.randperm(num_dst)[:n]
    return torch.stack([src, dst], dim=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_matches_reference(backend, dtype, page_size, device):
    layout = kvcache.PageLayout(12, page_size, 2, 24, dtype)
    k_cache, v_cache = (torch.randn(layout.shape, device=device).to(dtype) for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    mapping = random_mapping(12, 12, 5, disjoint=True)
    kvcache.copy_blocks(k_cache, v_cache, mapping.to(device))
    ref.copy_blocks(k_ref, v_ref, mapping.to(device))
    assert_bitwise_equal(k_cache, k_ref)
    assert_bitwise_equal(v_cache, v_ref)
    assert torch.equal(k_cache[mapping[0, 1]], k_cache[mapping[0, 0]])


@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_host_to_host(backend, dtype, page_size):
    src = kvcache.PageLayout(10, page_size, 2, 8, dtype)
    dst = kvcache.PageLayout(6, page_size, 2, 8, dtype)  # pools may differ in block count
    k_src, v_src = (torch.randn(src.shape).to(dtype) for _ in range(2))
    k_dst, v_dst = (torch.randn(dst.shape).to(dtype) for _ in range(2))
    k_ref, v_ref = k_dst.clone(), v_dst.clone()
    mapping = random_mapping(10, 6, 4, disjoint=False)
    kvcache.swap_blocks(k_src, v_src, k_dst, v_dst, mapping)
    ref.swap_blocks(k_src, v_src, k_ref, v_ref, mapping)
    assert_bitwise_equal(k_dst, k_ref)
    assert_bitwise_equal(v_dst, v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_moves_runs_of_consecutive_blocks(backend, dtype):
    # A prefix swapped out in order: the CUDA host side copies each run of blocks consecutive on both sides
    # with one copy per pool. Runs of 3 and 2, single blocks, a run ending where the next starts elsewhere.
    src = kvcache.PageLayout(12, 4, 2, 8, dtype, v_head_dim=16)  # V blocks of their own size
    dst = kvcache.PageLayout(9, 4, 2, 8, dtype, v_head_dim=16)
    k_src, v_src = torch.randn(src.shape).to(dtype), torch.randn(src.v_shape).to(dtype)
    k_dst, v_dst = torch.randn(dst.shape).to(dtype), torch.randn(dst.v_shape).to(dtype)
    k_ref, v_ref = k_dst.clone(), v_dst.clone()
    mapping = torch.tensor([[2, 0], [3, 1], [4, 2], [9, 6], [10, 7], [0, 3], [11, 8], [5, 5]])
    kvcache.swap_blocks(k_src, v_src, k_dst, v_dst, mapping)
    ref.swap_blocks(k_src, v_src, k_ref, v_ref, mapping)
    assert_bitwise_equal(k_dst, k_ref)
    assert_bitwise_equal(v_dst, v_ref)
    assert torch.equal(k_dst[0:3], k_src[2:5]) and torch.equal(v_dst[6:8], v_src[9:11])
    assert torch.equal(k_dst[4], k_ref[4])  # untouched


def test_swap_blocks_with_a_strided_mapping(backend):
    # Regression (issue #21's fuzzer): the CUDA host side handed the kernel a pointer into a temporary
    # contiguous copy of a non-contiguous mapping, freed before the copies ran (garbage block ids, a segfault).
    dtype = torch.float16
    k_src, v_src = (torch.randn(10, 2, 4, 8).to(dtype) for _ in range(2))
    k_dst, v_dst = (torch.randn(6, 2, 4, 8).to(dtype) for _ in range(2))
    k_ref, v_ref = k_dst.clone(), v_dst.clone()
    mapping = torch.tensor([[9, 0, 3, 7], [5, 1, 2, 0]]).t()  # [4, 2], strides (1, 4)
    assert not mapping.is_contiguous()
    for _ in range(20):  # the freed buffer is reused (and overwritten) by other allocations in between
        junk = [torch.full((8,), 10**9, dtype=torch.int64) for _ in range(8)]
        kvcache.swap_blocks(k_src, v_src, k_dst, v_dst, mapping)
        del junk
    ref.swap_blocks(k_src, v_src, k_ref, v_ref, mapping)
    assert_bitwise_equal(k_dst, k_ref)
    assert_bitwise_equal(v_dst, v_ref)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
def test_swap_blocks_with_device(direction):
    devs = {"d2h": ("cuda", "cpu"), "h2d": ("cpu", "cuda"), "d2d": ("cuda", "cuda")}[direction]
    layout = kvcache.PageLayout(8, 16, 2, 64, torch.bfloat16)
    k_src, v_src = layout.allocate(devs[0])
    k_src.normal_(), v_src.normal_()
    k_dst, v_dst = layout.allocate(devs[1], fill=0.0, pin_memory=devs[1] == "cpu")
    k_ref, v_ref = k_dst.clone(), v_dst.clone()
    mapping = random_mapping(8, 8, 5, disjoint=False)
    kvcache.swap_blocks(k_src, v_src, k_dst, v_dst, mapping)
    ref.swap_blocks(k_src, v_src, k_ref, v_ref, mapping)
    torch.cuda.synchronize()
    assert_bitwise_equal(k_dst, k_ref)
    assert_bitwise_equal(v_dst, v_ref)


# ---- opcheck and torch.compile ----------------------------------------------------------------
def _sample_calls(device: str, dtype: torch.dtype, ops=torch.ops.kvcache):
    pb = make_paged_batch([5, 0, 9], 4, 2, 8, dtype, device)
    pb.k_cache.nan_to_num_(0.0), pb.v_cache.nan_to_num_(0.0)  # opcheck compares outputs with NaN != NaN
    key, value = hf_style(2, 2, 3, 8, dtype, device), hf_style(2, 2, 3, 8, dtype, device)
    slots = torch.tensor([[0, 1, -1], [7, 8, 9]], device=device)
    k_out = torch.empty(3, 2, 10, 8, dtype=dtype, device=device)
    ragged = torch.empty(14, 2, 8, dtype=dtype, device=device)
    mapping = torch.tensor([[0, 3], [1, 4]], device=device)
    other = [torch.zeros(5, 2, 4, 8, dtype=dtype) for _ in range(2)]
    return {
        "append": (ops.append.default, (key, value, pb.k_cache, pb.v_cache, slots)),
        "paged_gather": (ops.paged_gather.default,
                         (pb.k_cache, pb.v_cache, pb.block_tables, pb.seq_lens, k_out, k_out.clone())),
        "paged_gather_ragged": (ops.paged_gather_ragged.default,
                                (pb.k_cache, pb.v_cache, pb.block_tables, pb.cu_seq_lens, ragged, ragged.clone())),
        "copy_blocks": (ops.copy_blocks.default, (pb.k_cache, pb.v_cache, mapping)),
        "swap_blocks": (ops.swap_blocks.default, (pb.k_cache, pb.v_cache, other[0], other[1], mapping.cpu())),
    }


OP_NAMES = ("append", "paged_gather", "paged_gather_ragged", "copy_blocks", "swap_blocks", "paged_attention",
            "merge_states")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", OP_NAMES[:5])  # the attention ops: tests/test_attention.py
def test_opcheck(name, dtype, device):
    op, args = _sample_calls(device, dtype)[name]
    torch.library.opcheck(op, args)


@pytest.mark.skipif(not HAS_CUDA_EMULATION, reason="built without KVCACHE_CUDA_EMULATION=ON")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", OP_NAMES[:5])
def test_opcheck_cuda_emulated(name, dtype):
    # the CUDA host code and kernels honour the schema: they write nothing but the (x!) arguments
    op, args = _sample_calls("cpu", dtype, torch.ops.kvcache_cuda_emulation)[name]
    torch.library.opcheck(op, args)


def test_every_op_has_cpu_and_cuda_kernels():
    for name in OP_NAMES:
        qualname = getattr(torch.ops.kvcache, name).default.name()
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CPU"), name
        if kvcache.build_info["cuda"]:
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CUDA"), name


def test_cuda_emulation_is_built_when_asked_for_and_has_every_op():
    # `make test` builds and tests the CUDA kernels under the CPU emulator: a missing library there
    # must fail, not quietly drop the emulated half of the kernel tests.
    if os.environ.get("KVCACHE_CUDA_EMULATION") == "ON":
        assert HAS_CUDA_EMULATION, f"{CUDA_EMULATION_LIBRARY} was not built"
    if not HAS_CUDA_EMULATION:
        pytest.skip("built without KVCACHE_CUDA_EMULATION=ON")
    for name in OP_NAMES:
        ours, emulated = getattr(torch.ops.kvcache, name).default, getattr(torch.ops.kvcache_cuda_emulation, name).default
        assert torch._C._dispatch_has_kernel_for_dispatch_key(emulated.name(), "CPU"), name
        # the same schema (op_schemas.h), but for the namespace
        assert str(emulated._schema).split("::", 1)[1] == str(ours._schema).split("::", 1)[1], name


@pytest.mark.parametrize("device", DEVICES)
def test_compiles_fullgraph(device):
    layout = kvcache.PageLayout(4, 4, 2, 8, torch.float32)

    def step(key, value, k_cache, v_cache, slots, table, lens):
        kvcache.append(key, value, k_cache, v_cache, slots)
        k, v = kvcache.paged_gather(k_cache, v_cache, table, lens, 8)
        return (k * 2).sum() + v.sum()

    def inputs():
        k_cache, v_cache = layout.allocate(device, fill=0.0)
        g = torch.Generator().manual_seed(1)
        key, value = (torch.randn(1, 2, 6, 8, generator=g).to(device) for _ in range(2))
        slots = torch.tensor([[8, 9, 10, 11, 0, 1]], device=device)
        table = torch.tensor([[2, 0]], dtype=torch.int32, device=device)
        return key, value, k_cache, v_cache, slots, table, torch.tensor([6], dtype=torch.int32, device=device)

    eager_args, compiled_args = inputs(), inputs()
    expected = step(*eager_args)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*compiled_args)
    assert torch.equal(expected, got)
    assert torch.equal(eager_args[2], compiled_args[2])  # the mutation of the pool survived compilation


def test_large_cpu_pools_ask_for_huge_pages():
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read() if __import__("os").path.exists(
        "/sys/kernel/mm/transparent_hugepage/enabled") else "[never]"
    if "[never]" in thp:
        pytest.skip("transparent huge pages are disabled on this machine")
    buf = torch.empty(8 << 20, dtype=torch.uint8)
    assert kvcache._C.advise_huge_pages(buf.data_ptr(), buf.nbytes)       # a 2 MiB-aligned interior exists
    assert not kvcache._C.advise_huge_pages(buf.data_ptr(), 4096)         # too small: nothing to advise


def _huge_kib(t: torch.Tensor) -> int:
    """KiB of transparent huge pages backing t's bytes (the AnonHugePages of every mapping it overlaps)."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.nbytes
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                start, end = (int(x, 16) for x in head[0].split("-"))
                inside = start < hi and end > lo
            elif inside and head[:1] == ["AnonHugePages:"]:
                total += int(head[1])
    return total


def test_pools_of_every_format_are_on_huge_pages():
    """KVPool.allocate (what PagedCache and Engine allocate through) and PageLayout.allocate put large CPU
    pools on huge pages, whatever memory earlier tests freed. (KVPool.allocate once made them with
    torch.zeros, touched before any advice: a decode step over 8 x 32k tokens 1.04x (bf16) to 1.1x (int8) as
    long, Zen 4. Advising torch.empty's memory instead failed this test in the CPU-only suite, where the int8
    codes came back as heap memory an earlier test had touched.)"""
    thp = "/sys/kernel/mm/transparent_hugepage/"
    if not os.path.exists(thp + "enabled") or "[never]" in open(thp + "enabled").read():
        pytest.skip("transparent huge pages are disabled on this machine")
    defrag = open(thp + "defrag").read()
    if "[defer]" in defrag or "[never]" in defrag:
        pytest.skip(f"huge pages are not made at the first touch of an advised range here (defrag: {defrag.strip()})")
    blocks = 4096  # codes of 16 MiB (int4) to 64 MiB (bf16) per side
    for fmt in ("bf16", "int8", "int4", "fp8_e4m3"):
        pool = kvcache.KVPool.allocate(blocks, 16, 8, 64, fmt)
        for name, t in (("k", pool.k), ("v", pool.v)):
            assert t.nbytes >= 16 << 20
            t.zero_()  # (full precision starts untouched: its pages come at the first write)
            assert _huge_kib(t) >= 2048, f"{fmt} pool's {name} codes ({t.nbytes >> 20} MiB) are not on huge pages"
    k, v = kvcache.PageLayout(blocks, 16, 8, 64, dtype=torch.bfloat16).allocate(fill=0.0)
    assert _huge_kib(k) >= 2048 and _huge_kib(v) >= 2048
