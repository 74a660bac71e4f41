"""plan_step / paged_attention_planned / append_planned: plan once per step, run per layer.

The planned ops must compute exactly what the unplanned ones compute (same task list, same kernels), read no
index values on the host per layer (kvcache.ops.host_index_reads, and the emulation library's own counter),
and refuse a plan that does not fit the call with a clear error, writing nothing."""

from __future__ import annotations

import ctypes

import pytest
import torch

import kvcache
from kvcache import reference as ref
from conftest import CUDA_EMULATED, CUDA_EMULATION_LIBRARY, HAS_CUDA_EMULATION, make_paged_batch

FORMATS = ("bf16", "fp32", "int8", "int4", "fp8_e4m3", "k=int8,v=int4", "int8(hadamard)")


def cu_of(q_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)


def host_reads(backend: str) -> int:
    """The host-read counter of the library that runs `backend`'s ops."""
    if backend == CUDA_EMULATED:
        lib = ctypes.CDLL(str(CUDA_EMULATION_LIBRARY))
        lib.kvcache_emulation_host_index_reads.restype = ctypes.c_int64
        return lib.kvcache_emulation_host_index_reads()
    return kvcache.ops.host_index_reads()


def filled_pool(fmt: str, lens: list[int], page: int = 16, heads: int = 2, dim: int = 64, spare: int = 2):
    """A pool of `fmt` holding random sequences of `lens` tokens on shuffled pages, and their tables."""
    pages = [-(-n // page) for n in lens]
    blocks = sum(pages) + spare
    pool = kvcache.KVPool.allocate(blocks, page, heads, dim, fmt)
    if pool.k.is_floating_point():  # full-precision pools start uninitialized: NaN garbage would never compare equal
        pool.k.zero_(), pool.v.zero_()
    perm = torch.randperm(blocks).to(torch.int32)
    table = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32)
    start = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[start:start + p]
        start += p
    layout = kvcache.PageLayout(blocks, page, heads, dim)
    dtype = pool.k.dtype if pool.k.is_floating_point() else torch.bfloat16
    for b, n in enumerate(lens):
        x = torch.randn(1, heads, n, dim).to(dtype)
        pool.append(x, torch.randn_like(x), layout.token_slots(table[b], torch.arange(n)).view(1, n))
    return pool, table, torch.tensor(lens, dtype=torch.int32)


def step_indices(pool, table, lens, q_lens):
    """The slot_mapping [batch, q_len] of the step's last q_len tokens (-1 where a row has fewer)."""
    width = max(q_lens)
    slots = torch.full((len(q_lens), width), -1, dtype=torch.int64)
    for b, (n, q) in enumerate(zip(lens.tolist(), q_lens)):
        slots[b, :q] = pool.layout.token_slots(table[b], torch.arange(n - q, n))
    return slots


@pytest.fixture(params=("cpu",) + ((CUDA_EMULATED,) if HAS_CUDA_EMULATION else ()))
def run_on(request):
    from conftest import ops_backend
    with ops_backend("ops" if request.param == "cpu" else request.param):
        yield request.param


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [1, 7, 1], [5, 3, 2]])
def test_planned_attention_equals_unplanned(run_on, fmt, q_lens):
    lens = [1200, 37, 300]  # long enough for split-K on both backends
    pool, table, seq_lens = filled_pool(fmt, lens)
    cu = cu_of(q_lens)
    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    plan = kvcache.plan_step(pool.k, pool.v, table, seq_lens, cu, q_heads=8, **pool.op_kwargs())
    for layer in range(3):  # one plan, several layers (queries)
        q = torch.randn(sum(q_lens), 8, 64).to(dtype)
        for window, softcap in ((-1, 0.0), (100, 30.0)):
            want, want_lse = pool.attention(q, table, seq_lens, cu, window_left=window, softcap=softcap,
                                            return_lse=True)
            got, got_lse = kvcache.paged_attention_planned(plan, q, pool.k, pool.v, window_left=window,
                                                           softcap=softcap, return_lse=True, **pool.op_kwargs())
            assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


def test_planned_attention_matches_reference(run_on):
    pb = make_paged_batch([700, 20, 1], 16, 2, 64, torch.float32)
    q_lens = [3, 20, 1]
    cu = cu_of(q_lens)
    q = torch.randn(sum(q_lens), 4, 64)
    plan = kvcache.plan_step(pb.k_cache, pb.v_cache, pb.block_tables, pb.seq_lens, cu, q_heads=4)
    out, lse = kvcache.paged_attention_planned(plan, q, pb.k_cache, pb.v_cache, return_lse=True)
    want, want_lse = torch.empty_like(q), torch.empty(q.shape[:2])
    ref.paged_attention_planned(ref.plan_step(pb.block_tables, pb.seq_lens, cu), q, pb.k_cache, pb.v_cache,
                                64 ** -0.5, -1, 0, 0.0, want, want_lse)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_planned_append_equals_unplanned(run_on, fmt):
    lens, q_lens = [40, 17, 3], [1, 4, 3]
    pool, table, seq_lens = filled_pool(fmt, lens)  # the step rewrites each row's last q_len tokens
    twin = kvcache.KVPool(**{f: getattr(pool, f) for f in ("num_blocks", "page_size", "num_kv_heads", "head_dim",
                                                           "format")},
                          k=pool.k.clone(), v=pool.v.clone(),
                          k_scale=None if pool.k_scale is None else pool.k_scale.clone(),
                          v_scale=None if pool.v_scale is None else pool.v_scale.clone())
    twin._scales_set = dict(pool._scales_set)
    slots = step_indices(pool, table, seq_lens, q_lens)
    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    key = torch.randn(3, 2, max(q_lens), 64).to(dtype)
    value = torch.randn_like(key)
    plan = kvcache.plan_step(pool.k, pool.v, table, seq_lens, cu_of(q_lens), slots, q_heads=2, **pool.op_kwargs())
    twin.append(key, value, slots)
    kvcache.append_planned(plan, key, value, pool.k, pool.v, **pool.op_kwargs())
    for a, b in ((pool.k, twin.k), (pool.v, twin.v), (pool.k_scale, twin.k_scale), (pool.v_scale, twin.v_scale)):
        assert (a is None and b is None) or torch.equal(a, b)


def test_append_planned_matches_reference(run_on):
    k_cache, v_cache = kvcache.PageLayout(6, 4, 2, 32, torch.float32).allocate(fill=0.0)
    table = torch.tensor([[5, 1], [2, 0]], dtype=torch.int32)
    lens = torch.tensor([6, 3], dtype=torch.int32)
    slots = torch.tensor([[1 * 4 + 0, 1 * 4 + 1], [2 * 4 + 2, -1]])
    plan = kvcache.plan_step(k_cache, v_cache, table, lens, cu_of([2, 1]), slots, q_heads=2)
    key, value = torch.randn(2, 2, 2, 32), torch.randn(2, 2, 2, 32)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kvcache.append_planned(plan, key, value, k_cache, v_cache)
    ref.append_planned(ref.plan_step(table, lens, cu_of([2, 1]), slots), key, value, k_ref, v_ref)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_per_layer_calls_read_no_indices(run_on):
    """The planned per-layer calls make no host reads of index values; the unplanned ones do (on a GPU each is
    a synchronization), so the count is a real measurement."""
    pool, table, seq_lens = filled_pool("int8", [300, 50])
    q_lens = [1, 1]
    slots = step_indices(pool, table, seq_lens, q_lens)
    key = torch.randn(2, 2, 1, 64).to(torch.bfloat16)
    q = torch.randn(2, 4, 64).to(torch.bfloat16)
    before = host_reads(run_on)
    plan = kvcache.plan_step(pool.k, pool.v, table, seq_lens, cu_of(q_lens), slots, q_heads=4, **pool.op_kwargs())
    planned = host_reads(run_on)
    assert planned - before == 4  # once per step: cu_q_lens, seq_lens, block_tables, slot_mapping
    for _ in range(8):  # eight layers
        kvcache.append_planned(plan, key, key, pool.k, pool.v, **pool.op_kwargs())
        kvcache.paged_attention_planned(plan, q, pool.k, pool.v, **pool.op_kwargs())
    assert host_reads(run_on) == planned
    kvcache.append(key, key, pool.k, pool.v, slots, **pool.op_kwargs())
    pool.attention(q, table, seq_lens, cu_of(q_lens))
    assert host_reads(run_on) == planned + 4  # the unplanned pair: slots, then cu, lens, tables


# ---- bad input ------------------------------------------------------------------------------------
def checksum(pool) -> list[torch.Tensor]:
    return [t.clone() for t in (pool.k, pool.v, pool.k_scale, pool.v_scale) if t is not None]


def unchanged(pool, before) -> bool:
    return all(torch.equal(a, b) for a, b in zip(checksum(pool), before))


def test_plan_refuses_bad_indices_like_the_ops(run_on):
    pool, table, lens = filled_pool("bf16", [40, 10])
    cu = cu_of([1, 1])
    bad_table = table.clone()
    bad_table[0, 1] = pool.num_blocks + 3
    for args, kwargs in (((bad_table, lens, cu), {}),
                         ((table, torch.tensor([40, -1], dtype=torch.int32), cu), {}),
                         ((table, lens, torch.tensor([0, 2, 1], dtype=torch.int32)), {}),
                         ((table, torch.tensor([40, 0], dtype=torch.int32), cu), {})):  # q_len > seq_len
        with pytest.raises(IndexError) as unplanned:
            pool.attention(torch.randn(2, 4, 64).to(torch.bfloat16), *args)
        with pytest.raises(IndexError) as planned:
            kvcache.plan_step(pool.k, pool.v, *args, q_heads=4)
        assert str(planned.value).splitlines()[0] == str(unplanned.value).splitlines()[0]
    slots = torch.tensor([[pool.num_blocks * 16], [3]])
    with pytest.raises(IndexError, match=r"slot_mapping\[0, 0\] = .* is out of range"):
        kvcache.plan_step(pool.k, pool.v, table, lens, cu, slots, q_heads=4)
    with pytest.raises(IndexError, match=r"writes slot 3 twice \(slot_mapping\[0, 0\] and slot_mapping\[1, 0\]\)"):
        kvcache.plan_step(pool.k, pool.v, table, lens, cu, torch.tensor([[3], [3]]), q_heads=4)
    with pytest.raises(ValueError, match="q_heads = 3 must be a positive multiple"):
        kvcache.plan_step(pool.k, pool.v, table, lens, cu, q_heads=3)


def test_planned_ops_refuse_a_plan_that_does_not_fit(run_on):
    pool, table, lens = filled_pool("int8", [40, 10])
    cu = cu_of([1, 1])
    slots = step_indices(pool, table, lens, [1, 1])
    plan = kvcache.plan_step(pool.k, pool.v, table, lens, cu, slots, q_heads=4, **pool.op_kwargs())
    q = torch.randn(2, 4, 64).to(torch.bfloat16)
    key = torch.randn(2, 2, 1, 64).to(torch.bfloat16)
    before = checksum(pool)

    def attend(p=plan, query=q, target=pool, **kw):
        return kvcache.paged_attention_planned(p, query, target.k, target.v, **{**target.op_kwargs(), **kw})

    def append(p=plan, k=key, target=pool, **kw):
        kvcache.append_planned(p, k, k, target.k, target.v, **{**target.op_kwargs(), **kw})

    other_dim = kvcache.KVPool.allocate(pool.num_blocks, 16, 2, 128, "int8")
    other_page = kvcache.KVPool.allocate(pool.num_blocks, 8, 2, 64, "int8")
    small = kvcache.KVPool.allocate(1, 16, 2, 64, "int8")
    cases = [
        (lambda: attend(query=torch.randn(3, 4, 64).to(torch.bfloat16)), ValueError, "made for 2 query tokens of 4 heads"),
        (lambda: attend(query=torch.randn(2, 8, 64).to(torch.bfloat16)), ValueError, "made for 2 query tokens of 4 heads"),
        (lambda: attend(target=other_dim, query=torch.randn(2, 4, 128).to(torch.bfloat16)), ValueError, "head_dim 128 but the plan was made for .* head_dim 64"),
        (lambda: attend(target=other_page), ValueError, "page_size 8, .* but the plan was made for page_size 16"),
        (lambda: attend(target=small), IndexError, "the pools hold 1 blocks but the plan uses block ids up to"),
        # int8 codes read as int4: K rows of another width are a layout of their own, but not in int8 codes
        (lambda: attend(k_format=4, k_scale=None), TypeError, "k_cache has dtype Char; an int4 pool holds uint8"),
        (lambda: attend(p=(plan.host[:-8], plan.device)), ValueError, "not a plan made by plan_step"),
        (lambda: attend(p=(plan.host.to(torch.int32), plan.device)), ValueError, "plan_host must be the first tensor"),
        (lambda: attend(p=(plan.host, plan.device[:-1])), ValueError, "plan_device must be the second tensor"),
        (lambda: append(k=torch.randn(2, 2, 2, 64).to(torch.bfloat16)), ValueError, r"plan's slot_mapping is \[batch, q_len\] = \[2, 1\]"),
        (lambda: append(target=small), IndexError, "the pools hold 1 blocks"),
    ]
    no_slots = kvcache.plan_step(pool.k, pool.v, table, lens, cu, q_heads=4, **pool.op_kwargs())
    cases.append((lambda: append(p=no_slots), ValueError, "made without a slot_mapping"))
    corrupt = plan.host.clone()
    corrupt[:8] = 0
    cases.append((lambda: attend(p=(corrupt, plan.device)), ValueError, "not a plan made by plan_step"))
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
        assert unchanged(pool, before)


def test_planned_ops_refuse_the_halves_of_two_plans(run_on):
    # Regression (segfault): the per-layer ops trust plan.device's indices, validated by plan_step against the
    # pools plan.host describes. The host half of a plan for a 4-block pool with the device half of one for a
    # 4096-block pool (same sizes) wrote slot 16000 of a 16-slot pool; so did a device half overwritten by hand.
    T = lambda x: torch.tensor(x, dtype=torch.int32)
    small = kvcache.KVPool.allocate(4, 4, 1, 32, torch.float32)
    big = kvcache.KVPool.allocate(4096, 4, 1, 32, torch.float32)
    small.k.zero_(), small.v.zero_()
    a = kvcache.plan_step(small.k, small.v, T([[1]]), T([1]), T([0, 1]), torch.tensor([[4]]), q_heads=1)
    b = kvcache.plan_step(big.k, big.v, T([[4000]]), T([1]), T([0, 1]), torch.tensor([[16000]]), q_heads=1)
    assert a.host.shape == b.host.shape and a.device.shape == b.device.shape  # (no size tells them apart)
    overwritten = a.device.clone().fill_(0x7f)
    key, q = torch.randn(1, 1, 1, 32), torch.randn(1, 1, 32)
    out = torch.full_like(q, 7.0)
    before = checksum(small)
    for mixed in ((a.host, b.device), (a.host, overwritten), (b.host.clone(), a.device)):
        with pytest.raises(ValueError, match=r"^plan: plan_host and plan_device are not the two tensors of one "
                                             r"plan_step call \(plan_host belongs to plan -?\d+, plan_device holds "
                                             r"plan id -?\d+\)"):
            kvcache.append_planned(mixed, key, key, small.k, small.v)
        with pytest.raises(ValueError, match=r"^plan: plan_host and plan_device are not the two tensors"):
            kvcache.paged_attention_planned(mixed, q, small.k, small.v, out=out)
        assert unchanged(small, before) and out.eq(7.0).all()
    # a copy of a whole plan is the same plan (torch.library.opcheck runs the ops on copies of their arguments)
    kvcache.append_planned(kvcache.StepPlanTensors(a.host.clone(), a.device.clone()), key, key, small.k, small.v)
    assert torch.equal(small.k[1, 0, 0], key[0, 0, 0])


def test_a_plan_fixes_the_split_of_its_thread_count():
    # plan_step's docstring: on the CPU the plan splits long contexts by the thread count when it is made; the
    # planned op then gives that split's result (the unplanned op's at that count) under any thread count.
    pool, table, lens = filled_pool("fp32", [6000], page=16, heads=1, dim=128)
    cu, q = cu_of([1]), torch.randn(1, 8, 128)
    threads = torch.get_num_threads()
    try:
        plans, refs = {}, {}
        for n in (1, 2):
            torch.set_num_threads(n)
            plans[n] = kvcache.plan_step(pool.k, pool.v, table, lens, cu, q_heads=8)
            refs[n] = kvcache.paged_attention(q, pool.k, pool.v, table, lens, cu)
        assert not torch.equal(plans[1].host, plans[2].host)  # (the split differs, so results may differ)
        for run in (1, 2, 3):
            torch.set_num_threads(run)
            for n in (1, 2):
                assert torch.equal(kvcache.paged_attention_planned(plans[n], q, pool.k, pool.v), refs[n])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not HAS_CUDA_EMULATION, reason="built without KVCACHE_CUDA_EMULATION=ON")
def test_a_plan_runs_only_on_the_backend_it_was_made_for():
    from conftest import ops_backend
    pool, table, lens = filled_pool("bf16", [40])
    plan = kvcache.plan_step(pool.k, pool.v, table, lens, cu_of([1]), q_heads=2)  # CPU tasks
    with ops_backend(CUDA_EMULATED), pytest.raises(ValueError, match="made for the CPU kernels but this call runs "
                                                                      "the CUDA ones"):
        kvcache.paged_attention_planned(plan, torch.randn(1, 2, 64).to(torch.bfloat16), pool.k, pool.v)


# ---- opcheck --------------------------------------------------------------------------------------
@pytest.mark.parametrize("with_slots", [False, True])
def test_opcheck_plan_step(with_slots):
    pool, table, lens = filled_pool("bf16", [40, 9])
    slots = step_indices(pool, table, lens, [1, 9]) if with_slots else None
    torch.library.opcheck(torch.ops.kvcache.plan_step.default,
                          (pool.k, pool.v, table, lens, cu_of([1, 9]), slots, 4))


@pytest.mark.parametrize("with_lse", [False, True])
def test_opcheck_planned_ops(with_lse):
    pool, table, lens = filled_pool("int8", [300, 9])
    slots = step_indices(pool, table, lens, [1, 9])
    cu = cu_of([1, 9])
    plan = kvcache.plan_step(pool.k, pool.v, table, lens, cu, slots, q_heads=4, **pool.op_kwargs())
    q = torch.randn(10, 4, 64).to(torch.bfloat16)
    lse = torch.empty(10, 4) if with_lse else None
    fmt = pool.op_kwargs()
    torch.library.opcheck(torch.ops.kvcache.paged_attention_planned.default,
                          (q, pool.k, pool.v, plan.host, plan.device, 0.125, -1, 0, 0.0, torch.empty_like(q), lse,
                           fmt["k_scale"], fmt["v_scale"], fmt["k_format"], fmt["v_format"]))
    key = torch.randn(2, 2, 9, 64).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.kvcache.append_planned.default,
                          (key, key, pool.k, pool.v, plan.host, plan.device, fmt["k_scale"], fmt["v_scale"],
                           fmt["k_format"], fmt["v_format"]))


# ---- a model's step ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_format,residual_length", [(None, None), ("int8", 0), ("int8", None), ("int4", None),
                                                        ("kivi2", None), ("k=int8,v=int4", 16)])
@pytest.mark.parametrize("seals", [False, True])
def test_a_models_decode_step_reads_indices_once_not_per_layer(kv_format, residual_length, seals):
    """Through PagedCache and the "kvcache" attention, a decode step's host reads of index values do not grow
    with the number of layers: the step plans once (residual windows included, the default of quantized
    formats, also in a step that seals a page), every layer runs planned."""
    transformers = pytest.importorskip("transformers")

    def reads_of_one_decode_step(layers: int) -> int:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                          attn_implementation="kvcache")
        model = transformers.LlamaForCausalLM(config).eval()
        cache = kvcache.PagedCache(config=config, kv_format=kv_format, residual_length=residual_length)
        ids = torch.randint(0, 64, (2, 37))
        with torch.no_grad():
            model(ids, past_key_values=cache)  # prefill
            if not seals:  # the first decode step seals page 0 of a 16-token window (once per page)
                model(ids[:, :1], past_key_values=cache)
            before = kvcache.ops.host_index_reads()
            model(ids[:, :1], past_key_values=cache)
            reads = kvcache.ops.host_index_reads() - before
        cache.free()
        return reads

    two, six = reads_of_one_decode_step(2), reads_of_one_decode_step(6)
    assert two == six > 0, (two, six)
